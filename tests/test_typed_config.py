"""One validated, typed config is passed down (issue 37): after a command validated its ConfigDict, nothing
reads that ConfigDict again; the helpers below the commands take the typed config (`config_schema`).

- Every helper of `cluster`, `inputs`, `config_validation` (and the commands' own builders) handed a raw
  ConfigDict raises TypeError instead of reading it.
- Each command (train with its warm start and final evaluation, sft, eval, build) runs end to end on a tiny
  config whose ConfigDict is made unreadable as soon as its validation returned: any later read of it
  raises, and is recorded, so a command that hands the raw config down again is red.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
import pytest

from configs import build as build_configs
from configs import eval as eval_configs
from configs import grpo
from configs import sft as sft_configs
from librarian_jax import cluster, config_validation, inputs, training
from librarian_jax.eval import cli, restore
from librarian_jax.warm_start import sft as supervised


def _grpo():
    return grpo.get_config("embedded")


def _sft():
    return sft_configs.get_config("embedded")


HELPERS = {
    "cluster.run_mesh": lambda: cluster.run_mesh(_grpo().mesh),
    "cluster.local_mesh": lambda: cluster.local_mesh(_grpo().mesh),
    "cluster.policy_weights": lambda: cluster.policy_weights(_grpo()),
    "cluster.initial_model": lambda: cluster.initial_model(_grpo(), None, None),
    "cluster.role_templates": lambda: cluster.role_templates(_grpo(), None),
    "cluster.protocol": lambda: cluster.protocol(_grpo()),
    "cluster.role_table": lambda: cluster.role_table(_grpo()),
    "cluster.Cluster.from_run": lambda: cluster.Cluster.from_run(_grpo(), "train", tokenizer=None,
                                                                 engine_mesh=None),
    "cluster.retrieval_model": lambda: cluster.retrieval_model("reranker", eval_configs.get_config().roles
                                                               .reranker, None, None),
    "inputs.build_tasks": lambda: inputs.build_tasks(_grpo()),
    "inputs.build_tokenizer": lambda: inputs.build_tokenizer(_grpo(), []),
    "inputs.update_tasks": lambda: inputs.update_tasks([], _grpo()),
    "inputs.write_split": lambda: inputs.write_split("/nonexistent", [], [], _grpo()),
    "config_validation.role_specs": lambda: config_validation.role_specs(_grpo()),
    "config_validation.validate_roles": lambda: config_validation.validate_roles(_grpo()),
    "training.train_config": lambda: training.train_config(_grpo()),
    "training.describe": lambda: training.describe(_grpo()),
    "training.prepare": lambda: training.prepare(_grpo()),
    "training.build": lambda: training.build(_grpo()),
    "training.compile_ahead": lambda: training.compile_ahead(_grpo()),
    "warm_start.sft.run": lambda: supervised.run(_sft()),
    "warm_start.sft.train": lambda: supervised.train(None, None, [], _sft(), workdir="/nonexistent"),
    "warm_start.sft.builder_template": lambda: supervised.builder_template(_sft(), None),
    "warm_start.sft.embedded_demonstrations": lambda: supervised.embedded_demonstrations(_sft()),
    "warm_start.sft.warm_start": lambda: supervised.warm_start(_grpo()),
    "eval.restore.restore_builder": lambda: restore.restore_builder(_grpo(), "/nonexistent", None, None),
    "eval.restore.expected_params": lambda: restore.expected_params(_grpo()),
    "config_validation.Overrides.of_eval": lambda: config_validation.Overrides.of_eval(
        eval_configs.get_config()),
}


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_helpers_refuse_the_raw_configdict(name):
    with pytest.raises(TypeError, match=r"takes the validated, typed config .* not a ConfigDict"):
        HELPERS[name]()


# ------------------------------------------------------------------------------------------ the commands


class ReadAfterValidation(AssertionError):
    """A command read its ConfigDict after validating it."""


def _poison(config: ml_collections.ConfigDict, reads: list[str]) -> None:
    """Makes `config` (and every section in it) raise on any attribute read from now on, recording it."""
    nested = [v for v in config._fields.values() if isinstance(v, ml_collections.ConfigDict)]  # noqa: SLF001
    for v in nested:
        _poison(v, reads)

    class Unreadable(type(config)):
        def __getattribute__(self, name: str) -> Any:
            if name == "__class__":  # isinstance checks (the helpers' refusal) may look
                return object.__getattribute__(self, name)
            reads.append(name)
            raise ReadAfterValidation(f"the ConfigDict was read after validation (.{name})")

    object.__setattr__(config, "__class__", Unreadable)


def _unreadable(config: Any) -> bool:
    return type(config).__name__ == "Unreadable"


def _poisoned_after(monkeypatch, module: Any, name: str, reads: list[str]) -> None:
    """`module.name` (a validation function) poisons its ConfigDict argument once it returned."""
    real = getattr(module, name)

    def validate(config: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(config, *args, **kwargs)
        if isinstance(config, ml_collections.ConfigDict):
            _poison(config, reads)
        return out

    monkeypatch.setattr(module, name, validate)


def _tiny_sft_preset(monkeypatch) -> None:
    """The warm start's SFT preset at test size: one step on two demonstration worlds."""
    real = sft_configs.get_config

    def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
        c = real(preset)
        c.train.update(num_steps=1, batch_rows=2, log_every=1, warmup_steps=0, max_row_len=1024)
        c.demos.update(num_tasks=2, per_task=1)
        c.checkpoint.async_save = False
        return c

    monkeypatch.setattr(sft_configs, "get_config", get_config)


@pytest.mark.slow
def test_no_command_reads_its_configdict_after_validation(tmp_path, monkeypatch, capsys):
    from tests.test_main import tiny_run_config

    reads: list[str] = []
    _poisoned_after(monkeypatch, config_validation, "validate", reads)  # train
    _poisoned_after(monkeypatch, supervised, "validate", reads)  # sft
    _poisoned_after(monkeypatch, cli, "plan_eval", reads)  # eval (and the run's final evaluation)
    _poisoned_after(monkeypatch, cli, "plan_build", reads)  # build
    _tiny_sft_preset(monkeypatch)

    # train: the warm start (SFT on demonstrations), one GRPO step, the final evaluation
    c = tiny_run_config(str(tmp_path / "run"), num_steps=1)
    c.warm_start.enabled = True
    c.eval.update(final_methods="trained", final_samples=0, num_tasks=1)
    training.train_command(c)
    assert _unreadable(c)  # validated, then made unreadable: the rest of the command never read it
    run_dir = str(tmp_path / "run")
    assert os.path.isfile(os.path.join(run_dir, "warm_start", "sft_summary.json"))
    assert os.path.isfile(os.path.join(run_dir, "eval", "final", "report.md"))
    # the recorded config is the one GRPO trained with (from the warm start's checkpoint), typed
    recorded = restore.load_run_config(run_dir)
    assert recorded.model.init == "orbax" and not recorded.warm_start.enabled

    # sft: the command on its own
    s = sft_configs.get_config("embedded")
    s.workdir = str(tmp_path / "sft")
    s.model.update(preset="tiny", tokenizer_vocab_size=2048)
    s.data.update(num_tasks=2, docs_per_task=2, min_words=20, max_words=30, questions_per_task=1)
    s.rollout.builder.update(max_turns=1, max_new_tokens=16)
    supervised.main(s)
    assert _unreadable(s)
    assert os.path.isdir(os.path.join(tmp_path, "sft", "checkpoints", "1"))

    # eval of that run
    e = eval_configs.get_config()
    e.update(run=run_dir, methods="trained", num_tasks=1, name="typed")
    e.ablation.enabled = False
    assert cli.run_eval(e)["accuracy"]
    assert _unreadable(e)

    # build over a folder with that run's builder
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("Alpha is a river in Beta. It flows north.\n")
    (folder / "b.md").write_text("Beta is a country. Its capital is Gamma.\n")
    b = build_configs.get_config()
    b.update(run=run_dir, out=str(tmp_path / "export"))
    b.data.path = str(folder)
    assert cli.run_build(b)["documents"] == 2
    assert _unreadable(b)

    capsys.readouterr()
    assert reads == [], f"a ConfigDict was read after its validation: {reads}"
