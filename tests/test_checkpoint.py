"""checkpoint: half-written and unreadable checkpoints, initial weights from Orbax. Exact resume (params,
optimizer, RNG, grain iterator state) is tested through `main` in tests/test_main.py."""

from __future__ import annotations

import hashlib
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from librarian_jax import checkpoint, testing
from librarian_jax.data import TaskPipeline, generate_world
from librarian_jax.rl import losses
from librarian_jax.rl import train_step as ts

VOCAB, ROWS, SEQ = 16, 4, 16
TINY = testing.tiny_config(vocab_size=VOCAB)
CONFIG = ts.TrainConfig(loss=losses.LossConfig(tis_cap=2.0),
                        optim=ts.OptimConfig(learning_rate=1e-2, warmup_steps=1, total_steps=8))



def _batch(tasks, key) -> dict[str, np.ndarray]:
    """Rows that depend on the data (task ids) and on the step's RNG key."""
    seed = int.from_bytes(hashlib.sha256("|".join(t.task_id for t in tasks).encode()).digest()[:4], "little")
    rng = np.random.default_rng(seed)
    noise = np.asarray(jax.random.normal(key, (ROWS, 1)))
    mask = np.zeros((ROWS, SEQ), np.float32)
    mask[:, 4:] = 1
    return {"tokens": rng.integers(0, VOCAB, (ROWS, SEQ)).astype(np.int32),
            "valid": np.ones((ROWS, SEQ), bool), "loss_mask": mask,
            "sampler_logprobs": np.full((ROWS, SEQ), -2.7, np.float32) * mask,
            "advantages": (noise * mask).astype(np.float32), "row_weights": np.ones(ROWS, np.float32)}


def _train_and_save(workdir: str, num_steps: int) -> None:
    """Real updates on real data, each step checkpointed (params, optimizer, RNG, grain iterator state).
    That a run resumed from them continues as if it had never stopped is checked through `main` itself:
    tests/test_main.py::test_main_hands_new_weights_to_the_engine_and_resumes_as_if_never_stopped."""
    trainer = ts.Trainer(testing.tiny_model(TINY), CONFIG)
    it = TaskPipeline(generate_world(0, 6, docs_per_task=1, questions_per_task=1), tasks_per_batch=2, seed=3,
                      num_epochs=None, shard_index=0, shard_count=1).iterator()
    rng = jax.random.key(42)
    ck = checkpoint.Checkpointer(workdir, save_every=1, keep=2)
    for step in range(1, num_steps + 1):
        tasks = next(it)
        rng, sub = jax.random.split(rng)
        trainer.update(_batch(tasks, sub))
        ck.save(step, params=trainer.params, opt_state=trainer.opt_state, rng=rng, data_state=it.get_state())
    ck.close()


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_half_written_checkpoints_are_skipped(tmp_path, caplog):
    k = 2
    killed_dir = str(tmp_path / "killed")
    _train_and_save(killed_dir, k + 2)
    # A half-written newest step (no commit marker) and an orbax tmp dir are skipped with a warning.
    os.remove(os.path.join(killed_dir, str(k + 2), checkpoint.COMMIT_MARKER))
    tmp_dir = os.path.join(killed_dir, "9.orbax-checkpoint-tmp-77")
    shutil.copytree(os.path.join(killed_dir, str(k + 1)), tmp_dir)
    with caplog.at_level("WARNING"):
        ck = checkpoint.Checkpointer(killed_dir, save_every=1, keep=2)
        trainer = ts.Trainer(testing.tiny_model(TINY), CONFIG)
        restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state)
        ck.close()
    assert restored.step == k + 1
    assert f"{os.path.join(killed_dir, str(k + 2))} is incomplete (no commit_success.txt)" in caplog.text
    assert "9.orbax-checkpoint-tmp-77 is incomplete (orbax tmp dir)" in caplog.text
    assert sorted(os.listdir(os.path.join(killed_dir, checkpoint.INCOMPLETE_DIR)))[0].startswith(f"{k + 2}.")
    assert restored.data_state is not None and restored.rng is not None


def test_committed_but_unreadable_step_falls_back(tmp_path, caplog):
    d = str(tmp_path / "ck")
    trainer = ts.Trainer(testing.tiny_model(TINY), CONFIG)
    ck = checkpoint.Checkpointer(d, save_every=2, keep=3, async_save=False)
    assert not ck.save(1, params=trainer.params, opt_state=trainer.opt_state)  # not due
    saved = {}
    for step in (2, 4):  # other params at each step, so a fall-back to the wrong one cannot pass
        saved[step] = jax.tree.map(lambda x, s=step: x + s, trainer.params)
        assert ck.save(step, params=saved[step], opt_state=trainer.opt_state, rng=jax.random.key(step),
                       data_state={"step": step})
    ck.wait()
    assert ck.steps() == [2, 4]
    shutil.rmtree(os.path.join(d, "4", "params"))
    with caplog.at_level("WARNING"):
        restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state)
    ck.close()
    assert restored.step == 2 and restored.data_state == {"step": 2}
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(saved[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "checkpoint step 4" in caplog.text and "is damaged (params:" in caplog.text
    assert os.listdir(os.path.join(d, checkpoint.DAMAGED_DIR))[0].startswith("4.")
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(jax.random.key(2)))


def test_restore_params_for_initial_weights(tmp_path):
    trainer = ts.Trainer(testing.tiny_model(TINY), CONFIG)
    ck = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep=1, async_save=False)
    ck.save(1, params=trainer.params, opt_state=trainer.opt_state)
    ck.close()
    fresh = testing.tiny_model(TINY, seed=7)
    nnx.update(fresh, checkpoint.restore_params(str(tmp_path), nnx.state(fresh, nnx.Param)))
    for a, b in zip(_leaves(trainer.params), _leaves(nnx.state(fresh, nnx.Param)), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.restore_params(str(tmp_path / "nope"), nnx.state(fresh, nnx.Param))
