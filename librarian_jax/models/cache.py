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
