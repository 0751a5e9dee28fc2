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
KEYS_AXES = ("cache_batch", "cache_seq", "kv_heads", "head_dim")  # "keys" and "values" in the keys layout

# An attention layer's K/V leaves by layout (`init_cache(layout=...)`), each with its position axis:
# - "heads" (`k` `[batch, kv_heads, head_dim, max_len]`, keys transposed, and `v` `[batch, kv_heads, max_len,
#   head_dim]`): the layouts in which XLA:CPU reads decode attention's two matmuls in place;
# - "keys" (`keys` and `values`, both `[batch, max_len, kv_heads, head_dim]`): the layout the TPU compiler
#   keeps a decode loop's cache in; stored any other way it copies every layer's K/V into it around the
#   loop (temporaries as large as the cache: `python -m librarian_jax.bench.cache_layout`).
LAYOUTS = ("heads", "keys")
SEQ_AXIS = {"k": -1, "v": -2, "keys": -3, "values": -3}


def layout_of(layer: dict[str, Any]) -> str | None:
    """The K/V layout of one layer's cache dict ("heads", "keys"), None for a linear-attention layer."""
    if "v" in layer:
        return "heads"
    if "values" in layer:
        return "keys"
    return None


def layer_max_len(layer: dict[str, Any]) -> int | None:
    """The positions an attention layer's cache holds (None: not an attention layer)."""
    for name in ("v", "values"):
        if name in layer:
            return int(layer[name].shape[SEQ_AXIS[name]])
    return None


def default_layout(platform: str) -> str:
    """The K/V layout an engine keeps on `platform` ("cpu", "tpu", "gpu"): "heads" on the CPU, "keys"
    elsewhere."""
    return "heads" if platform == "cpu" else "keys"


@struct.dataclass
class Cache:
    """lengths int32 `[batch]` (tokens already in each row); layers: one dict per layer.

    Attention layers: {"k": `[batch, kv_heads, head_dim, max_len]` (keys transposed), "v": `[batch, kv_heads,
    max_len, head_dim]`} in the "heads" layout, {"keys", "values": `[batch, max_len, kv_heads, head_dim]`} in
    the "keys" layout (`LAYOUTS`). Linear-attention layers: {"conv": `[batch, conv_dim, kernel - 1]`,
    "state": `[batch, v_heads, k_head_dim, v_head_dim]` float32}.
    """

    lengths: Any
    layers: tuple[dict[str, Any], ...]

    @property
    def max_len(self) -> int:
        for layer in self.layers:
            if (n := layer_max_len(layer)) is not None:
                return n
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
            if (n := layer_max_len(layer)) is not None:
                return n
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


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype: Any = None,
               layout: str = "heads") -> Cache:
    """An empty cache (all lengths 0) for `batch_size` rows of up to `max_len` tokens.

    K/V in `dtype` (default `config.dtype`) and `layout` (`LAYOUTS`); linear-attention state in the dtypes
    its layer declares.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"init_cache: layout must be one of {LAYOUTS}, got {layout!r}")
    dtype = jnp.dtype(dtype or config.dtype)
    layers: list[dict[str, jax.Array]] = []
    for t in config.layer_types:
        if t == "linear_attention":
            shapes = GatedDeltaNet.cache_shapes(config, batch_size)
            layers.append({name: jnp.zeros(shape, dt) for name, (shape, dt) in shapes.items()})
        else:
            kvh, d = config.num_kv_heads, config.head_dim
            if layout == "keys":
                layers.append({"keys": jnp.zeros((batch_size, max_len, kvh, d), dtype),
                               "values": jnp.zeros((batch_size, max_len, kvh, d), dtype)})
            else:
                layers.append({"k": jnp.zeros((batch_size, kvh, d, max_len), dtype),
                               "v": jnp.zeros((batch_size, kvh, max_len, d), dtype)})
    return Cache(lengths=jnp.zeros((batch_size,), jnp.int32), layers=tuple(layers))


def cache_logical_axes(config: ModelConfig, layout: str = "heads") -> Cache:
    """Same tree as `init_cache(config, ..., layout=layout)` with tuples of logical axis names in the
    leaves."""
    layers: list[dict[str, tuple[str, ...]]] = []
    for t in config.layer_types:
        if t == "linear_attention":
            layers.append(dict(GatedDeltaNet.cache_axes()))
        else:
            layers.append({"keys": KEYS_AXES, "values": KEYS_AXES} if layout == "keys" else
                          {"k": K_AXES, "v": V_AXES})
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
    return name if name in SEQ_AXIS else None


def _positions(kind: str, stop: int, lead: Any = slice(None)) -> tuple:
    """The index of positions `[:stop]` on `kind`'s position axis (`SEQ_AXIS`), `lead` on axis 0."""
    return (lead, Ellipsis, slice(None, stop)) + (slice(None),) * (-SEQ_AXIS[kind] - 1)


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
        return x if kind is None else x[_positions(kind, length)]

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
        if kind is not None:
            return f.at[_positions(kind, p.shape[SEQ_AXIS[kind]], slots)].set(p, mode="drop")
        return f.at[slots].set(p, mode="drop")

    return jax.tree_util.tree_map_with_path(put, full, part)
