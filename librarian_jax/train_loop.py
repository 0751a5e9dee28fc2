"""The one training loop: SFT (`warm_start.sft.train`) and GRPO (`training.run`) both run it, each supplying
its step (`Steps`).

    loop = train_loop.LoopConfig(workdir, num_steps=..., save_every=..., keep=...)
    result = train_loop.run(loop, steps)   # resume -> [steps.before_first] -> steps -> the last checkpoint

What the loop owns, the same for every trainer:
- checkpoints: one `checkpoint.Checkpointer` in `workdir/checkpoints` (Orbax, every shard digested), a save
  offered after every step (written every `save_every` steps and at the last, `force`), closed on the way out
  (an asynchronous save finishes) whatever happens;
- resume: with `resume`, the newest good checkpoint restores into the step's targets and the step takes it
  (`Steps.resumed`: params, optimizer state, its RNG and data position); the loop then runs from that step to
  `num_steps`, so a run killed at any point (a preempted host, a SIGKILL) loses only the steps since its last
  committed checkpoint and, resumed, continues as if it had never stopped (tests/test_main.py,
  test_determinism.py). No signal is caught: a checkpoint is committed only when every process finished it,
  so a kill mid-save leaves the previous step to resume from;
- summaries: TensorBoard under `workdir/tb`, written by process 0 (tensorboardX writes gs:// itself), the
  scalars each step returns, flushed every step;
- an optional progress bar (tqdm, process 0);
- the clock (`Clock`): a command's wall time and what this process compiled since it started, for its
  `done:` line and summary.

Collectives: every process runs the loop and calls every step and save (`checkpoint` and the steps meet
there); `Steps.saved_state` is told whether the step's checkpoint is due, so a step's collective for the
checkpoint (every process's iterator state) runs on every process together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Protocol

import jax
from absl import logging
from tensorboardX import SummaryWriter
from tqdm import tqdm

from librarian_jax import checkpoint, compile_cache, distributed, storage

CHECKPOINT_DIR = "checkpoints"
SUMMARY_DIR = "tb"


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How a trainer's steps are run, saved and resumed (each trainer fills it from its config)."""

    workdir: str  # checkpoints in workdir/checkpoints, TensorBoard in workdir/tb
    num_steps: int  # the loop runs until the step's count reaches this
    save_every: int
    keep: int
    async_save: bool = True
    keep_period: int | None = None  # besides the newest `keep`, every step that is a multiple of this
    resume: bool = True
    start_fresh: bool = False  # checkpoints exist but none restores: start over (True) or raise
    progress: str = ""  # a progress bar with this label ("" = none)


@dataclasses.dataclass
class Saved:
    """What a step's checkpoint holds (`checkpoint.Checkpointer.save`)."""

    params: Any
    opt_state: Any
    rng: jax.Array | None = None
    data_state: dict[str, Any] | None = None
    data_by_process: list[Any] | None = None
    extra: dict[str, Any] | None = None


@dataclasses.dataclass
class StepOut:
    """One step's results for the loop: TensorBoard scalars (written as given), the progress bar's postfix
    and the console line (logged by process 0; None: no line this step)."""

    scalars: Mapping[str, float]
    postfix: Mapping[str, str] | None = None
    line: str | None = None


class Steps(Protocol):
    """A trainer's side of the loop. `step` counts the steps done (0 before the first, the restored step
    after a resume)."""

    step: int

    def restore_targets(self) -> tuple[Any, Any]:
        """(params, optimizer state) a checkpoint restores into: their structure and shardings."""
        ...

    def resumed(self, restored: checkpoint.Restored, directory: str) -> None:
        """Takes a restored checkpoint (params, optimizer state, step, RNG, data position)."""
        ...

    def before_first(self, summaries: Summaries) -> None:
        """Runs once before the first step of this invocation (GRPO: the starting policy's evaluation)."""
        ...

    def train_step(self) -> StepOut:
        """Runs step `step + 1` (and counts it in `step`)."""
        ...

    def saved_state(self, due: bool) -> Saved:
        """What this step's checkpoint holds; `due`: whether it is written (so every process runs the same
        collectives)."""
        ...


class Summaries:
    """TensorBoard scalars under `workdir/tb` (process 0; a no-op on the others)."""

    def __init__(self, logdir: str | None):
        self.writer = SummaryWriter(logdir) if logdir is not None else None

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclasses.dataclass
class Clock:
    """A command's wall time and this process's compiles (new and from the persistent cache) since it
    started: make one first thing."""

    t0: float = dataclasses.field(default_factory=time.perf_counter)
    compiled_before: compile_cache.CompileTotals = dataclasses.field(
        default_factory=lambda: compile_cache.CompileClock.get().totals())

    def wall_s(self) -> float:
        return time.perf_counter() - self.t0

    def compiled(self) -> compile_cache.CompileTotals:
        return compile_cache.CompileClock.get().since(self.compiled_before)


@dataclasses.dataclass(frozen=True)
class LoopResult:
    start_step: int  # the step this invocation started from (0, or the restored one)
    last_step: int


def checkpointer(config: LoopConfig) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(storage.join(config.workdir, CHECKPOINT_DIR), save_every=config.save_every,
                                   keep=config.keep, async_save=config.async_save,
                                   keep_period=config.keep_period)


def resume(ck: checkpoint.Checkpointer, steps: Steps, start_fresh: bool) -> checkpoint.Restored | None:
    """The newest good checkpoint into `steps` (`Steps.resumed`); None when there is none."""
    params, opt_state = steps.restore_targets()
    restored = ck.restore(params=params, opt_state=opt_state, start_fresh=start_fresh)
    if restored is not None:
        steps.resumed(restored, ck.directory)
    return restored


def run(config: LoopConfig, steps: Steps) -> LoopResult:
    """Resumes `steps` (with `config.resume`), runs `before_first`, then every step up to `num_steps`, each
    one's scalars to TensorBoard and its checkpoint offered; closes the checkpointer (waiting for the last
    save) and the summaries on the way out, also on an error."""
    ck = checkpointer(config)
    try:
        if config.resume:
            resume(ck, steps, config.start_fresh)
        start = steps.step
        summaries = Summaries(storage.join(config.workdir, SUMMARY_DIR) if jax.process_index() == 0 else None)
        try:
            steps.before_first(summaries)
            _steps(config, steps, ck, summaries, start)
        finally:
            summaries.close()
    finally:
        ck.close()
    return LoopResult(start, steps.step)


def _steps(config: LoopConfig, steps: Steps, ck: checkpoint.Checkpointer, summaries: Summaries,
           start: int) -> None:
    bar = None
    if config.progress:
        bar = tqdm(total=config.num_steps, initial=start, desc=config.progress, unit="step",
                   disable=None if distributed.is_primary() else True)
    while steps.step < config.num_steps:
        out = steps.train_step()
        step = steps.step
        if bar is not None:
            bar.update(1)
            if out.postfix:
                bar.set_postfix(**out.postfix)
        if out.line is not None and distributed.is_primary():
            logging.info("%s", out.line)
        summaries.write(out.scalars, step)
        last = step == config.num_steps
        s = steps.saved_state(last or ck.should_save(step))
        ck.save(step, params=s.params, opt_state=s.opt_state, rng=s.rng, data_state=s.data_state,
                data_by_process=s.data_by_process, extra=s.extra, force=last)
    if bar is not None:
        bar.close()
