"""Orbax checkpoints of a training run: params (or LoRA params only), optimizer state, step, RNG key and the
data iterator state, saved asynchronously every N steps, the last K kept (and every multiple of `keep_period`
when given: the steps a run chooses its builder among, `eval.select`).

Layout (orbax-checkpoint 0.12.8 `CheckpointManager`, one `Composite` per step):

    <directory>/<step>/params      StandardSave of the trainable params (a pure dict of arrays)
    <directory>/<step>/opt_state   StandardSave of the optax state
    <directory>/<step>/meta        JsonSave: {"step", "rng" (raw key data), "data" (grain iterator state),
                                   "data_by_process" (multi-process runs: every process's iterator state)}
    <directory>/<step>/commit_success.txt   orbax's commit marker, written when the step is finalized

A step directory without the commit marker (a save that died half-way), or an orbax tmp directory
(`<step>.orbax-checkpoint-tmp-*`), is skipped with a warning and moved under `<directory>/_incomplete/`
(so a later save of the same step does not collide with it); restore then falls back to the newest good step.

Every step proves its content: at save, a crc32c digest of each array of `params` and `opt_state` (of its host
bytes, with its shape and dtype) goes into `meta["digests"]`; at restore every array is checked against it.
A step whose arrays are missing, truncated, fail to decode or do not match their digest, or whose `meta` is
not readable JSON, is *damaged*: `Checkpointer.restore` (training, SFT) and `restore_params` (eval, build,
`model.init="orbax"`) go through the one `restore_step` and fall back to the newest good step with a warning
naming the step, the array and the reason; the damaged newer steps are moved under `_damaged/`. When steps
exist and none restores, `Checkpointer.restore` raises `CheckpointError` listing each step and why; it
starts over only when asked (`start_fresh=True`, `config.checkpoint.start_fresh`). A step saved before
digests existed restores with a warning that it is unverified. Multi-process runs digest the arrays a
process can address whole (a globally sharded array of a multi-host mesh is not digested).

A save that fails (a full disk: `OSError` ENOSPC, in the synchronous part or the async writer) raises
`CheckpointError` naming the step and the directory; Orbax writes into a tmp directory and renames it only
once complete, so the previous step stays intact (the tmp directory is moved aside at the next start).

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
import errno
import json
import re
import time
from typing import Any

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from librarian_jax import storage
from librarian_jax.config_schema import ConfigError

COMMIT_MARKER = "commit_success.txt"
INCOMPLETE_DIR = "_incomplete"
DAMAGED_DIR = "_damaged"
DIGEST_ITEMS = ("params", "opt_state")
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


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (every step damaged, an asked-for step damaged, a failed save): one
    line naming the directory, the step and the reason. A `ConfigError`, so the CLI prints it as one line."""


@dataclasses.dataclass
class DamagedStep(Exception):
    """One step failed to restore: `what` is the item or array (`params/layers/0/attn/q/kernel`), `reason`
    one line."""

    step_dir: str
    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.what}: {self.reason}"


class MissingMeta(DamagedStep):
    """A step directory without a `meta` item: not a step this module saved (e.g. a params-only step another
    tool wrote). `restore_params` takes its params unverified; a training resume cannot (no RNG, no data
    position)."""


def one_line(e: BaseException, limit: int = 240) -> str:
    """`Type: first line of the message`, cut at `limit` characters (TensorStore errors carry a multi-kilobyte
    spec dump after the first line)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(" See full TensorStore details")[0]
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        text += f" ({one_line(cause, limit // 2)})"
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _keystr(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _host_bytes(x: Any) -> np.ndarray | None:
    """The array's host copy (C order), or None when this process cannot address all of it."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.ascontiguousarray(np.asarray(x))


def array_digest(host: np.ndarray) -> dict[str, Any]:
    """{"crc32c", "shape", "dtype"} of one host array (crc32c of its bytes in C order)."""
    # `extend` reads any buffer (no copy); `value` only takes read-only bytes
    return {"crc32c": int(google_crc32c.extend(0, host.reshape(-1).view(np.uint8))),
            "shape": list(host.shape), "dtype": str(host.dtype)}


def digests(tree: Any) -> dict[str, dict[str, Any]]:
    """The digest of every array leaf of `tree` (a pure tree, as saved), by path. Device-to-host copies start
    for every leaf before the first is read, so they overlap."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for _, x in leaves:
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            x.copy_to_host_async()
    out = {}
    for path, x in leaves:
        if not isinstance(x, jax.Array | np.ndarray | np.generic):
            continue
        host = _host_bytes(x)
        if host is not None:
            out[_keystr(path)] = array_digest(host)
    return out


def verify(step_dir: str, item: str, tree: Any, want: dict[str, dict[str, Any]]) -> None:
    """Raises DamagedStep naming the first array of `tree` (item `item`) whose digest is not `want`'s."""
    have_paths = set()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, jax.Array | np.ndarray | np.generic):
            continue
        key = _keystr(path)
        have_paths.add(key)
        expected = want.get(key)
        if expected is None:
            continue  # not digested at save (an array no process held whole)
        host = _host_bytes(x)
        if host is None:
            continue
        got = array_digest(host)
        if got["shape"] != expected["shape"] or got["dtype"] != expected["dtype"]:
            raise DamagedStep(step_dir, f"{item}/{key}",
                              f"restored as {got['dtype']}{got['shape']}, saved as "
                              f"{expected['dtype']}{expected['shape']}")
        if got["crc32c"] != expected["crc32c"]:
            finite = bool(np.isfinite(host).all()) if np.issubdtype(host.dtype, np.floating) else True
            raise DamagedStep(step_dir, f"{item}/{key}",
                              f"crc32c {got['crc32c']:#010x} != {expected['crc32c']:#010x} saved (content "
                              f"changed on disk{'' if finite else '; it holds non-finite values'})")
    missing = sorted(set(want) - have_paths)
    if missing:
        raise DamagedStep(step_dir, f"{item}/{missing[0]}", "saved, but not in the restore target")


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


def read_meta(step_dir: str) -> dict[str, Any]:
    """The `meta` item of a step (JSON); DamagedStep when it is missing or not readable JSON."""
    path = storage.join(step_dir, "meta", "metadata")
    try:
        meta = json.loads(storage.read_text(path))
    except FileNotFoundError:
        raise MissingMeta(step_dir, "meta", f"{path} is missing") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise DamagedStep(step_dir, "meta", f"{path} is not readable JSON ({one_line(e, 120)})") from None
    if not isinstance(meta, dict):
        raise DamagedStep(step_dir, "meta", f"{path} holds {type(meta).__name__}, not an object")
    return meta


def _restore_item(step_dir: str, item: str, target: Any) -> Any:
    """One StandardSave item of a step into `target`'s (pure) structure and shardings."""
    path = storage.join(step_dir, item)
    if not storage.isdir(path):
        raise DamagedStep(step_dir, item, f"{path} is missing")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(storage.path(path), _abstract(_convert(target)))
    except Exception as e:  # noqa: BLE001 - any failure to read or decode an item makes the step damaged
        raise DamagedStep(step_dir, item, one_line(e)) from None


def restore_step(step_dir: str, *, params: Any, opt_state: Any = None,
                 require_meta: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    """The one restore of a step, for training, SFT, eval and build: `(params, opt_state, meta)` with
    params/opt_state in the structure and shardings of the targets (opt_state None when not asked for), every
    array checked against the digest saved in `meta`. Raises `DamagedStep` naming the item or array. With
    `require_meta=False` a step without `meta` (`MissingMeta`: a params-only step) restores unverified, with
    a warning, and `meta` is `{}`; unreadable `meta` is damage either way."""
    try:
        meta = read_meta(step_dir)
    except MissingMeta:
        if require_meta:
            raise
        meta = {}
    saved = meta.get("digests")
    if not isinstance(saved, dict):
        logging.warning("checkpoint %s has no array digests (%s); its arrays are restored unverified",
                        step_dir, "saved before they existed" if meta else "no meta item: a params-only step")
        saved = {}
    out = []
    for item, target in (("params", params), ("opt_state", opt_state)):
        if target is None:
            out.append(None)
            continue
        pure = _restore_item(step_dir, item, target)
        verify(step_dir, item, pure, saved.get(item) or {})
        out.append(_from_pure(target, pure))
    return out[0], out[1], meta


def _step_of(step_dir: str) -> int:
    name = storage.basename(step_dir.rstrip("/"))
    return int(name) if _STEP_RE.match(name) else -1


def _set_aside(directory: str, step: int) -> None:
    """Moves a damaged step under `<directory>/_damaged/` (process 0), kept for inspection."""
    if jax.process_index() == 0:
        storage.move(storage.join(directory, str(step)),
                     storage.join(directory, DAMAGED_DIR, f"{step}.{time.time_ns()}"))


def _failures(failed: list[tuple[int, DamagedStep]]) -> str:
    return "; ".join(f"step {s}: {e}" for s, e in failed)


def _is_disk_full(e: BaseException) -> bool:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "RESOURCE_EXHAUSTED" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def check_schedule(restored: Restored, schedule: dict[str, Any], directory: str = "") -> list[str]:
    """Compares the optimizer schedule a checkpoint recorded (`meta["extra"]["schedule"]`, saved as
    `extra={"schedule": trainer.schedule_info()}`) with this run's; logs a WARNING naming each setting that
    changed and returns those names. A run resumed with another `train.num_steps` follows another cosine
    schedule from the resumed step on, so it cannot equal the run it resumes (nor a straight run of either
    length). Checkpoints without the record are not compared."""
    saved = (restored.meta.get("extra") or {}).get("schedule")
    if not isinstance(saved, dict):
        return []
    changed = sorted(k for k in set(saved) | set(schedule) if saved.get(k) != schedule.get(k))
    if changed:
        logging.warning(
            "checkpoint step %d%s was trained with another optimizer schedule (%s); the resumed run follows "
            "this run's from step %d on, so it is not the run that saved it", restored.step,
            f" of {directory}" if directory else "",
            ", ".join(f"{k}: {saved.get(k)!r} -> {schedule.get(k)!r}" for k in changed), restored.step + 1)
    return changed


class Checkpointer:
    """Saves and restores a run's state under `directory` (see module doc)."""

    def __init__(self, directory: str, *, save_every: int = 1, keep: int = 3, async_save: bool = True,
                 sync_timeout_s: int = 600, keep_period: int | None = None):
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
        # keep_period: steps that are multiples of it are never deleted (besides the newest `keep`)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period,
                                               save_interval_steps=1,
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
        `data_by_process`: every process's data iterator state, in process order (multi-process runs).
        The digest of every array goes into `meta["digests"]`. A failed save (a full disk) raises
        `CheckpointError`; the previous step stays as it was."""
        if not force and not self.should_save(step):
            return False
        if step in self.manager.all_steps():
            logging.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        # the previous async save first (Orbax waits for it anyway): its failure names its own step
        self.wait()
        pure_params, pure_opt = _convert(params), _convert(opt_state)
        t0 = time.perf_counter()
        meta = {"step": int(step), "rng": rng_to_json(rng) if rng is not None else None,
                "data": data_state, "extra": extra or {},
                "digests": {"params": digests(pure_params), "opt_state": digests(pure_opt)}}
        self.digest_s = time.perf_counter() - t0
        if data_by_process is not None:
            meta["data_by_process"] = list(data_by_process)
        json.dumps(meta)  # fail now, with the offending value, rather than inside the async writer
        args = ocp.args.Composite(params=ocp.args.StandardSave(pure_params),
                                  opt_state=ocp.args.StandardSave(pure_opt),
                                  meta=ocp.args.JsonSave(meta))
        try:
            saved = self.manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - a full disk in the synchronous part of the save
            raise self._save_error(step, e) from e
        if saved:
            self._pending = step
            logging.info("checkpoint: saving step %d to %s (async)", step, self.directory)
        return bool(saved)

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        done = [s for s in self.steps() if s != step]
        prev = f"the previous step {done[-1]} is intact" if done else "no earlier step exists"
        why = "the disk is full" if _is_disk_full(e) else "the write failed"
        return CheckpointError(f"checkpoint step {step} could not be saved to {self.directory}: {why} "
                               f"({one_line(e)}); {prev}")

    def restore(self, *, params: Any, opt_state: Any, step: int | None = None,
                start_fresh: bool = False) -> Restored | None:
        """Restores the newest good committed step (or `step`) into the structure/shardings of the targets.

        A damaged step (see module doc) is reported with a warning naming the step, the array and the reason,
        and the previous one is tried; once a good one restores, the damaged newer ones are moved under
        `_damaged/`. Returns None when there is no committed step. When steps exist and none restores, raises
        `CheckpointError` listing each step and why, unless `start_fresh` (then they are moved aside with a
        warning and None is returned). An asked-for `step` that is damaged raises.
        """
        candidates = [step] if step is not None else list(reversed(self.steps()))
        failed: list[tuple[int, DamagedStep]] = []
        for s in candidates:
            step_dir = storage.join(self.directory, str(s))
            try:
                p, o, meta = restore_step(step_dir, params=params, opt_state=opt_state)
            except DamagedStep as e:
                failed.append((s, e))
                if step is not None:
                    raise CheckpointError(
                        f"checkpoint step {s} in {self.directory} is damaged: {e}") from None
                logging.warning("checkpoint step %d in %s is damaged (%s); trying the previous step", s,
                                self.directory, e)
                continue
            for bad, _ in failed:
                _set_aside(self.directory, bad)
            if failed:
                self.manager.reload()
                logging.warning("checkpoint: restored step %d of %s; damaged newer step(s) %s moved to %s/",
                                s, self.directory, [b for b, _ in failed], DAMAGED_DIR)
            rng = rng_from_json(meta["rng"]) if meta.get("rng") else None
            logging.info("checkpoint: restored step %d from %s", s, self.directory)
            return Restored(step=int(meta.get("step", s)), params=p, opt_state=o, rng=rng,
                            data_state=meta.get("data"), meta=meta)
        if not failed:
            return None
        if not start_fresh:
            raise CheckpointError(
                f"checkpoint: no step in {self.directory} restores ({_failures(failed)}); "
                "not starting over: fix or remove them, or set config.checkpoint.start_fresh=True")
        for bad, _ in failed:
            _set_aside(self.directory, bad)
        self.manager.reload()
        logging.warning("checkpoint: no step in %s restores (%s); starting fresh as config.checkpoint."
                        "start_fresh asks (the damaged steps are under %s/)", self.directory,
                        _failures(failed), DAMAGED_DIR)
        return None

    def wait(self) -> None:
        """Waits for the pending async save; its failure (a full disk) raises `CheckpointError` naming it."""
        pending, self._pending = getattr(self, "_pending", None), None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the async writer's failure
            raise self._save_error(-1 if pending is None else pending, e) from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def restore_params(path: str, target: Any, *, fallback: bool = True) -> Any:
    """Reads the `params` item of an Orbax checkpoint into `target`'s structure (e.g. `nnx.state(model,
    nnx.Param)`), checked against its digests (`restore_step`). `path` is a run's checkpoint directory (its
    newest good committed step is used) or one step directory. With `fallback`, a damaged step falls back to
    the newest good committed step older than it, with a warning naming the step, the array and the reason;
    none good (or `fallback=False`) raises `CheckpointError` listing each step and why. Used by eval and build
    (`eval.restore.restore_builder`) and for initial weights (`model.init = "orbax"`)."""
    return restore_params_step(path, target, fallback=fallback)[0]


def restore_params_step(path: str, target: Any, *, fallback: bool = True) -> tuple[Any, int]:
    """`restore_params` and the step it restored."""
    path = storage.abspath(path)
    if not storage.isdir(path):
        raise FileNotFoundError(f"orbax checkpoint {path} does not exist")
    if storage.isdir(storage.join(path, "params")):  # one step directory
        directory, first = storage.dirname(path), _step_of(path)
        candidates = [(first, path)]
        if fallback and first >= 0:
            candidates += [(s, storage.join(directory, str(s)))
                           for s in reversed(_committed(directory)) if s < first]
    else:
        directory = path
        candidates = [(s, storage.join(path, str(s))) for s in reversed(_committed(path))]
        if not candidates:
            raise FileNotFoundError(f"orbax checkpoint directory {path} holds no committed step")
        if not fallback:
            candidates = candidates[:1]
    failed: list[tuple[int, DamagedStep]] = []
    for i, (s, step_dir) in enumerate(candidates):
        try:
            params, _, _ = restore_step(step_dir, params=target, require_meta=False)
        except DamagedStep as e:
            failed.append((s, e))
            logging.warning("checkpoint step %d in %s is damaged (%s)%s", s, directory, e,
                            "; trying the previous step" if i + 1 < len(candidates) else "")
            continue
        if failed:
            logging.warning("checkpoint: using step %d of %s instead of damaged step(s) %s", s, directory,
                            [b for b, _ in failed])
        return params, s
    raise CheckpointError(f"checkpoint: no usable step in {directory} ({_failures(failed)})")


def _committed(directory: str) -> list[int]:
    return sorted(int(n) for n in storage.listdir(directory)
                  if _STEP_RE.match(n) and is_committed(storage.join(directory, n)))
