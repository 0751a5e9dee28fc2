"""The engine's two device programs: chunked prefill into slots, and the on-device decode loop.

Slot state is one ``models.Cache`` with batch size ``num_slots``: every leaf (K/V buffers, conv and recurrent
state, ``lengths``) has the slot on axis 0 and is treated the same way, so every model family works. The
cache is allocated once and donated into both programs, so XLA updates it in place.

Invariant kept by the host (see ``engine.py``): a slot's cache holds all of its session's tokens except the
last one, the *pending* token. A decode step feeds the pending token and samples the next; a prefill writes
new tokens at the slot's current length. This way one decode step is one model call of one token per slot.

Both functions are pure. ``programs(...)`` jits them with ``graphdef`` and the layout arguments bound (cached
per key, so the key is hashed once per engine, not per call, and every engine over the same model structure,
mesh and shapes shares the compiled programs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from librarian_jax.engine import sampling
from librarian_jax.models import cache as cache_lib
from librarian_jax.models import partitioning

# Per-slot finish reasons returned by the decode loop.
RUNNING, STOP, LENGTH, CACHE_FULL = 0, 1, 2, 3
REASONS = {STOP: "stop", LENGTH: "length", CACHE_FULL: "cache_full"}


def finish_reason(stopped: Any, produced: Any, budget: Any, cached: Any, max_len: int,
                  where: Callable[..., Any] = jnp.where) -> Any:
    """Why a slot stops after sampling a token (``RUNNING`` if it goes on), one rule for the decode loop and
    any host-side stand-in (``testing.ScriptedEngine``, with ``where=numpy.where``): a stop id ends the turn
    (``STOP``), else ``produced >= budget`` tokens this turn (``LENGTH``), else a session that cannot take
    one more token (``CACHE_FULL``: ``cached``, the slot's cached tokens, one fewer than the session's,
    + 2 > ``max_len``). Arguments broadcast (``[slots]`` in the loop, scalars on the host)."""
    return where(stopped, STOP, where(produced >= budget, LENGTH,
                                      where(cached + 2 > max_len, CACHE_FULL, RUNNING)))


def admission_status(length: int, max_new_tokens: int, max_len: int) -> str | None:
    """The status a submitted turn ends with before any decoding (None: it decodes): ``"cache_full"`` when
    a session of ``length`` tokens cannot take one more, ``"length"`` when it may produce none."""
    if length + 1 > max_len:
        return "cache_full"
    if max_new_tokens == 0:
        return "length"
    return None


_constrain = partitioning.constrain  # the cache keeps the engine's slot sharding through every program


def _model(graphdef: nnx.GraphDef, params: Any, scan: bool) -> tuple[nnx.Module, Any]:
    """(model, layer stack or None) from a program's ``params``: the model's ``nnx.State``, or with ``scan``
    the pair (state, the scanned layers' stacked states, see ``Engine(scan_layers=True)``)."""
    if not scan:
        return nnx.merge(graphdef, params), None
    state, stacked = params
    model = nnx.merge(graphdef, state)
    return model, model.layer_stack(stacked)


def prefill(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: Any,
    slots: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    reset: jax.Array,
    *,
    cache_sharding: tuple | None = None,
    attend_len: int | None = None,
    scan_layers: bool = False,
) -> Any:
    """Writes a chunk of new tokens into several slots at their current lengths.

    Args:
      graphdef, params: the model, split by ``nnx.split``.
      cache: the slot cache (batch = num_slots); donated.
      slots: int32 ``[k]``, the slot of each row; an index ``>= num_slots`` is a padding row (ignored).
      tokens: int32 ``[k, chunk]``.
      mask: bool ``[k, chunk]``, True on real tokens (a prefix of each row).
      reset: bool ``[k]``: zero the slot's state (``lengths`` included) before writing, for a slot that a new
        or re-admitted session takes over.
      attend_len: static; the rows' cache positions the model reads and writes (``models.cache.live_len``:
        at least every row's length + chunk); None = the whole cache.
      scan_layers: static; run the model's repeating layers under one ``lax.scan`` (``Transformer.hidden``),
        so the program compiles each distinct layer once: ``params`` is then (state, stacked layer states)
        and ``cache`` a ``models.cache.ScanCache`` (see ``Engine(scan_layers=True)``).
    Returns:
      The updated slot cache (rows not in ``slots`` unchanged).
    """
    model, layer_stack = _model(graphdef, params, scan_layers)
    view = cache_lib.live_view(cache, attend_len)
    rows = jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), view)
    keep = ~reset

    def zero(x: jax.Array) -> jax.Array:
        return x * keep.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)

    rows = jax.tree.map(zero, rows)
    _, rows = model(tokens, cache=rows, mask=mask, layer_stack=layer_stack)
    # With attend_len, a reset row's positions beyond it keep the previous session's K/V: attention never
    # reads them (only indices < the row's length), and later writes overwrite them.
    cache = cache_lib.merge_live(cache, rows, slots)
    return _constrain(cache, cache_sharding)


def prefill_all(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: Any,
    tokens: jax.Array,
    mask: jax.Array,
    reset: jax.Array,
    *,
    cache_sharding: tuple | None = None,
    attend_len: int | None = None,
    scan_layers: bool = False,
) -> Any:
    """``prefill`` for (nearly) every slot at once: row ``i`` is slot ``i``, no gather/scatter of cache rows.

    Args:
      tokens: int32 ``[num_slots, chunk]``; mask: bool ``[num_slots, chunk]`` (all False for a slot with
        nothing to prefill); reset: bool ``[num_slots]``.
    Returns:
      The updated slot cache.
    """
    model, layer_stack = _model(graphdef, params, scan_layers)
    n = tokens.shape[0]
    rows = jnp.where(reset, jnp.arange(n), n)  # out of range for slots not reset: dropped
    cache = jax.tree.map(lambda x: x.at[rows].set(jnp.zeros((), x.dtype), mode="drop"), cache)
    _, view = model(tokens, cache=cache_lib.live_view(cache, attend_len), mask=mask, layer_stack=layer_stack)
    return _constrain(cache_lib.merge_live(cache, view), cache_sharding)


def decode(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: Any,
    tokens: jax.Array,
    active: jax.Array,
    budget: jax.Array,
    stop_ids: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seeds: jax.Array,
    streams: jax.Array,
    *,
    max_len: int,
    num_steps: int,
    cache_sharding: tuple | None = None,
    processed_logprobs: bool = False,
    attend_len: int | None = None,
    scan_layers: bool = False,
) -> tuple[Any, dict[str, jax.Array]]:
    """Advances every active slot, one token per step, inside one ``lax.while_loop``.

    A slot stops when it samples one of its stop ids (``STOP``), when it has produced ``budget`` tokens
    (``LENGTH``), or when its session would outgrow ``max_len`` tokens (``CACHE_FULL``). The loop ends when
    no slot is active or after ``num_steps`` steps (slots still running then report ``RUNNING``).

    Args:
      cache: slot cache, batch = num_slots; donated. Holds each session's tokens except the pending one.
      tokens: int32 ``[slots]``, each slot's pending (last, not yet cached) token.
      active: bool ``[slots]``; the host only activates a slot with ``lengths + 2 <= max_len``, budget > 0.
      budget: int32 ``[slots]``, tokens the slot may still produce this turn.
      stop_ids: int32 ``[slots, n_stop]``, padded with -1.
      temperature, top_p, top_k, seeds, streams: per-slot sampling parameters, see ``sampling.sample``.
      max_len: the most tokens a session may hold (static).
      num_steps: the most steps of this round (static); also the width of the output buffers.
      processed_logprobs: also return the log-probs under the truncated distribution sampled from (static;
        when False they are neither carried nor returned, and XLA drops their computation).
      attend_len: static; the cache positions the loop reads and writes (``models.cache.live_len``: at least
        every active slot's length + its steps this round); None = the whole cache. The loop carries only
        this view and writes it back once at the end.
      scan_layers: static; as in ``prefill`` (``params`` = (state, stacked layer states), ``cache`` a
        ``models.cache.ScanCache``).
    Returns:
      ``(cache, out)`` with ``out["tokens"]`` int32 ``[slots, num_steps]`` (slot ``s`` produced
      ``out["tokens"][s, :out["count"][s]]``), ``out["logprobs"]`` (and, when asked for,
      ``out["processed_logprobs"]``) float32 ``[slots, num_steps]``, ``out["count"]`` int32 ``[slots]``,
      ``out["reason"]`` int32 ``[slots]``.
    """
    model, layer_stack = _model(graphdef, params, scan_layers)
    num_slots = tokens.shape[0]
    zeros_f = jnp.zeros((num_slots, num_steps), jnp.float32)
    full_cache, cache = cache, cache_lib.live_view(cache, attend_len)
    carry = dict(
        step=jnp.int32(0),
        cache=cache,
        tok=tokens.astype(jnp.int32),
        active=active,
        count=jnp.zeros((num_slots,), jnp.int32),
        reason=jnp.zeros((num_slots,), jnp.int32),
        out_tok=jnp.zeros((num_slots, num_steps), jnp.int32),
        out_lp=zeros_f,
    )
    if processed_logprobs:
        carry["out_plp"] = zeros_f

    def cond(c: dict) -> jax.Array:
        return (c["step"] < num_steps) & jnp.any(c["active"])

    def body(c: dict) -> dict:
        act = c["active"]
        position = c["cache"].lengths + 1  # absolute position of the token sampled now
        logits, new_cache = model(c["tok"][:, None], cache=c["cache"], mask=act[:, None],
                                  layer_stack=layer_stack)
        new_cache = _constrain(new_cache, cache_sharding)
        tok, lp, plp = sampling.sample(
            logits[:, -1],
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seeds=seeds,
            streams=streams,
            positions=position,
        )
        tok = jnp.where(act, tok, c["tok"])
        step = c["step"]
        out_tok = jax.lax.dynamic_update_slice(c["out_tok"], tok[:, None], (0, step))
        out_lp = jax.lax.dynamic_update_slice(c["out_lp"], lp[:, None], (0, step))
        count = c["count"] + act.astype(jnp.int32)
        is_stop = jnp.any(tok[:, None] == stop_ids, axis=-1)
        reason = finish_reason(is_stop, count, budget, new_cache.lengths, max_len)
        finished = act & (reason != RUNNING)
        new = dict(
            step=step + 1,
            cache=new_cache,
            tok=tok,
            active=act & ~finished,
            count=count,
            reason=jnp.where(finished, reason, c["reason"]),
            out_tok=out_tok,
            out_lp=out_lp,
        )
        if processed_logprobs:
            new["out_plp"] = jax.lax.dynamic_update_slice(c["out_plp"], plp[:, None], (0, step))
        return new

    c = jax.lax.while_loop(cond, body, carry)
    out = dict(tokens=c["out_tok"], logprobs=c["out_lp"], count=c["count"], reason=c["reason"])
    if processed_logprobs:
        out["processed_logprobs"] = c["out_plp"]
    return _constrain(cache_lib.merge_live(full_cache, c["cache"]), cache_sharding), out


def copy_slots(cache: Any, src: jax.Array, dst: jax.Array, *, cache_sharding: tuple | None = None) -> Any:
    """Copies whole slot rows (every leaf: K/V, conv and recurrent state, ``lengths``): row ``dst[i]`` becomes
    row ``src[i]``. Prefix sharing uses it to hand one slot's prefilled prompt prefix to others.

    Args:
      cache: the slot cache; donated.
      src, dst: int32 ``[k]``; a ``dst >= num_slots`` is a padding row (ignored); no ``dst`` is a ``src``.
    Returns:
      The updated slot cache.
    """
    leaves, treedef = jax.tree.flatten(cache)
    split = [False] * len(leaves) if cache_sharding is None else [_slots_split(sh) for sh in cache_sharding]
    out = [_copy_split(x, src, dst) if sp else x.at[dst].set(jnp.take(x, src, axis=0, mode="clip"),
                                                              mode="drop")
           for x, sp in zip(leaves, split, strict=True)]
    return _constrain(jax.tree.unflatten(treedef, out), cache_sharding)


def _slots_split(sharding: Any) -> bool:
    """Whether a cache leaf's slot axis (axis 0) is split over devices."""
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return bool(spec) and spec[0] is not None


_COPY_CHUNK = 4  # rows a split leaf copies at a time (a group's followers of one leader, typically)


def _copy_split(x: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """`copy_slots` of one leaf whose slot axis is split over devices, written so that no device gathers the
    whole leaf: `_COPY_CHUNK` rows at a time, each chunk's `src` rows a one-hot contraction over the slot
    axis (each device its own slots, then one sum of the chunk's rows across devices), written back by a
    one-hot expansion and a mask that each device computes for its own slots. A gather and scatter on the
    split axis made XLA gather every slot on every device: the paper builder's 64-slot copy held 50 GiB of
    temporaries on a v5p chip. Exact: each value written is one value times 1 plus zeros (finite caches)."""
    slots, k = x.shape[0], src.shape[0]
    pad = -k % _COPY_CHUNK
    src = jnp.concatenate([src, jnp.zeros((pad,), src.dtype)]).reshape(-1, _COPY_CHUNK)
    dst = jnp.concatenate([dst, jnp.full((pad,), slots, dst.dtype)]).reshape(-1, _COPY_CHUNK)
    kind = jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_ else x.dtype
    flat = x.reshape(slots, -1).astype(kind)

    def chunk(i: jax.Array, flat: jax.Array) -> jax.Array:
        pick = jax.nn.one_hot(src[i], slots, dtype=kind)  # [chunk, slots]
        put = jax.nn.one_hot(dst[i], slots, dtype=kind)  # a dst >= slots is all zero: dropped
        rows = jnp.einsum("cs,sr->cr", pick, flat)
        moved = jnp.einsum("cs,cr->sr", put, rows)
        return jnp.where((put.sum(axis=0) > 0)[:, None], moved, flat)

    flat = jax.lax.fori_loop(0, src.shape[0], chunk, flat)
    return flat.astype(x.dtype).reshape(x.shape)


@functools.lru_cache(maxsize=64)
def copy_program(cache_sharding: tuple | None) -> Callable[..., Any]:
    """``copy_slots`` jitted with the cache donated: ``(cache, src, dst) -> cache``."""
    return jax.jit(functools.partial(copy_slots, cache_sharding=cache_sharding), donate_argnums=(0,))


class Programs(NamedTuple):
    """``prefill(params, cache, slots, tokens, mask, reset) -> cache``,
    ``prefill_all(params, cache, tokens, mask, reset) -> cache`` and
    ``decode(params, cache, tokens, active, budget, stop_ids, temperature, top_p, top_k, seeds, streams)
    -> (cache, out)``, jitted with the cache donated; each also takes a static ``attend_len=`` (see
    ``models.cache.live_len``), one compiled program per length used."""

    prefill: Callable[..., Any]
    prefill_all: Callable[..., Any]
    decode: Callable[..., Any]


@functools.lru_cache(maxsize=64)
def _prefill_programs(graphdef: nnx.GraphDef, cache_sharding: tuple | None,
                      scan_layers: bool = False) -> tuple[Callable, Callable]:
    # Prefill does not depend on max_len or the decode settings: engines that differ only in those share it.
    def prefill_fn(params, cache, slots, tokens, mask, reset, attend_len=None):
        return prefill(graphdef, params, cache, slots, tokens, mask, reset, cache_sharding=cache_sharding,
                       attend_len=attend_len, scan_layers=scan_layers)

    def prefill_all_fn(params, cache, tokens, mask, reset, attend_len=None):
        return prefill_all(graphdef, params, cache, tokens, mask, reset, cache_sharding=cache_sharding,
                           attend_len=attend_len, scan_layers=scan_layers)

    static = dict(donate_argnums=(1,), static_argnames=("attend_len",))
    return jax.jit(prefill_fn, **static), jax.jit(prefill_all_fn, **static)


@functools.lru_cache(maxsize=64)
def programs(
    graphdef: nnx.GraphDef,
    cache_sharding: tuple | None,
    max_len: int,
    num_steps: int,
    processed_logprobs: bool = False,
    scan_layers: bool = False,
) -> Programs:
    """The jitted prefill and decode programs for one model structure and slot layout (`scan_layers`: see
    ``decode``)."""

    def decode_fn(params, cache, *args, attend_len=None):
        return decode(
            graphdef, params, cache, *args,
            max_len=max_len, num_steps=num_steps, cache_sharding=cache_sharding,
            processed_logprobs=processed_logprobs, attend_len=attend_len, scan_layers=scan_layers,
        )

    prefill_fn, prefill_all_fn = _prefill_programs(graphdef, cache_sharding, scan_layers)
    decode_jit = jax.jit(decode_fn, donate_argnums=(1,), static_argnames=("attend_len",))
    return Programs(prefill=prefill_fn, prefill_all=prefill_all_fn, decode=decode_jit)
