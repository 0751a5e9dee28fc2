"""`train_loop`, the one loop SFT and GRPO run: a step supplied by a fake trainer (a counter in jax arrays)
is checkpointed, resumed where it stopped, summarised and counted the same way as the trainers' (their own
resume tests: test_main.py, test_sft.py, test_determinism.py)."""

from __future__ import annotations

import ast
import glob
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from librarian_jax import checkpoint, train_loop

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "librarian_jax"


class Counter:
    """A trainer whose params after step k are [1 + 2 + ... + k] * 4 (so a resumed run must restore them)."""

    def __init__(self) -> None:
        self.step = 0
        self.params = {"w": jnp.zeros(4)}
        self.opt_state = {"m": jnp.zeros(4)}
        self.data = 0  # a data position, restored from the checkpoint's meta
        self.firsts = 0
        self.resumed_from: int | None = None

    def restore_targets(self):
        return self.params, self.opt_state

    def resumed(self, restored: checkpoint.Restored, directory: str) -> None:
        self.params, self.opt_state, self.step = restored.params, restored.opt_state, restored.step
        self.data = restored.data_state["pos"]
        self.resumed_from = restored.step

    def before_first(self, summaries: train_loop.Summaries) -> None:
        self.firsts += 1
        summaries.write({"first/step": float(self.step)}, self.step)

    def train_step(self) -> train_loop.StepOut:
        self.step += 1
        self.data += 1
        self.params = {"w": self.params["w"] + self.step}
        self.opt_state = {"m": self.opt_state["m"] + 1}
        return train_loop.StepOut({"loss": float(self.step)}, postfix={"w": "x"}, line=f"step {self.step}")

    def saved_state(self, due: bool) -> train_loop.Saved:
        return train_loop.Saved(self.params, self.opt_state, data_state={"pos": self.data})


def _loop(workdir: str, num_steps: int) -> train_loop.LoopConfig:
    return train_loop.LoopConfig(workdir, num_steps=num_steps, save_every=2, keep=5, async_save=False,
                                 progress="test")


def test_a_stopped_loop_resumes_where_its_checkpoint_left_it(tmp_path):
    straight, stopped = Counter(), Counter()
    done = train_loop.run(_loop(str(tmp_path / "a"), 5), straight)
    assert (done.start_step, done.last_step, straight.firsts) == (0, 5, 1)
    # every 2 steps and the last
    assert sorted(int(d) for d in os.listdir(tmp_path / "a" / "checkpoints") if d.isdigit()) == [2, 4, 5]
    assert glob.glob(str(tmp_path / "a" / "tb" / "events.out.tfevents.*"))

    train_loop.run(_loop(str(tmp_path / "b"), 3), stopped)  # stopped after step 3 (saved: it was the last)
    again = Counter()
    done = train_loop.run(_loop(str(tmp_path / "b"), 5), again)
    assert (again.resumed_from, done.start_step, done.last_step) == (3, 3, 5)
    np.testing.assert_array_equal(again.params["w"], straight.params["w"])
    np.testing.assert_array_equal(again.opt_state["m"], straight.opt_state["m"])
    assert again.data == straight.data == 5

    finished = Counter()  # a finished run resumes at its last step and runs none
    done = train_loop.run(_loop(str(tmp_path / "a"), 5), finished)
    assert (done.start_step, done.last_step, finished.resumed_from) == (5, 5, 5)


def test_resume_off_starts_over(tmp_path):
    train_loop.run(_loop(str(tmp_path), 2), Counter())
    fresh = Counter()
    cfg = train_loop.LoopConfig(str(tmp_path), num_steps=2, save_every=2, keep=5, async_save=False,
                                resume=False)
    done = train_loop.run(cfg, fresh)
    assert (fresh.resumed_from, done.start_step) == (None, 0)


def test_the_loop_owns_every_trainers_checkpointer_and_summaries():
    """One loop: in the package only `train_loop` constructs a `Checkpointer` or a TensorBoard
    `SummaryWriter` for training (the checkpoint bench times a bare Checkpointer; an eval report writes
    its own scalars)."""
    allowed = {"Checkpointer": {"train_loop", "bench.checkpoint"},
               "SummaryWriter": {"train_loop", "eval.report"}}
    found: dict[str, set[str]] = {k: set() for k in allowed}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func).rpartition(".")[2]
                if name in found:
                    found[name].add(module)
    assert found == allowed, found
