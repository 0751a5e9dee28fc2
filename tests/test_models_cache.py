"""Cached prefill in chunks + single-token decode == one full forward pass, row by row, with padding."""

from __future__ import annotations

import functools
import glob
import math
import os
import re

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from librarian_jax.models import Transformer, cache_logical_axes, get_preset, init_cache, init_model, load_hf

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "golden")
LENGTHS = (19, 7, 13)  # real tokens per row; every row ends at a different step
CHUNKS = (4, 4, 1)  # prefill width 4, again width 4 (row 1 all padding), then single-token decode


def _jit_call(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def call(state, tokens, cache, mask):
        return nnx.merge(graphdef, state)(tokens, cache=cache, mask=mask)

    return lambda tokens, cache=None, mask=None: call(state, tokens, cache, mask)


def _check_cached_equals_full(model, vocab: int, atol: float = 1e-4):
    rng = np.random.default_rng(0)
    b, total = len(LENGTHS), max(LENGTHS)
    tokens = rng.integers(0, vocab, (b, total)).astype(np.int32)
    real = np.arange(total)[None, :] < np.array(LENGTHS)[:, None]
    call = _jit_call(model)

    # reference: no cache, no padding (causal, so row i's first n logits are those of its n-token prefix)
    ref, none = call(jnp.asarray(tokens), None, jnp.ones((b, total), bool))
    assert none is None
    want = [np.asarray(ref)[i, :n] for i, n in enumerate(LENGTHS)]
    # full forward with right padding (garbage in the padded slots) and a mask gives the same real logits
    padded = np.where(real, tokens, rng.integers(0, vocab, tokens.shape)).astype(np.int32)
    full, _ = call(jnp.asarray(padded), None, jnp.asarray(real))
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(np.asarray(full)[i, :n], want[i], atol=atol, rtol=0)

    cache = init_cache(model.config, b, 32)
    got = [[] for _ in LENGTHS]
    done = np.zeros(b, np.int64)
    widths = [CHUNKS[0], CHUNKS[1]] + [CHUNKS[2]] * total
    step = 0
    while (done < np.array(LENGTHS)).any():
        w = widths[step]
        n_new = np.minimum(np.array(LENGTHS) - done, w)
        if step == 1:
            n_new[1] = 0  # a row that only carries padding this call
        mask = np.arange(w)[None, :] < n_new[:, None]
        chunk = np.stack([np.pad(tokens[i, done[i]:done[i] + w], (0, max(0, w - (total - done[i]))))
                          for i in range(b)])
        chunk = np.where(mask, chunk[:, :w], rng.integers(0, vocab, (b, w))).astype(np.int32)
        logits, cache = call(jnp.asarray(chunk), cache, jnp.asarray(mask))
        for i in range(b):
            got[i].extend(np.asarray(logits)[i, :n_new[i]])
        done += n_new
        np.testing.assert_array_equal(np.asarray(cache.lengths), done)
        step += 1
    for i in range(b):
        np.testing.assert_allclose(np.stack(got[i]), want[i], atol=atol, rtol=0, err_msg=f"row {i}")


@pytest.mark.parametrize("name", ["gemma3", "llama3"])
def test_chunked_prefill_and_decode_match_full_forward(name):
    """Gemma 3 (window 8 < 19 tokens, post norms, softcap) and Llama 3 with real (golden) weights."""
    model = load_hf(os.path.join(GOLDEN, name))
    _check_cached_equals_full(model, model.config.vocab_size)


def test_hybrid_qwen3_5_cache_matches_full_forward():
    """Qwen3.5 hybrid: gated partial-rotary attention + Gated DeltaNet state through the same cache."""
    folders = sorted(glob.glob(os.path.join(GOLDEN, "qwen3_5*")))
    if not folders:
        pytest.skip("no qwen3_5 golden fixture")
    model = load_hf(folders[0])
    _check_cached_equals_full(model, model.config.vocab_size, atol=2e-4)


def test_tiny_preset_bf16_and_cache_tree():
    config = get_preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
    model = Transformer(config, rngs=nnx.Rngs(0))
    assert model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    cache = init_cache(config, 2, 16)
    axes = cache_logical_axes(config)
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)
    assert jax.tree.structure(cache) == jax.tree.structure(axes, is_leaf=is_axes)
    assert cache.layers[0]["k"].shape == (2, 2, 32, 16) and cache.layers[0]["k"].dtype == jnp.bfloat16
    assert axes.layers[0]["k"] == ("cache_batch", "kv_heads", "head_dim", "cache_seq")
    assert cache.layers[0]["v"].shape == (2, 2, 16, 32)
    assert axes.layers[0]["v"] == ("cache_batch", "kv_heads", "cache_seq", "head_dim")
    call = _jit_call(model)
    tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    logits, cache = call(tokens, cache, jnp.ones((2, 5), bool))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 5, config.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(cache.lengths), [5, 5])


def test_query_blocked_attention_equals_dense():
    """Long inputs go through query blocks; same result (and gradient) as one dense block."""
    from librarian_jax.models.layers import attend

    rng = np.random.default_rng(1)
    b, s, t = 2, 11, 16
    q = jnp.asarray(rng.normal(size=(b, s, 4, 8)), jnp.float32)
    kt = jnp.asarray(rng.normal(size=(b, 2, 8, t)), jnp.float32)  # [batch, kv_heads, head_dim, keys]
    v = jnp.asarray(rng.normal(size=(b, 2, t, 8)), jnp.float32)
    q_key_idx = jnp.asarray([[3], [5]]) + jnp.arange(s)[None, :]
    key_valid = jnp.asarray(np.arange(t)[None, :] < np.array([[14], [16]]))

    @functools.partial(jax.jit, static_argnums=1)
    def value_and_grad(q, block):
        f = lambda q: attend(q, kt, v, q_key_idx, key_valid=key_valid, window=5, scale=0.3, block=block)
        out, vjp = jax.vjp(f, q)
        return out, vjp(jnp.cos(out))[0]

    out_blocked, g_blocked = value_and_grad(q, 4)
    out_dense, g_dense = value_and_grad(q, 64)
    np.testing.assert_allclose(np.asarray(out_blocked), np.asarray(out_dense), atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_blocked), np.asarray(g_dense), atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_causal_blocked_attention_equals_dense(window):
    """The no-cache path's static causal blocks (each reading only the keys it can see): same output and
    gradients (q, k, v) as one dense block over every key, with padding and a sliding window."""
    from librarian_jax.models.layers import attend, attend_causal, causal_blocks

    rng = np.random.default_rng(2)
    b, s, h, kvh, d = 2, 23, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32)
    key_valid = jnp.asarray(np.arange(s)[None, :] < np.array([[17], [23]]))
    # 5 blocks of 5 (the last of 3) with window 5: later blocks skip the keys below their window
    blocks = causal_blocks(s, window, max_blocks=5, min_block=4)
    assert [x[:2] for x in blocks] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert blocks[-1][2] == (0 if window is None else 16)

    def dense(q, k, v):
        idx = jnp.broadcast_to(jnp.arange(s), (b, s))
        return attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), idx, key_valid=key_valid,
                      window=window, scale=0.3)

    def blocked(q, k, v):
        return attend_causal(q, k, v, key_valid=key_valid, window=window, scale=0.3, max_blocks=5,
                             min_block=4)

    # a padded query with no visible key (row 0's last ones, window 5) averages other keys in each version:
    # compared at real queries, whose outputs alone reach a loss
    real = np.asarray(key_valid)[:, :, None, None]

    def out_and_grads(f):  # one jitted program (op by op, the blocks' many small ops took 10+ s)
        def run(q, k, v):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(jnp.cos(out) * real)
        return jax.jit(run)(q, k, v)

    ref_out, ref_grads = out_and_grads(dense)
    out, grads = out_and_grads(blocked)
    np.testing.assert_allclose(np.asarray(out) * real, np.asarray(ref_out) * real, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5)


def _elements(shape: str) -> int:
    dims = re.search(r"\[([\d,]*)\]", shape)
    return int(np.prod([int(x) for x in dims.group(1).split(",") if x])) if dims else 0


def test_causal_attention_backward_reorders_no_score_array():
    """The hand-written backward (`_causal_core`) reads every product's operands in their natural layout:
    the compiled forward + backward transposes or copies nothing as large as a block's scores (JAX's
    autodiff of the same blocks transposed the probabilities and score gradients of every block)."""
    from librarian_jax.models.layers import attend_causal, causal_blocks

    b, s, h, kvh, d = 2, 256, 4, 2, 8
    # the smallest block's scores hold b * kvh * (64 * 2) * 64 = 32K elements; q, k, v, outputs <= 16K
    smallest = min(b * kvh * (q1 - q0) * (h // kvh) * (k1 - k0) for q0, q1, k0, k1 in causal_blocks(s))
    assert smallest > b * s * h * d
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.float32)
    valid = jax.ShapeDtypeStruct((b, s), jnp.bool_)

    def loss(q, k, v, valid):
        return jnp.sum(jnp.cos(attend_causal(q, k, v, key_valid=valid, scale=0.3)))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile().as_text()
    moved = [line.strip()[:160] for line in hlo.splitlines()
             if "=" in line and any(k in line.split("=")[0] for k in ("transpose", "copy"))
             and _elements(line.split("=")[1]) >= smallest]
    assert not moved, moved


def test_causal_attention_gradient_in_bfloat16():
    """bf16 inputs (the paper presets' dtype): outputs and q/k/v gradients of the blocked attention within
    bf16 rounding of the float32 dense reference, in bf16."""
    from librarian_jax.models.layers import attend, attend_causal

    rng = np.random.default_rng(3)
    b, s, h, kvh, d = 2, 150, 4, 2, 16
    args32 = [jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32) for n in (h, kvh, kvh)]
    key_valid = jnp.asarray(np.arange(s)[None, :] < np.array([[150], [97]]))
    real = np.asarray(key_valid)[:, :, None, None]
    cot = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) * real

    def dense(q, k, v):
        idx = jnp.broadcast_to(jnp.arange(s), (b, s))
        return attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), idx, key_valid=key_valid,
                      scale=0.25)

    def out_and_grads(f, args, cot):  # one jitted program each (op by op took 20+ s)
        out, vjp = jax.vjp(f, *args)
        return out, vjp(cot)

    ref_out, ref_grads = jax.jit(out_and_grads, static_argnums=0)(dense, args32, cot)
    blocked = functools.partial(attend_causal, key_valid=key_valid, scale=0.25, min_block=16)
    out, grads = jax.jit(out_and_grads, static_argnums=0)(
        blocked, [x.astype(jnp.bfloat16) for x in args32], cot.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    err = np.abs(np.asarray(out, np.float32) - np.asarray(ref_out)) * real
    assert err.max() < 0.05, err.max()
    for g, r in zip(grads, ref_grads, strict=True):
        r = np.asarray(r)
        assert np.abs(np.asarray(g, np.float32) - r).max() < 0.03 * np.abs(r).max()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host_platform_device_count=8)")
def test_init_model_creates_params_in_their_shardings():
    config = get_preset("tiny", num_layers=1)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = init_model(config, seed=0, mesh=mesh)
    emb = model.embed_tokens.embedding[...]
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert {x.data.shape for x in emb.addressable_shards} == {(2048 // 4, 128)}
    down = model.layers[0].mlp.down_proj.kernel[...]
    assert down.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert float(jnp.std(emb)) == pytest.approx(0.02, rel=0.1)


def test_decode_drops_padded_and_out_of_range_writes_and_reads_cache_in_place():
    """One decode step (batch 3, seq 1) with a row that is padding and a row whose cache is full: neither
    write lands (and nothing raises), the real row's write does; the compiled step never copies or
    transposes a cache-sized buffer (K/V are read where they are stored)."""
    config = get_preset("tiny", num_layers=1, vocab_size=64, dtype="float32", param_dtype="float32")
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    max_len = 7  # K/V element count (3 * 2 * 32 * 7) differs from every activation's

    def step(state, tokens, cache, mask):
        return nnx.merge(graphdef, state)(tokens, cache=cache, mask=mask)

    rng = np.random.default_rng(0)
    cache = init_cache(config, 3, max_len)
    k0, v0 = (jnp.asarray(rng.normal(size=cache.layers[0][n].shape), jnp.float32) for n in ("k", "v"))
    cache = cache.replace(lengths=jnp.asarray([2, 3, max_len], jnp.int32), layers=({"k": k0, "v": v0},))
    k0, v0 = np.asarray(k0), np.asarray(v0)
    tokens, mask = jnp.asarray([[5], [6], [7]], jnp.int32), jnp.asarray([[True], [False], [True]])
    compiled = jax.jit(step, donate_argnums=2).lower(state, tokens, cache, mask).compile()  # as the engine
    _, new = compiled(state, tokens, cache, mask)

    np.testing.assert_array_equal(np.asarray(new.lengths), [3, 3, max_len + 1])
    k1, v1 = np.asarray(new.layers[0]["k"]), np.asarray(new.layers[0]["v"])  # [b, kvh, d, T], [b, kvh, T, d]
    np.testing.assert_array_equal(k1[1:], k0[1:])  # padded row and full row: untouched
    np.testing.assert_array_equal(v1[1:], v0[1:])
    changed_k = np.nonzero((k1[0] != k0[0]).any(axis=(0, 1)))[0]
    changed_v = np.nonzero((v1[0] != v0[0]).any(axis=(0, 2)))[0]
    assert changed_k.tolist() == [2] and changed_v.tolist() == [2]  # row 0 wrote at its length only

    # any copy/transpose of as many elements as a K/V leaf, in whatever shape (the old layout transposed the
    # cache to [batch, kv_heads, len, head_dim] on every step)
    moved = [line.strip() for line in compiled.as_text().splitlines()
             if (m := re.search(r"= \w+\[([\d,]+)\]\S* (?:copy|transpose)\(", line))
             and math.prod(int(x) for x in m.group(1).split(",")) == k0[0].size * 3]
    assert not moved, "\n".join(moved)
