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

from librarian_jax import checkpoint, models, testing
from librarian_jax.config_schema import GRPOConfig
from librarian_jax.rl import losses
from librarian_jax.rl import train_step as ts

VOCAB, ROWS, SEQ = 16, 4, 16
TINY = testing.tiny_config(vocab_size=VOCAB)
CONFIG = ts.TrainConfig(loss=losses.LossConfig(tis_cap=2.0),
                        optim=ts.OptimConfig(learning_rate=1e-2, warmup_steps=1, total_steps=8))
STEPS = (1, 2, 3)



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
    trainer = ts.Trainer(testing.tiny_model(TINY), CONFIG)
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
    return d, saved, ts.Trainer(testing.tiny_model(TINY, seed=5), CONFIG)


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
    "garbage_in_data": (lambda s: _garbage(_largest_data_file(s)),
                        r"params/\S+ shard \[[0-9:,]+\]: crc32c 0x[0-9a-f]+ != "),
    "garbage_data_file": (lambda s: _garbage(_largest_data_file(s), "all"), r"params: .*Error reading"),
    "truncated_data_file": (lambda s: os.truncate(_largest_data_file(s), 10), r"params: .*Error reading"),
    "deleted_data_file": (lambda s: os.remove(_largest_data_file(s)), r"params: .*Error reading"),
    "garbage_opt_state": (lambda s: _garbage(_largest_data_file(s, "opt_state")),
                          r"opt_state(/\S+)?( shard \[[0-9:,]+\])?: "),
    "garbage_meta": (lambda s: open(os.path.join(s, "meta", "metadata"), "wb").write(b"\xff\xfe{garbage"),
                     r"meta: .*/meta/metadata is not readable JSON"),
    "deleted_params": (lambda s: shutil.rmtree(os.path.join(s, "params")), r"params: .*/params is missing"),
    # a training resume needs meta (RNG, data position); restore_params takes a params-only step unverified
    "deleted_meta": (lambda s: shutil.rmtree(os.path.join(s, "meta")), r"meta: .*/meta/metadata is missing"),
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
    target = nnx.state(testing.tiny_model(TINY, seed=9), nnx.Param)
    with caplog.at_level("WARNING"):
        params, step = checkpoint.restore_params_step(os.path.join(d, "3"), target)
    assert step == 2 and "checkpoint step 3" in caplog.text and "crc32c" in caplog.text
    for a, b in zip(saved[2], _leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"no usable step in .*step 3: params/\S+ shard \[[0-9:,]+\]: crc32c"):
        checkpoint.restore_params(os.path.join(d, "3"), target, fallback=False)
    params, step = checkpoint.restore_params_step(d, target)  # the run's directory: newest good step
    assert step == 2


def test_a_params_only_step_restores_unverified_with_a_warning(damaged, caplog):
    d, saved, _ = damaged
    shutil.rmtree(os.path.join(d, "3", "meta"))
    with caplog.at_level("WARNING"):
        target = nnx.state(testing.tiny_model(TINY, seed=9), nnx.Param)
        params, step = checkpoint.restore_params_step(os.path.join(d, "3"), target)
    assert step == 3 and "no meta item: a params-only step" in caplog.text
    for a, b in zip(saved[3], _leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


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


def test_every_shard_of_every_array_is_digested(run):
    """`meta["digests"]`: for every array of params and optimizer state, the shards Orbax wrote (here one
    process's replica-parallel slices over 8 devices), which tile the array, each with the crc32c of exactly
    the trained values in its region and the process that wrote it; `meta["hosts"]`: each process's host."""
    import socket

    d, saved = run
    meta = checkpoint.read_meta(os.path.join(d, "3"))
    assert set(meta["digests"]) == {"params", "opt_state"} and meta["hosts"] == [socket.gethostname()]
    pure = nnx.state(testing.tiny_model(TINY), nnx.Param).to_pure_dict()
    keys = [checkpoint._keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
    params = meta["digests"]["params"]
    assert sorted(params) == sorted(keys)
    for key, value in zip(keys, saved[3], strict=True):
        entry = params[key]
        assert entry["shape"] == list(value.shape) and entry["dtype"] == str(value.dtype)
        covered = np.zeros(value.shape, np.int32)
        for region, shard in entry["shards"].items():
            sl = checkpoint._region_slices(region)
            covered[sl] += 1
            assert shard == {"crc32c": checkpoint.crc32c(value[sl]), "process": 0}, (key, region)
        assert (covered == 1).all(), key  # the shards tile the array, once each
    opt = meta["digests"]["opt_state"]
    assert len(opt) == len(jax.tree.leaves(ts.Trainer(testing.tiny_model(TINY), CONFIG).opt_state))


def test_the_digests_come_from_orbaxs_host_copies_on_its_writer(tmp_path):
    """No copy of our own: with the hook in place `save()` never copies a shard to the host for its digest
    (`copied_bytes`, what the fall-back copied, stays 0), and the digests that arrive are those of the
    values."""
    assert checkpoint.HOOKED
    trainer = ts.Trainer(testing.tiny_model(TINY), CONFIG)
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
    assert ck.save(1, params=trainer.params, opt_state=trainer.opt_state, force=True)
    ck.close()
    state = jax.tree.leaves((trainer.params, trainer.opt_state))
    assert ck.last_digests.copied_bytes == 0
    assert ck.last_digests.nbytes == sum(x.nbytes for x in state)
    _, _, meta = checkpoint.restore_step(str(tmp_path / "ck" / "1"), params=trainer.params,
                                         opt_state=trainer.opt_state)  # every shard checked against them
    assert len(meta["digests"]["params"]) == len(jax.tree.leaves(trainer.params))


def test_a_step_with_whole_array_digests_is_still_checked(damaged):
    """Steps saved before shard digests carry one digest per array (`{"crc32c", "shape", "dtype"}`): they
    restore checked array by array, and a damaged one falls back."""
    import json

    d, saved, trainer = damaged
    pure = nnx.state(testing.tiny_model(TINY), nnx.Param).to_pure_dict()
    keys = [checkpoint._keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
    for step in (2, 3):
        path = os.path.join(d, str(step), "meta", "metadata")
        meta = json.load(open(path))
        arrays = zip(keys, saved[step], strict=True)
        meta["digests"] = {"params": {k: {"crc32c": checkpoint.crc32c(v), "shape": list(v.shape),
                                          "dtype": str(v.dtype)} for k, v in arrays}}
        meta.pop("hosts")
        with open(path, "w") as f:
            json.dump(meta, f)
    _garbage(_largest_data_file(os.path.join(d, "3")))
    ck = checkpoint.Checkpointer(d, save_every=1, keep=5)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 3 in .* is damaged: params/\S+: crc32c 0x"):
        ck.restore(params=trainer.params, opt_state=trainer.opt_state, step=3)
    restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state)
    ck.close()
    assert restored.step == 2
    for a, b in zip(saved[2], _leaves(restored.params), strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------- Hugging Face folders

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "golden")


def _hf_copy(tmp_path, name: str = "llama3") -> str:
    folder = str(tmp_path / name)
    shutil.copytree(os.path.join(GOLDEN, name), folder)
    return folder


def _edit_tensors(folder: str, edit) -> str:
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def _edit_config(folder: str, edit) -> str:
    import json

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _bias(t):
    t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(t["model.layers.0.self_attn.q_proj.weight"].shape[0],
                                                         np.float32)


def _extra_layer(t):
    for k in [k for k in t if k.startswith("model.layers.1.")]:
        t[k.replace("layers.1.", "layers.2.")] = t[k]


def _int8(t):
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].astype(np.int8)


def _nan(t):
    t["model.layers.1.mlp.down_proj.weight"] = np.full_like(t["model.layers.1.mlp.down_proj.weight"], np.nan)


def _f16(t):
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.float16)


HF_DAMAGE = {
    "unexpected_bias": (_bias, r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' "
                               r"is not used by the model"),
    "more_layers_than_config": (_extra_layer, r"model\.safetensors holds layers 2\.\.2 \(e\.g\. tensor "
                                              r"'model\.layers\.2\..*num_hidden_layers=2"),
    "int8_weights": (_int8, r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' is I8: a "
                            r"quantised checkpoint"),
    "nan_weights": (_nan, r"non-finite values, e\.g\. 'model\.layers\.1\.mlp\.down_proj\.weight' in "
                          r".*model\.safetensors"),
    "dtype_not_config": (_f16, r"tensor 'model\.norm\.weight' is float16 but config\.json declares float32"),
}


@pytest.mark.parametrize("kind", sorted(HF_DAMAGE))
def test_load_hf_refuses_a_wrong_model_naming_file_and_tensor(tmp_path, kind, caplog):
    folder = _hf_copy(tmp_path)
    edit, message = HF_DAMAGE[kind]
    _edit_tensors(folder, edit)
    with pytest.raises(models.hf_io.HFLoadError, match=message) as e:
        models.load_hf(folder)
    assert folder in str(e.value) and "\n" not in str(e.value)
    if kind in ("unexpected_bias", "more_layers_than_config", "dtype_not_config"):
        with caplog.at_level("WARNING"):
            models.load_hf(folder, strict=False)  # the escape hatch: loads, says so at WARNING
        assert "load_hf (strict=False)" in caplog.text
    if kind == "nan_weights":
        with caplog.at_level("WARNING"):
            models.load_hf(folder, allow_nonfinite=True)
        assert "loaded anyway (allow_nonfinite=True)" in caplog.text


def _cut(path: str, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


HF_FILES = {
    "truncated_safetensors": (lambda d: _cut(os.path.join(d, "model.safetensors"),
                                             os.path.getsize(os.path.join(d, "model.safetensors")) // 2),
                              r"model\.safetensors is not a readable safetensors file"),
    "empty_safetensors": (lambda d: _cut(os.path.join(d, "model.safetensors"), 0),
                          r"model\.safetensors is not a readable safetensors file \(0 bytes"),
    "cut_config": (lambda d: _cut(os.path.join(d, "config.json"), 40), r"config\.json is not readable JSON"),
    "negative_layers": (lambda d: _edit_config(d, lambda c: c.update(num_hidden_layers=-2)),
                        r"config\.json: num_hidden_layers must be an integer >= 1, got -2"),
    "string_field": (lambda d: _edit_config(d, lambda c: c.update(hidden_size="64")),
                     r"config\.json: hidden_size must be an integer >= 1, got '64'"),
}


@pytest.mark.parametrize("kind", sorted(HF_FILES))
def test_load_hf_errors_name_the_file_and_field(tmp_path, kind):
    folder = _hf_copy(tmp_path)
    damage, message = HF_FILES[kind]
    damage(folder)
    with pytest.raises(models.hf_io.HFLoadError, match=message) as e:
        models.load_hf(folder)
    assert folder in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------- settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD_SETTINGS = [
    ("rollout.builder.temperature", -0.5, r"config\.rollout\.builder\.temperature: must be >= 0\.0, got -0"),
    ("rollout.builder.top_p", 1.5, r"config\.rollout\.builder\.top_p: must be <= 1, got 1\.5"),
    ("rollout.builder.top_p", 0.0, r"config\.rollout\.builder\.top_p: must be > 0\.0, got 0\.0"),
    ("rollout.builder.top_k", -1, r"config\.rollout\.builder\.top_k: must be >= 0, got -1"),
    ("rollout.builder.max_new_tokens", 0, r"config\.rollout\.builder\.max_new_tokens: must be >= 1, got 0"),
    ("rollout.answerer.temperature", -1.0, r"config\.rollout\.answerer\.temperature: must be >= 0\.0"),
    ("rollout.answerer.max_new_tokens", 0, r"config\.rollout\.answerer\.max_new_tokens: must be >= 1"),
    ("rollout.group_size", 1, r"config\.rollout\.group_size: must be >= 2 for GRPO, got 1"),
    ("roles.answerer.slots", -1, r"config\.roles\.answerer\.slots: must be >= 0, got -1"),
    ("roles.judge.init", "bogus", r"config\.roles\.judge\.init: must be one of .*got 'bogus'"),
    ("roles.executor.dtype", "int8", r"config\.roles\.executor\.dtype: must be one of .*got 'int8'"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_SETTINGS,
                         ids=[f"{k}={v}" for k, v, _ in BAD_SETTINGS])
def test_a_bad_setting_stops_the_run_before_any_work(tmp_path, key, value, message):
    """`training.run` rejects it before the warm start, a compile or a write to the workdir."""
    from configs import grpo
    from librarian_jax import training
    from librarian_jax.config_validation import ConfigError

    cfg = grpo.get_config("embedded")
    cfg.workdir = str(tmp_path / "workdir")
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(ConfigError, match=message) as e:
        training.run(cfg)
    assert "\n" not in str(e.value)
    assert not os.path.exists(cfg.workdir)  # nothing written, nothing built


def test_unknown_keys_are_found_with_the_closest_known_one():
    from configs import grpo
    from librarian_jax import cli_flags

    cfg = grpo.get_config("embedded")
    assert cli_flags.unknown_key(cfg, "train.num_steps") is None
    assert cli_flags.unknown_key(cfg, "train.num_stepz") == (
        "config.train.num_stepz: unknown key (did you mean config.train.num_steps?)")
    assert cli_flags.unknown_key(cfg, "trian.num_steps") == (
        "config.trian: unknown key (did you mean config.train?)")
    assert "is a value, not a section" in cli_flags.unknown_key(cfg, "train.num_steps.x")


def test_an_unknown_key_on_the_command_line_is_one_line_and_exit_2():
    """The real command line (`main` parses its flags with `cli_flags.parse_flags`)."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "librarian_jax.main", "--config=configs/grpo.py:embedded",
                          "--config.train.num_stepz=3", "--dry_run"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[-1] == "error: config.train.num_stepz: unknown key (did you mean config.train.num_steps?)"


# a Python program that runs `main` with its arguments and, at exit, says whether the JAX backend started
_BACKEND_PROBE = """
import atexit, runpy, sys
from jax._src import xla_bridge
atexit.register(lambda: print(f"backend started: {xla_bridge.backends_are_initialized()}", file=sys.stderr))
if sys.argv[1] == "import":
    for name in sys.argv[2:]:
        __import__(name)
else:
    sys.argv = ["librarian_jax.main", *sys.argv[1:]]
    runpy.run_module("librarian_jax.main", run_name="__main__", alter_sys=True)
"""


def _probe(*args: str):
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1", LIBRARIAN_JAX_HUGE_PAGES="0")
    return subprocess.run([sys.executable, "-c", _BACKEND_PROBE, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("config", "flag", "message"), [
    ("configs/grpo.py:embedded", "--config.rollout.group_size=1",
     r"config\.rollout\.group_size: must be >= 2 for GRPO, got 1"),
    ("configs/eval.py", "--config.samples=0", r"config\.samples: must be >= 1, got 0"),
], ids=["train", "eval"])
def test_a_bad_setting_exits_before_the_jax_backend_starts(config, flag, message):
    """`main` checks the command's schema before it imports the command: exit 2 with the one line, no
    program compiled (`JAX_LOG_COMPILES=1` logs none), no backend started. The run-time is in BENCHMARKS.md
    (about 2 s on 2 cores; 3.3 s before, 4-5 s when an import compiled)."""
    out = _probe(f"--config={config}", flag)
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.search(rf"^error: {message}", out.stderr, re.M), out.stderr[-2000:]
    assert "Compiling" not in out.stderr and "Finished tracing" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.rstrip().endswith("backend started: False"), out.stderr[-2000:]


def test_importing_the_commands_starts_no_jax_backend():
    """No module of a command starts the JAX backend when imported (bm25s, the BM25 baseline's and the
    served workspace's search, runs a jitted `top_k` at import: imported where it is used), so on a pod
    nothing touches the devices before `jax.distributed.initialize`."""
    out = _probe("import", "librarian_jax.training", "librarian_jax.warm_start.sft", "librarian_jax.eval.cli",
                 "librarian_jax.serve.server")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Compiling" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.rstrip().endswith("backend started: False"), out.stderr[-2000:]


# ------------------------------------------------------------------------------- eval and build

FIXTURE_TASKS = os.path.join(REPO, "tests", "fixtures", "data", "tasks.jsonl")


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """A training workdir of the default config (config.json, checkpoints 2 and 3 of moved params)."""
    from configs import grpo
    from librarian_jax import cluster, training
    from librarian_jax.eval import restore

    run_dir = tmp_path_factory.mktemp("eval_run")
    cfg = grpo.get_config("embedded")
    cfg.workdir = str(run_dir)
    (run_dir / "config.json").write_text(cfg.to_json_best_effort())
    cfg = GRPOConfig.parse(cfg)
    model = cluster.initial_model(cfg, None, testing.ByteTokenizer())
    trainer = ts.Trainer(model, training.train_config(cfg))
    ck = checkpoint.Checkpointer(str(run_dir / "checkpoints"), async_save=False, keep=3)
    saved = {}
    for step in (2, 3):
        moved = jax.tree.map(lambda x, s=step: x + 0.01 * s, trainer.params)
        saved[step] = _leaves(moved)
        ck.save(step, params=moved, opt_state=trainer.opt_state, force=True)
    ck.close()
    return str(run_dir), restore.load_run_config(str(run_dir)), saved


@pytest.fixture
def eval_copy(eval_run, tmp_path):
    src, run_cfg, saved = eval_run
    run_dir = str(tmp_path / "run")
    shutil.copytree(src, run_dir)
    return run_dir, run_cfg, saved


def _eval_cfg(run_dir: str, **kw):
    from configs import eval as eval_configs

    c = eval_configs.get_config()
    c.update(run=run_dir, tasks=FIXTURE_TASKS, methods="trained", **kw)
    return c


def test_eval_skips_a_step_with_damaged_metadata_at_plan_time(eval_copy, caplog):
    from librarian_jax.eval import cli

    run_dir, _, _ = eval_copy
    ckpts = os.path.join(run_dir, "checkpoints")
    _garbage(os.path.join(ckpts, "3", "meta", "metadata"), "all")
    with caplog.at_level("WARNING"):
        plan = cli.plan_eval(_eval_cfg(run_dir))
    assert plan.step == 2 and "checkpoint step 3" in caplog.text and "not readable JSON" in caplog.text
    # the damaged step asked for by number: one line naming it
    from librarian_jax.config_validation import ConfigError

    with pytest.raises(ConfigError, match=r"config\.step: '.*/checkpoints/3' is damaged \(meta: "):
        cli.plan_eval(_eval_cfg(run_dir, step=3))
    _garbage(os.path.join(ckpts, "2", "params", "_METADATA"), "all")
    with pytest.raises(ConfigError) as e:
        cli.plan_eval(_eval_cfg(run_dir))
    msg = str(e.value)
    assert msg.startswith("config.run: no checkpoint step in") and "step 3: meta" in msg and "step 2:" in msg
    assert "\n" not in msg and len(msg) < 1000, msg


def test_eval_restore_falls_back_from_damaged_arrays_and_never_uses_them(eval_copy, caplog):
    from librarian_jax.eval import restore

    run_dir, run_cfg, saved = eval_copy
    step_dir = os.path.join(run_dir, "checkpoints", "3")
    _garbage(_largest_data_file(step_dir))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    with caplog.at_level("WARNING"):
        model = restore.restore_builder(run_cfg, step_dir, mesh, testing.ByteTokenizer())
    assert "checkpoint step 3" in caplog.text and "crc32c" in caplog.text and "using step 2" in caplog.text
    for a, b in zip(saved[2], _leaves(nnx.state(model, nnx.Param)), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 3: params/\S+ shard \[[0-9:,]+\]: crc32c"):
        restore.restore_builder(run_cfg, step_dir, mesh, testing.ByteTokenizer(), fallback=False)


def _truncate(path: str, fraction: float = 2 / 3) -> None:
    """Cuts a file to `fraction` of its size: the arrays stored past the cut fail to read, the others read."""
    os.truncate(path, int(os.path.getsize(path) * fraction))


def _stderr_lines(stderr: str) -> list[str]:
    """stderr's lines without tqdm's progress bars (redrawn in place with \\r, ours) and blank lines."""
    bar = re.compile(r"^[^|\n]*\d+%\|[^|]*\| \d+/\d+ \[[^\]]*\]")
    out = []
    for line in stderr.splitlines():
        for piece in line.split("\r"):
            piece = bar.sub("", piece)
            if piece.strip():
                out.append(piece)
    return out


_RESTORE_DAMAGED = """
import os, sys
import jax.numpy as jnp
import numpy as np
from librarian_jax import checkpoint
target = {f"w{i}": jnp.zeros((512, 512), jnp.float32) for i in range(8)}
for _ in range(3):
    params, step = checkpoint.restore_params_step(os.path.join(sys.argv[1], "2"), target)
    want = np.random.default_rng(0).normal(size=(512, 512)).astype(np.float32)
    assert step == 1 and (np.asarray(params["w0"]) == want).all(), step
"""


def test_restoring_a_damaged_step_prints_its_warning_and_nothing_else(tmp_path):
    """A step whose params file is cut after a third of its arrays, restored three times in one process:
    each restore prints its one warning, nothing else reaches stderr, and the process exits 0. Before the
    reads a failed one leaves behind were settled (`checkpoint._run_sync_settled`), the same process printed
    10-15 tracebacks ("Exception ignored in: <coroutine object _read_array_index_and_device_put>",
    "RuntimeError: Event loop is closed"), each with a TensorStore spec of 50 lines (3 runs of 3)."""
    import subprocess
    import sys

    d = str(tmp_path / "checkpoints")
    tree = {f"w{i}": jax.numpy.asarray(np.random.default_rng(i).normal(size=(512, 512)).astype(np.float32))
            for i in range(8)}
    ck = checkpoint.Checkpointer(d, async_save=False)
    for step in (1, 2):
        ck.save(step, params=tree, opt_state={"count": jax.numpy.asarray(np.int32(step))}, force=True)
    ck.close()
    _truncate(_largest_data_file(os.path.join(d, "2")))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _RESTORE_DAMAGED, d], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _stderr_lines(out.stderr)
    want = re.compile(rf"WARNING:absl:checkpoint step 2 in {re.escape(d)} is damaged \(params: Exception: "
                      r"Encountered error while reading array index: [^\n]{0,400}\); using step 1")
    assert len(lines) == 3 and all(want.fullmatch(line) for line in lines), out.stderr[-3000:]


def test_an_evaluation_of_a_damaged_step_prints_its_warning_and_exits_0(eval_copy):
    """`main --config=configs/eval.py` on a run whose newest step has its largest params file truncated: the
    whole stderr is the command's own progress (INFO records of this package, tqdm's bars) and one warning,
    the fall-back's, and the evaluation ends with exit code 0 on the step before."""
    import subprocess
    import sys

    run_dir, _, _ = eval_copy
    ckpts = os.path.join(run_dir, "checkpoints")
    _truncate(_largest_data_file(os.path.join(ckpts, "3")))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "librarian_jax.main", "--config=configs/eval.py",
                          f"--config.run={run_dir}", f"--config.tasks={FIXTURE_TASKS}",
                          "--config.methods=trained"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    record = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (\S+\.py):\d+\] (.*)")
    ours = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "librarian_jax", "**", "*.py"),
                                                   recursive=True)}
    warnings, previous = [], None
    for line in _stderr_lines(out.stderr):
        m = record.match(line)
        if m is None:  # only an INFO record of ours continues on indented lines (the protocol's differences)
            assert previous == "I" and line.startswith("  ") and not line.lstrip().startswith("File "), \
                f"{line!r} in\n{out.stderr[-3000:]}"
            continue
        level, source, message = m.groups()
        assert source in ours, line
        previous = level
        if level != "I":
            warnings.append((level, source, message))
    assert len(warnings) == 1, warnings
    level, source, message = warnings[0]
    assert level == "W" and source == "checkpoint.py", warnings
    want = re.compile(rf"checkpoint step 3 in {re.escape(ckpts)} is damaged \(params: Exception: Encountered "
                      r"error while reading array index: [^\n]{0,400}\); using step 2")
    assert want.fullmatch(message), message


def test_eval_checks_its_output_directory_before_any_work(eval_copy, monkeypatch):
    from librarian_jax.config_validation import ConfigError
    from librarian_jax.eval import cli, restore

    run_dir, _, _ = eval_copy
    # /proc takes no file, even for root (a chmod'ed directory does not stop root)
    with pytest.raises(ConfigError, match=r"config\.out: '/proc/librarian_out/x' is not writable \('/proc'"):
        cli.plan_eval(_eval_cfg(run_dir, out="/proc/librarian_out/x"))
    monkeypatch.setattr(restore, "MIN_FREE_BYTES", 1 << 62)
    with pytest.raises(ConfigError, match=r"config\.run: '.*/eval/default': only \d+ MiB free on its disk"):
        cli.plan_eval(_eval_cfg(run_dir))
    monkeypatch.undo()
    assert cli.plan_eval(_eval_cfg(run_dir)).step == 3


# ------------------------------------------------------------------------------------- training faults


def test_non_finite_updates_are_skipped_counted_and_stop_after_n_in_a_row(tmp_path, caplog):
    trainer = ts.Trainer(testing.tiny_model(TINY), CONFIG)  # max_skipped_in_a_row=3 (the default)
    nan = dict(_batch(1), advantages=np.full((ROWS, SEQ), np.nan, np.float32))
    assert trainer.update(_batch(1))["skipped"] == 0.0
    good = _leaves(trainer.params)
    with caplog.at_level("WARNING"):
        for i in (1, 2):
            out = trainer.update(nan)
            assert (out["skipped"], out["skipped_in_a_row"], out["skipped_total"]) == (1.0, i, i)
    assert "update skipped, params kept (2 in a row, 2 in all)" in caplog.text
    for a, b in zip(good, _leaves(trainer.params), strict=True):
        np.testing.assert_array_equal(a, b)  # a skipped update changes nothing
    # a checkpoint saved now holds the finite params of before the skips
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"), async_save=False)
    ck.save(trainer.step, params=trainer.params, opt_state=trainer.opt_state, force=True)
    restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state)
    ck.close()
    assert all(np.isfinite(x).all() for x in _leaves(restored.params) + _leaves(restored.opt_state))
    out = trainer.update(_batch(2))  # a finite update resets the run of skips
    assert (out["skipped"], out["skipped_in_a_row"], out["skipped_total"]) == (0.0, 0, 2)
    trainer.update(nan)
    trainer.update(nan)
    with pytest.raises(ts.NonFiniteUpdates, match=r"train step 6: 3 updates in a row \(steps 4\.\.6\) had a "
                                                  r"non-finite loss or gradient.*max_skipped_in_a_row=3"):
        trainer.update(nan)


def test_a_failed_async_save_names_its_step_at_the_next_save(damaged, monkeypatch):
    d, _, trainer = damaged
    ck = checkpoint.Checkpointer(d, save_every=1, keep=5)
    assert ck.save(4, params=trainer.params, opt_state=trainer.opt_state)

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.manager, "wait_until_finished", full)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"checkpoint step 4 could not be saved .*disk is full"):
        ck.save(5, params=trainer.params, opt_state=trainer.opt_state)
    monkeypatch.undo()
    ck.close()


def test_a_resume_with_another_lr_schedule_is_reported(tmp_path, caplog):
    """A 2-step and a 4-step run follow other cosine schedules (train.num_steps sets its length): the
    measured cause of 'two launches differ' (BENCHMARKS.md, "Bit-identical launches")."""
    short = ts.Trainer(testing.tiny_model(TINY), CONFIG)
    longer = ts.Trainer(testing.tiny_model(TINY), ts.TrainConfig(loss=CONFIG.loss, optim=ts.OptimConfig(
        learning_rate=1e-2, warmup_steps=1, total_steps=16)))
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"), async_save=False)
    ck.save(1, params=short.params, opt_state=short.opt_state, force=True,
            extra={"schedule": short.schedule_info()})
    restored = ck.restore(params=short.params, opt_state=short.opt_state)
    ck.close()
    assert checkpoint.check_schedule(restored, short.schedule_info()) == []
    with caplog.at_level("WARNING"):
        assert checkpoint.check_schedule(restored, longer.schedule_info()) == ["total_steps"]
    assert "total_steps: 8 -> 16" in caplog.text and "not the run that saved it" in caplog.text
