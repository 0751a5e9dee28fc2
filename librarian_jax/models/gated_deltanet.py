"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid layers, in Flax NNX.

A line-by-line port of Hugging Face transformers' `Qwen3_5GatedDeltaNet` (models/qwen3_5/modeling_qwen3_5.py):

    x [batch, seq, hidden]
      -> in_proj_qkv -> causal depthwise conv1d (kernel K, no bias) -> SiLU -> split q | k | v
         q, k [batch, seq, k_heads, k_head_dim] (L2-normalised, q scaled by k_head_dim**-0.5),
         v    [batch, seq, v_heads, v_head_dim]
      -> in_proj_z -> z [batch, seq, v_heads, v_head_dim]      (output gate)
      -> in_proj_b -> beta = sigmoid(b)                          [batch, seq, v_heads]
      -> in_proj_a -> g = -exp(A_log) * softplus(a + dt_bias)   [batch, seq, v_heads] (log decay, <= 0)
      -> gated delta rule, per value head h (each k head serves v_heads // k_heads consecutive v heads):
             S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t
         with S [k_head_dim, v_head_dim] float32
      -> gated RMSNorm over v_head_dim: w * rmsnorm(o) * silu(z)  (plain `w`, not `1 + w`)
      -> out_proj -> y [batch, seq, hidden]

Two exact evaluations of the same recurrence:
- `chunk_gated_delta_rule` (prefill / training): the sequence is cut into chunks of `CHUNK_SIZE` (64) tokens;
  inside a chunk the delta rule is a unit-lower-triangular solve (the WY / UT transform) plus masked
  [chunk, chunk] products, and a `lax.scan` carries the state from chunk to chunk. No [seq, seq] matrix is
  ever formed: activation memory grows as batch * heads * seq * chunk (the per-chunk [chunk, chunk] blocks)
  plus batch * seq * heads * head_dim, and the state is batch * heads * k_head_dim * v_head_dim.
- `recurrent_gated_delta_rule` (decode): a `lax.scan` over tokens, one rank-1 state update per token;
  used automatically when seq <= `RECURRENT_MAX_SEQ`.

Cache (one dict per layer, see `GatedDeltaNet.cache_shapes`): `conv` [batch, conv_dim, K - 1] holds the last
K - 1 pre-convolution inputs (HF's conv_state layout), `state` [batch, v_heads, k_head_dim, v_head_dim]
float32 the recurrent state. Padding (mask False, always a suffix of a row) gets beta = 0 and g = 0, which
leaves the state exactly untouched, and the conv tail is taken at each row's own length: after a padded call
the cache is what it would be after the row's last real token. (HF instead zeroes padded inputs, which still
decays the state; outputs at real tokens are the same, only the state after right padding differs.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from librarian_jax.models.layers import Dense

CHUNK_SIZE = 64
"""Tokens per chunk of the parallel form (as HF / flash-linear-attention's `chunk_gated_delta_rule`)."""

RECURRENT_MAX_SEQ = 8
"""Calls with at most this many tokens use the token-by-token recurrence (decode); longer ones are chunked."""

_L2NORM_EPS = 1e-6  # as HF's l2norm / FLA's use_qk_l2norm_in_kernel


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter tagged with logical axis names only.

    The loader (or `partitioning.shard_model`) maps them to mesh axes later, so flax's eager sharding (which
    wants mesh axis names) stays off.
    """
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


HF_PARAMS: dict[str, tuple[str, bool]] = {
    # HF tensor suffix under `model.layers.{i}.linear_attn.` -> (nnx attribute path, transpose?).
    # transpose=True: the HF tensor is ours with the last two axes swapped (torch Linear's [out, in] vs our
    # [in, out] kernel).
    "in_proj_qkv.weight": ("in_proj_qkv.kernel", True),
    "in_proj_z.weight": ("in_proj_z.kernel", True),
    "in_proj_b.weight": ("in_proj_b.kernel", True),
    "in_proj_a.weight": ("in_proj_a.kernel", True),
    "conv1d.weight": ("conv1d.weight", False),  # HF's Conv1d layout [conv_dim, 1, kernel], kept as is
    "dt_bias": ("dt_bias", False),
    "A_log": ("A_log", False),
    "norm.weight": ("norm.weight", False),
    "out_proj.weight": ("out_proj.kernel", True),
}

_CONFIG_FIELDS = (
    "hidden_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@dataclasses.dataclass(frozen=True)
class DeltaNetDims:
    """The sizes of one Gated DeltaNet layer, read from a `ModelConfig`."""

    hidden: int
    k_heads: int
    v_heads: int
    k_head_dim: int
    v_head_dim: int
    kernel: int
    eps: float
    dtype: Any
    param_dtype: Any
    init_std: float

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_config(cls, config: Any) -> DeltaNetDims:
        missing = [name for name in _CONFIG_FIELDS if not getattr(config, name, None)]
        if missing:
            raise ValueError(
                f"GatedDeltaNet needs positive config fields {missing} (HF Qwen3_5TextConfig names); "
                f"{type(config).__name__} does not set them"
            )
        dims = cls(
            hidden=int(config.hidden_size),
            k_heads=int(config.linear_num_key_heads),
            v_heads=int(config.linear_num_value_heads),
            k_head_dim=int(config.linear_key_head_dim),
            v_head_dim=int(config.linear_value_head_dim),
            kernel=int(config.linear_conv_kernel_dim),
            eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            dtype=jnp.dtype(getattr(config, "dtype", None) or jnp.float32),
            param_dtype=jnp.dtype(getattr(config, "param_dtype", None) or jnp.float32),
            init_std=float(getattr(config, "initializer_range", None) or 0.02),
        )
        if dims.v_heads % dims.k_heads:
            raise ValueError(
                f"linear_num_value_heads={dims.v_heads} must be a multiple of "
                f"linear_num_key_heads={dims.k_heads}"
            )
        if dims.kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={dims.kernel} must be >= 2")
        return dims


# ----------------------------------------------------------------------------------------------------------
# Pure functions (all float32 inside).


def l2norm(x: jax.Array, eps: float = _L2NORM_EPS) -> jax.Array:
    """`x * rsqrt(sum(x**2, -1) + eps)` over the last axis, as HF's `l2norm`."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_depthwise_conv(
    x: jax.Array, conv_state: jax.Array, weight: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv1d that continues from `conv_state` (no activation, float32 result).

    Args:
      x: `[batch, seq, channels]` new inputs.
      conv_state: `[batch, channels, kernel - 1]` the inputs before `x` (zeros at the start of a sequence).
      weight: `[channels, 1, kernel]` (HF's Conv1d layout; tap `kernel - 1` multiplies the newest input).
      lengths: int32 `[batch]` number of real tokens of each row (a prefix of `x`).

    Returns:
      out `[batch, seq, channels]` float32, and the new conv state `[batch, channels, kernel - 1]`: the last
      `kernel - 1` inputs up to and including each row's last real token (the old state for length 0).
    """
    seq = x.shape[1]
    kernel = weight.shape[-1]
    full = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)  # [b, K-1+seq, c]
    taps = weight[:, 0, :].astype(jnp.float32)  # [c, K]
    fullf = full.astype(jnp.float32)
    out = fullf[:, 0:seq, :] * taps[:, 0]
    for j in range(1, kernel):
        out = out + fullf[:, j : j + seq, :] * taps[:, j]
    tail = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, kernel - 1, axis=0))(full, lengths)
    return out, jnp.swapaxes(tail, 1, 2)


def recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time (decode form).

    Args:
      q, k: `[batch, seq, heads, k_head_dim]` float32 (q L2-normalised and scaled; heads = value heads).
      v: `[batch, seq, heads, v_head_dim]` float32.
      g: `[batch, seq, heads]` log decay (<= 0); beta: `[batch, seq, heads]` write strength in [0, 1].
      initial_state: `[batch, heads, k_head_dim, v_head_dim]` float32.

    Returns:
      o `[batch, seq, heads, v_head_dim]` float32, final state `[batch, heads, k_head_dim, v_head_dim]`.
    """

    def step(state: jax.Array, inputs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = inputs  # [b, h, dk], [b, h, dk], [b, h, dv], [b, h], [b, h]
        state = state * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    seq = q.shape[1]
    xs = tuple(jnp.swapaxes(t, 0, 1) for t in (q, k, v, g, beta))  # time-major
    final, out = jax.lax.scan(step, initial_state, xs, unroll=seq <= RECURRENT_MAX_SEQ)
    return jnp.swapaxes(out, 0, 1), final


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks (prefill / training form); arguments and results as the recurrent one.

    Within a chunk of C tokens, with cumulative log decay c_i and D_ij = exp(c_i - c_j) for j <= i:
      (I + tril(diag(beta) K K^T * D, -1)) [U | W] = [diag(beta) V | diag(beta exp(c)) K]   (UT transform)
      V_new = U - W S;   O = (Q exp(c)) S + tril(Q K^T * D) V_new;
      S <- exp(c_C) S + (K exp(c_C - c))^T V_new.
    Memory: the [chunk, chunk] blocks for all chunks, batch * heads * seq * chunk floats; never [seq, seq].
    """
    batch, seq, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-seq) % chunk_size
    if pad:  # zero padding has beta = 0 and g = 0: it changes neither outputs nor the state
        q, k, v = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (q, k, v))
        g, beta = (jnp.pad(t, ((0, 0), (0, pad), (0, 0))) for t in (g, beta))
    n = (seq + pad) // chunk_size

    def chunks(t: jax.Array) -> jax.Array:  # [b, n*C, h, ...] -> [b, h, n, C, ...]
        t = t.reshape(batch, n, chunk_size, heads, *t.shape[3:])
        return jnp.moveaxis(t, 3, 1)

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [b, h, n, C]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool))  # i >= j
    strict = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool), -1)  # i > j
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [b, h, n, C, C]

    k_beta = k * beta[..., None]
    ut = jnp.where(strict, jnp.einsum("...id,...jd->...ij", k_beta, k) * decay, 0.0)
    eye = jnp.eye(chunk_size, dtype=ut.dtype)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = jax.lax.linalg.triangular_solve(
        ut + eye, rhs, left_side=True, lower=True, unit_diagonal=True
    )  # [b, h, n, C, dv + dk]
    u, w = solved[..., :dv], solved[..., dv:]

    attn = jnp.where(causal, jnp.einsum("...id,...jd->...ij", q, k) * decay, 0.0)  # [b, h, n, C, C]
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [b, h, n]

    def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        u_n, w_n, q_n, k_n, attn_n, decay_n = xs  # chunk n of every tensor, [b, h, C, ...]
        v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, state)
        out = jnp.einsum("bhck,bhkv->bhcv", q_n, state) + jnp.einsum("bhij,bhjv->bhiv", attn_n, v_new)
        state = state * decay_n[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_n, v_new)
        return state, out

    xs = tuple(jnp.moveaxis(t, 2, 0) for t in (u, w, q_dec, k_dec, attn, chunk_decay))
    final, out = jax.lax.scan(step, initial_state, xs)  # out [n, b, h, C, dv]
    out = jnp.transpose(out, (1, 0, 3, 2, 4)).reshape(batch, n * chunk_size, heads, dv)
    return out[:, :seq], final


# ----------------------------------------------------------------------------------------------------------
# Modules.


class DepthwiseCausalConv(nnx.Module):
    """HF's `nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False)` as a causal, cached conv.

    `weight` `[conv_dim, 1, kernel]` (HF's layout), logical axes `("conv", None, None)`.
    """

    def __init__(self, channels: int, kernel: int, *, param_dtype: Any, rngs: nnx.Rngs) -> None:
        bound = 1.0 / math.sqrt(kernel)  # torch's default init for a depthwise Conv1d
        value = jax.random.uniform(rngs.params(), (channels, 1, kernel), jnp.float32, -bound, bound)
        self.weight = _param(value.astype(param_dtype), ("conv", None, None))

    def __call__(
        self, x: jax.Array, conv_state: jax.Array, lengths: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """x `[batch, seq, conv_dim]` -> (float32 `[batch, seq, conv_dim]`, `[batch, conv_dim, K-1]`)."""
        return causal_depthwise_conv(x, conv_state, self.weight[...], lengths)


class GatedRMSNorm(nnx.Module):
    """HF's `Qwen3_5RMSNormGated`: `w * rmsnorm(x) * silu(gate)` over the last axis (`w` starts at ones)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any) -> None:
        self.eps = eps
        self.weight = _param(jnp.ones((dim,), param_dtype), ("norm",))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        """x, gate `[..., dim]` -> `[..., dim]` in x's dtype."""
        dtype = x.dtype
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        h = self.weight[...] * h.astype(dtype)
        h = h * jax.nn.silu(gate.astype(jnp.float32))
        return h.astype(dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear-attention layer (HF `Qwen3_5GatedDeltaNet`), with a cache for prefill and decode.

    `y, new_cache = layer(x, cache=None, mask=None)`:
      x `[batch, seq, hidden]`; cache None or `{"conv": [batch, conv_dim, K-1], "state": [batch, v_heads,
      k_head_dim, v_head_dim] float32}`; mask None or bool `[batch, seq]` (True on real tokens, a prefix of
      each row). y `[batch, seq, hidden]` in `config.dtype`. Without a cache the layer starts from zeros and
      returns `(y, None)`; with one it continues from it and returns the updated cache (pass the zeros of
      `cache_shapes` to have a prefill fill a fresh cache). seq <= `RECURRENT_MAX_SEQ` runs the token
      recurrence, longer inputs the chunked form (`mode` forces one: "auto" | "chunk" | "recurrent").

    Parameters (named after HF's submodules, see `HF_PARAMS`): `in_proj_qkv.kernel` [hidden, conv_dim]
    ("embed", "conv"), `in_proj_z.kernel` [hidden, value_dim] ("embed", "lin_heads"), `in_proj_b.kernel`,
    `in_proj_a.kernel` [hidden, v_heads] ("embed", "lin_heads"), `conv1d.weight` [conv_dim, 1, K]
    ("conv", None, None), `dt_bias`, `A_log` [v_heads] ("lin_heads",), `norm.weight` [v_head_dim] ("norm",),
    `out_proj.kernel` [value_dim, hidden] ("lin_heads", "embed"); conv_dim = 2 * key_dim + value_dim.
    """

    def __init__(self, config: Any, *, rngs: nnx.Rngs) -> None:
        d = DeltaNetDims.from_config(config)
        self.dims = d
        normal = nnx.initializers.normal(d.init_std)

        def linear(n_in: int, n_out: int, axes: tuple[str, str]) -> Dense:
            return Dense(
                n_in,
                n_out,
                use_bias=False,
                dtype=d.dtype,
                param_dtype=d.param_dtype,
                kernel_init=nnx.with_partitioning(normal, axes, eager_sharding=False),
                rngs=rngs,
            )

        self.in_proj_qkv = linear(d.hidden, d.conv_dim, ("embed", "conv"))
        self.in_proj_z = linear(d.hidden, d.value_dim, ("embed", "lin_heads"))
        self.in_proj_b = linear(d.hidden, d.v_heads, ("embed", "lin_heads"))
        self.in_proj_a = linear(d.hidden, d.v_heads, ("embed", "lin_heads"))
        self.conv1d = DepthwiseCausalConv(d.conv_dim, d.kernel, param_dtype=d.param_dtype, rngs=rngs)
        self.dt_bias = _param(jnp.ones((d.v_heads,), d.param_dtype), ("lin_heads",))
        a = jax.random.uniform(rngs.params(), (d.v_heads,), jnp.float32, 0.01, 16.0)  # as HF's _init_weights
        self.A_log = _param(jnp.log(a).astype(d.param_dtype), ("lin_heads",))
        self.norm = GatedRMSNorm(d.v_head_dim, d.eps, param_dtype=d.param_dtype)
        self.out_proj = linear(d.value_dim, d.hidden, ("lin_heads", "embed"))

    # -- cache description ------------------------------------------------------------------------------

    @staticmethod
    def cache_shapes(config: Any, batch: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """`{"conv": ((batch, conv_dim, K-1), config.dtype), "state": ((batch, v_heads, dk, dv), f32)}`."""
        d = DeltaNetDims.from_config(config)
        return {
            "conv": ((batch, d.conv_dim, d.kernel - 1), d.dtype),
            "state": ((batch, d.v_heads, d.k_head_dim, d.v_head_dim), jnp.dtype(jnp.float32)),
        }

    @staticmethod
    def cache_axes() -> dict[str, tuple[str | None, ...]]:
        """Logical axis names of the cache leaves (same keys as `cache_shapes`)."""
        return {"conv": ("cache_batch", "conv", None), "state": ("cache_batch", "lin_heads", None, None)}

    @staticmethod
    def init_cache(config: Any, batch: int) -> dict[str, jax.Array]:
        """A zero cache: the state at the start of a sequence."""
        return {
            name: jnp.zeros(shape, dtype)
            for name, (shape, dtype) in GatedDeltaNet.cache_shapes(config, batch).items()
        }

    # -- forward ----------------------------------------------------------------------------------------

    def _check_inputs(self, x: jax.Array, cache: dict[str, jax.Array] | None, mask: jax.Array | None) -> None:
        d = self.dims
        if x.ndim != 3 or x.shape[-1] != d.hidden:
            raise ValueError(f"GatedDeltaNet: x must be [batch, seq, {d.hidden}], got shape {x.shape}")
        batch, seq = x.shape[:2]
        if mask is not None and tuple(mask.shape) != (batch, seq):
            raise ValueError(
                f"GatedDeltaNet: mask shape {tuple(mask.shape)} != x's [batch, seq] {(batch, seq)}"
            )
        if cache is not None:
            if set(cache) != {"conv", "state"}:
                raise ValueError(f"GatedDeltaNet: cache keys {sorted(cache)} != ['conv', 'state']")
            want = {
                "conv": (batch, d.conv_dim, d.kernel - 1),
                "state": (batch, d.v_heads, d.k_head_dim, d.v_head_dim),
            }
            for name, shape in want.items():
                if tuple(cache[name].shape) != shape:
                    raise ValueError(
                        f"GatedDeltaNet: cache[{name!r}] shape {tuple(cache[name].shape)} != expected {shape}"
                    )

    def __call__(
        self,
        x: jax.Array,
        cache: dict[str, jax.Array] | None = None,
        mask: jax.Array | None = None,
        *,
        mode: str = "auto",
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """x `[batch, seq, hidden]` -> (y `[batch, seq, hidden]`, new cache or None); see the class doc."""
        self._check_inputs(x, cache, mask)
        if mode not in ("auto", "chunk", "recurrent"):
            raise ValueError(f"GatedDeltaNet: mode must be 'auto', 'chunk' or 'recurrent', got {mode!r}")
        d = self.dims
        batch, seq, _ = x.shape
        x = x.astype(d.dtype)
        if mask is None:
            lengths = jnp.full((batch,), seq, jnp.int32)
        else:
            mask = mask.astype(bool)
            lengths = jnp.sum(mask, axis=1, dtype=jnp.int32)
            x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))  # as HF's apply_mask_to_padding_states

        mixed = self.in_proj_qkv(x)  # [b, s, conv_dim]
        z = self.in_proj_z(x).reshape(batch, seq, d.v_heads, d.v_head_dim)
        b = self.in_proj_b(x)  # [b, s, v_heads]
        a = self.in_proj_a(x)

        if cache is not None:
            conv_state = cache["conv"]
        else:
            conv_state = jnp.zeros((batch, d.conv_dim, d.kernel - 1), d.dtype)
        conv_out, new_conv = self.conv1d(mixed, conv_state, lengths)
        mixed = jax.nn.silu(conv_out).astype(d.dtype)
        q, k, v = jnp.split(mixed, [d.key_dim, 2 * d.key_dim], axis=-1)
        q = q.reshape(batch, seq, d.k_heads, d.k_head_dim).astype(jnp.float32)
        k = k.reshape(batch, seq, d.k_heads, d.k_head_dim).astype(jnp.float32)
        v = v.reshape(batch, seq, d.v_heads, d.v_head_dim).astype(jnp.float32)
        q = l2norm(q) * (d.k_head_dim**-0.5)
        k = l2norm(k)
        if d.v_heads != d.k_heads:  # each k head serves v_heads // k_heads consecutive v heads
            q = jnp.repeat(q, d.v_heads // d.k_heads, axis=2)
            k = jnp.repeat(k, d.v_heads // d.k_heads, axis=2)

        beta = jax.nn.sigmoid(b).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        if mask is not None:  # padded tokens neither decay nor write the state
            beta = jnp.where(mask[..., None], beta, 0.0)
            g = jnp.where(mask[..., None], g, 0.0)

        state = (
            cache["state"].astype(jnp.float32)
            if cache is not None
            else jnp.zeros((batch, d.v_heads, d.k_head_dim, d.v_head_dim), jnp.float32)
        )
        use_recurrent = mode == "recurrent" or (mode == "auto" and seq <= RECURRENT_MAX_SEQ)
        if use_recurrent:
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        else:
            out, state = chunk_gated_delta_rule(q, k, v, g, beta, state)

        out = self.norm(out.astype(d.dtype), z)  # [b, s, v_heads, v_head_dim]
        y = self.out_proj(out.reshape(batch, seq, d.value_dim))
        if cache is None:
            return y, None
        return y, {"conv": new_conv.astype(cache["conv"].dtype), "state": state}
