"""Building blocks: RMSNorm, RoPE, gated MLP and (GQA, cached, sliding-window, gated-output) attention.

Parameter attribute names follow the Hugging Face submodule names (`q_proj`, `input_layernorm`, ...) so the
safetensors mapping in `hf_io.py` is mechanical. Linear kernels are `[in, out]` (HF stores `[out, in]`).
"""

from __future__ import annotations

import functools
import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from librarian_jax.models.config import ModelConfig

INIT_STD = 0.02
_NEG = float(np.finfo(np.float32).min)


class Dense(nnx.Linear):
    """`nnx.Linear` (same parameters, same values) whose input's leading dims are flattened first:
    `[..., d_in]` runs as one `[tokens, d_in] x [d_in, d_out]` product.

    Why: for an input with several leading dims (`[batch, seq, d_in]`) JAX's transpose rule writes the
    kernel's gradient as a product of transposed operands, and XLA:CPU materialises a transposed copy of the
    output's cotangent (`[d_out, tokens]`) for every projection of every layer in each train step; on a 2-D
    input the gradient is one product contracting the tokens of both operands, with no copy (the tiny
    preset's MLP forward + backward at 8 x 1,152 tokens: 1.5x faster on CPU, BENCHMARKS.md).
    """

    def __call__(self, inputs: jax.Array, out_sharding: object = None) -> jax.Array:
        """inputs `[..., d_in]` -> `[..., d_out]`."""
        if inputs.ndim <= 2:
            return super().__call__(inputs, out_sharding=out_sharding)
        lead = inputs.shape[:-1]
        out = super().__call__(inputs.reshape(-1, inputs.shape[-1]), out_sharding=out_sharding)
        return out.reshape(*lead, out.shape[-1])


def dense(config: ModelConfig, d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> Dense:
    """Bias-free linear layer `[.., d_in] -> [.., d_out]` with logical axes on its `[d_in, d_out]` kernel."""
    return Dense(
        d_in, d_out, use_bias=False, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype,
        kernel_init=nnx.with_partitioning(nnx.initializers.normal(INIT_STD), axes, eager_sharding=False),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim. `plus_one` (Gemma, Qwen3.5): `x_hat * (1 + w)` with w initialised at 0.

    Statistics in float32; output in the input's dtype (rounding as HF: Gemma casts after the multiply,
    Llama/Qwen3 cast x_hat before it).
    """

    def __init__(self, dim: int, *, eps: float, plus_one: bool, param_dtype: jnp.dtype):
        init = nnx.initializers.zeros if plus_one else nnx.initializers.ones
        self.weight = nnx.Param(init(jax.random.key(0), (dim,), param_dtype), out_sharding=("norm",),
                                eager_sharding=False)
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        """x `[..., dim]` -> same shape and dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...]
        if self.plus_one:
            return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w.astype(x.dtype) * xf.astype(x.dtype)


# ----------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: ModelConfig, layer_type: str) -> np.ndarray:
    """Inverse frequencies `[rotary_dim // 2]` float32 for a layer type, as HF's rope init functions.

    Gemma 3 sliding layers use `rope_local_theta` with default RoPE; other layers use `rope_theta` and
    `rope_type` ("default", "linear": / factor, "llama3": the Llama 3.1 frequency-dependent scaling).
    """
    dim = config.rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    if layer_type == "sliding_attention" and config.rope_local_theta is not None:
        return (1.0 / (np.float32(config.rope_local_theta) ** exponent)).astype(np.float32)
    inv = (1.0 / (np.float32(config.rope_theta) ** exponent)).astype(np.float32)
    if config.rope_type == "linear":
        inv = (inv / np.float32(config.rope_factor)).astype(np.float32)
    elif config.rope_type == "llama3":
        factor, lo, hi = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        old = config.rope_original_max_position
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions int `[batch, seq]` -> (cos, sin), each float32 `[batch, seq, rotary_dim // 2]`."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first `2 * cos.shape[-1]` dims of x `[batch, seq, heads, head_dim]`."""
    half = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------- MLP


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act = SiLU (SwiGLU) or tanh-GELU (GeGLU)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        e, m = config.hidden_size, config.intermediate_size
        self.gate_proj = dense(config, e, m, ("embed", "mlp"), rngs)
        self.up_proj = dense(config, e, m, ("embed", "mlp"), rngs)
        self.down_proj = dense(config, m, e, ("mlp", "embed"), rngs)
        self.activation = config.activation

    def __call__(self, x: jax.Array) -> jax.Array:
        """x `[batch, seq, hidden]` -> `[batch, seq, hidden]`."""
        g = self.gate_proj(x)
        g = jax.nn.silu(g) if self.activation == "silu" else jax.nn.gelu(g, approximate=True)
        return self.down_proj(g * self.up_proj(x))


# ----------------------------------------------------------------------------------------------- attention


Q_BLOCK = 512  # queries per block when a call has more than this many new tokens


def _attend_dense(q, kt, v, q_key_idx, key_valid, window, scale, keys_major=False):
    """One query block; q `[batch, seq, heads, head_dim]`, kt `[batch, kv_heads, head_dim, keys]`, v `[batch,
    kv_heads, keys, head_dim]`; with `keys_major` both `[batch, keys, kv_heads, head_dim]`."""
    b, s, h, d = q.shape
    t, kvh = (v.shape[1], v.shape[2]) if keys_major else (v.shape[2], v.shape[1])
    kin, vin = ("btkd", "btkd") if keys_major else ("bkdt", "bktd")
    k_idx = jnp.arange(t, dtype=jnp.int32)
    allowed = k_idx[None, None, :] <= q_key_idx[:, :, None]  # [batch, seq, keys]
    if window is not None:
        allowed &= (q_key_idx[:, :, None] - k_idx[None, None, :]) < window
    if key_valid is not None:
        allowed &= key_valid[:, None, :]
    # GQA without repeating K/V: queries are grouped per KV head and both products are batched over (batch,
    # kv_heads). K is stored transposed (`[.., head_dim, keys]`) so that q @ K^T and probs @ V both read their
    # operand in its natural matmul layout: the compiled decode step neither copies, transposes nor repacks
    # the cache (K as `[.., keys, head_dim]` made the score product ~2.5x slower on CPU).
    g = h // kvh
    if s == 1:
        # Decode: `[batch, kv_heads, group, head_dim]` x keys is one plain matmul per (batch, kv_head); on CPU
        # ~3x faster than the 5-d form below, whose extra unit dim XLA lowers to a slow batched dot.
        qg = q.reshape(b, kvh, g, d)
        scores = jnp.einsum(f"bkgd,{kin}->bkgt", qg, kt, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(allowed[:, None, :, :], scores, _NEG)  # allowed [batch, 1, keys]
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum(f"bkgt,{vin}->bkgd", probs, v).reshape(b, 1, h, d)
    qg = q.reshape(b, s, kvh, g, d)
    scores = jnp.einsum(f"bskgd,{kin}->bksgt", qg, kt, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(allowed[:, None, :, None, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(f"bksgt,{vin}->bskgd", probs, v).reshape(b, s, h, d)


def attend(
    q: jax.Array,
    kt: jax.Array,
    v: jax.Array,
    q_key_idx: jax.Array,
    *,
    key_valid: jax.Array | None = None,
    window: int | None = None,
    scale: float,
    block: int = Q_BLOCK,
    keys_major: bool = False,
) -> jax.Array:
    """Causal grouped-query softmax attention.

    q `[batch, seq, heads, head_dim]`; kt (keys, transposed) `[batch, kv_heads, head_dim, keys]`; v `[batch,
    kv_heads, keys, head_dim]` (the cache's "heads" layout), or with `keys_major` both `[batch, keys,
    kv_heads, head_dim]` (its "keys" layout); q_key_idx int32 `[batch, seq]`
    is each query's own index on the key axis: query s of row b sees key t iff t <= q_key_idx[b, s], and
    q_key_idx[b, s] - t < window (sliding layers), and key_valid[b, t] (bool `[batch, keys]`, optional).
    Returns `[batch, seq, heads, head_dim]`. Scores and softmax in float32, probabilities cast to v's dtype.
    A query with no visible key gets a uniform average (never NaN); only padding produces that.

    Memory: scores are `[batch, heads, seq, keys]` float32 for seq <= `block`; longer inputs are processed in
    query blocks of `block` (a rematerialised `lax.map`), so memory grows with block * keys, not seq * keys.
    """
    b, s, h, d = q.shape
    if s <= block:
        return _attend_dense(q, kt, v, q_key_idx, key_valid, window, scale, keys_major)
    nb = -(-s // block)
    pad = nb * block - s
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    ip = jnp.pad(q_key_idx, ((0, 0), (0, pad)))
    qb = qp.reshape(b, nb, block, h, d).swapaxes(0, 1)
    ib = ip.reshape(b, nb, block).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        qi, ii = args
        return _attend_dense(qi, kt, v, ii, key_valid, window, scale, keys_major)

    out = jax.lax.map(one, (qb, ib))  # [blocks, batch, block, heads, head_dim]
    return out.swapaxes(0, 1).reshape(b, nb * block, h, d)[:, :s]


CAUSAL_BLOCKS = 16  # at most this many query blocks in `attend_causal`
CAUSAL_MIN_BLOCK = 64  # queries per block at least (fewer only when the whole input is shorter)


def causal_blocks(seq: int, window: int | None = None, *, max_blocks: int = CAUSAL_BLOCKS,
                  min_block: int = CAUSAL_MIN_BLOCK) -> list[tuple[int, int, int, int]]:
    """Static query blocks of a no-cache causal attention over `seq` tokens: (q0, q1, k0, k1) each, queries
    [q0, q1) reading keys [k0, k1) = every key some query of the block may see (k1 = q1; k0 = 0, or the
    first key inside the sliding `window` of the block's first query). Blocks of equal size (the last may be
    shorter), at least `min_block` queries and at most `max_blocks` blocks."""
    n = max(1, min(max_blocks, seq // min_block))
    size = -(-seq // n)
    out = []
    for q0 in range(0, seq, size):
        q1 = min(q0 + size, seq)
        k0 = 0 if window is None else max(0, q0 - window + 1)
        out.append((q0, q1, k0, q1))
    return out


def attend_causal(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    key_valid: jax.Array | None = None,
    window: int | None = None,
    scale: float,
    max_blocks: int = CAUSAL_BLOCKS,
    min_block: int = CAUSAL_MIN_BLOCK,
) -> jax.Array:
    """Causal grouped-query softmax attention of a sequence over itself (no cache: training, scoring).

    q `[batch, seq, heads, head_dim]`; k, v `[batch, seq, kv_heads, head_dim]`; key_valid bool `[batch, seq]`
    (optional). Query s sees key t iff t <= s, s - t < window (sliding layers) and key_valid[b, t].
    Returns `[batch, seq, heads, head_dim]`; the same values as `attend` with q_key_idx = arange(seq) at every
    query that sees a key (a query that sees none, only padding, gets a uniform average of its block's keys).

    The queries are cut into static blocks (`causal_blocks`), each reading only the keys it can see, so the
    score products and softmax cover about (blocks + 1) / (2 blocks) of the seq x seq square (under half of
    it for a sliding window shorter than seq) instead of all of it. The gradient is written by hand
    (`_causal_core`, the FlashAttention backward over the same blocks): it recomputes each block's
    probabilities from the forward's row maxima and sums, so nothing of size seq x seq is kept between the
    passes, and every product reads its operands in their natural layout (queries, keys and values are laid
    out head-major once per call; no score-sized array is ever transposed). Scores and softmax in float32,
    probabilities in v's dtype.
    """
    b, s, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    # head-major, a query's `group` heads adjacent: q `[batch, kv_heads, seq * group, head_dim]`, k / v
    # `[batch, kv_heads, seq, head_dim]`
    qh = q.reshape(b, s, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, s * g, d)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    blocks = tuple(causal_blocks(s, window, max_blocks=max_blocks, min_block=min_block))
    out = _causal_core(qh, kh, vh, key_valid, blocks, g, window, float(scale))
    return out.reshape(b, kvh, s, g, d).transpose(0, 2, 1, 3, 4).reshape(b, s, h, d)


def _block_scores(qb: jax.Array, kt: jax.Array, key_valid: jax.Array | None, block: tuple[int, int, int, int],
                  g: int, window: int | None, scale: float) -> jax.Array:
    """Masked scores float32 `[batch, kv_heads, (q1 - q0) * g, k1 - k0]` of one causal block; qb `[batch,
    kv_heads, (q1 - q0) * g, head_dim]` (its rows: queries q0.. each `g` heads), kt `[batch, kv_heads,
    head_dim, seq]` (all keys, transposed)."""
    q0, q1, k0, k1 = block
    scores = jnp.einsum("bkmd,bkdt->bkmt", qb, kt[..., k0:k1], preferred_element_type=jnp.float32) * scale
    q_idx = jax.lax.broadcasted_iota(jnp.int32, ((q1 - q0) * g, k1 - k0), 0) // g + q0
    k_idx = jax.lax.broadcasted_iota(jnp.int32, ((q1 - q0) * g, k1 - k0), 1) + k0
    allowed = (k_idx <= q_idx)[None, None]
    if window is not None:
        allowed &= (q_idx - k_idx < window)[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, k0:k1]
    return jnp.where(allowed, scores, _NEG)


def _concat_rows(parts: list[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _causal_core(qh: jax.Array, kh: jax.Array, vh: jax.Array, key_valid: jax.Array | None,
                 blocks: tuple[tuple[int, int, int, int], ...], g: int, window: int | None,
                 scale: float) -> jax.Array:
    """`attend_causal` on head-major inputs: qh `[batch, kv_heads, seq * g, head_dim]`, kh / vh `[batch,
    kv_heads, seq, head_dim]` -> `[batch, kv_heads, seq * g, head_dim]`."""
    return _causal_forward(qh, kh, vh, key_valid, blocks, g, window, scale)[0]


def _causal_forward(qh, kh, vh, key_valid, blocks, g, window, scale):
    """Output and residuals: (q, k, v, key_valid, the output, each row's score maximum and 1 / its sum of
    exponentials, `[batch, kv_heads, seq * g, 1]` float32)."""
    kt = jnp.swapaxes(kh, 2, 3)  # [batch, kv_heads, head_dim, seq]
    outs, maxes, inv_sums = [], [], []
    for block in blocks:
        q0, q1, k0, k1 = block
        scores = _block_scores(qh[:, :, q0 * g:q1 * g], kt, key_valid, block, g, window, scale)
        top = jnp.max(scores, axis=-1, keepdims=True)
        e = jnp.exp(scores - top)
        inv = 1.0 / jnp.sum(e, axis=-1, keepdims=True)
        outs.append(jnp.einsum("bkmt,bktd->bkmd", (e * inv).astype(vh.dtype), vh[:, :, k0:k1]))
        maxes.append(top)
        inv_sums.append(inv)
    out = _concat_rows(outs)
    return out, (qh, kh, vh, key_valid, out, _concat_rows(maxes), _concat_rows(inv_sums))


def _causal_backward(blocks, g, window, scale, residuals, d_out):
    """The FlashAttention backward, block by block: P = exp(S - max) / sum from the forward's statistics,
    dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = scale dS K, dK^T += scale Q^T dS, dV^T += dO^T P."""
    qh, kh, vh, key_valid, out, maxes, inv_sums = residuals
    kt, vt = jnp.swapaxes(kh, 2, 3), jnp.swapaxes(vh, 2, 3)  # [batch, kv_heads, head_dim, seq]
    qt, d_out_t = jnp.swapaxes(qh, 2, 3), jnp.swapaxes(d_out, 2, 3)  # [batch, kv_heads, head_dim, seq * g]
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    f32 = jnp.float32
    d_kt = jnp.zeros(kt.shape, f32)
    d_vt = jnp.zeros(vt.shape, f32)
    d_q = []
    for block in blocks:
        q0, q1, k0, k1 = block
        m0, m1 = q0 * g, q1 * g
        scores = _block_scores(qh[:, :, m0:m1], kt, key_valid, block, g, window, scale)
        probs = jnp.exp(scores - maxes[:, :, m0:m1]) * inv_sums[:, :, m0:m1]
        d_probs = jnp.einsum("bkmd,bkdt->bkmt", d_out[:, :, m0:m1], vt[..., k0:k1],
                             preferred_element_type=f32)
        d_scores = (probs * (d_probs - delta[:, :, m0:m1])).astype(qh.dtype)
        d_q.append(jnp.einsum("bkmt,bktd->bkmd", d_scores, kh[:, :, k0:k1],
                              preferred_element_type=f32) * scale)
        d_kt = d_kt.at[..., k0:k1].add(
            jnp.einsum("bkdm,bkmt->bkdt", qt[..., m0:m1], d_scores, preferred_element_type=f32) * scale)
        d_vt = d_vt.at[..., k0:k1].add(jnp.einsum(
            "bkdm,bkmt->bkdt", d_out_t[..., m0:m1], probs.astype(vh.dtype), preferred_element_type=f32))
    return (_concat_rows(d_q).astype(qh.dtype), jnp.swapaxes(d_kt, 2, 3).astype(kh.dtype),
            jnp.swapaxes(d_vt, 2, 3).astype(vh.dtype), None)


_causal_core.defvjp(_causal_forward, _causal_backward)


class Attention(nnx.Module):
    """Multi-head attention with GQA, RoPE (optionally partial), optional q/k RMSNorm, optional sliding
    window, optional sigmoid output gate (Qwen3.5), reading and writing a per-row KV cache."""

    def __init__(self, config: ModelConfig, layer_type: str, *, rngs: nnx.Rngs):
        e, h, kvh, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        q_width = h * d * (2 if config.attn_output_gate else 1)
        self.q_proj = dense(config, e, q_width, ("embed", "heads"), rngs)
        self.k_proj = dense(config, e, kvh * d, ("embed", "kv_heads"), rngs)
        self.v_proj = dense(config, e, kvh * d, ("embed", "kv_heads"), rngs)
        self.o_proj = dense(config, h * d, e, ("heads", "embed"), rngs)
        if config.qk_norm:
            norm = dict(eps=config.rms_norm_eps, plus_one=config.norm_plus_one,
                        param_dtype=config.jnp_param_dtype)
            self.q_norm = RMSNorm(d, **norm)
            self.k_norm = RMSNorm(d, **norm)
        self.qk_norm = config.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.gated = config.attn_output_gate
        self.window = config.sliding_window if layer_type == "sliding_attention" else None
        self.scale = (config.query_pre_attn_scalar or d) ** -0.5

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        *,
        mask: jax.Array,
        cache: dict[str, jax.Array] | None = None,
        lengths: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """Self-attention over the new tokens (and the cache when given).

        x `[batch, seq, hidden]`; rope = (cos, sin) `[batch, seq, rotary_dim // 2]`; mask bool `[batch, seq]`
        (True = real token, padding a suffix). Without a cache, token s sees tokens t <= s that are real.
        With `cache` = {"k": `[batch, kv_heads, head_dim, max_len]`, "v": `[batch, kv_heads, max_len,
        head_dim]`} (see `models.cache.Cache`; or, in a layer scan, K/V stacked `[batch, layers, ...]` and
        "layer": the int32 index of this layer's slice, written in place) and `lengths` int32 `[batch]`: new
        token t of row b is written at cache index lengths[b] + t (padded tokens and indices >= max_len are
        not written) and attends
        to cache indices <= lengths[b] + t. Sliding layers also drop keys whose index is `window` or more
        below the query's (HF: kv_idx > q_idx - sliding_window). Returns (y `[batch, seq, hidden]`, new cache
        or None).
        """
        b, s, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q = q.reshape(b, s, h, 2 * d)
            q, gate = q[..., :d], q[..., d:].reshape(b, s, h * d)
        q = q.reshape(b, s, h, d)
        k = self.k_proj(x).reshape(b, s, kvh, d)
        v = self.v_proj(x).reshape(b, s, kvh, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if cache is None:
            out = attend_causal(q, k, v, key_valid=mask, window=self.window, scale=self.scale)
            return self._output(out, gate), None

        keys_major = "values" in cache  # the "keys" layout (models.cache.LAYOUTS)
        max_len = cache["values"].shape[-3] if keys_major else cache["v"].shape[-2]
        q_key_idx = lengths[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [batch, seq]
        write_idx = jnp.where(mask, q_key_idx, max_len)  # padded tokens -> out of range -> dropped
        rows = jnp.arange(b)[:, None]
        # cache[b, :, (:,) write_idx[b, t]] = k[b, t]: the advanced indices (rows, write_idx) lead, so the
        # update is k as computed, `[batch, seq, kv_heads, head_dim]`, for every layout.
        layer = cache.get("layer")
        if keys_major:
            at = (rows, write_idx) if layer is None else (rows, layer, write_idx)
            new_cache = {name: cache[name].at[at].set(x.astype(cache[name].dtype), mode="drop")
                         for name, x in (("keys", k), ("values", v))}
            k, v = new_cache["keys"], new_cache["values"]
            if layer is not None:
                new_cache["layer"] = layer
                k = jax.lax.dynamic_index_in_dim(k, layer, 1, keepdims=False)
                v = jax.lax.dynamic_index_in_dim(v, layer, 1, keepdims=False)
        elif layer is None:
            new_cache = {
                "k": cache["k"].at[rows, :, :, write_idx].set(k.astype(cache["k"].dtype), mode="drop"),
                "v": cache["v"].at[rows, :, write_idx].set(v.astype(cache["v"].dtype), mode="drop"),
            }
            k, v = new_cache["k"], new_cache["v"]
        else:  # K/V of every layer of a scan group, stacked `[batch, layers, ...]`: write ours in place
            new_cache = {
                "k": cache["k"].at[rows, layer, :, :, write_idx].set(k.astype(cache["k"].dtype), mode="drop"),
                "v": cache["v"].at[rows, layer, :, write_idx].set(v.astype(cache["v"].dtype), mode="drop"),
                "layer": layer,
            }
            k = jax.lax.dynamic_index_in_dim(new_cache["k"], layer, 1, keepdims=False)
            v = jax.lax.dynamic_index_in_dim(new_cache["v"], layer, 1, keepdims=False)
        if k.dtype != q.dtype:
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        # every index <= q_key_idx was written by a real token of this row: no key_valid
        out = attend(q, k, v, q_key_idx, window=self.window, scale=self.scale, keys_major=keys_major)
        return self._output(out, gate), new_cache

    def _output(self, out: jax.Array, gate: jax.Array | None) -> jax.Array:
        """Attention output `[batch, seq, heads, head_dim]` (and the output gate `[batch, seq, heads *
        head_dim]` or None) -> o_proj `[batch, seq, hidden]`."""
        b, s = out.shape[:2]
        out = out.reshape(b, s, -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out)
