"""The batch scheduler: every session of a whole rollout batch in the engines' slots together.

`run_batch(tasks, group_size, engines, tokenizer, config, rng)` starts B x G builder episodes (generators, see
`agents.runtime`) and drives them all at once: each `Generate` a generator yields is submitted to its engine
("policy" = the builder's engine; "frozen" = answerer, executor, judge, summariser — it may hold the same
weights, or be the same engine object); each `Parallel` becomes child generators run concurrently. While any
request is in flight the scheduler calls `engine.step()` on every engine with work and resumes the
generators whose turns finished. So builder turns of all episodes decode together, and a probe's R x Q
answerer runs (and the executor writes of a turn) join the frozen engine's decode loop together with every
other episode's — never one question at a time.

Host work (parsing, workspace actions, observations) happens between engine steps; `SchedulerStats` records
per-step batch sizes, tokens, device time and host time for the benchmark.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from librarian_jax.agents.runtime import (
    ANSWERER,
    FROZEN,
    POLICY,
    AgentContext,
    Generate,
    Parallel,
    engine_for_role,
)
from librarian_jax.rollout.episode import run_episode
from librarian_jax.rollout.records import EpisodeRecord
from librarian_jax.rollout.rewards import RolloutConfig
from librarian_jax.tokenizers import chat_template


@dataclasses.dataclass
class SchedulerStats:
    """What a `Scheduler.run` did, per engine role: steps, per-step in-flight turns, tokens, time."""

    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    inflight_per_step: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    turns: dict[str, int] = dataclasses.field(default_factory=dict)
    generated_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    engine_s: float = 0.0  # time inside engine.step() calls
    host_s: float = 0.0  # everything else (generators: parsing, workspace, observations)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Task:
    gen: Generator
    parent: _Task | None = None
    slot: int = 0  # index in the parent's results
    pending: int = 0
    results: list[Any] = dataclasses.field(default_factory=list)


class Scheduler:
    """Drives agent generators over engines by role (see the module docstring)."""

    def __init__(self, engines: Mapping[str, Any], *, max_idle_steps: int = 100_000):
        self.engines = dict(engines)
        self.max_idle_steps = max_idle_steps
        self.stats = SchedulerStats()
        self._waiting: dict[int, tuple[_Task, str]] = {}  # id(session) -> (task, role)
        self._inflight: dict[str, int] = {}
        self._roots: list[Any] = []
        self._done = 0

    def _advance(self, task: _Task, value: Any) -> None:
        while True:
            try:
                req = task.gen.send(value)
            except StopIteration as stop:
                self._finish(task, stop.value)
                return
            if isinstance(req, Generate):
                role = _resolve_role(self.engines, req.role)
                engine = self.engines[role]
                engine.submit(
                    req.session,
                    req.max_new_tokens,
                    req.sampling,
                    req.stop_ids,
                    tag=req.tag,
                )
                self._waiting[id(req.session)] = (task, role)
                self._inflight[role] = self._inflight.get(role, 0) + 1
                return
            if isinstance(req, Parallel):
                if not req.generators:
                    value = []
                    continue
                task.pending = len(req.generators)
                task.results = [None] * len(req.generators)
                for i, g in enumerate(req.generators):
                    self._advance(_Task(g, task, i), None)
                return
            raise TypeError(f"an agent generator yielded {type(req).__name__}; expected Generate or Parallel")

    def _finish(self, task: _Task, value: Any) -> None:
        parent = task.parent
        if parent is None:
            self._roots[task.slot] = value
            self._done += 1
            return
        parent.results[task.slot] = value
        parent.pending -= 1
        if parent.pending == 0:
            results, parent.results = parent.results, []
            self._advance(parent, results)

    def run(self, generators: Sequence[Generator]) -> list[Any]:
        """Runs the generators to completion; returns their return values in order."""
        t_start = time.perf_counter()
        engine_s = 0.0
        self._roots = [None] * len(generators)
        self._done = 0
        for i, g in enumerate(generators):
            self._advance(_Task(g, None, i), None)
        idle = 0
        roles = {}
        for role, eng in self.engines.items():  # one engine object may serve several roles
            roles.setdefault(id(eng), []).append(role)
        while self._waiting:
            progressed = False
            for eng_roles in roles.values():
                inflight = sum(self._inflight.get(r, 0) for r in eng_roles)
                if inflight == 0:
                    continue
                engine = self.engines[eng_roles[0]]
                key = "+".join(eng_roles)
                self.stats.steps[key] = self.stats.steps.get(key, 0) + 1
                self.stats.inflight_per_step.setdefault(key, []).append(inflight)
                t0 = time.perf_counter()
                results = engine.step()
                engine_s += time.perf_counter() - t0
                for res in results:
                    entry = self._waiting.pop(id(res.session), None)
                    if entry is None:
                        raise RuntimeError(
                            f"engine returned a turn for a session no agent is waiting on: {res.session!r}"
                        )
                    task, role = entry
                    self._inflight[role] -= 1
                    self.stats.turns[key] = self.stats.turns.get(key, 0) + 1
                    self.stats.generated_tokens[key] = self.stats.generated_tokens.get(key, 0) + len(
                        res.tokens
                    )
                    progressed = True
                    self._advance(task, res)
            idle = 0 if progressed else idle + 1
            if idle > self.max_idle_steps:
                raise RuntimeError(
                    f"engines made no progress for {idle} steps with {len(self._waiting)} turns in flight"
                )
        if self._done != len(generators):
            raise RuntimeError(f"{len(generators) - self._done} agent generators never finished")
        wall = time.perf_counter() - t_start
        self.stats.engine_s += engine_s
        self.stats.wall_s += wall
        self.stats.host_s += wall - engine_s
        return list(self._roots)


def _resolve_role(engines: Mapping[str, Any], role: str) -> str:
    """The key of `engines` that serves `role` (its own, else "frozen" for a frozen role, else "policy")."""
    engine = engine_for_role(engines, role)  # raises KeyError naming the role
    if role in engines:
        return role
    return next(k for k in (FROZEN, POLICY) if k in engines and engines[k] is engine)


def _engines_by_role(engines: Any) -> dict[str, Any]:
    if isinstance(engines, Mapping):
        out = dict(engines)
    elif isinstance(engines, (tuple, list)) and len(engines) == 2:
        out = {POLICY: engines[0], FROZEN: engines[1]}
    else:  # one engine for every role
        out = {POLICY: engines, FROZEN: engines}
    if POLICY not in out:
        raise KeyError(f"run_batch: engines need a {POLICY!r} engine; got roles {sorted(out)}")
    out.setdefault(FROZEN, out[POLICY])
    return out


def fit_to_engines(config: RolloutConfig, engines: Mapping[str, Any]) -> RolloutConfig:
    """`config` with the builder's and answerer's context budgets set where they are unset (<= 0: the
    engine's `max_seq_len`), for callers without a cluster; `config` itself when both are set (a cluster's
    mode config always is, `cluster.mode_rollout`). A budget is never lowered: one its engine cannot hold is
    refused where the config is checked (`config_validation.check_budgets`)."""
    b, a = config.builder, config.answerer
    if b.context_budget > 0 and a.context_budget > 0:
        return config
    pol = getattr(engines.get(POLICY), "max_seq_len", None)
    ans = engines.get(ANSWERER) if ANSWERER in engines else engines.get(FROZEN, engines.get(POLICY))
    fro = getattr(ans, "max_seq_len", None)
    if pol is not None and b.context_budget <= 0:
        b = dataclasses.replace(b, context_budget=int(pol))
    if fro is not None and a.context_budget <= 0:
        a = dataclasses.replace(a, context_budget=int(fro))
    return dataclasses.replace(config, builder=b, answerer=a)


def episode_rng(seed: int, skip: int = 0) -> np.random.Generator:
    """The episode seed stream `run_batch` draws from (`default_rng(seed)`, one `integers(2**62)` per
    episode, task-major), advanced past `skip` episodes (those of corpora before this share's: another
    process's, or earlier ones of a chunk): every episode gets the seed it gets in one run over all."""
    rng = np.random.default_rng(int(seed))
    for _ in range(int(skip)):
        rng.integers(2**62)
    return rng


def run_batch(
    tasks: Sequence[Any],
    group_size: int,
    engines: Any,
    tokenizer: Any,
    config: RolloutConfig,
    rng: Any = 0,
    *,
    template: Any = None,
    scheduler: Scheduler | None = None,
    templates: Mapping[str, Any] | None = None,
) -> list[EpisodeRecord]:
    """Runs `group_size` builder episodes for every task, all batched together; returns their records.

    Args:
      tasks: `CorpusTask`s (B).
      group_size: builder episodes per task (G); records come task-major (`group_id` = index in `tasks`,
        `episode_index` = index in the group).
      engines: `{"policy": Engine, "frozen": Engine}`, a `(policy, frozen)` pair, or one engine for all.
      tokenizer: `encode`/`decode`; `template` defaults to `tokenizers.chat_template(tokenizer)`.
      config: the `RolloutConfig`.
      rng: an int seed or a `numpy.random.Generator`; every episode gets its own seed stream from it.
      scheduler: reuse one (its `stats` accumulate); default a new one.
      templates: a chat template per role where it differs from `template` (e.g. thinking off for the
        frozen roles of a Qwen3.5 run).
    """
    if group_size < 1:
        raise ValueError(f"run_batch: group_size must be >= 1, got {group_size}")
    by_role = _engines_by_role(engines)
    if template is None:
        template = chat_template(tokenizer)
    config = fit_to_engines(config, by_role)
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(int(rng))
    gens = []
    for b, task in enumerate(tasks):
        for g in range(group_size):
            ctx = AgentContext(tokenizer, template, by_role, np.random.default_rng(int(rng.integers(2**62))),
                               templates=dict(templates or {}))
            gens.append(run_episode(ctx, task, config, group_id=b, episode_index=g))
    sched = scheduler or Scheduler(by_role)
    records = sched.run(gens)
    logging.info(
        "rollout batch: %d episodes, mean reward %.3f, scheduler %s",
        len(records),
        float(np.mean([r.total_reward for r in records])) if records else 0.0,
        {k: v for k, v in sched.stats.steps.items()},
    )
    return records
