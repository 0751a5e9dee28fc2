"""The generation engine: fixed slots, chunked prefill, on-device decode rounds, continuous batching.

``Engine`` keeps ``num_slots`` sessions' caches on the mesh at once (one ``Cache`` of batch ``num_slots``,
allocated once, sharded by logical-axis rules, donated through every program). ``step()`` admits waiting turns
into slots (evicting idle sessions LRU when none is free), prefills their new tokens in bucketed chunks, runs
one decode round of at most ``round_steps`` tokens on device, and returns the turns that finished. Sessions
that finish early free their decode lane for the next admitted turn at the next round.

Token accounting: a session may hold at most ``max_seq_len`` tokens (prompt, generated and appended). A turn
that would exceed it ends with status ``"cache_full"``; a session already too long to generate one more token
ends its next turn immediately with ``"cache_full"`` and no tokens.

Ownership: a ``Session`` is a plain token record (``engine/session.py``); the engine alone keeps each live
session's ``_Lane`` (slot, cached length, turn in flight, status, LRU clock) and is the only writer of its
record (sampled tokens in ``step()``, observations in ``append()``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from librarian_jax import compile_cache, models
from librarian_jax.engine import slots as slot_programs
from librarian_jax.engine.mesh import make_mesh
from librarian_jax.engine.sampling import GREEDY, SamplingParams
from librarian_jax.engine.session import Request, Session, TurnResult
from librarian_jax.models import cache as cache_lib
from librarian_jax.models.cache import live_len, live_lens, stack_cache
from librarian_jax.models.moe import bind_mesh
from librarian_jax.models.partitioning import (
    bytes_per_device,
    is_abstract,
    normalize_rules,
    place,
    stacked_sharding,
    state_shardings,
    tree_shardings,
)
from librarian_jax.models.transformer import ScanPlan, scan_plan, stack_layers

DEFAULT_PREFILL_BUCKETS: tuple[int, ...] = (32, 128, 512)
SCAN_LAYERS = False  # Engine's default for `scan_layers`


@dataclasses.dataclass
class StepStats:
    """What one ``Engine.step()`` did.

    Attributes:
      active_slots: slots decoding in this round.
      decode_steps: loop iterations the round ran.
      tokens_decoded: tokens sampled in this round (all slots).
      prefill_tokens: real tokens prefilled; prefill_calls: prefill programs run.
      prefill_s, decode_s: device time (dispatch to result) of prefill and of the decode round.
      host_s: the rest of this step plus the host time since the previous step ended (the caller's work).
      evictions: idle sessions evicted to make room.
      shared_prefix_tokens: prompt tokens not prefilled because a session took them from another's slot.
      finished: turns returned.
    """

    active_slots: int = 0
    decode_steps: int = 0
    tokens_decoded: int = 0
    prefill_tokens: int = 0
    prefill_calls: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    host_s: float = 0.0
    evictions: int = 0
    finished: int = 0
    shared_prefix_tokens: int = 0


@dataclasses.dataclass
class _Lane:
    """The engine's bookkeeping for one live (not closed) session.

    Attributes:
      slot: the slot holding the session's cache, if any.
      cached: leading record tokens in that slot's cache.
      needs_reset: the slot must be zeroed before this session's first prefill into it.
      request: the turn in flight, if any.
      status: ``"idle" | "waiting" | "running" | "cache_full"``.
      last_used: the engine clock at the session's last use (LRU eviction picks the smallest).
    """

    slot: int | None = None
    cached: int = 0
    needs_reset: bool = False
    request: Request | None = None
    status: str = "idle"
    last_used: int = 0
    upto: int | None = None  # prefill only this many record tokens for now (a prefix-sharing leader)


def _make_cache(config: Any, num_slots: int, capacity: int, dtype: Any, layout: str,
                plan: ScanPlan | None = None) -> Any:
    cache = models.init_cache(config, num_slots, capacity, dtype, layout)
    return cache if plan is None else stack_cache(cache, plan.period, plan.periods)


@functools.lru_cache(maxsize=64)
def _cache_allocator(
    config: Any, num_slots: int, capacity: int, dtype: Any, layout: str, shardings: tuple, treedef: Any,
    plan: ScanPlan | None = None,
) -> Callable[[], Any]:
    """A jitted function allocating the slot cache straight into its shardings (cached: one compile per
    layout, so short-lived engines such as ``generate``'s do not recompile)."""
    return jax.jit(
        functools.partial(_make_cache, config, num_slots, capacity, dtype, layout, plan),
        out_shardings=jax.tree.unflatten(treedef, shardings),
    )


@functools.lru_cache(maxsize=64)
def _layer_stacker(graphdef: nnx.GraphDef, plan: ScanPlan, shardings: tuple,
                   treedef: Any) -> Callable[..., Any]:
    """A jitted ``state -> the scanned layers' stacked states`` (``transformer.stack_layers``), straight into
    ``shardings`` (cached per model structure and layout)."""

    def stack(state: nnx.State) -> tuple[Any, ...]:
        return stack_layers(list(nnx.merge(graphdef, state).layers), plan).states

    return jax.jit(stack, out_shardings=jax.tree.unflatten(treedef, shardings))


def _mesh_of(state: Any) -> Mesh:
    """The mesh the params already live on (if they are sharded over several devices), else one device."""
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return make_mesh({"data": 1}, devices=jax.devices()[:1])


def _slot_buckets(num_slots: int) -> list[int]:
    out, k = [], 1
    while k < num_slots:
        out.append(k)
        k *= 2
    out.append(num_slots)
    return out


class Engine:
    """Continuous-batching generation over fixed cache slots.

    Args:
      model: a ``models.Transformer`` (needs ``model.config``).
      num_slots: sessions whose caches are resident at once (the decode batch).
      max_seq_len: the most tokens one session may hold.
      mesh: device mesh (``engine.mesh.make_mesh``); default: the mesh the model's params are already sharded
        over, else a one-device mesh on ``jax.devices()[0]``.
      rules: logical-axis rules; default ``models.partitioning.DEFAULT_RULES``.
      prefill_buckets: chunk lengths prefill uses (each is one compiled program per slot-count bucket).
      round_steps: the most decode steps per ``step()``; the host admits new work between rounds.
      max_stop_ids: the most stop ids one turn may give.
      cache_dtype: dtype of the K/V cache (default: the model's choice in ``init_cache``).
      cache_layout: the K/V cache's layout (``models.cache.LAYOUTS``): "heads" (XLA:CPU's in-place one) or
        "keys" (``[slot, position, kv_heads, head_dim]``, the one the TPU compiler keeps a decode loop's cache
        in; in another it copies every layer's K/V around the loop); "auto": "heads" on CPU devices, "keys"
        on any other. Same tokens either way.
      stats_window: how many of the latest ``StepStats`` ``engine.stats`` keeps (oldest dropped first), so a
        long run's stats stay bounded; ``engine.total_steps`` counts every step.
      processed_logprobs: also return each turn's log-probs under the truncated (top-k / top-p) distribution
        it was sampled from (``TurnResult.processed_logprobs``); off by default, so decode neither computes
        nor transfers them.
      share_prefix: sessions admitted together whose records share at least this many leading tokens prefill
        the common prefix once and copy it into each other's slots (``_share_prefixes``); 0 turns it off.
      scan_layers: run the model's repeating layers under one ``lax.scan`` in the prefill and decode programs
        (``Transformer.hidden``, ``transformer.scan_plan``), so each program compiles each distinct layer
        once instead of once per layer: compile time stops growing with depth. Same tokens and log-probs as
        the loop. The engine then keeps the slot cache as a ``models.cache.ScanCache`` and a stacked copy
        of the scanned layers' weights (made when the engine is built and on each ``update_params``: one
        more copy of those weights in device memory). A model the plan cannot scan runs the loop (logged).
        Off by default: on the CPU the scanned decode step is slower (each layer's weights and K/V are
        sliced out of the stack every step), see BENCHMARKS.md.
    """

    def __init__(
        self,
        model: nnx.Module,
        num_slots: int,
        max_seq_len: int,
        mesh: Mesh | None = None,
        *,
        rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        round_steps: int = 64,
        max_stop_ids: int = 8,
        cache_dtype: Any = None,
        stats_window: int = 10_000,
        processed_logprobs: bool = False,
        share_prefix: int = 32,
        scan_layers: bool = SCAN_LAYERS,
        cache_layout: str = "auto",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"Engine: num_slots must be >= 1, got {num_slots}")
        if max_seq_len < 2:
            raise ValueError(f"Engine: max_seq_len must be >= 2, got {max_seq_len}")
        if stats_window < 1:
            raise ValueError(f"Engine: stats_window must be >= 1, got {stats_window}")
        if round_steps < 1:
            raise ValueError(f"Engine: round_steps must be >= 1, got {round_steps}")
        if not prefill_buckets or any(b < 1 for b in prefill_buckets):
            raise ValueError(f"Engine: prefill_buckets must be positive, got {tuple(prefill_buckets)}")
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"Engine: model {type(model).__name__} has no `config` attribute")
        self.config = config
        self.num_slots = int(num_slots)
        self.max_seq_len = int(max_seq_len)
        self.round_steps = int(round_steps)
        self.max_stop_ids = int(max_stop_ids)
        self.prefill_buckets = tuple(sorted(set(int(b) for b in prefill_buckets)))
        # The model drops padded and out-of-range cache writes (models contract), so a chunk may run past the
        # end of a slot: the cache needs no room beyond max_seq_len.
        self.capacity = self.max_seq_len
        self.rules = normalize_rules(rules)
        self.graphdef, state = nnx.split(model)
        self.mesh = mesh if mesh is not None else _mesh_of(state)
        if getattr(config, "num_experts", 0):
            # MoE layers run their experts expert-parallel on this mesh (models/moe.py); a graph-only change
            if bind_mesh(model, self.mesh, self.rules):
                self.graphdef, state = nnx.split(model)
        self._param_shardings = state_shardings(state, self.mesh, self.rules)
        # an abstract model (`nnx.eval_shape`, a plan for a topology): every array below is a shape laid out
        # as a real engine lays it out, nothing is allocated, and only `programs_ahead` may be called
        self.abstract = is_abstract(state)
        self.params = place(state, self._param_shardings)

        if not isinstance(scan_layers, bool):
            raise ValueError(f"Engine: scan_layers must be a bool, got {scan_layers!r}")
        self._plan: ScanPlan | None = None
        if scan_layers:
            plan = scan_plan(list(model.layers), model)
            if plan.period:
                self._plan = plan
            else:
                logging.info("Engine: scan_layers: running the %d layers one by one: %s", len(model.layers),
                             plan.reason)
        self.scan_layers = self._plan is not None  # whether the programs really scan
        self._stacked: tuple[Any, ...] | None = None
        if self._plan is not None:
            # stacked layer k: layer k's param shardings with a replicated leading axis
            # the state as an argument (not closed over): an abstract engine's state is shapes, traced here
            abstract_stack = jax.eval_shape(
                lambda st: stack_layers(list(nnx.merge(self.graphdef, st).layers), self._plan).states, state)
            on_axis0 = functools.partial(stacked_sharding, axis=0)
            shardings = [jax.tree.map(on_axis0, self._param_shardings["layers"][k])
                         for k in range(self._plan.period)]
            self._stacker = _layer_stacker(self.graphdef, self._plan, tuple(jax.tree.leaves(shardings)),
                                           jax.tree.structure(abstract_stack))
            self._stacked = place(abstract_stack, jax.tree.unflatten(
                jax.tree.structure(abstract_stack), jax.tree.leaves(shardings))) if self.abstract else \
                self._stacker(self.params)

        if cache_layout == "auto":
            cache_layout = cache_lib.default_layout(self.mesh.devices.flat[0].platform)
        if cache_layout not in cache_lib.LAYOUTS:
            raise ValueError(f"Engine: cache_layout must be 'auto' or one of {cache_lib.LAYOUTS}, "
                             f"got {cache_layout!r}")
        self.cache_layout = cache_layout
        make = functools.partial(_make_cache, config, self.num_slots, self.capacity, cache_dtype,
                                 cache_layout)
        abstract = jax.eval_shape(make)
        shardings = tree_shardings(abstract, models.cache_logical_axes(config, cache_layout), self.mesh,
                                   self.rules)
        if self._plan is not None:
            shardings = stack_cache(shardings, self._plan.period, self._plan.periods, stacked_sharding)
            abstract = jax.eval_shape(functools.partial(make, plan=self._plan))
        self._cache_sharding = tuple(jax.tree.leaves(shardings))
        self._cache_treedef = jax.tree.structure(abstract)
        if self.abstract:
            self.cache = place(abstract, jax.tree.unflatten(self._cache_treedef, self._cache_sharding))
        else:
            self.cache = _cache_allocator(
                config, self.num_slots, self.capacity, cache_dtype, cache_layout, self._cache_sharding,
                self._cache_treedef, self._plan,
            )()
        # what `programs_ahead` lowers with
        self._cache_spec = jax.tree.map(compile_cache.abstract, self.cache)

        self.processed_logprobs = bool(processed_logprobs)
        self.share_prefix = int(share_prefix)
        self._copy = slot_programs.copy_program(self._cache_sharding)
        self._programs = slot_programs.programs(
            self.graphdef, self._cache_sharding, self.max_seq_len, self.round_steps, self.processed_logprobs,
            self.scan_layers,
        )

        self._owner: list[Session | None] = [None] * self.num_slots
        self._lanes: dict[int, _Lane] = {}  # session id -> bookkeeping, for sessions not closed
        self._waiting: collections.deque[Session] = collections.deque()
        self._running: list[Session] = []
        self._ready: list[TurnResult] = []
        self._sessions = 0
        self._clock = 0
        self._last_end: float | None = None
        self._slot_buckets = _slot_buckets(self.num_slots)
        self.stats_window = int(stats_window)
        self.stats: list[StepStats] = []  # the latest `stats_window` steps
        self.total_steps = 0

    # ----------------------------------------------------------------------------------------------- public

    def new_session(self, prompt_ids: Sequence[int]) -> Session:
        """A new session whose record starts with ``prompt_ids`` (loss mask 0); no slot until submitted."""
        self._sessions += 1
        s = Session(self, self._sessions, prompt_ids)
        self._lanes[s.id] = _Lane(last_used=self._tick())
        return s

    def status(self, session: Session) -> str:
        """``"idle" | "waiting" | "running" | "cache_full" | "closed"``."""
        lane = self._lanes.get(session.id) if session.engine is self else None
        return "closed" if lane is None else lane.status

    def slot_of(self, session: Session) -> int | None:
        """The slot holding ``session``'s cache, or None (not admitted yet, evicted or closed)."""
        lane = self._lanes.get(session.id) if session.engine is self else None
        return None if lane is None else lane.slot

    def append(self, session: Session, ids: Sequence[int]) -> None:
        """Appends observation (or any host-written) tokens to ``session``'s record, loss mask 0; only
        between turns."""
        lane = self._lane(session, "append")
        if lane.status in ("waiting", "running"):
            raise RuntimeError(f"Session {session.id}: append() while a turn is in flight ({lane.status})")
        session.extend(ids)
        lane.last_used = self._tick()

    def submit(
        self,
        session: Session,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: Iterable[int] = (),
        *,
        tag: int = -1,
    ) -> Request:
        """Queues one turn of ``session``: up to ``max_new_tokens`` sampled tokens, ending at a stop id.

        The sampled tokens enter the session's record tagged ``tag`` (e.g. the agent's turn index). Returns
        the ``Request``; its ``result`` is set (and the ``TurnResult`` returned by ``step()``) when the turn
        finishes.
        """
        lane = self._lane(session, "submit")
        if lane.status in ("waiting", "running"):
            raise RuntimeError(f"submit: session {session.id} already has a turn in flight")
        if max_new_tokens < 0:
            raise ValueError(f"submit: max_new_tokens must be >= 0, got {max_new_tokens}")
        stops = tuple(int(t) for t in stop_ids)
        if len(stops) > self.max_stop_ids:
            raise ValueError(f"submit: {len(stops)} stop ids given; engine max_stop_ids={self.max_stop_ids}")
        req = Request(
            session, int(max_new_tokens), sampling or GREEDY, stops, start=len(session), tag=int(tag),
            processed_logprobs=[] if self.processed_logprobs else None,
        )
        lane.request = req
        ends = "cache_full" if lane.status == "cache_full" else slot_programs.admission_status(
            len(session), max_new_tokens, self.max_seq_len)
        if ends is not None:
            self._finish(session, ends)
        else:
            lane.status = "waiting"
            self._waiting.append(session)
        return req

    def close(self, session: Session) -> None:
        """Frees ``session``'s slot and forgets its bookkeeping; its record stays readable. Closing a closed
        session does nothing."""
        if session.engine is not self:
            raise ValueError(f"close: session {session.id} belongs to another engine")
        lane = self._lanes.get(session.id)
        if lane is None:
            return
        if lane.status in ("waiting", "running"):
            raise RuntimeError(f"close: session {session.id} has a turn in flight")
        self._release(session)
        del self._lanes[session.id]

    def step(self) -> list[TurnResult]:
        """Admits waiting turns, prefills them, runs one decode round; returns the turns that finished."""
        if self.abstract:
            raise RuntimeError("Engine.step: an abstract engine (built from shapes, for a plan) runs nothing")
        t0 = time.perf_counter()
        st = StepStats(host_s=(t0 - self._last_end) if self._last_end is not None else 0.0)
        self._admit(st)
        t1 = time.perf_counter()
        self._prefill(st)
        t2 = time.perf_counter()
        st.prefill_s = t2 - t1
        if self._running:
            self._decode_round(st)
        t3 = time.perf_counter()
        st.decode_s = t3 - t2
        results, self._ready = self._ready, []
        st.finished = len(results)
        t4 = time.perf_counter()
        st.host_s += (t1 - t0) + (t4 - t3)
        self._last_end = t4
        self.stats.append(st)
        self.total_steps += 1
        if len(self.stats) > self.stats_window:
            del self.stats[: len(self.stats) - self.stats_window]
        return results

    def pending(self) -> bool:
        """Whether any submitted turn has not been returned by ``step()`` yet."""
        return bool(self._waiting or self._running or self._ready)

    def run_until_done(self) -> list[TurnResult]:
        """Calls ``step()`` until every submitted turn finished; returns them in finishing order."""
        out: list[TurnResult] = []
        while self.pending():
            out.extend(self.step())
        return out

    def update_params(self, state: nnx.State | nnx.Module) -> None:
        """Swaps in new weights (an ``nnx.State`` of the same model, or the model itself).

        Arrays already on the mesh with the engine's shardings are used as they are; others move device to
        device (``jax.device_put``) — never through the host.
        """
        if isinstance(state, nnx.Module):
            _, state = nnx.split(state)
        new_def = jax.tree.structure(state)
        old_def = jax.tree.structure(self.params)
        if new_def != old_def:
            raise ValueError(
                f"update_params: state tree differs from the engine's params:\n{new_def}\nvs\n{old_def}"
            )
        for new, old in zip(jax.tree.leaves(state), jax.tree.leaves(self.params), strict=True):
            if new.shape != old.shape:
                raise ValueError(f"update_params: leaf shape {new.shape} != the engine's {old.shape}")
        self.params = jax.device_put(state, self._param_shardings)
        if self._plan is not None:
            self._stacked = None  # the old stack's memory goes before the new one is made
            self._stacked = self._stacker(self.params)

    @property
    def _program_params(self) -> Any:
        """What the programs take as ``params``: the state, or (state, stacked layer states) when scanning."""
        return self.params if self._plan is None else (self.params, self._stacked)

    def _idle_prefill_all_args(self, chunk: int) -> tuple[np.ndarray, ...]:
        """``prefill_all``'s (tokens, mask, reset) for a call of ``chunk`` tokens that changes nothing."""
        n = self.num_slots
        return np.zeros((n, chunk), np.int32), np.zeros((n, chunk), bool), np.zeros((n,), bool)

    def _idle_decode_args(self) -> tuple[np.ndarray, ...]:
        """``decode``'s arguments after (params, cache) for a round with no active slot (changes nothing)."""
        n = self.num_slots
        zi, zf = np.zeros((n,), np.int32), np.zeros((n,), np.float32)
        stops = np.full((n, self.max_stop_ids), -1, np.int32)
        return zi, np.zeros((n,), bool), zi, stops, zf, zf + 1, zi, zi, zi

    def _idle_prefill_args(self, rows: int, chunk: int) -> tuple[np.ndarray, ...]:
        """``prefill``'s (slots, tokens, mask, reset) for a call of ``rows`` rows of ``chunk`` tokens that
        changes nothing (every row at slot ``num_slots``: out of range, its writes dropped)."""
        return (np.full((rows,), self.num_slots, np.int32), np.zeros((rows, chunk), np.int32),
                np.zeros((rows, chunk), bool), np.zeros((rows,), bool))

    def _program_calls(self) -> list[tuple[str, Any, tuple[np.ndarray, ...], dict[str, Any]]]:
        """Every prefill and decode program this engine runs, as (name, jitted program, its arguments after
        ``(params, cache)``, static keywords), with arguments that change nothing: per attended cache length
        (``models.cache.live_lens``), each prefill chunk bucket at every slot-count bucket (``prefill_all``
        for all slots, ``prefill`` for fewer), then the decode round (no active slot). What ``warmup`` runs
        and ``programs_ahead`` lowers."""
        n, p, out = self.num_slots, self._programs, []
        for live in live_lens(self.capacity):
            at, kw = "all" if live is None else live, {"attend_len": live}
            for chunk in self.prefill_buckets:
                out.append((f"prefill_all[{n}x{chunk}, attend {at}]", p.prefill_all,
                            self._idle_prefill_all_args(chunk), kw))
                for k in self._slot_buckets[:-1]:
                    out.append((f"prefill[{k}x{chunk}, attend {at}]", p.prefill,
                                self._idle_prefill_args(k, chunk), kw))
            out.append((f"decode[{n}, attend {at}]", p.decode, self._idle_decode_args(), kw))
        return out

    def resident_bytes(self) -> dict[str, int]:
        """Bytes one device of the engine's mesh holds while the engine lives: ``weights`` (its params, plus
        the stacked copy of the scanned layers' when scanning) and ``cache`` (every slot's K/V and recurrent
        state), from the arrays' shardings (exact, no compile; an abstract engine's too)."""
        weights = bytes_per_device(self.params) + (bytes_per_device(self._stacked) if self._stacked else 0)
        return {"weights": weights, "cache": bytes_per_device(self.cache)}

    def warmup(self) -> float:
        """Compiles every prefill program (each chunk bucket x slot-count bucket) and the decode round, with
        inputs that change nothing (padding rows only, no active slot). Returns the seconds it took."""
        if self.abstract:
            raise RuntimeError("Engine.warmup: an abstract engine runs nothing (use programs_ahead)")
        t = time.perf_counter()
        for _, fn, args, kw in self._program_calls():
            if fn is self._programs.decode:
                self.cache, out = fn(self._program_params, self.cache, *args, **kw)
                jax.block_until_ready(out)
            else:
                self.cache = fn(self._program_params, self.cache, *args, **kw)
        return time.perf_counter() - t

    def programs_ahead(self) -> list[tuple[str, Callable[[], Any]]]:
        """Every program this engine can run, as ``(name, lower)`` pairs: ``lower()`` lowers that program for
        the engine's shapes from abstract arguments (``jax.ShapeDtypeStruct``s with the params' and cache's
        shardings; ``compile_cache.Ahead`` then compiles it), so nothing runs and no buffer is touched:
        another thread may use the engine meanwhile. Once compiled, the engine's own call of the program
        compiles nothing (JAX's in-memory caches), and the persistent compilation cache keeps it for later
        processes.

        The set: the prefill and decode programs ``warmup`` runs (``_program_calls``), and the slot-copy
        program of prefix sharing at each slot-count bucket."""
        params = jax.tree.map(compile_cache.abstract, self._program_params)
        cache = self._cache_spec

        def job(fn: Any, *args: Any, **kw: Any) -> Callable[[], Any]:
            return lambda: fn.lower(*args, **kw)

        out = [(name, job(fn, params, cache, *args, **kw)) for name, fn, args, kw in self._program_calls()]
        if self.share_prefix >= 1:
            for k in self._slot_buckets:
                ids = np.zeros((k,), np.int32)
                out.append((f"copy[{k}]", job(self._copy, cache, ids, ids)))
        return out

    def compile_ahead(self, threads: int = 1) -> compile_cache.AheadReport:
        """Compiles every program of ``programs_ahead`` now, on ``threads`` threads
        (``compile_cache.Ahead``). Safe beside other work on the engine."""
        return compile_cache.Ahead(self.programs_ahead(), threads, "engine").run()

    def reset_stats(self) -> None:
        self.stats = []
        self._last_end = None

    # --------------------------------------------------------------------------------------------- internal

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _lane(self, session: Session, what: str) -> _Lane:
        if session.engine is not self:
            raise ValueError(f"{what}: session {session.id} belongs to another engine")
        lane = self._lanes.get(session.id)
        if lane is None:
            raise RuntimeError(f"{what}: session {session.id} is closed")
        return lane

    def _release(self, session: Session) -> None:
        lane = self._lanes[session.id]
        if lane.slot is not None:
            self._owner[lane.slot] = None
        lane.slot = None
        lane.cached = 0

    def _finish(self, session: Session, status: str) -> None:
        lane = self._lanes[session.id]
        req = lane.request
        assert req is not None
        turn = session.record(req.start)
        plp = req.processed_logprobs
        req.result = TurnResult(
            session=session,
            tokens=turn.tokens.tolist(),
            logprobs=turn.logprobs,
            status=status,
            processed_logprobs=None if plp is None else np.asarray(plp, np.float32),
        )
        lane.request = None
        lane.status = "cache_full" if status == "cache_full" else "idle"
        lane.last_used = self._tick()
        self._ready.append(req.result)

    def _take_slot(self, st: StepStats) -> int | None:
        for i, owner in enumerate(self._owner):
            if owner is None:
                return i
        lanes = self._lanes
        idle = [s for s in self._owner if s is not None and lanes[s.id].status in ("idle", "cache_full")]
        if not idle:
            return None
        victim = min(idle, key=lambda s: self._lanes[s.id].last_used)
        slot = self._lanes[victim.id].slot
        logging.debug("evicting idle session %d from slot %s", victim.id, slot)
        self._release(victim)
        st.evictions += 1
        return slot

    def _admit(self, st: StepStats) -> None:
        still: collections.deque[Session] = collections.deque()
        for s in self._waiting:
            lane = self._lanes[s.id]
            if lane.slot is None:
                slot = self._take_slot(st)
                if slot is None:
                    still.append(s)
                    continue
                lane.slot, lane.cached, lane.needs_reset = slot, 0, True
                self._owner[slot] = s
            lane.status = "running"
            self._running.append(s)
        self._waiting = still

    def _prefill_end(self, session: Session) -> int:
        """How many leading record tokens prefill puts in the slot now: all but the pending one, or fewer
        for a prefix-sharing leader (``lane.upto``)."""
        upto = self._lanes[session.id].upto
        return len(session) - 1 if upto is None else min(len(session) - 1, upto)

    def _bucket_for(self, session: Session) -> int:
        remaining = self._prefill_end(session) - self._lanes[session.id].cached
        for b in self.prefill_buckets:
            if b >= remaining:
                return b
        return self.prefill_buckets[-1]

    def _prefill(self, st: StepStats) -> None:
        if self.share_prefix >= 1:
            self._share_prefixes(st)
        self._prefill_sessions(st, self._running)
        if st.prefill_calls:
            jax.block_until_ready(self.cache.lengths)

    def _share_prefixes(self, st: StepStats) -> None:
        """Newly admitted sessions whose records start with the same ``share_prefix`` or more tokens (the
        answerer runs of one probe: one system prompt and workspace listing) prefill that common prefix once:
        a leader prefills exactly the prefix, then its slot row is copied into the others' slots, which go on
        from there. Exact for every cache kind (the leader's state holds exactly the prefix when copied)."""
        lanes, m = self._lanes, self.share_prefix
        groups: dict[tuple[int, ...], list[Session]] = collections.defaultdict(list)
        for s in self._running:
            lane = lanes[s.id]
            if lane.needs_reset and lane.cached == 0 and len(s) - 1 >= m:
                groups[tuple(s.token_slice(0, m))].append(s)
        plan = []
        for members in groups.values():
            if len(members) < 2:
                continue
            cap = min(len(s) for s in members) - 1
            lead = np.asarray(members[0].token_slice(0, cap))
            common = cap
            for s in members[1:]:
                diff = np.nonzero(np.asarray(s.token_slice(0, cap)) != lead)[0]
                common = min(common, int(diff[0]) if diff.size else cap)
            plan.append((members[0], common, members[1:]))
        if not plan:
            return
        for leader, common, _ in plan:
            lanes[leader.id].upto = common
        self._prefill_sessions(st, [leader for leader, _, _ in plan])
        src, dst = [], []
        for leader, common, followers in plan:
            lanes[leader.id].upto = None
            for f in followers:
                lane = lanes[f.id]
                src.append(lanes[leader.id].slot)
                dst.append(lane.slot)
                lane.cached, lane.needs_reset = common, False
                st.shared_prefix_tokens += common
        k = next(b for b in self._slot_buckets if b >= len(dst))
        pad = k - len(dst)
        src_ids = np.asarray(src + [0] * pad, np.int32)
        dst_ids = np.asarray(dst + [self.num_slots] * pad, np.int32)
        self.cache = self._copy(self.cache, src_ids, dst_ids)

    def _prefill_sessions(self, st: StepStats, sessions: Sequence[Session]) -> None:
        lanes = self._lanes
        work = [s for s in sessions if lanes[s.id].needs_reset or lanes[s.id].cached < self._prefill_end(s)]
        calls = []
        while work:
            groups: dict[int, list[Session]] = collections.defaultdict(list)
            for s in work:
                groups[self._bucket_for(s)].append(s)
            for chunk, group in sorted(groups.items()):
                for start in range(0, len(group), self.num_slots):
                    part = group[start : start + self.num_slots]
                    k = next(b for b in self._slot_buckets if b >= len(part))
                    # Most slots at once: run every slot in place (rows = slots); otherwise gather the k rows.
                    full = k == self.num_slots
                    rows = self.num_slots if full else k
                    slots = np.full((rows,), self.num_slots, np.int32)
                    tokens = np.zeros((rows, chunk), np.int32)
                    mask = np.zeros((rows, chunk), bool)
                    reset = np.zeros((rows,), bool)
                    reach = 0  # the most cache positions a row holds after this chunk
                    for row, s in enumerate(part):
                        lane = lanes[s.id]
                        new = s.token_slice(lane.cached, min(self._prefill_end(s), lane.cached + chunk))
                        r = lane.slot if full else row
                        slots[r] = lane.slot
                        tokens[r, : len(new)] = new
                        mask[r, : len(new)] = True
                        reset[r] = lane.needs_reset
                        lane.needs_reset = False
                        lane.cached += len(new)
                        reach = max(reach, lane.cached)
                        st.prefill_tokens += len(new)
                    live = live_len(reach, self.capacity)  # attention reads only the live positions
                    if full:
                        self.cache = self._programs.prefill_all(
                            self._program_params, self.cache, tokens, mask, reset, attend_len=live
                        )
                    else:
                        args = (slots, tokens, mask, reset)
                        self.cache = self._programs.prefill(self._program_params, self.cache, *args,
                                                            attend_len=live)
                    calls.append(chunk)
            work = [s for s in work if lanes[s.id].cached < self._prefill_end(s)]
        st.prefill_calls += len(calls)

    def _decode_round(self, st: StepStats) -> None:
        n = self.num_slots
        tokens = np.zeros((n,), np.int32)
        active = np.zeros((n,), bool)
        budget = np.zeros((n,), np.int32)
        stops = np.full((n, self.max_stop_ids), -1, np.int32)
        temperature = np.zeros((n,), np.float32)
        top_p = np.ones((n,), np.float32)
        top_k = np.zeros((n,), np.int32)
        seeds = np.zeros((n,), np.int32)
        streams = np.zeros((n,), np.int32)
        reach = 0  # the most cache positions an active slot can hold by the end of the round
        for s in self._running:
            lane = self._lanes[s.id]
            req = lane.request
            assert req is not None and lane.slot is not None and lane.cached == len(s) - 1
            i = lane.slot
            tokens[i] = s.last_token
            active[i] = True
            budget[i] = req.max_new_tokens - req.generated
            reach = max(reach, lane.cached + min(int(budget[i]), self.round_steps))
            stops[i, : len(req.stop_ids)] = req.stop_ids
            sp = req.sampling
            temperature[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, sp.top_k
            seeds[i] = np.uint32(sp.seed & 0xFFFFFFFF).view(np.int32)
            streams[i] = np.uint32(sp.stream & 0xFFFFFFFF).view(np.int32)
        self.cache, out = self._programs.decode(
            self._program_params, self.cache, tokens, active, budget, stops, temperature, top_p, top_k, seeds,
            streams,
            attend_len=live_len(reach, self.capacity),  # attention reads only the live positions
        )
        out = jax.device_get(out)
        st.active_slots = int(active.sum())
        st.decode_steps = int(out["count"].max(initial=0))
        st.tokens_decoded = int(out["count"].sum())
        still = []
        for s in self._running:
            lane = self._lanes[s.id]
            i = lane.slot
            count = int(out["count"][i])
            req = lane.request
            s.extend(out["tokens"][i, :count].tolist(), out["logprobs"][i, :count].tolist(), tag=req.tag)
            if req.processed_logprobs is not None:
                req.processed_logprobs.extend(out["processed_logprobs"][i, :count].tolist())
            lane.cached += count
            reason = int(out["reason"][i])
            if reason == slot_programs.RUNNING:
                still.append(s)
            else:
                self._finish(s, slot_programs.REASONS[reason])
        self._running = still


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _generate_buckets(prefill_len: int) -> tuple[int, ...]:
    """Prefill chunk lengths for one ``generate`` call whose longest row prefills ``prefill_len`` tokens: one
    power-of-two chunk that holds them all (at least 8), so short prompts are not padded to the engine's
    smallest default bucket (16-token prompts: a 16-token chunk, half the work of a 32-token one); beyond the
    largest default bucket, the default chunks."""
    if prefill_len > DEFAULT_PREFILL_BUCKETS[-1]:
        return DEFAULT_PREFILL_BUCKETS
    return (max(8, 1 << max(prefill_len - 1, 0).bit_length()),)


def generate_engine(model: nnx.Module, rows: int, longest: int, max_new_tokens: int, *, num_stops: int = 0,
                    mesh: Mesh | None = None, scan_layers: bool = SCAN_LAYERS) -> Engine:
    """The engine ``generate`` runs for ``rows`` prompts of at most ``longest`` tokens: one slot per row, a
    cache of ``longest + max_new_tokens`` rounded up to 16, one prefill chunk for the prompts
    (``_generate_buckets``) and one decode round of ``max_new_tokens`` steps."""
    return Engine(
        model,
        num_slots=rows,
        max_seq_len=_round_up(longest + max_new_tokens, 16),
        mesh=mesh,
        prefill_buckets=_generate_buckets(longest - 1),
        round_steps=max_new_tokens,
        max_stop_ids=max(1, num_stops),
        scan_layers=scan_layers,
    )


def generate(
    model: nnx.Module,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: Iterable[int] = (),
    mesh: Mesh | None = None,
    scan_layers: bool = SCAN_LAYERS,
) -> list[list[int]]:
    """Generates a continuation of every prompt (the contract entry point).

    Row ``i`` samples with ``SamplingParams(temperature, top_p, top_k, seed, stream=i)``. Each returned list
    holds the new tokens only, **including the stop token** when one was sampled (so a caller can tell a stop
    from a budget end); generation of a row ends at its first stop id or after ``max_new_tokens`` tokens.

    Args:
      model: a ``models.Transformer``.
      prompt_ids: one non-empty list of token ids per row.
      max_new_tokens: most new tokens per row.
      temperature, top_p, top_k, seed: see ``SamplingParams``.
      stop_ids: ids that end a row (included in its output).
      mesh: optional mesh (default: one device).
      scan_layers: see ``Engine``.
    Returns:
      ``list[list[int]]``, one list of new token ids per prompt.
    """
    prompts = [[int(t) for t in p] for p in prompt_ids]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"generate: prompt_ids[{i}] is empty")
    if not prompts or max_new_tokens <= 0:
        return [[] for _ in prompts]
    stops = tuple(int(t) for t in stop_ids)
    engine = generate_engine(model, len(prompts), max(len(p) for p in prompts), max_new_tokens,
                             num_stops=len(stops), mesh=mesh, scan_layers=scan_layers)
    requests = []
    for i, p in enumerate(prompts):
        s = engine.new_session(p)
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stream=i)
        requests.append(engine.submit(s, max_new_tokens, sp, stops))
    engine.run_until_done()
    return [list(r.result.tokens) for r in requests]
