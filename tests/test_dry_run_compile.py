"""`main --dry_run --compile` builds only what it compiles: the run's cluster (its engines), never the trainer
and its optimizer state (gigabytes for a 4B full fine-tune), and writes nothing to the workdir."""

from __future__ import annotations

import os
import re

import pytest

from librarian_jax import training
from librarian_jax.rl import train_step


@pytest.mark.slow
def test_dry_run_compile_builds_the_engines_and_not_the_trainer(tmp_path, monkeypatch, capsys):
    from tests.test_main import tiny_run_config

    def no_trainer(*args, **kwargs):
        raise AssertionError("--dry_run --compile made the trainer")

    monkeypatch.setattr(train_step, "Trainer", no_trainer)
    workdir = str(tmp_path / "run")
    c = tiny_run_config(workdir, num_steps=1)
    c.rollout.update(policy_slots=1, max_seq_len=512)  # few programs: one slot count, short sessions
    c.rollout.builder.compaction_budget = 256
    training.train_command(c, dry_run=True, compile_programs=True)
    out = capsys.readouterr().out
    m = re.search(r"compiled ahead: (\d+) programs", out)
    assert m and int(m.group(1)) > 0, out  # the policy engine's prefill and decode programs
    assert not os.path.exists(workdir)  # its tokenizer went to a temporary directory
