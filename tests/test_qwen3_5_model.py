"""The Qwen3.5 hybrid (Gated DeltaNet + gated full attention) end to end: HF logit parity, HF round trip,
and the cached prefill/decode path with padded rows.

Fixtures: tests/fixtures/golden/qwen3_5_*/, written by tests/make_golden_qwen3_5.py (torch); no torch here.
"""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from forward import cached, forward
from jax.sharding import Mesh
from safetensors.numpy import load_file

from librarian_jax.models import Transformer, cache_logical_axes, init_cache, load_hf, save_hf
from librarian_jax.models.partitioning import tree_shardings

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "golden")
FIXTURES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(GOLDEN, "qwen3_5_*")))


def params(model: Transformer) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


@pytest.mark.parametrize("folder", FIXTURES)
def test_logits_match_hf(folder):
    """fp32 logits of the whole hybrid model within 1e-4 of transformers' Qwen3_5ForCausalLM."""
    model = load_hf(os.path.join(GOLDEN, folder))
    assert model.config.model_type == "qwen3_5_text" and "linear_attention" in model.config.layer_types
    ref = np.load(os.path.join(GOLDEN, folder, "reference.npz"))
    graphdef, state = nnx.split(model)
    logits = forward(graphdef, state, jnp.asarray(ref["input_ids"]), None)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("folder", FIXTURES)
def test_load_save_load_is_exact(folder, tmp_path):
    """load_hf -> save_hf -> load_hf gives bit-identical params and config, and the HF tensors themselves."""
    first = load_hf(os.path.join(GOLDEN, folder))
    save_hf(first, str(tmp_path))
    second = load_hf(str(tmp_path))
    assert second.config == first.config
    a, b = params(first), params(second)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    original = load_file(os.path.join(GOLDEN, folder, "model.safetensors"))
    saved = load_file(str(tmp_path / "model.safetensors"))
    tied = first.config.tie_embeddings
    assert set(saved) == {k for k in original if not (tied and k == "lm_head.weight")}
    for key, tensor in saved.items():
        np.testing.assert_array_equal(tensor, original[key], err_msg=key)


def test_padded_prefill_then_decode_equals_full_forward():
    """Rows of different lengths: one padded prefill, then single-token decodes through the hybrid cache
    (conv/recurrent state + K/V) give the logits of a full uncached pass over each row's real tokens."""
    model = load_hf(os.path.join(GOLDEN, "qwen3_5_a"))
    graphdef, state = nnx.split(model)
    vocab = model.config.vocab_size
    prompt, lengths, steps = 80, np.array([80, 50]), 3
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (2, prompt + steps)).astype(np.int32)
    prompt_mask = np.arange(prompt)[None, :] < lengths[:, None]

    cache = init_cache(model.config, 2, prompt + steps)
    logits, cache = cached(graphdef, state, jnp.asarray(tokens[:, :prompt]), cache, jnp.asarray(prompt_mask))
    got = [np.asarray(logits)]
    for t in range(steps):  # row b's t-th generated token sits right after its own prompt
        step_tokens = tokens[np.arange(2), lengths + t][:, None]
        logits, cache = cached(graphdef, state, jnp.asarray(step_tokens), cache, None)
        got.append(np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + steps)

    # the same rows without a cache: row b is its prompt then its decoded tokens, right-padded
    full_tokens = np.zeros((2, prompt + steps), np.int32)
    for b in range(2):
        full_tokens[b, : lengths[b] + steps] = np.concatenate(
            [tokens[b, : lengths[b]], tokens[b, lengths[b] + np.arange(steps)]]
        )
    full_mask = np.arange(prompt + steps)[None, :] < (lengths + steps)[:, None]
    full = np.asarray(forward(graphdef, state, jnp.asarray(full_tokens), jnp.asarray(full_mask)))
    for b in range(2):
        n = lengths[b]
        np.testing.assert_allclose(got[0][b, :n], full[b, :n], atol=1e-4, rtol=0)
        for t in range(steps):
            np.testing.assert_allclose(got[1 + t][b, 0], full[b, n + t], atol=1e-4, rtol=0)


def test_sharded_hybrid_prefill_matches_hf():
    """On a (data 2, tensor 4) mesh the DeltaNet params, conv and recurrent state are split over `tensor` by
    their logical axes; a cached prefill still gives HF's logits."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/run.sh simulates them with XLA_FLAGS)")
    folder = os.path.join(GOLDEN, "qwen3_5_a")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 4), ("data", "fsdp", "tensor"))
    model = load_hf(folder, mesh=mesh)
    lin = model.layers[0].linear_attn
    assert lin.in_proj_qkv.kernel.get_value().sharding.spec[1] == "tensor"
    assert lin.conv1d.weight.get_value().sharding.spec[0] == "tensor"
    cache = init_cache(model.config, 2, 90)
    cache = jax.device_put(cache, tree_shardings(cache, cache_logical_axes(model.config), mesh))
    ref = np.load(os.path.join(folder, "reference.npz"))
    graphdef, state = nnx.split(model)
    logits, cache = cached(graphdef, state, jnp.asarray(ref["input_ids"]), cache, None)
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-4, rtol=0)
    assert cache.layers[0]["state"].sharding.spec[:2] == ("data", "tensor")
