"""Benchmark: one full rollout batch (B tasks x G builder episodes, their probes) on the tiny preset.

    python -m librarian_jax.bench.rollout [--num_tasks=4 --group_size=4 --max_turns=4 ...]
        [--num_layers=0] [--scan_layers=false]

A warm-up batch compiles every program first (or reads them from the persistent compilation cache at
`--compilation_cache_dir`); the programs it compiled and the seconds it spent tracing, lowering and compiling
them are reported (`compile_cache.CompileClock`), and any the timed batch still compiled. The timed batch
then reports
  - tokens/s: sampled tokens (builder + answerer/executor) per wall second, and prefilled tokens per second,
  - slot occupancy: mean active decode slots / slots over the decode rounds of each engine,
  - host share: the part of wall time outside `engine.step()` (parsing, workspace, observations, scheduling),
  - device time split into prefill and decode per engine.
With random weights the builder rarely writes a valid call, so probes come from `probe_at_start` (every
episode probes the raw workspace: B x G x Q x R answerer runs batched together) plus the terminal evaluation.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from absl import app, flags
from flax import nnx

from librarian_jax import compile_cache
from librarian_jax.agents import AnswererConfig, BuilderConfig
from librarian_jax.agents.vocabulary import all_texts
from librarian_jax.bench.common import load_average
from librarian_jax.data.synthetic import generate_world, world_texts
from librarian_jax.engine import Engine
from librarian_jax.models import Transformer, get_preset
from librarian_jax.rollout import RolloutConfig, Scheduler, run_batch
from librarian_jax.tokenizers import cached_tokenizer

flags.DEFINE_integer("num_tasks", 4, "tasks per batch (B)")
flags.DEFINE_integer("group_size", 4, "builder episodes per task (G)")
flags.DEFINE_integer("max_turns", 4, "builder turns per episode (H)")
flags.DEFINE_integer("builder_new_tokens", 64, "new tokens per builder turn")
flags.DEFINE_integer("answerer_turns", 2, "answerer turns before the forced answer")
flags.DEFINE_integer("answerer_new_tokens", 16, "new tokens per answerer turn")
flags.DEFINE_integer("questions", 2, "hidden questions per task (Q)")
flags.DEFINE_integer("repeats", 2, "answerer runs per question per probe (R)")
flags.DEFINE_integer("policy_slots", 16, "slots of the builder engine")
flags.DEFINE_integer("frozen_slots", 64, "slots of the answerer/executor engine")
flags.DEFINE_integer("round_steps", 16, "decode steps per engine.step()")
flags.DEFINE_string("preset", "tiny", "model preset")
flags.DEFINE_integer("num_layers", 0, "decoder layers override (0 = the preset's): how the first batch's "
                     "compile time grows with depth")
flags.DEFINE_bool("scan_layers", False, "engines run the repeating layers under one lax.scan "
                  "(rollout.scan_layers)")
compile_cache.define_flag()
flags.DEFINE_string(
    "cache_dir", os.path.join(tempfile.gettempdir(), "librarian_jax_bench"), "tokenizer cache"
)


def _engine_summary(name: str, engine, wall: float) -> dict:
    rounds = [s for s in engine.stats if s.decode_steps > 0]
    occ = float(np.mean([s.active_slots / engine.num_slots for s in rounds])) if rounds else 0.0
    return {
        "engine": name,
        "steps": len(engine.stats),
        "decode_rounds": len(rounds),
        "mean_active_slots": float(np.mean([s.active_slots for s in rounds])) if rounds else 0.0,
        "slot_occupancy": occ,
        "tokens_decoded": sum(s.tokens_decoded for s in engine.stats),
        "prefill_tokens": sum(s.prefill_tokens for s in engine.stats),
        "prefill_s": sum(s.prefill_s for s in engine.stats),
        "decode_s": sum(s.decode_s for s in engine.stats),
        "evictions": sum(s.evictions for s in engine.stats),
        "active_per_round": [s.active_slots for s in rounds],
    }


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    cache_dir = compile_cache.enable(f.compilation_cache_dir)
    tasks = generate_world(0, f.num_tasks, questions_per_task=f.questions, reuse_questions_per_task=0)
    tok = cached_tokenizer(world_texts(generate_world(0, 64)) + all_texts(), f.cache_dir, 2048)
    model = Transformer(get_preset(f.preset, **({"num_layers": f.num_layers} if f.num_layers else {})),
                        rngs=nnx.Rngs(0))
    policy = Engine(model, num_slots=f.policy_slots, max_seq_len=4096, round_steps=f.round_steps,
                    scan_layers=f.scan_layers)
    frozen = Engine(model, num_slots=f.frozen_slots, max_seq_len=2048, round_steps=f.round_steps,
                    scan_layers=f.scan_layers)
    cfg = RolloutConfig(
        builder=BuilderConfig(
            max_turns=f.max_turns,
            max_new_tokens=f.builder_new_tokens,
            executor="model",
            compaction_budget=3000,
        ),
        answerer=AnswererConfig(
            max_turns=f.answerer_turns,
            max_new_tokens=f.answerer_new_tokens,
            forced_max_new_tokens=f.answerer_new_tokens,
            context_budget=frozen.max_seq_len,  # what the frozen engine holds (never lowered for it)
        ),
        probe_repeats=f.repeats,
        probe_at_start=True,
        terminal_repeats=1,
        terminal_questions="hidden",
        use_model_judge=False,
        probe_min_gap=2,
    )
    engines = {"policy": policy, "frozen": frozen}
    clock = compile_cache.CompileClock.get()
    t, before = time.perf_counter(), clock.totals()
    run_batch(tasks, f.group_size, engines, tok, cfg, 0)
    warm, warm_compile = time.perf_counter() - t, clock.since(before)
    policy.reset_stats()
    frozen.reset_stats()
    sched = Scheduler(engines)
    t, before = time.perf_counter(), clock.totals()
    records = run_batch(tasks, f.group_size, engines, tok, cfg, 1, scheduler=sched)
    wall, timed_compile = time.perf_counter() - t, clock.since(before)
    p, fz = _engine_summary("policy", policy, wall), _engine_summary("frozen", frozen, wall)
    sampled = p["tokens_decoded"] + fz["tokens_decoded"]
    prefilled = p["prefill_tokens"] + fz["prefill_tokens"]
    print(
        f"rollout batch: B={f.num_tasks} x G={f.group_size} episodes, H={f.max_turns}, Q={f.questions}, "
        f"R={f.repeats}, preset={f.preset} ({model.config.num_layers} layers), "
        f"scan_layers={policy.scan_layers}; load average {load_average()}; "
        f"compilation cache {cache_dir or 'off'}"
    )
    print(f"  first batch {warm:.1f}s (compile: {warm_compile.line() or 'nothing'}); timed batch {wall:.1f}s "
          f"(compile: {timed_compile.line() or 'nothing'})")
    print(
        f"  wall {wall:.2f}s  sampled tokens {sampled} ({sampled / wall:.0f} tok/s)  prefilled tokens "
        f"{prefilled} ({prefilled / wall:.0f} tok/s)"
    )
    print(
        f"  host share of wall time {sched.stats.host_s / wall:.1%} (engine.step {sched.stats.engine_s:.2f}s)"
    )
    for e in (p, fz):
        print(
            f"  {e['engine']:>6}: {e['steps']} steps, {e['decode_rounds']} decode rounds, mean active slots "
            f"{e['mean_active_slots']:.1f} (occupancy {e['slot_occupancy']:.1%}), "
            f"decoded {e['tokens_decoded']}, "
            f"prefilled {e['prefill_tokens']}, prefill {e['prefill_s']:.2f}s, decode {e['decode_s']:.2f}s, "
            f"evictions {e['evictions']}"
        )
    for e in (p, fz):
        print(f"  {e['engine']:>6} active slots per decode round: {e['active_per_round']}")
    runs = sum(r.token_counts["answerer_runs"] for r in records)
    print(
        f"  episodes {len(records)}, answerer runs {runs}, "
        f"builder turns {sum(r.num_turns for r in records)}, "
        f"mean total reward {np.mean([r.total_reward for r in records]):.3f}"
    )


if __name__ == "__main__":
    app.run(main)
