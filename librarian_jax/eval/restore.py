"""A training run's builder, restored from its Orbax checkpoints onto the mesh of *this* process.

    run_cfg = load_run_config(run_dir)                       # the run's own config.json, typed
    step, step_dir = select_step(run_dir, step=None)         # newest committed step (or the one asked for)
    check_checkpoint(step_dir, run_cfg)                      # shapes vs the run's preset / LoRA rank
    model = restore_builder(run_cfg, step_dir, mesh, tok)    # full params, or LoRA params on the base

Every check reads only JSON and Orbax metadata, so a bad run directory fails with one line naming the path
(`ConfigError`) before any weight is loaded; a newest step whose metadata does not read is skipped with a
warning; `check_output_dir` checks the output directory takes a file and has free space. The restore goes
through `checkpoint.restore_step` (every array against its saved digest; a damaged step falls back): Orbax's
`StandardRestore` into abstract targets that carry this mesh's shardings (each process reads its own shards;
no gather to one host), so a run trained on a (8, 1, 1) mesh restores onto (2, 4, 1) or one device alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import jax
from absl import logging
from flax import nnx

from librarian_jax import checkpoint, cluster, inputs, models, storage, tokenizers
from librarian_jax.config_schema import RUN_SCHEMAS, RunConfig, require_typed, schema_for, upgrade_recorded
from librarian_jax.config_validation import ConfigError
from librarian_jax.models.placement import placed_copy
from librarian_jax.rl.train_step import apply_lora

CHECKPOINT_DIR = "checkpoints"


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config.{key}: {msg}")


def load_run_config(run_dir: str, key: str = "run") -> RunConfig:
    """The config a training run recorded in `run_dir/config.json`, read through its schema (`GRPOConfig`,
    or `SFTConfig` for an SFT run; keys it leaves out take their defaults): typed and checked, or a
    ConfigError naming the file and the bad key. Keys an older run recorded under a name since retired are
    read under the new one (`config_schema.upgrade_recorded`)."""
    path = storage.join(run_dir, "config.json")
    if not storage.isdir(run_dir):
        raise _err(key, f"training workdir {run_dir!r} does not exist")
    if not storage.isfile(path):
        raise _err(key, f"{path!r} is missing: not a training workdir (main writes config.json at start)")
    try:
        recorded = json.loads(storage.read_text(path))
    except (OSError, ValueError) as e:
        raise _err(key, f"{path!r} is not a readable config ({e})") from None
    if not isinstance(recorded, dict):
        raise _err(key, f"{path!r} is not a readable config (a JSON object expected)")
    try:
        schema = schema_for(recorded)
        if schema not in RUN_SCHEMAS:
            raise ConfigError(f"config.command: {recorded.get('command')!r} is not a training command")
        return schema.parse(upgrade_recorded(recorded))
    except ConfigError as e:
        raise _err(key, f"{path!r}: {e}") from None


def committed_steps(ckpt_dir: str) -> list[int]:
    """Steps of `ckpt_dir` that Orbax finished (commit marker present), oldest first. Read-only: unlike
    `checkpoint.Checkpointer`, evaluation never moves a run's half-written steps."""
    return sorted(
        int(n)
        for n in storage.listdir(ckpt_dir)
        if n.isdigit() and checkpoint.is_committed(storage.join(ckpt_dir, n))
    )


def step_is_readable(step_dir: str) -> str | None:
    """Why `step_dir` cannot be restored, judged on its metadata alone (the step's `meta` JSON and the
    params item's Orbax metadata; no array is read), or None. The arrays themselves are checked against their
    digests when they are restored (`checkpoint.restore_step`)."""
    try:
        checkpoint.read_meta(step_dir)
    except checkpoint.MissingMeta:
        pass  # a params-only step: restored unverified, with a warning
    except checkpoint.DamagedStep as e:
        return str(e)
    try:
        checkpoint_shapes(step_dir)
    except ConfigError as e:
        return str(e).removeprefix("config.run: ")
    return None


def select_step(run_dir: str, step: int | None = None, key: str = "run") -> tuple[int, str]:
    """(step, step directory): `step`, or the newest committed one whose metadata reads (a newer damaged one
    is skipped with a warning naming it and why, as training's restore does); a half-written, missing or
    damaged asked-for step is an error naming its path (a newer half-written step is skipped with a
    warning)."""
    ckpt_dir = storage.join(run_dir, CHECKPOINT_DIR)
    steps = committed_steps(ckpt_dir)
    if step is not None and step >= 0:
        path = storage.join(ckpt_dir, str(step))
        if not storage.isdir(path):
            raise _err("step", f"{path!r} does not exist (committed steps: {steps})")
        if not checkpoint.is_committed(path):
            raise _err(
                "step", f"{path!r} is half-written (no {checkpoint.COMMIT_MARKER}); committed steps: {steps}"
            )
        why = step_is_readable(path)
        if why:
            raise _err("step", f"{path!r} is damaged ({why}); committed steps: {steps}")
        return step, path
    if not steps:
        raise _err(key, f"{ckpt_dir!r} holds no committed checkpoint step")
    failed: list[tuple[int, str]] = []
    while steps:
        why = step_is_readable(storage.join(ckpt_dir, str(steps[-1])))
        if not why:
            break
        failed.append((steps[-1], why))
        steps = steps[:-1]
    if not steps:
        raise _err(key, f"no checkpoint step in {ckpt_dir!r} restores "
                        f"({'; '.join(f'step {s}: {why}' for s, why in failed)})")
    if failed:  # one line for the fall-back, as `checkpoint.restore_params` writes it
        logging.warning("%s; evaluating step %d", checkpoint.damaged_steps(ckpt_dir, failed), steps[-1])
    half_written = [n for n in storage.listdir(ckpt_dir) if n.isdigit() and int(n) > steps[-1]
                    and not checkpoint.is_committed(storage.join(ckpt_dir, n))]
    for n in half_written:
        logging.warning(
            "checkpoint %s is half-written; evaluating step %d", storage.join(ckpt_dir, n), steps[-1]
        )
    return steps[-1], storage.join(ckpt_dir, str(steps[-1]))


def _keystr(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {
        _keystr(p): tuple(getattr(leaf, "shape", ()))
        for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _base_model_config(run_cfg: RunConfig) -> Any:

    m = run_cfg.model
    if m.init == "hf":
        path = os.path.join(m.path, "config.json")
        if not os.path.isfile(path):
            raise _err("run", f"the run's base model {path!r} is missing (model.path of the run's config)")
        with open(path) as f:
            return models.config_from_hf(json.load(f))
    return models.get_preset(m.preset)


def expected_params(run_cfg: RunConfig) -> tuple[dict[str, tuple[int, ...]], bool]:
    """(shape of every trainable param by path, is_lora) of the run's policy, from abstract shapes only."""
    require_typed(run_cfg, RUN_SCHEMAS, "eval.restore.expected_params")
    m = run_cfg.model
    cfg = _base_model_config(run_cfg)

    def make() -> Any:
        model = models.Transformer(cfg, rngs=nnx.Rngs(0))
        return apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_module_path) if m.lora_rank else model

    abstract = nnx.eval_shape(make)
    wrt = nnx.LoRAParam if m.lora_rank else nnx.Param
    return _shapes(nnx.state(abstract, wrt).to_pure_dict()), bool(m.lora_rank)


def checkpoint_shapes(step_dir: str) -> dict[str, tuple[int, ...]]:
    """Param shapes stored in a checkpoint step (Orbax metadata; no array is read)."""
    import orbax.checkpoint as ocp

    path = storage.join(step_dir, "params")
    if not storage.isdir(path):
        raise _err("run", f"{path!r} is missing: not a librarian_jax checkpoint step")
    # the item's handler, not a Checkpointer: a Checkpointer also reads the step's metadata file, which lives
    # one level up, and warns that it is missing from every good step
    handler = ocp.StandardCheckpointHandler()
    try:
        md = handler.metadata(storage.path(path))
    except Exception as e:  # noqa: BLE001 - unreadable metadata (garbage, a cut file) is one line naming it
        raise _err("run", f"{path!r}: Orbax metadata not readable ({checkpoint.one_line(e, 160)})") from None
    finally:
        handler.close()
    return _shapes(getattr(md, "tree", md))


# what an eval or build writes besides its workspaces (report, records); checked free at start
MIN_FREE_BYTES = 64 * 1024**2


def check_output_dir(out_dir: str, key: str = "out", min_free_bytes: int | None = None) -> None:
    """Before any work: `out_dir` (or its nearest existing parent) takes a file, and its disk has
    `min_free_bytes` free (default `MIN_FREE_BYTES`); else a one-line ConfigError naming the path. A
    `gs://` directory is not probed (its writes are checked by the first one)."""
    if storage.is_remote(out_dir):
        return
    parent = os.path.abspath(out_dir)
    while not os.path.isdir(parent):
        if os.path.exists(parent):
            raise _err(key, f"{out_dir!r}: {parent!r} is a file, not a directory")
        parent = os.path.dirname(parent)
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".librarian_write_check_"):
            pass
    except OSError as e:
        raise _err(key, f"{out_dir!r} is not writable ({parent!r}: {e.strerror or e})") from None
    free = shutil.disk_usage(parent).free
    min_free_bytes = MIN_FREE_BYTES if min_free_bytes is None else min_free_bytes
    if free < min_free_bytes:
        raise _err(key, f"{out_dir!r}: only {free / 1024**2:.0f} MiB free on its disk "
                        f"({min_free_bytes / 1024**2:.0f} MiB needed)")


def check_checkpoint(step_dir: str, run_cfg: RunConfig) -> None:
    """Raises ConfigError naming `step_dir` when its params are not the run's policy (another model preset,
    full params where LoRA was expected or the other way round, another LoRA rank)."""
    want, lora = expected_params(run_cfg)
    have = checkpoint_shapes(step_dir)
    have_lora = any("lora" in k for k in have)
    what = f"LoRA rank {run_cfg.model.lora_rank}" if lora else "full params"
    if have_lora != lora:
        kind = "LoRA" if have_lora else "full"
        raise _err(
            "run",
            f"checkpoint {step_dir!r} holds {kind} params; the run's config "
            f"({run_cfg.model.preset}) expects {what}",
        )
    for k in sorted(set(want) | set(have)):
        if want.get(k) != have.get(k):
            raise _err(
                "run",
                f"checkpoint {step_dir!r} does not match model {run_cfg.model.preset} with "
                f"{what}: param {k} has shape {have.get(k)} in the checkpoint, {want.get(k)} expected",
            )


def base_model(run_cfg: RunConfig, mesh: Any, tokenizer: Any) -> nnx.Module:
    """The run's initial weights (`model.init`/`model.path` of its config): the "base builder"."""
    return cluster.initial_model(run_cfg, mesh, tokenizer)


def restore_builder(
    run_cfg: RunConfig, step_dir: str, mesh: Any, tokenizer: Any, base: nnx.Module | None = None,
    *, fallback: bool = True,
) -> nnx.Module:
    """The policy of `run_cfg` at `step_dir`, on `mesh`: the base model with the checkpoint's params (full),
    or the base wrapped with LoRA adapters holding the checkpoint's LoRA params. The abstract restore target
    carries `mesh`'s shardings, so Orbax reads straight into them. Every array is checked against the step's
    digests (`checkpoint.restore_step`, the one restore of training, SFT, eval and build): a damaged step
    falls back to the newest good older one with a warning naming both (`fallback`; a step the user asked for
    by number should pass False) or raises `checkpoint.CheckpointError` naming the step, array and reason."""
    require_typed(run_cfg, RUN_SCHEMAS, "eval.restore.restore_builder")
    m = run_cfg.model
    model = base if base is not None else base_model(run_cfg, mesh, tokenizer)
    if m.lora_rank:
        model = apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_module_path, seed=run_cfg.seed)
    # a copy placed on `mesh` (`models.placement.placed_copy`: new Variables), so restoring into it never
    # changes `base` (eval's base builder and the trained one share the base's values this way)
    model = placed_copy(model, mesh)
    wrt = nnx.LoRAParam if m.lora_rank else nnx.Param
    target = nnx.state(model, wrt)
    restored, step = checkpoint.restore_params_step(step_dir, target, fallback=fallback)
    nnx.update(model, restored)
    logging.info(
        "restored the builder (%s) from %s (step %d) onto mesh %s",
        "LoRA" if m.lora_rank else "full params",
        step_dir,
        step,
        dict(mesh.shape),
    )
    return model


def run_tokenizer(run_cfg: RunConfig, run_dir: str, tasks: list[Any]) -> Any:
    """The run's tokenizer: its recorded file (`run_dir/tokenizer/*.model` when exactly one), else the one
    `inputs.build_tokenizer` gives for the run's config (HF folder / `model.tokenizer`)."""
    cfg = dataclasses.replace(run_cfg, workdir=run_dir)
    if not cfg.model.tokenizer and cfg.model.init != "hf":
        tok_dir = storage.join(run_dir, "tokenizer")
        files = [storage.join(tok_dir, n) for n in storage.listdir(tok_dir) if n.endswith(".model")]
        if len(files) == 1:
            return tokenizers.load_tokenizer(inputs.local_file(files[0], "tokenizer"))
    return inputs.build_tokenizer(cfg, tasks)
