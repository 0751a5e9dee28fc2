"""Fault injection: damaged copies of a real tiny run's checkpoints, damaged Hugging Face directories, a
read-only workdir, bad settings. Each gives the documented fall-back or a one-line error naming what is wrong,
and never trains or evaluates on wrong weights (issue 39)."""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from librarian_jax import checkpoint, models
from librarian_jax.rl import losses
from librarian_jax.rl import train_step as ts

VOCAB, ROWS, SEQ = 16, 4, 16
CONFIG = ts.TrainConfig(loss=losses.LossConfig(tis_cap=2.0),
                        optim=ts.OptimConfig(learning_rate=1e-2, warmup_steps=1, total_steps=8))
STEPS = (1, 2, 3)


def _model(seed: int = 0) -> models.Transformer:
    cfg = models.get_preset("tiny", vocab_size=VOCAB, num_layers=1, hidden_size=32, intermediate_size=64,
                            num_heads=2, num_kv_heads=1, head_dim=16, layer_types=("full_attention",))
    return models.Transformer(cfg, rngs=nnx.Rngs(seed))


def _batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    mask = np.zeros((ROWS, SEQ), np.float32)
    mask[:, 4:] = 1
    return {"tokens": rng.integers(0, VOCAB, (ROWS, SEQ)).astype(np.int32),
            "valid": np.ones((ROWS, SEQ), bool), "loss_mask": mask,
            "sampler_logprobs": np.full((ROWS, SEQ), -2.7, np.float32) * mask,
            "advantages": (rng.normal(size=(ROWS, 1)) * mask).astype(np.float32),
            "row_weights": np.ones(ROWS, np.float32)}


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real tiny run: 3 updates, each step checkpointed; the params of every step, as trained."""
    d = str(tmp_path_factory.mktemp("run") / "checkpoints")
    trainer = ts.Trainer(_model(), CONFIG)
    ck = checkpoint.Checkpointer(d, save_every=1, keep=5)
    saved = {}
    for step in STEPS:
        trainer.update(_batch(step))
        saved[step] = _leaves(trainer.params)
        ck.save(step, params=trainer.params, opt_state=trainer.opt_state, rng=jax.random.key(step),
                data_state={"step": step})
    ck.close()
    return d, saved


@pytest.fixture
def damaged(run, tmp_path):
    """A fresh copy of the run's checkpoints (the test damages it) and a fresh trainer as the target."""
    src, saved = run
    d = str(tmp_path / "checkpoints")
    shutil.copytree(src, d)
    return d, saved, ts.Trainer(_model(seed=5), CONFIG)


def _largest_data_file(step_dir: str, item: str = "params") -> str:
    files = glob.glob(os.path.join(step_dir, item, "ocdbt.process_0", "d", "*"))
    return max(files, key=os.path.getsize)


def _garbage(path: str, where: str = "middle", n: int = 64) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2 if where == "middle" else 0)
        f.write(np.random.default_rng(0).bytes(size if where == "all" else n))


DAMAGE = {
    # bytes in the middle of a data file: orbax decodes them into wrong values; only the digest sees it
    "garbage_in_data": (lambda s: _garbage(_largest_data_file(s)), r"params/\S+: crc32c 0x[0-9a-f]+ != "),
    "garbage_data_file": (lambda s: _garbage(_largest_data_file(s), "all"), r"params: .*Error reading"),
    "truncated_data_file": (lambda s: os.truncate(_largest_data_file(s), 10), r"params: .*Error reading"),
    "deleted_data_file": (lambda s: os.remove(_largest_data_file(s)), r"params: .*Error reading"),
    "garbage_opt_state": (lambda s: _garbage(_largest_data_file(s, "opt_state")), r"opt_state(/\S+)?: "),
    "garbage_meta": (lambda s: open(os.path.join(s, "meta", "metadata"), "wb").write(b"\xff\xfe{garbage"),
                     r"meta: .*/meta/metadata is not readable JSON"),
    "deleted_params": (lambda s: shutil.rmtree(os.path.join(s, "params")), r"params: .*/params is missing"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_newest_step_falls_back_to_the_previous_good_one(damaged, kind, caplog):
    d, saved, trainer = damaged
    damage, reason = DAMAGE[kind]
    damage(os.path.join(d, "3"))
    ck = checkpoint.Checkpointer(d, save_every=1, keep=5)
    with caplog.at_level("WARNING"):
        restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state)
    ck.close()
    assert restored.step == 2 and restored.data_state == {"step": 2}
    for a, b in zip(saved[2], _leaves(restored.params), strict=True):
        np.testing.assert_array_equal(a, b)  # the step-2 weights, bit for bit: never the damaged ones
    warning = [r.getMessage() for r in caplog.records if "checkpoint step 3" in r.getMessage()]
    assert warning and "is damaged (" in warning[0], caplog.text
    assert re.search(reason, warning[0]), warning[0]
    assert len(warning[0]) < 600, warning[0]  # one line, no TensorStore spec dump
    assert ck.steps() == [1, 2] and os.listdir(os.path.join(d, checkpoint.DAMAGED_DIR))[0].startswith("3.")


def test_every_step_damaged_stops_with_each_reason_and_never_starts_over(damaged):
    d, _, trainer = damaged
    for s in STEPS:
        _garbage(_largest_data_file(os.path.join(d, str(s))))
    ck = checkpoint.Checkpointer(d, save_every=1, keep=5)
    with pytest.raises(checkpoint.CheckpointError) as e:
        ck.restore(params=trainer.params, opt_state=trainer.opt_state)
    msg = str(e.value)
    assert "\n" not in msg and "not starting over" in msg and "checkpoint.start_fresh" in msg
    for s in STEPS:
        assert f"step {s}: params/" in msg
    assert ck.steps() == list(STEPS)  # nothing moved: the next launch stops the same way
    # starting over needs the explicit flag; the damaged steps are kept aside
    assert ck.restore(params=trainer.params, opt_state=trainer.opt_state, start_fresh=True) is None
    assert ck.steps() == [] and len(os.listdir(os.path.join(d, checkpoint.DAMAGED_DIR))) == 3
    ck.close()


def test_an_asked_for_damaged_step_is_an_error_naming_it(damaged):
    d, _, trainer = damaged
    _garbage(_largest_data_file(os.path.join(d, "2")))
    ck = checkpoint.Checkpointer(d, save_every=1, keep=5)
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint step 2 in .* is damaged: params/"):
        ck.restore(params=trainer.params, opt_state=trainer.opt_state, step=2)
    ck.close()


def test_restore_params_eval_path_falls_back_or_names_the_step(damaged, caplog):
    """`restore_params` (eval, build, model.init='orbax') checks the same digests through `restore_step`."""
    d, saved, _ = damaged
    _garbage(_largest_data_file(os.path.join(d, "3")))
    target = nnx.state(_model(seed=9), nnx.Param)
    with caplog.at_level("WARNING"):
        params, step = checkpoint.restore_params_step(os.path.join(d, "3"), target)
    assert step == 2 and "checkpoint step 3" in caplog.text and "crc32c" in caplog.text
    for a, b in zip(saved[2], _leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(checkpoint.CheckpointError, match=r"no usable step in .*step 3: params/\S+: crc32c"):
        checkpoint.restore_params(os.path.join(d, "3"), target, fallback=False)
    params, step = checkpoint.restore_params_step(d, target)  # the run's directory: newest good step
    assert step == 2


def test_a_full_disk_during_a_save_keeps_the_previous_step_and_stops(damaged, monkeypatch):
    d, saved, trainer = damaged
    ck = checkpoint.Checkpointer(d, save_every=1, keep=5, async_save=False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.manager, "save", full)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"checkpoint step 4 could not be saved to .*: the disk is full .*previous "
                             r"step 3 is intact"):
        ck.save(4, params=trainer.params, opt_state=trainer.opt_state)
    monkeypatch.undo()
    restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state)
    ck.close()
    assert restored.step == 3
    for a, b in zip(saved[3], _leaves(restored.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_digests_are_in_the_meta_of_every_step(run):
    d, _ = run
    meta = checkpoint.read_meta(os.path.join(d, "3"))
    params = meta["digests"]["params"]
    assert set(meta["digests"]) == {"params", "opt_state"}
    assert len(params) == len(jax.tree.leaves(nnx.state(_model(), nnx.Param)))
    assert all(set(v) == {"crc32c", "shape", "dtype"} for v in params.values())
