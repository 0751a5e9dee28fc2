"""eval.restore: a run's checkpoint restored onto another mesh equals the trainer's params; LoRA restore gives
the trained model's logits; bad checkpoints are one-line errors naming the path, before any model loads."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types

import forward
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import grpo
from librarian_jax import checkpoint, cluster, models, training
from librarian_jax.config_schema import GRPOConfig
from librarian_jax.config_validation import ConfigError
from librarian_jax.engine import make_mesh
from librarian_jax.eval import restore
from librarian_jax.models.placement import placed_copy
from librarian_jax.rl import train_step

TOK = types.SimpleNamespace(vocab_size=64)


def _save_run(tmp_path, lora_rank: int):
    """A run dir with config.json and one checkpoint of a trainer on an (8, 1, 1) mesh whose trainable
    params were moved away from their initial values."""
    cfg = grpo.get_config("embedded")
    cfg.workdir = str(tmp_path)
    cfg.model.lora_rank = lora_rank
    with open(tmp_path / "config.json", "w") as f:
        f.write(cfg.to_json_best_effort())
    cfg = GRPOConfig.parse(cfg)
    mesh = make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
    base = cluster.initial_model(cfg, mesh, TOK)
    model = (
        train_step.apply_lora(
            base, lora_rank, cfg.model.lora_alpha, cfg.model.lora_module_path, seed=cfg.seed
        )
        if lora_rank
        else base
    )
    trainer = train_step.Trainer(model, training.train_config(cfg), mesh=mesh)
    keys = iter(jax.random.split(jax.random.key(1), 1000))
    moved = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), trainer.params)
    trainer.set_state(moved, trainer.opt_state, 3)
    ck = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    ck.save(3, params=trainer.params, opt_state=trainer.opt_state, force=True)
    ck.close()
    return restore.load_run_config(str(tmp_path)), trainer


def test_full_params_restore_onto_another_mesh_equals_the_trainer(tmp_path, caplog):
    run_cfg, trainer = _save_run(tmp_path, 0)
    step, step_dir = restore.select_step(str(tmp_path))
    assert step == 3
    mesh = make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    with caplog.at_level("WARNING"):
        restore.check_checkpoint(step_dir, run_cfg)
        model = restore.restore_builder(run_cfg, step_dir, mesh, TOK)
    # a good checkpoint is checked and restored without a warning (orbax warned that the step's metadata
    # file was missing when asked for the params item's metadata: true of every good step, read like damage)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    got = nnx.state(model, nnx.Param).to_pure_dict()
    want = trainer.params.to_pure_dict()
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for g, w in zip(flat_got, flat_want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    shardings = {tuple(x.sharding.mesh.shape.values()) for x in flat_got}
    assert shardings == {(2, 4, 1)}  # restored straight onto the new mesh
    assert any(not x.sharding.is_fully_replicated for x in flat_got)  # really sharded, not gathered


def test_restoring_the_trained_builder_leaves_the_base_builder_as_it_was(tmp_path):
    """Eval restores the trained builder onto its base model (`restore_builder(..., base=models.base)`) and
    then evaluates the base builder too: the restore must not write into the base. Red when the restore's
    placed copy shares the base's Variables (the base builder then scored as the trained one)."""
    run_cfg, trainer = _save_run(tmp_path, 0)
    _, step_dir = restore.select_step(str(tmp_path))
    mesh = make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    base = placed_copy(restore.base_model(run_cfg, mesh, TOK), mesh)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(nnx.state(base, nnx.Param))]
    trained = restore.restore_builder(run_cfg, step_dir, mesh, TOK, base=base)
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(base, nnx.Param))]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    moved = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trained, nnx.Param))]
    assert any(not np.array_equal(m, b) for m, b in zip(moved, before, strict=True))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_run")
    return (path, *_save_run(path, 4))


def test_lora_restore_gives_the_trained_models_logits(lora_run):
    tmp_path, run_cfg, trainer = lora_run
    _, step_dir = restore.select_step(str(tmp_path))
    restore.check_checkpoint(step_dir, run_cfg)
    model = restore.restore_builder(run_cfg, step_dir, make_mesh({"data": 2, "fsdp": 4, "tensor": 1}), TOK)
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % 60, jnp.int32)
    want = forward.logits(trainer.model(), tokens)
    got = forward.logits(model, tokens)
    base = forward.logits(cluster.initial_model(run_cfg, None, TOK), tokens)
    assert float(jnp.abs(want - base).max()) > 1e-3  # the adapters matter
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_bad_checkpoints_are_one_line_errors_naming_the_path(lora_run):
    tmp_path, run_cfg, _ = lora_run
    _, step_dir = restore.select_step(str(tmp_path))
    def other(**model):
        return dataclasses.replace(run_cfg, model=dataclasses.replace(run_cfg.model, **model))

    with pytest.raises(ConfigError, match=r"config\.run: checkpoint .*/checkpoints/3' does not match .*lora"):
        restore.check_checkpoint(step_dir, other(lora_rank=8))
    with pytest.raises(ConfigError, match=r"holds LoRA params; the run's config \(tiny(_8k)?\) expects full"):
        restore.check_checkpoint(step_dir, other(lora_rank=0))
    with pytest.raises(ConfigError, match=r"does not match model decode_bench"):
        restore.check_checkpoint(step_dir, other(lora_rank=4, preset="decode_bench"))
    # a half-written newer step is skipped; asked for by number it is an error naming it
    os.makedirs(tmp_path / "checkpoints" / "5" / "params", exist_ok=True)
    assert restore.select_step(str(tmp_path))[0] == 3
    with pytest.raises(ConfigError, match=r"config\.step: '.*/checkpoints/5' is half-written"):
        restore.select_step(str(tmp_path), 5)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"config\.run: '.*/empty/config\.json' is missing"):
        restore.load_run_config(str(empty))
    (empty / "config.json").write_text(json.dumps(run_cfg.to_dict()))
    with pytest.raises(ConfigError, match=r"config\.run: '.*/empty/checkpoints' holds no committed"):
        restore.select_step(str(empty))
    assert models.get_preset("tiny")  # (the checks above read metadata only)
