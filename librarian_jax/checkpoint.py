"""Orbax checkpoints of a training run: params (or LoRA params only), optimizer state, step, RNG key and the
data iterator state, saved asynchronously every N steps, the last K kept (and every multiple of `keep_period`
when given: the steps a run chooses its builder among, `eval.select`).

Layout (orbax-checkpoint 0.12.8 `CheckpointManager`, one `Composite` per step):

    <directory>/<step>/params      StandardSave of the trainable params (a pure dict of arrays)
    <directory>/<step>/opt_state   StandardSave of the optax state
    <directory>/<step>/meta        JSON: {"step", "rng" (raw key data), "data" (grain iterator state),
                                   "data_by_process" (multi-process runs: every process's iterator state),
                                   "digests" (every shard's, below), "hosts" (each process's host name)}
    <directory>/<step>/commit_success.txt   orbax's commit marker, written when the step is finalized

A step directory without the commit marker (a save that died half-way), or an orbax tmp directory
(`<step>.orbax-checkpoint-tmp-*`), is skipped with a warning and moved under `<directory>/_incomplete/`
(so a later save of the same step does not collide with it); restore then falls back to the newest good step.

Every step proves its content, shard by shard. Each process digests (crc32c) the shards of `params` and
`opt_state` that it writes, keyed by array and shard (the shard's region of the global array, `0:64,0:256`),
from the host copy Orbax makes for its asynchronous write, on Orbax's writer thread: the next step runs
meanwhile (`_serialize_and_digest`). The `meta` item is written last in the same save: each process posts its
digests (`distributed.post`, JAX's coordination service) and process 0 merges every process's into
`meta["digests"]` (`{item: {array: {"shape", "dtype", "shards": {region: {"crc32c", "process"}}}}}`), so a
committed step holds the digest of every shard of every host. At restore each process checks the shards it
holds (in whatever layout it restores: a saved shard is checked by the process holding the restored shard
that contains it) and the processes agree before any goes on (`restore_step`).

A step whose arrays are missing, truncated, fail to decode or do not match their digest, or whose `meta` is
not readable JSON, is *damaged*, on every process together: `Checkpointer.restore` (training, SFT) and
`restore_params` (eval, build, `model.init="orbax"`) go through the one `restore_step` and fall back to the
newest good step with one warning naming the step, the array, the shard and the process (host) that wrote it,
and the reason; the damaged newer steps are moved under `_damaged/`. Orbax's other reads of a failed restore
are settled before that warning (`_run_sync_settled`), so it is the only thing the fall-back prints. When
steps exist and none restores, `Checkpointer.restore` raises `CheckpointError` listing each step and why; it
starts over only when asked (`start_fresh=True`, `config.checkpoint.start_fresh`). A step saved before
digests existed restores with a warning that it is unverified; one saved with whole-array digests (before
shard digests) is checked array by array where a process holds the array whole.

A save that fails (a full disk: `OSError` ENOSPC, in the synchronous part or the async writer) raises
`CheckpointError` naming the step and the directory; Orbax writes into a tmp directory and renames it only
once complete, so the previous step stays intact (the tmp directory is moved aside at the next start).

Multi-process runs: every process constructs the Checkpointer and calls `save`/`restore` for every step (each
writes its own shards of the global arrays; process 0 writes `meta` once every process's digests arrived and,
after Orbax's barrier confirms every process finished, the commit marker). So a committed step is one every
process committed, with every process's digests; a restart resumes from the newest of those. Orbax's
cross-process barriers and the digests' exchange time out after `sync_timeout_s` (and a dead process stops the
others sooner through JAX's heartbeat, `librarian_jax.distributed.initialize`).

`directory` may be a local path or a URL (`gs://bucket/run/checkpoints`): Orbax gets it as an `epath.Path`
and writes the arrays through tensorstore's `gcs` driver; the bookkeeping here (commit markers, moving
half-written steps) goes through `librarian_jax.storage`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import re
import socket
import threading
import time
import zlib
from collections.abc import Iterable
from typing import Any

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.serialization import jax_array_handlers

from librarian_jax import distributed, storage
from librarian_jax.errors import ConfigError

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


# ------------------------------------------------------------------------------------------- digests

_CRC_CHUNK = 8 << 20  # bytes per crc32c call: the C extension holds the GIL while it runs (~0.7 ms a chunk)


def crc32c(host: np.ndarray) -> int:
    """crc32c of a host array's bytes in C order (a copy only when it is not C-contiguous), in chunks, so the
    thread computing it lets the others run between them."""
    data = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    crc = 0
    for i in range(0, data.size, _CRC_CHUNK):
        crc = google_crc32c.extend(crc, data[i : i + _CRC_CHUNK])  # `extend` reads any buffer (no copy)
    return int(crc)


def region(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's key: its region of the global array, `start:stop` per dimension (`0:64,0:256`; "" for a
    scalar)."""
    return ",".join(f"{sl.start or 0}:{n if sl.stop is None else sl.stop}"
                    for sl, n in zip(index, shape, strict=True))


def _region_slices(key: str) -> tuple[slice, ...]:
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",")) if key else ()


def _contains(outer: tuple[slice, ...], inner: tuple[slice, ...]) -> bool:
    return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner, strict=True))


def _resolved(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return _region_slices(region(index, shape))


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _whole(x: Any) -> list[tuple[tuple[slice, ...], np.ndarray]]:
    """A host array as one fragment covering all of it."""
    host = np.asarray(x)
    return [(tuple(slice(0, n) for n in host.shape), host)]


def _own_fragments(x: jax.Array) -> list[tuple[tuple[slice, ...], np.ndarray]]:
    """The shards of `x` this process writes when Orbax's host copies are not hooked (one replica of each:
    `replica_id == 0`), copied to the host here."""
    shards = [s for s in x.addressable_shards if s.replica_id == 0]
    for s in shards:
        s.data.copy_to_host_async()
    return [(s.index, np.asarray(s.data)) for s in shards]


class SaveDigests:
    """The shard digests of one save: this process's, added as Orbax's writer threads hand over their host
    copies (`add`), then every process's, merged on process 0 by the `meta` item's writer (`gather`).
    `expected`: {item: array keys} that Orbax will hand over; `nbytes`/`seconds`: what this process digested
    and the time it took (on the writer threads); `copied_bytes`: the device shards this process copied to
    the host itself, on the save's call, for want of Orbax's copies (0 while the hook is in place)."""

    def __init__(self, exchange: str, expected: dict[str, set[str]], timeout_s: float):
        self.exchange = exchange  # the coordination-service key of this save's exchange
        self.timeout_s = timeout_s
        self.digests: dict[str, dict[str, Any]] = {item: {} for item in DIGEST_ITEMS}
        self.nbytes, self.seconds = 0, 0.0
        self.copied_bytes = 0
        self._missing = {item: set(keys) for item, keys in expected.items()}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._check_done()

    def add(self, item: str, key: str, shape: Iterable[int], dtype: Any,
            fragments: Iterable[tuple[tuple[slice, ...], np.ndarray]]) -> None:
        """Digests one array's fragments (index in the global array, host data) written by this process."""
        t0 = time.perf_counter()
        shape = tuple(int(n) for n in shape)
        shards, nbytes = {}, 0
        for index, host in fragments:
            shards[region(index, shape)] = {"crc32c": crc32c(host), "process": jax.process_index()}
            nbytes += host.nbytes
        with self._lock:
            entry = self.digests[item].setdefault(key, {"shape": list(shape), "dtype": str(np.dtype(dtype)),
                                                        "shards": {}})
            entry["shards"].update(shards)
            self._missing.get(item, set()).discard(key)
            self.nbytes += nbytes
            self.seconds += time.perf_counter() - t0
            self._check_done()

    def add_orbax(self, item: str, values: Any, infos: Any) -> None:
        """Orbax's host copies of a batch of an item's arrays (`ReplicaSlices`, each with its `ParamInfo`)."""
        try:
            for value, info in zip(values, infos, strict=True):
                self.add(item, _keystr(info.keypath), value.global_shape, value.dtype,
                         [(r.index, np.asarray(r.data())) for r in value.replica_slices])
        except BaseException as e:  # noqa: BLE001 - the meta writer raises it, failing the save
            self.fail(e)
            raise

    def fail(self, e: BaseException) -> None:
        self._error = e
        self._done.set()

    def _check_done(self) -> None:
        if not any(self._missing.values()):
            self._done.set()

    def gather(self) -> dict[str, Any] | None:
        """Waits until this process's arrays are digested and posts them; on process 0 returns what `meta`
        records of every process (`{"digests": merged, "hosts": host names}`), elsewhere None. Raises on a
        failed digest or a timeout."""
        if not self._done.wait(self.timeout_s):
            missing = sorted(f"{item}/{k}" for item, keys in self._missing.items() for k in keys)
            raise TimeoutError(f"{len(missing)} arrays were not handed to the digests in "
                               f"{self.timeout_s:.0f} s (e.g. {missing[0]})")
        if self._error is not None:
            raise RuntimeError(f"digesting the saved shards failed: {one_line(self._error)}") from self._error
        if not distributed.is_multi():
            return {"digests": self.digests, "hosts": [socket.gethostname()]}
        distributed.post(self.exchange, {"digests": self.digests, "host": socket.gethostname()})
        if not distributed.is_primary():
            return None
        merged: dict[str, dict[str, Any]] = {item: {} for item in DIGEST_ITEMS}
        hosts = []
        for posted in distributed.read_posts(self.exchange, self.timeout_s):
            hosts.append(posted["host"])
            for item, arrays in posted["digests"].items():
                for key, entry in arrays.items():
                    have = merged[item].setdefault(key, {**entry, "shards": {}})
                    have["shards"].update(entry["shards"])
        return {"digests": merged, "hosts": hosts}


# the saves whose digests Orbax's writer threads are adding, by (checkpoint directory, step)
_SAVES: dict[tuple[str, int], SaveDigests] = {}
_SAVES_LOCK = threading.Lock()


def _save_of(item_dir: Any) -> tuple[str, SaveDigests] | None:
    """(item, the save) an Orbax item directory (`<directory>/<step>[.orbax-checkpoint-tmp-N]/<item>[...]`)
    belongs to, when it is one of ours."""
    step_dir = item_dir.parent
    step = step_dir.name.split(".", 1)[0]
    if not step.isdigit():
        return None
    with _SAVES_LOCK:
        save = _SAVES.get((str(step_dir.parent), int(step)))
    return (item_dir.name.split(".", 1)[0], save) if save is not None else None


# ------------------------------------------------------------------------------------------- Orbax hooks
# Two functions of Orbax 0.12 (`orbax.checkpoint._src`; pyproject.toml pins the minor version) are replaced:
# the array writer by one that calls it and digests beside it, the event-loop runner by its own few lines
# plus settling the loop's tasks. Orbax looks both up by name at every call, so the replacements hold for
# every save and restore, also those that are not this module's; a test fails if either stops taking effect.

_orbax_serialize = getattr(jax_array_handlers, "_async_serialize_replica_slices", None)


async def _serialize_and_digest(values: Any, infos: Any, args: Any, **kwargs: Any) -> Any:
    """Orbax's write of a batch of arrays from their host copies (`_async_serialize_replica_slices`, on the
    asynchronous save's writer thread), which also digests those host copies (on a worker thread, beside the
    write) when they belong to one of our saves: no second device-to-host copy, nothing on the step's own
    thread."""
    owner = _save_of(infos[0].parent_dir) if infos else None
    if owner is None:
        return await _orbax_serialize(values, infos, args, **kwargs)
    digest = asyncio.ensure_future(asyncio.to_thread(owner[1].add_orbax, owner[0], values, infos))
    try:
        return await _orbax_serialize(values, infos, args, **kwargs)
    finally:
        await digest


_orbax_run_sync = getattr(asyncio_utils, "_run_sync_via_new_loop", None)


def _run_sync_settled(coro: Any) -> Any:
    """Orbax's `asyncio_utils._run_sync_via_new_loop` (every Orbax read and write runs its coroutine on a new
    event loop through it), which settles the loop's tasks before closing it. Orbax reads an item's arrays and
    their shards in `asyncio.gather`s; when one read fails (a damaged step) the others are still running, and
    Orbax closed the loop under them: each then reported itself on stderr, at garbage collection ("Exception
    ignored in: <coroutine object _read_array_index_and_device_put>", with kilobytes of TensorStore spec),
    from TensorStore's threads ("RuntimeError: Event loop is closed"), or at the process's exit. Here the
    tasks still pending when `coro` ends are cancelled and awaited, their errors collected (the failure is the
    one `coro` raised), the loop's worker threads joined, and then the loop is closed."""
    loop = asyncio.new_event_loop()
    pending: set[asyncio.Task] = set()

    def track(loop: asyncio.AbstractEventLoop, task_coro: Any, **kwargs: Any) -> asyncio.Task:
        task = asyncio.Task(task_coro, loop=loop, **kwargs)
        pending.add(task)
        task.add_done_callback(pending.discard)
        return task

    loop.set_task_factory(track)  # this loop's own tasks: asyncio.all_tasks is not safe beside other threads
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            left = list(pending)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


HOOKED = _orbax_serialize is not None  # else every process copies its shards to the host itself, at save
if HOOKED:
    jax_array_handlers._async_serialize_replica_slices = _serialize_and_digest
else:
    logging.warning("orbax-checkpoint %s has no jax_array_handlers._async_serialize_replica_slices: shard "
                    "digests are computed from a host copy of their own, on the save's call", ocp.__version__)
if _orbax_run_sync is not None:
    asyncio_utils._run_sync_via_new_loop = _run_sync_settled


# ------------------------------------------------------------------------------------------- meta


class _MetaHandler(ocp.JsonCheckpointHandler):
    """The `meta` item: Orbax's JSON item, written (by process 0) once every process's shard digests are in,
    as `meta["digests"]`. It runs on the asynchronous save's own thread, so the wait overlaps the next step,
    and Orbax commits the step only after it (and every other item of every process) finished."""

    async def async_save(self, directory: Any, item: Any = None, args: Any = None) -> list[Any]:
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._write(directory, args), name="meta")]

    async def _write(self, directory: Any, args: MetaSave) -> None:
        meta = dict(args.meta)
        if args.digests is not None:
            recorded = await asyncio.to_thread(args.digests.gather)
            if recorded is None:
                return  # another process's: process 0 writes the item
            meta.update(recorded)
        if distributed.is_primary():
            await asyncio.to_thread((directory / self._filename).write_text, json.dumps(meta))


@ocp.args.register_with_handler(_MetaHandler, for_save=True, for_restore=True)  # restored by `read_meta`
@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
    """The `meta` item's save: the JSON object and the save's digests to add to it (None: none)."""

    meta: dict[str, Any]
    digests: SaveDigests | None = None


# ------------------------------------------------------------------------------------------- verify


@dataclasses.dataclass
class Checked:
    """What one process's `verify` checked: `shards` in all, and of the arrays no process holds whole, how
    many of their saved shards it checked (`spread`) out of `spread_total` (the same on every process; the
    processes' `spread` add up to it unless a shard straddles restored shards of several processes)."""

    shards: int = 0
    spread: int = 0
    spread_total: int = 0


def _writer(entry: dict[str, Any], hosts: list[str]) -> str:
    p = int(entry.get("process", 0))
    if len(hosts) < 2:
        return ""
    return f" written by process {p}" + (f" ({hosts[p]})" if p < len(hosts) else "")


def _mismatch(step_dir: str, what: str, host: np.ndarray, got: int, want: int) -> DamagedStep:
    finite = bool(np.isfinite(host).all()) if np.issubdtype(host.dtype, np.floating) else True
    return DamagedStep(step_dir, what, f"crc32c {got:#010x} != {want:#010x} saved (content changed on disk"
                                       f"{'' if finite else '; it holds non-finite values'})")


def verify(step_dir: str, item: str, tree: Any, want: dict[str, dict[str, Any]],
           hosts: list[str] | None = None) -> Checked:
    """Checks the restored `tree` (item `item`) against its saved digests `want`; raises DamagedStep naming
    the first array, shard and writer that does not match. This process checks each saved shard that lies in
    one of its restored shards (replica 0), or anywhere in an array it holds whole; `hosts`: each process's
    host name (`meta["hosts"]`), for the message. Whole-array digests (older steps) are checked where the
    array is held whole."""
    hosts = hosts or []
    checked, have_paths = Checked(), set()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_array(x):
            continue
        key = _keystr(path)
        have_paths.add(key)
        expected = want.get(key)
        if expected is None:
            continue  # not digested at save
        shape, dtype = [int(n) for n in np.shape(x)], str(x.dtype)
        if shape != expected["shape"] or dtype != expected["dtype"]:
            raise DamagedStep(step_dir, f"{item}/{key}", f"restored as {dtype}{shape}, saved as "
                                                         f"{expected['dtype']}{expected['shape']}")
        whole = not isinstance(x, jax.Array) or x.is_fully_addressable
        if "shards" not in expected:  # a whole-array digest
            if whole:
                host = np.asarray(x)
                got = crc32c(host)
                if got != expected["crc32c"]:
                    raise _mismatch(step_dir, f"{item}/{key}", host, got, expected["crc32c"])
                checked.shards += 1
            continue
        local = [] if whole else [(_resolved(s.index, x.shape), s) for s in x.addressable_shards
                                  if s.replica_id == 0]
        cache: dict[int, np.ndarray] = {}
        full: np.ndarray | None = None
        if not whole:
            checked.spread_total += len(expected["shards"])
        for key_region, entry in expected["shards"].items():
            sl = _region_slices(key_region)
            if whole:
                full = np.asarray(x) if full is None else full
                host = full[sl]
            else:
                holder = next((i for i, (idx, _) in enumerate(local) if _contains(idx, sl)), None)
                if holder is None:
                    continue  # another process holds it (or it straddles restored shards)
                idx, shard = local[holder]
                if holder not in cache:
                    cache[holder] = np.asarray(shard.data)
                host = cache[holder][tuple(slice(s.start - o.start, s.stop - o.start)
                                           for s, o in zip(sl, idx, strict=True))]
                checked.spread += 1
            got = crc32c(host)
            if got != entry["crc32c"]:
                raise _mismatch(step_dir, f"{item}/{key} shard [{key_region}]{_writer(entry, hosts)}", host,
                                got, entry["crc32c"])
            checked.shards += 1
    missing = sorted(set(want) - have_paths)
    if missing:
        raise DamagedStep(step_dir, f"{item}/{missing[0]}", "saved, but not in the restore target")
    return checked


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
    """One StandardSave item of a step into `target`'s (pure) structure and shardings. Orbax's handler, not
    its `Checkpointer`: that one meets the other processes at a barrier after the read, which a process whose
    read failed never reaches; `restore_step` meets them itself."""
    path = storage.join(step_dir, item)
    if not storage.isdir(path):
        raise DamagedStep(step_dir, item, f"{path} is missing")
    handler = ocp.StandardCheckpointHandler()
    try:
        return handler.restore(storage.path(path), args=ocp.args.StandardRestore(_abstract(_convert(target))))
    except Exception as e:  # noqa: BLE001 - any failure to read or decode an item makes the step damaged
        raise DamagedStep(step_dir, item, one_line(e)) from None
    finally:
        handler.close()


def _agree(step_dir: str, failure: DamagedStep | None, checked: Checked) -> tuple[DamagedStep | None, int]:
    """Every process's outcome of restoring `step_dir`, as one: (the first failure in process order, named
    with the process that met it when there are several; the number of saved shards of arrays no process
    holds whole that no process checked). A collective: every process restores the same step together."""
    mine = {"failure": None if failure is None else {"missing_meta": isinstance(failure, MissingMeta),
                                                     "what": failure.what, "reason": failure.reason},
            "spread": checked.spread, "spread_total": checked.spread_total, "host": socket.gethostname()}
    everyone = distributed.gather(mine, "checkpoint.restore")
    unchecked = everyone[0]["spread_total"] - sum(o["spread"] for o in everyone)
    for p, outcome in enumerate(everyone):
        f = outcome["failure"]
        if f is not None:
            where = f" (met by process {p}, {outcome['host']})" if len(everyone) > 1 else ""
            return (MissingMeta if f["missing_meta"] else DamagedStep)(step_dir, f["what"],
                                                                        f["reason"] + where), unchecked
    return None, unchecked


def restore_step(step_dir: str, *, params: Any, opt_state: Any = None,
                 require_meta: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    """The one restore of a step, for training, SFT, eval and build: `(params, opt_state, meta)` with
    params/opt_state in the structure and shardings of the targets (opt_state None when not asked for), every
    shard checked against its digest in `meta` by the process holding it. In a multi-process run every process
    calls it for the same step, and they agree before returning: a failure on any process (a shard that does
    not match, an array it cannot read) raises the same `DamagedStep` on all of them, naming the item, array,
    shard, the process (host) that wrote it and the one that met it. With `require_meta=False` a step without
    `meta` (`MissingMeta`: a params-only step) restores unverified, with a warning, and `meta` is `{}`;
    unreadable `meta` is damage either way."""
    failure: DamagedStep | None = None
    meta: dict[str, Any] = {}
    out: list[Any] = [None, None]
    checked = Checked()
    try:
        try:
            meta = read_meta(step_dir)
        except MissingMeta:
            if require_meta:
                raise
        saved = meta.get("digests")
        if not isinstance(saved, dict):
            logging.warning("checkpoint %s has no array digests (%s); its arrays are restored unverified",
                            step_dir,
                            "saved before they existed" if meta else "no meta item: a params-only step")
            saved = {}
        for i, (item, target) in enumerate((("params", params), ("opt_state", opt_state))):
            if target is None:
                continue
            pure = _restore_item(step_dir, item, target)
            c = verify(step_dir, item, pure, saved.get(item) or {}, meta.get("hosts"))
            checked = Checked(checked.shards + c.shards, checked.spread + c.spread,
                              checked.spread_total + c.spread_total)
            out[i] = _from_pure(target, pure)
    except DamagedStep as e:
        failure = e
    failure, unchecked = _agree(step_dir, failure, checked)
    if failure is not None:
        raise failure
    if unchecked and distributed.is_primary():
        logging.warning("checkpoint %s: %d saved shards were not verified (restored onto a layout that "
                        "splits them across processes)", step_dir, unchecked)
    return out[0], out[1], meta


def _step_of(step_dir: str) -> int:
    name = storage.basename(step_dir.rstrip("/"))
    return int(name) if _STEP_RE.match(name) else -1


def _set_aside(directory: str, step: int) -> None:
    """Moves a damaged step under `<directory>/_damaged/` (process 0), kept for inspection."""
    if jax.process_index() == 0:
        storage.move(storage.join(directory, str(step)),
                     storage.join(directory, DAMAGED_DIR, f"{step}.{time.time_ns()}"))


def _failures(failed: list[tuple[int, Any]]) -> str:
    return "; ".join(f"step {s}: {e}" for s, e in failed)


def damaged_steps(directory: str, failed: list[tuple[int, Any]]) -> str:
    """The head of a fall-back's one warning: `checkpoint step 3 in DIR is damaged (why)`, or for several
    `checkpoint steps 4, 3 in DIR are damaged (step 4: why; step 3: why)`."""
    if len(failed) == 1:
        return f"checkpoint step {failed[0][0]} in {directory} is damaged ({failed[0][1]})"
    return (f"checkpoint steps {', '.join(str(s) for s, _ in failed)} in {directory} are damaged "
            f"({_failures(failed)})")


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
                 sync_timeout_s: int = 600, keep_period: int | None = None, digests: bool = True):
        """`digests=False` saves steps without shard digests (a restore then warns that they are unverified):
        only for measuring what the digests cost (`librarian_jax.bench.checkpoint`)."""
        if save_every < 1:
            raise ValueError(f"checkpoint.save_every must be >= 1, got {save_every}")
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.directory = storage.abspath(directory)  # a local path or a URL (gs://...)
        self.save_every = save_every
        self.digests = digests
        self.sync_timeout_s = sync_timeout_s
        self.last_digests: SaveDigests | None = None  # the last finished save's (`nbytes`, `seconds`)
        self._pending: int | None = None
        self._pending_digests: tuple[tuple[str, int], SaveDigests | None] | None = None
        self._saves = 0
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
        Every shard's digest goes into `meta["digests"]`, computed on Orbax's writer threads (see module
        doc): this call returns once Orbax has its host copies. A failed save (a full disk) raises
        `CheckpointError`; the previous step stays as it was."""
        if not force and not self.should_save(step):
            return False
        if step in self.manager.all_steps():
            logging.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        # the previous async save first (Orbax waits for it anyway): its failure names its own step
        self.wait()
        pure_params, pure_opt = _convert(params), _convert(opt_state)
        meta = {"step": int(step), "rng": rng_to_json(rng) if rng is not None else None,
                "data": data_state, "extra": extra or {}}
        if data_by_process is not None:
            meta["data_by_process"] = list(data_by_process)
        json.dumps(meta)  # fail now, with the offending value, rather than inside the async writer
        save_digests = self._digests_of(step, pure_params, pure_opt) if self.digests else None
        key = (str(storage.path(self.directory)), int(step))
        with _SAVES_LOCK:
            _SAVES[key] = save_digests
        self._pending_digests = (key, save_digests)
        args = ocp.args.Composite(params=ocp.args.StandardSave(pure_params),
                                  opt_state=ocp.args.StandardSave(pure_opt),
                                  meta=MetaSave(meta, save_digests))
        try:
            saved = self.manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - a full disk in the synchronous part of the save
            if save_digests is not None:
                save_digests.fail(e)  # the `meta` writer, already waiting for them, stops
            self._forget_digests()
            raise self._save_error(step, e) from e
        if not saved:
            if save_digests is not None:
                save_digests.fail(RuntimeError(f"Orbax did not save step {step}"))
            self._forget_digests()
            return False
        self._pending = step
        logging.info("checkpoint: saving step %d to %s (async)", step, self.directory)
        return True

    def _digests_of(self, step: int, pure_params: Any, pure_opt: Any) -> SaveDigests:
        """The digests of a save about to start: the arrays whose host copies Orbax will hand over
        (`_serialize_and_digest`), and the others (host arrays, written by process 0) digested here."""
        expected: dict[str, set[str]] = {item: set() for item in DIGEST_ITEMS}
        here = []
        for item, tree in zip(DIGEST_ITEMS, (pure_params, pure_opt), strict=True):
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
                if not _is_array(x):
                    continue
                key = _keystr(path)
                if isinstance(x, jax.Array) and HOOKED:
                    expected[item].add(key)
                elif isinstance(x, jax.Array):
                    here.append((item, key, x, _own_fragments(x)))
                elif distributed.is_primary():
                    here.append((item, key, x, _whole(x)))
        self._saves += 1
        exchange = f"checkpoint_digests/{zlib.crc32(self.directory.encode()):08x}/{step}/{self._saves}"
        save_digests = SaveDigests(exchange, expected, self.sync_timeout_s)
        for item, key, x, fragments in here:
            save_digests.add(item, key, np.shape(x), x.dtype, fragments)
            if isinstance(x, jax.Array):
                save_digests.copied_bytes += sum(f.nbytes for _, f in fragments)
        return save_digests

    def _forget_digests(self) -> None:
        if self._pending_digests is not None:
            key, save_digests = self._pending_digests
            with _SAVES_LOCK:
                if _SAVES.get(key) is save_digests:
                    del _SAVES[key]
            self._pending_digests = None
            self.last_digests = save_digests

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        done = [s for s in self.steps() if s != step]
        prev = f"the previous step {done[-1]} is intact" if done else "no earlier step exists"
        why = "the disk is full" if _is_disk_full(e) else "the write failed"
        return CheckpointError(f"checkpoint step {step} could not be saved to {self.directory}: {why} "
                               f"({one_line(e)}); {prev}")

    def restore(self, *, params: Any, opt_state: Any, step: int | None = None,
                start_fresh: bool = False) -> Restored | None:
        """Restores the newest good committed step (or `step`) into the structure/shardings of the targets.

        A damaged step (see module doc) makes it try the previous one; once a good one restores, the damaged
        newer ones are moved under `_damaged/`, and one warning names each with its array, shard and reason,
        and the step restored. Returns None when there is no committed step. When steps exist and none
        restores, raises `CheckpointError` listing each step and why, unless `start_fresh` (then they are
        moved aside with a warning and None is returned). An asked-for `step` that is damaged raises. In a
        multi-process run every process calls it, and all fall back (or stop) together (`restore_step`)."""
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
                continue
            for bad, _ in failed:
                _set_aside(self.directory, bad)
            if failed:
                distributed.meet("checkpoint.set_aside")  # process 0 moved them before anyone lists steps
                self.manager.reload()
                logging.warning("%s; restored step %d instead (moved %s to %s/)",
                                damaged_steps(self.directory, failed), s,
                                ", ".join(str(b) for b, _ in failed), DAMAGED_DIR)
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
        distributed.meet("checkpoint.set_aside")
        self.manager.reload()
        logging.warning("checkpoint: no step in %s restores (%s); starting fresh as config.checkpoint."
                        "start_fresh asks (the damaged steps are under %s/)", self.directory,
                        _failures(failed), DAMAGED_DIR)
        return None

    def wait(self) -> None:
        """Waits for the pending async save; its failure (a full disk) raises `CheckpointError` naming it."""
        pending, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the async writer's failure
            raise self._save_error(-1 if pending is None else pending, e) from e
        self._forget_digests()  # only once Orbax's writers are done: they look the save up until then

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def restore_params(path: str, target: Any, *, fallback: bool = True) -> Any:
    """Reads the `params` item of an Orbax checkpoint into `target`'s structure (e.g. `nnx.state(model,
    nnx.Param)`), checked against its digests (`restore_step`). `path` is a run's checkpoint directory (its
    newest good committed step is used) or one step directory. With `fallback`, a damaged step falls back to
    the newest good committed step older than it, with one warning naming the step, array and reason of each;
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
    for s, step_dir in candidates:
        try:
            params, _, _ = restore_step(step_dir, params=target, require_meta=False)
        except DamagedStep as e:
            failed.append((s, e))
            continue
        if failed:
            logging.warning("%s; using step %d", damaged_steps(directory, failed), s)
        return params, s
    raise CheckpointError(f"checkpoint: no usable step in {directory} ({_failures(failed)})")


def _committed(directory: str) -> list[int]:
    return sorted(int(n) for n in storage.listdir(directory)
                  if _STEP_RE.match(n) and is_committed(storage.join(directory, n)))
