"""Multi-turn sessions: cache continuation + continuous batching vs re-prefilling each turn in a static batch.

    python -m librarian_jax.bench.sessions [--sessions=32] [--turns=16] [--preset=tiny]

Workload: ``sessions`` agent-like sessions of ``turns`` turns each. Every turn samples a per-session,
per-turn number of tokens (uniform in [min_new, max_new], greedy, no stop id, so both modes produce exactly
the same tokens), then the host appends an observation of varied length (uniform in [min_obs, max_obs]).

- continuous: one ``Engine`` with a slot per session; a finished turn gets its observation appended and is
  resubmitted at once, the cache carries over (only the new observation is prefilled), and the scheduler
  runs rounds of ``round_steps`` decode steps, so short turns do not wait for long ones.
- static re-prefill: every turn starts fresh sessions holding each whole history (prefilled from scratch,
  as an agent loop without cache continuation does) and runs them as one batch until the slowest finishes.

Prints the total time of each mode and the ratio, the time at which every session had finished turn t
(growth over turns), and the continuous mode's decode-round vs prefill vs host time.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags, logging
from flax import nnx

from librarian_jax import models
from librarian_jax.engine import Engine

flags.DEFINE_integer("sessions", 32, "sessions")
flags.DEFINE_integer("turns", 16, "turns per session")
flags.DEFINE_string("preset", "tiny", "model preset")
flags.DEFINE_integer("prompt_len", 64, "prompt tokens")
flags.DEFINE_integer("min_new", 4, "fewest tokens sampled per turn")
flags.DEFINE_integer("max_new", 48, "most tokens sampled per turn")
flags.DEFINE_integer("min_obs", 8, "shortest observation")
flags.DEFINE_integer("max_obs", 96, "longest observation")
flags.DEFINE_integer("round_steps", 16, "decode steps per continuous-batching round")
flags.DEFINE_integer("seed", 0, "workload seed")
F = flags.FLAGS


def _workload(vocab: int) -> tuple[list[list[int]], np.ndarray, list[list[list[int]]]]:
    rng = np.random.default_rng(F.seed)
    prompts = [rng.integers(0, vocab, size=F.prompt_len).tolist() for _ in range(F.sessions)]
    budgets = rng.integers(F.min_new, F.max_new + 1, size=(F.sessions, F.turns))
    def observation() -> list[int]:
        return rng.integers(0, vocab, size=int(rng.integers(F.min_obs, F.max_obs + 1))).tolist()

    obs = [[observation() for _ in range(F.turns)] for _ in range(F.sessions)]
    return prompts, budgets, obs


def run_continuous(engine: Engine, prompts, budgets, obs) -> tuple[float, list[float], list[list[int]]]:
    """Returns (total seconds, seconds when all sessions finished turn t, final token records)."""
    engine.reset_stats()
    t0 = time.perf_counter()
    sessions = [engine.new_session(p) for p in prompts]
    turn = {s.id: 0 for s in sessions}
    index = {s.id: i for i, s in enumerate(sessions)}
    finished_at = [[0.0] * F.sessions for _ in range(F.turns)]
    for i, s in enumerate(sessions):
        engine.submit(s, int(budgets[i, 0]))
    while engine.pending():
        for res in engine.step():
            s = res.session
            i, t = index[s.id], turn[s.id]
            assert res.status == "length", res.status
            finished_at[t][i] = time.perf_counter() - t0
            s.append(obs[i][t])
            turn[s.id] = t + 1
            if t + 1 < F.turns:
                engine.submit(s, int(budgets[i, t + 1]))
    total = time.perf_counter() - t0
    records = [s.record().tokens.tolist() for s in sessions]
    for s in sessions:
        s.close()
    return total, [max(row) for row in finished_at], records


def run_static(engine: Engine, prompts, budgets, obs) -> tuple[float, list[float], list[list[int]]]:
    engine.reset_stats()
    t0 = time.perf_counter()
    histories = [list(p) for p in prompts]
    done_at = []
    for t in range(F.turns):
        sessions = [engine.new_session(h) for h in histories]
        reqs = [engine.submit(s, int(budgets[i, t])) for i, s in enumerate(sessions)]
        engine.run_until_done()
        for i, (s, r) in enumerate(zip(sessions, reqs, strict=True)):
            histories[i] += r.result.tokens + obs[i][t]
            s.close()
        done_at.append(time.perf_counter() - t0)
    return time.perf_counter() - t0, done_at, histories


def main(argv: list[str]) -> None:
    del argv
    config = models.get_preset(F.preset)
    model = models.Transformer(config, rngs=nnx.Rngs(0))
    prompts, budgets, obs = _workload(config.vocab_size)
    longest = max(
        F.prompt_len + int(budgets[i].sum()) + sum(len(o) for o in obs[i]) for i in range(F.sessions)
    )
    max_seq_len = -(-(longest + 1) // 128) * 128
    load = os.getloadavg()
    cont = Engine(model, num_slots=F.sessions, max_seq_len=max_seq_len, round_steps=F.round_steps)
    static = Engine(model, num_slots=F.sessions, max_seq_len=max_seq_len, round_steps=F.max_new)
    compile_s = cont.warmup() + static.warmup()
    t_cont, cont_turns, rec_cont = run_continuous(cont, prompts, budgets, obs)
    stats = list(cont.stats)
    t_static, static_turns, rec_static = run_static(static, prompts, budgets, obs)
    same = rec_cont == rec_static
    decode_s = sum(s.decode_s for s in stats)
    prefill_s = sum(s.prefill_s for s in stats)
    host_s = sum(s.host_s for s in stats)
    busy = [s.active_slots for s in stats if s.decode_steps]
    tokens = int(budgets.sum())
    half = F.turns // 2
    lines = [
        f"sessions bench: preset {F.preset}, {F.sessions} sessions x {F.turns} turns, "
        f"{tokens} sampled tokens, max_seq_len {max_seq_len}, compile {compile_s:.1f}s (excluded), "
        f"load average {load[0]:.2f}",
        f"continuous + cache continuation: {t_cont:7.2f}s  ({tokens / t_cont:7.1f} sampled tok/s)",
        f"static batch, re-prefill/turn:   {t_static:7.2f}s  ({tokens / t_static:7.1f} sampled tok/s)",
        f"speedup: {t_static / t_cont:.2f}x; identical token records in both modes: {same}",
        "growth (time when every session finished turn t): continuous "
        + " ".join(f"{x:.1f}" for x in cont_turns)
        + " | static "
        + " ".join(f"{x:.1f}" for x in static_turns),
        f"second half / first half of turns: continuous "
        f"{(cont_turns[-1] - cont_turns[half - 1]) / cont_turns[half - 1]:.2f}, static "
        f"{(static_turns[-1] - static_turns[half - 1]) / static_turns[half - 1]:.2f} (1.0 = linear)",
        f"continuous: {len(stats)} rounds, decode {decode_s:.2f}s, prefill {prefill_s:.2f}s, "
        f"host {host_s:.2f}s "
        f"(host share {host_s / max(t_cont, 1e-9):.1%}), mean active slots {np.mean(busy):.1f}/{F.sessions}",
    ]
    for line in lines:
        logging.info(line)
    print("\n".join(lines))  # noqa: T201 - a CLI report


if __name__ == "__main__":
    app.run(main)
