"""Orbax checkpoints of a training run: params (or LoRA params only), optimizer state, step, RNG key and the
data iterator state, saved asynchronously every N steps, the last K kept.

Layout (orbax-checkpoint 0.12.8 `CheckpointManager`, one `Composite` per step):

    <directory>/<step>/params      StandardSave of the trainable params (a pure dict of arrays)
    <directory>/<step>/opt_state   StandardSave of the optax state
    <directory>/<step>/meta        JsonSave: {"step", "rng" (raw key data), "data" (grain iterator state),
                                   "data_by_process" (multi-process runs: every process's iterator state)}
    <directory>/<step>/commit_success.txt   orbax's commit marker, written when the step is finalized

A step directory without the commit marker (a save that died half-way), or an orbax tmp directory
(`<step>.orbax-checkpoint-tmp-*`), is skipped with a warning and moved under `<directory>/_incomplete/`
(so a later save of the same step does not collide with it); restore then falls back to the newest good step.
A step that is marked committed but still fails to restore is treated the same way.

Multi-process runs: every process constructs the Checkpointer and calls `save`/`restore` for every step (each
writes its own shards of the global arrays; process 0 writes `meta` and, after Orbax's barrier confirms every
process finished, the commit marker). So a committed step is one every process committed; a restart resumes
from the newest of those. Orbax's cross-process barriers time out after `sync_timeout_s` (and a dead process
stops the others sooner through JAX's heartbeat, `librarian_jax.distributed.initialize`).

`directory` may be a local path or a URL (`gs://bucket/run/checkpoints`): Orbax gets it as an `epath.Path`
and writes the arrays through tensorstore's `gcs` driver; the bookkeeping here (commit markers, moving
half-written steps) goes through `librarian_jax.storage`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from librarian_jax import storage

COMMIT_MARKER = "commit_success.txt"
INCOMPLETE_DIR = "_incomplete"
ITEMS = ("params", "opt_state", "meta")
_STEP_RE = re.compile(r"^(\d+)$")


@dataclasses.dataclass
class Restored:
    """A restored training state. `params`/`opt_state` have the structure (and shardings) of the targets."""

    step: int
    params: Any
    opt_state: Any
    rng: jax.Array | None
    data_state: dict[str, Any] | None
    meta: dict[str, Any]


def _convert(tree: Any) -> Any:
    if isinstance(tree, nnx.State):
        return tree.to_pure_dict()
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_convert(x) for x in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(_convert(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _convert(v) for k, v in tree.items()}
    return tree


def _from_pure(target: Any, pure: Any) -> Any:
    """Puts the arrays of `pure` (the shape `_convert(target)` had) back into `target`'s structure."""
    if isinstance(target, nnx.State):
        new = jax.tree.map(lambda x: x, target)  # a fresh State; the target is left as it was
        nnx.replace_by_pure_dict(new, pure)
        return new
    if isinstance(target, tuple) and hasattr(target, "_fields"):
        return type(target)(*(_from_pure(t, p) for t, p in zip(target, pure, strict=True)))
    if isinstance(target, tuple | list):
        return type(target)(_from_pure(t, p) for t, p in zip(target, pure, strict=True))
    if isinstance(target, dict):
        return {k: _from_pure(v, pure[k]) for k, v in target.items()}
    return pure


def _abstract(tree: Any) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray | np.generic):
            return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        return x

    return jax.tree.map(leaf, tree)


def rng_to_json(key: jax.Array) -> dict[str, Any]:
    """A PRNG key (typed or raw uint32) -> JSON: its raw key data and whether it was typed."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(key) if typed else key
    return {"data": np.asarray(data).astype(np.uint32).tolist(), "typed": bool(typed),
            "impl": str(jax.random.key_impl(key)) if typed else None}


def rng_from_json(d: dict[str, Any]) -> jax.Array:
    data = jnp.asarray(np.asarray(d["data"], np.uint32))
    return jax.random.wrap_key_data(data) if d.get("typed") else data


def is_committed(step_dir: str) -> bool:
    """True when orbax finished the step: a `<step>` directory (not a tmp dir) holding the commit marker
    (orbax 0.12.8 writes `commit_success.txt` last, on every filesystem, `gs://` included)."""
    name = storage.basename(step_dir)
    return bool(_STEP_RE.match(name)) and storage.exists(storage.join(step_dir, COMMIT_MARKER))


def quarantine_incomplete(directory: str) -> list[str]:
    """Moves every half-written step (no commit marker, or an orbax tmp dir) of `directory` under
    `_incomplete/`, with a warning each. Returns the moved names. Only process 0 touches the filesystem."""
    moved = []
    for name in storage.listdir(directory):
        path = storage.join(directory, name)
        if name == INCOMPLETE_DIR or not storage.isdir(path):
            continue
        is_tmp = ".orbax-checkpoint-tmp" in name
        if not is_tmp and not _STEP_RE.match(name):
            continue
        if not is_tmp and is_committed(path):
            continue
        moved.append(name)
        logging.warning("checkpoint %s is incomplete (%s); skipping it and moving it to %s/", path,
                        "orbax tmp dir" if is_tmp else f"no {COMMIT_MARKER}", INCOMPLETE_DIR)
        if jax.process_index() == 0:
            storage.move(path, storage.join(directory, INCOMPLETE_DIR, f"{name}.{time.time_ns()}"))
    return moved


class Checkpointer:
    """Saves and restores a run's state under `directory` (see module doc)."""

    def __init__(self, directory: str, *, save_every: int = 1, keep: int = 3, async_save: bool = True,
                 sync_timeout_s: int = 600):
        if save_every < 1:
            raise ValueError(f"checkpoint.save_every must be >= 1, got {save_every}")
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.directory = storage.abspath(directory)  # a local path or a URL (gs://...)
        self.save_every = save_every
        storage.makedirs(self.directory)
        quarantine_incomplete(self.directory)
        if jax.process_count() > 1:  # every process sees the same directory before orbax lists it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("librarian_jax.checkpoint.quarantine")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1,
                                               enable_async_checkpointing=async_save, create=True,
                                               async_options=ocp.options.AsyncOptions(timeout_secs=sync_timeout_s))
        self.manager = ocp.CheckpointManager(storage.path(self.directory), options=options, item_names=ITEMS)

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(s for s in self.manager.all_steps()
                      if is_committed(storage.join(self.directory, str(s))))

    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    def save(self, step: int, *, params: Any, opt_state: Any, rng: jax.Array | None = None,
             data_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
             force: bool = False, data_by_process: list[Any] | None = None) -> bool:
        """Starts an (async) save of `step` when it is due (`step % save_every == 0`) or `force`.
        `data_by_process`: every process's data iterator state, in process order (multi-process runs)."""
        if not force and not self.should_save(step):
            return False
        if step in self.manager.all_steps():
            logging.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        meta = {"step": int(step), "rng": rng_to_json(rng) if rng is not None else None,
                "data": data_state, "extra": extra or {}}
        if data_by_process is not None:
            meta["data_by_process"] = list(data_by_process)
        json.dumps(meta)  # fail now, with the offending value, rather than inside the async writer
        args = ocp.args.Composite(params=ocp.args.StandardSave(_convert(params)),
                                  opt_state=ocp.args.StandardSave(_convert(opt_state)),
                                  meta=ocp.args.JsonSave(meta))
        saved = self.manager.save(step, args=args, force=True)
        if saved:
            logging.info("checkpoint: saving step %d to %s (async)", step, self.directory)
        return bool(saved)

    def restore(self, *, params: Any, opt_state: Any, step: int | None = None) -> Restored | None:
        """Restores the newest committed step (or `step`) into the structure/shardings of the targets.

        A step that fails to restore is quarantined with a warning and the previous one is tried.
        Returns None when no usable checkpoint exists.
        """
        candidates = [step] if step is not None else list(reversed(self.steps()))
        for s in candidates:
            try:
                args = ocp.args.Composite(
                    params=ocp.args.StandardRestore(_abstract(_convert(params))),
                    opt_state=ocp.args.StandardRestore(_abstract(_convert(opt_state))),
                    meta=ocp.args.JsonRestore())
                out = self.manager.restore(s, args=args)
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                logging.warning("checkpoint step %d in %s could not be restored (%s: %s); trying the "
                                "previous one", s, self.directory, type(e).__name__, e)
                if step is not None:
                    raise
                if jax.process_index() == 0:
                    storage.move(storage.join(self.directory, str(s)),
                                 storage.join(self.directory, INCOMPLETE_DIR, f"{s}.{time.time_ns()}"))
                self.manager.reload()
                continue
            meta = dict(out["meta"])
            rng = rng_from_json(meta["rng"]) if meta.get("rng") else None
            logging.info("checkpoint: restored step %d from %s", s, self.directory)
            return Restored(step=int(meta.get("step", s)), params=_from_pure(params, out["params"]),
                            opt_state=_from_pure(opt_state, out["opt_state"]), rng=rng,
                            data_state=meta.get("data"), meta=meta)
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_params(path: str, target: Any) -> Any:
    """Reads the `params` item of an Orbax checkpoint into `target`'s structure (e.g. `nnx.state(model,
    nnx.Param)`). `path` is a run's checkpoint directory (its newest committed step is used) or one step
    directory. Used for initial weights (`model.init_from = "orbax"`)."""
    path = storage.abspath(path)
    if not storage.isdir(path):
        raise FileNotFoundError(f"orbax checkpoint {path} does not exist")
    if storage.isdir(storage.join(path, "params")):
        step_dir = path
    else:
        steps = sorted(int(n) for n in storage.listdir(path)
                       if _STEP_RE.match(n) and is_committed(storage.join(path, n)))
        if not steps:
            raise FileNotFoundError(f"orbax checkpoint directory {path} holds no committed step")
        step_dir = storage.join(path, str(steps[-1]))
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(storage.path(storage.join(step_dir, "params")), _abstract(_convert(target)))
    return _from_pure(target, pure)
