"""The decode cache: per-row lengths, per-layer K/V (attention) or conv/recurrent state (linear attention)."""

from __future__ import annotations

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


def live_view(cache: Cache, length: int | None) -> Cache:
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
            return x[..., :length]  # [batch, kv_heads, head_dim, length]
        if kind == "v":
            return x[:, :, :length]  # [batch, kv_heads, length, head_dim]
        return x

    return jax.tree_util.tree_map_with_path(cut, cache)


def merge_live(full: Cache, part: Cache, slots: jax.Array | None = None) -> Cache:
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
            return f.at[slots, :, :, : p.shape[-1]].set(p, mode="drop")
        if kind == "v":
            return f.at[slots, :, : p.shape[2]].set(p, mode="drop")
        return f.at[slots].set(p, mode="drop")

    return jax.tree_util.tree_map_with_path(put, full, part)
