"""Multi-process runs: start-up with timeouts, process-local engine meshes, weights from the trainer's global
mesh to each process's engines, this process's share of a global batch, and metrics/JSON across processes.

The design (DESIGN.md, "Multi-host"): the trainer's params live on the *global* mesh (every device of every
process); each process's engines (policy and frozen roles) live on a *process-local* mesh over the devices
that process owns. A rollout is host-driven (a different sequence of prefills and decode rounds on every
process, depending on what its models write), so engines on a global mesh would force every process through
the same programs in lockstep; process-local engines let each process run its own share of the batch's tasks
at its own pace, and the processes meet only at the update. The local mesh is this process's slice of a
"hybrid" mesh `(proc, *local axes)` over the same devices, so moving new weights to the engines is one jitted
reshard on the global devices (each process keeps a copy laid out as its engine wants) followed by wrapping
this process's shards as local arrays: device to device, never through the host.

Everything here is a no-op (or the identity) in a single-process run.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding

from librarian_jax import storage, xla_flags
from librarian_jax.rollout import read_jsonl, write_jsonl
from librarian_jax.rollout.scheduler import episode_rng  # noqa: F401 - the stream a share of a batch draws

# Environment knobs (the launch scripts pass them with --env=KEY=VALUE; launch/README.md).
HEARTBEAT_ENV = "LIBRARIAN_HEARTBEAT_TIMEOUT_S"  # a process silent this long is declared dead (all stop)
INIT_TIMEOUT_ENV = "LIBRARIAN_INIT_TIMEOUT_S"  # how long processes wait for each other at start
SYNC_TIMEOUT_ENV = "LIBRARIAN_SYNC_TIMEOUT_S"  # how long a process waits for the others' rollouts (a step)
DEFAULT_HEARTBEAT_S = 60
DEFAULT_INIT_TIMEOUT_S = 300
DEFAULT_SYNC_TIMEOUT_S = 3600


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize` for multi-process runs: explicit coordinator env vars
    (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` > 1, `JAX_PROCESS_ID`), or a TPU pod slice (several
    worker hostnames). Returns whether it did.

    A process that dies (or stops sending heartbeats for `LIBRARIAN_HEARTBEAT_TIMEOUT_S`, default 60 s) makes
    JAX's coordination service stop every other process with "The following tasks are unhealthy (stopped
    sending heartbeats): <process ids>"; nobody waits forever at a barrier or collective.
    """
    env = dict(os.environ if env is None else env)
    explicit = bool(env.get("JAX_COORDINATOR_ADDRESS")) and int(env.get("JAX_NUM_PROCESSES", "1")) > 1
    pod = len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
    if not (explicit or pod):
        return False
    # CPU (gloo) collectives give up after 30 s by default; processes reach the update minutes apart when
    # their compiles or rollouts differ. XLA reads XLA_FLAGS when the backend starts, after this call.
    xla_flags.set_default("xla_cpu_collective_timeout_seconds",
                          str(int(env.get(SYNC_TIMEOUT_ENV, DEFAULT_SYNC_TIMEOUT_S))))
    timeouts = {"heartbeat_timeout_seconds": int(env.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)),
                "initialization_timeout": int(env.get(INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_S))}
    if explicit:
        jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=int(env["JAX_NUM_PROCESSES"]),
                                   process_id=int(env.get("JAX_PROCESS_ID", "0")), **timeouts)
    else:
        jax.distributed.initialize(**timeouts)  # TPU pod: coordinator and ids come from the TPU metadata
    logging.info("process %d of %d: %d local / %d global devices; a process silent for %d s stops the job",
                 jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
                 timeouts["heartbeat_timeout_seconds"])
    return True


def is_multi() -> bool:
    return jax.process_count() > 1


def is_primary() -> bool:
    return jax.process_index() == 0


# ------------------------------------------------------------------------------------------- meshes


def local_mesh_shape(shape: Mapping[str, int], num_processes: int) -> dict[str, int]:
    """The per-process share of a global mesh `shape` (sizes resolved, no -1): the process count is divided
    out of the outermost axes first (`data`, then `fsdp`, `expert`, `tensor`), so a data- or fsdp-parallel
    mesh keeps its inner (tensor) axes whole inside each process.

    `{"data": 8, "fsdp": 1, "tensor": 1}`, 2 processes -> `{"data": 4, ...}`; `{"data": 1, "fsdp": 32,
    "tensor": 1}`, 8 processes -> `{"fsdp": 4, ...}`. Raises ValueError when the processes cannot split it.
    """
    out, left = dict(shape), int(num_processes)
    for name in out:
        g = int(np.gcd(out[name], left))
        out[name] //= g
        left //= g
    if left != 1:
        raise ValueError(f"mesh {dict(shape)} cannot be split over {num_processes} processes (process count "
                         f"must divide the product of the outer axes)")
    return out


def hybrid_meshes(global_mesh: Mesh) -> tuple[Mesh, Mesh]:
    """(hybrid, local): `hybrid` is a mesh over the global mesh's devices with a leading `proc` axis, one
    row per process, each row shaped `local_mesh_shape(global_mesh.shape)`; `local` is this process's row as a
    Mesh with the global mesh's axis names (the engines' mesh); one process: `local` is `global_mesh`."""
    names = tuple(global_mesh.axis_names)
    n = jax.process_count()
    if n == 1:
        return Mesh(global_mesh.devices[None], ("proc", *names)), global_mesh
    local_shape = local_mesh_shape(dict(global_mesh.shape), n)
    by_proc: dict[int, list[Any]] = {}
    for d in global_mesh.devices.flat:
        by_proc.setdefault(d.process_index, []).append(d)
    rows = []
    for p in range(n):
        devs = sorted(by_proc.get(p, []), key=lambda d: d.id)
        if len(devs) != int(np.prod(list(local_shape.values()))):
            raise ValueError(f"process {p} owns {len(devs)} devices of the mesh; its share is {local_shape}")
        rows.append(np.asarray(devs, dtype=object).reshape(tuple(local_shape.values())))
    grid = np.stack(rows)
    return Mesh(grid, ("proc", *names)), Mesh(grid[jax.process_index()], names)


class Localizer:
    """Moves a tree of global arrays (the trainer's, on the global mesh) to the layout of a tree of
    process-local arrays (an engine's params, on this process's local mesh), device to device.

    One jitted reshard onto the hybrid mesh with each leaf's local partition spec (replicated over `proc`:
    every process gets a full copy laid out as its engine wants; for a params tree sharded over several
    processes this is the all-gather the engine's copy needs), then this process's shards wrapped as local
    arrays (`make_array_from_single_device_arrays`, no copy). Leaves already fully addressable pass through
    unchanged (a single-process run: the engine's `update_params` places them as before).
    """

    def __init__(self, global_mesh: Mesh, local_mesh: Mesh):
        self.hybrid, self.local = hybrid_meshes(global_mesh)
        if local_mesh.devices.tolist() != self.local.devices.tolist():
            raise ValueError("Localizer: the engines' mesh is not this process's row of the hybrid mesh")
        self._reshard_cache: dict[Any, Any] = {}

    def __call__(self, tree: Any, like: Any) -> Any:
        """`tree` (global arrays) laid out like `like` (same structure; local arrays)."""
        leaves, treedef = jax.tree.flatten(tree)
        like_leaves = treedef.flatten_up_to(like)
        todo = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
        if not todo:
            return tree
        specs = tuple(like_leaves[i].sharding.spec if isinstance(like_leaves[i].sharding, NamedSharding)
                      else jax.sharding.PartitionSpec() for i in todo)
        key = (specs, tuple((leaves[i].shape, str(leaves[i].dtype)) for i in todo))
        fn = self._reshard_cache.get(key)
        if fn is None:
            outs = tuple(NamedSharding(self.hybrid, s) for s in specs)
            fn = jax.jit(lambda *xs: xs, out_shardings=outs)
            self._reshard_cache[key] = fn
        moved = fn(*(leaves[i] for i in todo))
        out = list(leaves)
        for i, x in zip(todo, moved, strict=True):
            sharding = NamedSharding(self.local, specs[todo.index(i)])
            out[i] = jax.make_array_from_single_device_arrays(
                x.shape, sharding, [s.data for s in x.addressable_shards])
        return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------------------------------- batches


def process_slice(n: int, process: int | None = None, count: int | None = None, *,
                  even: bool = True) -> slice:
    """Process `process`'s (default: this one's) contiguous share of `n` items over `count` processes
    (default: all). `even` (a global batch of tasks or rows, one global array): `n` must divide evenly;
    else `numpy.array_split`'s shares, the first `n % count` processes one item more, empty ones when there
    are fewer items than processes (evaluation's corpora)."""
    p = jax.process_index() if process is None else int(process)
    k = jax.process_count() if count is None else int(count)
    size, extra = divmod(int(n), k)
    if even and extra:
        raise ValueError(f"{n} tasks per batch cannot be split evenly over {k} processes")
    begin = p * size + min(p, extra)
    return slice(begin, begin + size + (1 if p < extra else 0))


# ------------------------------------------------------------------------------------------- host values


def allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable `obj`, in process order (a collective: all processes call it)."""
    if not is_multi():
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode("utf-8"), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
    padded = np.zeros((int(lengths.max()),), np.uint8)
    padded[: data.size] = data
    allb = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(allb[i, : int(lengths[i])]).decode("utf-8")) for i in range(len(lengths))]


def share(n: int, process: int | None = None, count: int | None = None) -> slice:
    """Process `process`'s (default: this one's) contiguous share of `n` corpora over `count` processes
    (default: all): `numpy.array_split`'s, the first `n % count` processes one corpus more; empty when there
    are fewer corpora than processes (evaluation's held-out corpora). One process: everything."""
    return process_slice(n, process, count, even=False)


_MEETINGS = itertools.count()  # every process meets in the same order, so the n-th meeting has one name


def meet(what: str) -> None:
    """All processes wait for each other here (`wait_for_all`, timeout `LIBRARIAN_SYNC_TIMEOUT_S`): before a
    collective that processes reach at different times (their shares take different times, and a device
    collective's own timeout is not meant for that wait). Every process meets in the same order."""
    if is_multi():
        wait_for_all(f"meet/{what}/{next(_MEETINGS)}")


def gather(obj: Any, what: str) -> list[Any]:
    """Every process's JSON-serialisable `obj`, in process order (`allgather_json` after `meet`); one
    process: `[obj]`."""
    if not is_multi():
        return [obj]
    meet(what)
    return allgather_json(obj)


def gather_sections(sections: Sequence[tuple[str, list[Any]]], what: str) -> dict[str, list[Any]]:
    """Every process's items of each named section, in process order: when each process's items of a
    section come from its contiguous `share` in order, the concatenation is the section of a single-process
    run. Every process must pass the same section names in the same order."""
    gathered = gather([[name, items] for name, items in sections], what)
    out: dict[str, list[Any]] = {name: [] for name, _ in sections}
    for per_process in gathered:
        for name, items in per_process:
            out[name].extend(items)
    return out


def slowest(timings: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Processes' timing entries as the job's: each the slowest process's (the job waits for it)."""
    keys = list(dict.fromkeys(k for t in timings for k in t))
    return {k: max(float(t[k]) for t in timings if k in t) for k in keys}


# metric name -> how processes' values combine; anything else is a mean weighted by episodes
_SUM_KEYS = ("probe/count", "rollout/generated_tokens", "rows/tokens", "rows/loss_tokens", "rows/num_rows",
             "rows/padded_rows", "rows/truncated", "adv/num_groups")
_MAX_KEYS = ("rows/seq_len", "compile/programs", "compile/cache_hits")  # per process: the most
_MAX_SUFFIXES = ("time_s", "_s")
_WEIGHTED_BY = {"probe/accuracy": "probe/count"}  # a mean over probes, not episodes


def reduce_metrics(metrics: Mapping[str, float], weight: float) -> dict[str, float]:
    """One step's metrics over all processes (a collective; `combine_metrics` says how). `weight`: this
    process's episode count. One process: `metrics` unchanged."""
    if not is_multi():
        return dict(metrics)
    gathered = allgather_json({"m": {k: float(v) for k, v in metrics.items()}, "w": float(weight)})
    return combine_metrics([g["m"] for g in gathered], [g["w"] for g in gathered])


def combine_metrics(per_process: Sequence[Mapping[str, float]], weights: Sequence[float]) -> dict[str, float]:
    """Processes' metrics as the job's: counts and token totals summed, times and lengths the largest (the
    slowest process), `probe/accuracy` a mean over probes, everything else a mean weighted by `weights` (each
    process's episodes). NaNs (no probe on a process) are left out. Rates (`*/tokens_per_s`) come from the
    combined totals. Metrics every process computed alike (the update's) come out unchanged."""
    out: dict[str, float] = {}
    for k in sorted({k for m in per_process for k in m}):
        vals = np.array([float(m.get(k, np.nan)) for m in per_process])
        ws = np.array([float(m.get(_WEIGHTED_BY[k], 0.0)) for m in per_process]) if k in _WEIGHTED_BY \
            else np.asarray(weights, float)
        ok = np.isfinite(vals)
        if not ok.any():
            out[k] = float("nan")
        elif k in _SUM_KEYS:
            out[k] = float(vals[ok].sum())
        elif k in _MAX_KEYS or k.endswith(_MAX_SUFFIXES):
            out[k] = float(vals[ok].max())
        else:
            w = ws[ok] if ws[ok].sum() > 0 else np.ones(int(ok.sum()))
            out[k] = float(np.sum(vals[ok] * w) / np.sum(w))
    if "rollout/generated_tokens" in out and "rollout/time_s" in out:
        out["rollout/tokens_per_s"] = out["rollout/generated_tokens"] / max(out["rollout/time_s"], 1e-9)
    if "rows/tokens" in out and "train/time_s" in out:
        out["train/tokens_per_s"] = out["rows/tokens"] / max(out["train/time_s"], 1e-9)
    return out


def wait_for_all(name: str, timeout_s: float | None = None) -> None:
    """All processes meet here through JAX's coordination service (its key-value store, not a device
    collective, so no collective timeout applies): e.g. after each process's rollouts, which take different
    times. Gives up after `timeout_s` (`LIBRARIAN_SYNC_TIMEOUT_S`, default 3600) with the coordination
    service's error naming the processes that did not arrive; a dead process stops all sooner (heartbeat).
    `name` must be new for each meeting (e.g. carry the step)."""
    if not is_multi():
        return
    if timeout_s is None:
        timeout_s = float(os.environ.get(SYNC_TIMEOUT_ENV, DEFAULT_SYNC_TIMEOUT_S))
    _client().wait_at_barrier(f"librarian_jax/{name}", int(timeout_s * 1000))


def post(key: str, obj: Any) -> None:
    """Puts this process's JSON-serialisable `obj` under `key/<process>` in JAX's coordination service (its
    key-value store: no device collective, so any thread may call it while the main thread computes).
    Pair with `read_posts`; `key` must be new for each exchange. One process: nothing to do."""
    if is_multi():
        _client().key_value_set(f"librarian_jax/{key}/{jax.process_index()}", json.dumps(obj))


def read_posts(key: str, timeout_s: float | None = None) -> list[Any]:
    """Every process's `post(key, obj)`, in process order, waiting for each up to `timeout_s`
    (`LIBRARIAN_SYNC_TIMEOUT_S`): the coordination service's error names the key that did not arrive, and a
    dead process stops the job sooner (heartbeat). The entries are deleted once read, so call it on one
    process only. One process: nothing was posted, `[]`."""
    if not is_multi():
        return []
    if timeout_s is None:
        timeout_s = float(os.environ.get(SYNC_TIMEOUT_ENV, DEFAULT_SYNC_TIMEOUT_S))
    client, out = _client(), []
    for p in range(jax.process_count()):
        name = f"librarian_jax/{key}/{p}"
        out.append(json.loads(client.blocking_key_value_get(name, int(timeout_s * 1000))))
        client.key_value_delete(name)
    return out


def _client() -> Any:
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def abort(message: str, code: int = 1) -> None:
    """Ends this process at once (no interpreter shutdown, whose distributed shutdown barrier would wait for
    the others up to 5 minutes): the others see its heartbeats stop and end with an error naming it."""
    import sys

    logging.error("process %d of %d: %s; stopping this process (the others stop when its heartbeats do)",
                  jax.process_index(), jax.process_count(), message)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(name: str) -> None:
    """All processes meet here (JAX's coordination service; a dead process stops the others, see
    `initialize`)."""
    if is_multi():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def episode_file(directory: str, step: int, process: int | None = None) -> str:
    """Where `process` (default: this one) writes its episode records of `step`: `step_N.jsonl` (process 0)
    or `step_N.pK.jsonl` (process K), in `directory` (a local path or a URL such as `gs://...`)."""
    process = jax.process_index() if process is None else int(process)
    return storage.join(directory, f"step_{step}{f'.p{process}' if process else ''}.jsonl")


def write_step_records(directory: str, step: int, records: Sequence[Any]) -> str:
    """This process's episode records of `step` (`rollout.write_jsonl`: a `gs://` workdir works too).
    Returns the file."""
    path = episode_file(directory, step)
    write_jsonl(path, records)
    return path


def episode_files(directory: str, step: int) -> list[str]:
    """Every process's episode records of `step` in `directory` (`step_N.jsonl` from process 0,
    `step_N.pK.jsonl` from process K), in process order: read them together as the step's one set. Other
    files (e.g. `step_N.partial.jsonl`) are not the step's records and are left out."""
    pattern = re.compile(rf"step_{step}(?:\.p([0-9]+))?\.jsonl")
    found = []
    for name in storage.listdir(directory):
        m = pattern.fullmatch(name)
        if m:
            found.append((int(m.group(1) or 0), storage.join(directory, name)))
    return [path for _, path in sorted(found)]


def read_step_records(directory: str, step: int) -> list[Any]:
    """The episode records of `step` from every process's file, task-major in global order."""
    return [r for f in episode_files(directory, step) for r in read_jsonl(f)]


def offsets(counts: Sequence[int]) -> list[int]:
    return [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]


def uncommit(model: Any) -> None:
    """Multi-process start-up: rewrites `model`'s arrays (loaded onto this process's devices, so "committed"
    there) as uncommitted copies that every process holds alike, which the trainer can place on the global
    mesh (JAX moves committed arrays between processes' devices only over a cross-host transport the CPU and
    GPU backends lack). One host copy of the initial weights at start-up; nothing per step."""
    if not is_multi():
        return
    import jax.numpy as jnp
    from flax import nnx

    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) if isinstance(x, jax.Array) else x,
                                   state))
