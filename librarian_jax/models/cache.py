"""The decode cache: per-row lengths, per-layer K/V (attention) or conv/recurrent state (linear attention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from librarian_jax.models.config import ModelConfig
from librarian_jax.models.gated_deltanet import GatedDeltaNet

K_AXES = ("cache_batch", "kv_heads", "head_dim", "cache_seq")
V_AXES = ("cache_batch", "kv_heads", "cache_seq", "head_dim")


@struct.dataclass
class Cache:
    """lengths int32 `[batch]` (tokens already in each row); layers: one dict per layer.

    Attention layers: {"k": `[batch, kv_heads, head_dim, max_len]` (keys transposed), "v": `[batch, kv_heads,
    max_len, head_dim]`}: the layouts in which decode attention's two matmuls read them in place.
    Linear-attention layers: {"conv": `[batch, conv_dim, kernel - 1]`, "state": `[batch, v_heads, k_head_dim,
    v_head_dim]` float32}.
    """

    lengths: Any
    layers: tuple[dict[str, Any], ...]

    @property
    def max_len(self) -> int:
        for layer in self.layers:
            if "v" in layer:
                return int(layer["v"].shape[2])
        raise ValueError("Cache has no attention layer, so no max_len")


@struct.dataclass
class ScanCache:
    """A `Cache` laid out for a layer scan (`Transformer.hidden` with a `LayerStack` of this `period`):
    `groups[k]` holds the caches of layers k, k + period, ..., k + (periods - 1) * period, each leaf stacked
    on a new axis 1 (`[batch, periods, ...]`, the rest of each leaf's layout as in `Cache`: the slot stays
    on axis 0, so whatever treats a cache row by row treats this one alike); `rest` holds layers
    period * periods onwards, one dict each. `stack_cache` / `unstack_cache` convert (one copy each way);
    the engine keeps its slot cache in this form when it scans (`Engine(scan_layers=True)`).
    """

    lengths: Any
    groups: tuple[dict[str, Any], ...]
    rest: tuple[dict[str, Any], ...]

    @property
    def period(self) -> int:
        return len(self.groups)

    @property
    def periods(self) -> int:
        return int(jax.tree.leaves(self.groups)[0].shape[1])

    @property
    def max_len(self) -> int:
        for layer in (*self.groups, *self.rest):
            if "v" in layer:
                return int(layer["v"].shape[-2])
        raise ValueError("Cache has no attention layer, so no max_len")


def stack_cache(cache: Cache, period: int, periods: int,
                stack: Callable[..., Any] = lambda *xs: jnp.stack(xs, axis=1)) -> ScanCache:
    """`cache` as a `ScanCache` whose first `period * periods` layers are stacked by `period`.

    `stack(*leaves)` stacks the leaves of one group on axis 1 (default `jnp.stack`); another `stack` maps
    trees that mirror a cache (e.g. its shardings, see `partitioning.stacked_sharding`) the same way.
    """
    if period < 1 or periods < 1 or period * periods > len(cache.layers):
        raise ValueError(f"stack_cache: period {period} x periods {periods} does not fit "
                         f"{len(cache.layers)} layers")
    groups = tuple(jax.tree.map(stack, *[cache.layers[k + j * period] for j in range(periods)])
                   for k in range(period))
    return ScanCache(lengths=cache.lengths, groups=groups, rest=tuple(cache.layers[period * periods:]))


def unstack_cache(cache: ScanCache) -> Cache:
    """The `Cache` a `ScanCache` stands for: layer k + j * period is `groups[k]` at index j of axis 1."""
    p, n = cache.period, cache.periods
    layers = [jax.tree.map(lambda a, j=i // p: a[:, j], cache.groups[i % p]) for i in range(p * n)]
    return Cache(lengths=cache.lengths, layers=(*layers, *cache.rest))


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype: Any = None) -> Cache:
    """An empty cache (all lengths 0) for `batch_size` rows of up to `max_len` tokens.

    K/V in `dtype` (default `config.dtype`); linear-attention state in the dtypes its layer declares.
    """
    dtype = jnp.dtype(dtype or config.dtype)
    layers: list[dict[str, jax.Array]] = []
    for t in config.layer_types:
        if t == "linear_attention":
            shapes = GatedDeltaNet.cache_shapes(config, batch_size)
            layers.append({name: jnp.zeros(shape, dt) for name, (shape, dt) in shapes.items()})
        else:
            kvh, d = config.num_kv_heads, config.head_dim
            layers.append({"k": jnp.zeros((batch_size, kvh, d, max_len), dtype),
                           "v": jnp.zeros((batch_size, kvh, max_len, d), dtype)})
    return Cache(lengths=jnp.zeros((batch_size,), jnp.int32), layers=tuple(layers))


def cache_logical_axes(config: ModelConfig) -> Cache:
    """Same tree as `init_cache(config, ...)` with tuples of logical axis names in the leaves."""
    layers: list[dict[str, tuple[str, ...]]] = []
    for t in config.layer_types:
        if t == "linear_attention":
            layers.append(dict(GatedDeltaNet.cache_axes()))
        else:
            layers.append({"k": K_AXES, "v": V_AXES})
    return Cache(lengths=("cache_batch",), layers=tuple(layers))


# ------------------------------------------------------------------------------------------- live length

MIN_LIVE_LEN = 512  # the shortest attended length a program is compiled for (fewer, larger buckets)


def live_len(needed: int, capacity: int) -> int | None:
    """The cache length a call attends to when its rows reach at most `needed` positions; None = all.

    `capacity >> k` for the largest k in 1..3 with `capacity >> k >= max(needed, MIN_LIVE_LEN)` (and a
    multiple of 8), else None (the whole cache): an engine compiles each program for at most 4 lengths.
    """
    best = None
    for k in (1, 2, 3):
        length = capacity >> k
        if length < max(needed, MIN_LIVE_LEN) or length % 8:
            break
        best = length
    return best


def live_lens(capacity: int) -> list[int | None]:
    """Every value `live_len(., capacity)` can return, the whole cache (None) first."""
    out: list[int | None] = [None]
    for k in (1, 2, 3):
        length = capacity >> k
        if length < MIN_LIVE_LEN or length % 8:
            break
        out.append(length)
    return out


def _is_kv(path: tuple) -> str | None:
    name = getattr(path[-1], "key", None)
    return name if name in ("k", "v") else None


def live_view(cache: Cache | ScanCache, length: int | None) -> Cache | ScanCache:
    """`cache` with its K/V cut to the first `length` positions (static; None = all): what attention reads.

    Decode and prefill programs run the model on this view so attention reads only the live part of the
    cache (`Attention` takes the cache's length as its `max_len` and drops writes beyond it); `merge_live`
    writes it back. Lengths and linear-attention state are carried whole.
    """
    if length is None or length >= cache.max_len:
        return cache

    def cut(path: tuple, x: jax.Array) -> jax.Array:
        kind = _is_kv(path)
        if kind == "k":
            return x[..., :length]  # [batch, (layers,) kv_heads, head_dim, length]
        if kind == "v":
            return x[..., :length, :]  # [batch, (layers,) kv_heads, length, head_dim]
        return x

    return jax.tree_util.tree_map_with_path(cut, cache)


def merge_live(full: Cache | ScanCache, part: Cache | ScanCache,
               slots: jax.Array | None = None) -> Cache | ScanCache:
    """Writes `part` (a `live_view` of some rows) back into `full`.

    Args:
      full: the whole cache, batch `num_slots`, K/V of `max_len` positions.
      part: a view with K/V of `length <= max_len` positions; batch `num_slots` when `slots` is None, else
        `[k]` rows going to `slots` (int32 `[k]`; an index >= num_slots is dropped).
    Returns:
      `full` with positions `[:length]` of K/V and every other leaf replaced by `part`'s (for the rows given).
    """

    def put(path: tuple, f: jax.Array, p: jax.Array) -> jax.Array:
        p = p.astype(f.dtype)
        kind = _is_kv(path)
        if slots is None:
            if kind is None or p.shape == f.shape:
                return p
            return jax.lax.dynamic_update_slice(f, p, (0,) * f.ndim)
        if kind == "k":
            return f.at[slots, ..., : p.shape[-1]].set(p, mode="drop")
        if kind == "v":
            return f.at[slots, ..., : p.shape[-2], :].set(p, mode="drop")
        return f.at[slots].set(p, mode="drop")

    return jax.tree_util.tree_map_with_path(put, full, part)
