"""Gated DeltaNet (Qwen3.5 linear attention) against HF transformers' outputs, and its own invariants.

Fixtures: tests/fixtures/golden/qwen3_5_*/, written by tests/make_golden_qwen3_5.py (torch); no torch here.
"""

from __future__ import annotations

import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from librarian_jax.models.config import ModelConfig
from librarian_jax.models.gated_deltanet import (
    CHUNK_SIZE,
    HF_PARAMS,
    RECURRENT_MAX_SEQ,
    GatedDeltaNet,
)

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "golden")
FIXTURES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(GOLDEN, "qwen3_5_*")))


def config_from_json(folder: str) -> ModelConfig:
    """The fields a DeltaNet layer reads, from a fixture's HF config.json (independent of hf_io)."""
    with open(os.path.join(GOLDEN, folder, "config.json")) as f:
        c = json.load(f)
    return ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], rms_norm_eps=c["rms_norm_eps"],
        layer_types=tuple(c["layer_types"]), model_type=c["model_type"],
        partial_rotary_factor=c["rope_parameters"]["partial_rotary_factor"],
        linear_num_key_heads=c["linear_num_key_heads"], linear_num_value_heads=c["linear_num_value_heads"],
        linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
        linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
    )


def load_layer(folder: str, index: int) -> GatedDeltaNet:
    """A DeltaNet layer filled from the fixture's safetensors through `HF_PARAMS` (as a loader would)."""
    config = config_from_json(folder)
    layer = nnx.eval_shape(lambda: GatedDeltaNet(config, rngs=nnx.Rngs(0)))  # no random init: filled below
    with safe_open(os.path.join(GOLDEN, folder, "model.safetensors"), "np") as f:
        for suffix, (path, transpose) in HF_PARAMS.items():
            tensor = f.get_tensor(f"model.layers.{index}.linear_attn.{suffix}")
            if transpose:
                tensor = tensor.T
            *parents, leaf = path.split(".")
            owner = functools.reduce(getattr, parents, layer)
            var = getattr(owner, leaf)
            assert var.get_value().shape == tensor.shape, (suffix, var.get_value().shape, tensor.shape)
            var.set_value(jnp.asarray(tensor))
    return layer


@functools.partial(jax.jit, static_argnums=(0, 5))
def apply(graphdef, state, x, cache, mask, mode="auto"):
    """One jitted call of the layer (graphdef static): `(y, new_cache)`."""
    return nnx.merge(graphdef, state)(x, cache=cache, mask=mask, mode=mode)


def close(actual, expected, atol: float) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=0)


def split(layer: GatedDeltaNet):
    return nnx.split(layer)


@pytest.fixture(scope="module")
def layer_a():
    """Fixture a's first DeltaNet layer (GQA 2 in the delta rule, dk 16 != dv 8, kernel 4)."""
    return split(load_layer("qwen3_5_a", 0))


def test_fixtures_present():
    assert FIXTURES == ["qwen3_5_a", "qwen3_5_b", "qwen3_5_c"]


@pytest.mark.parametrize("folder", FIXTURES)
def test_layer_matches_hf(folder):
    """Prefill output and cache, then two decode steps, equal HF's `Qwen3_5GatedDeltaNet` (fp32, 1e-4)."""
    ref = np.load(os.path.join(GOLDEN, folder, "linear_layer.npz"))
    index = int(ref["layer_index"])
    graphdef, state = split(load_layer(folder, index))
    config = config_from_json(folder)
    x = jnp.asarray(ref["x"])
    batch, seq = x.shape[:2]
    assert seq > CHUNK_SIZE and seq % CHUNK_SIZE  # several chunks, the last one partial

    y, cache = apply(graphdef, state, x, GatedDeltaNet.init_cache(config, batch), None)
    close(y, ref["y"], 1e-4)
    # HF keeps K columns of conv inputs; only the last K - 1 are ever read.
    close(cache["conv"], ref["conv_state"][..., 1:], 1e-5)
    close(cache["state"], ref["state"], 1e-4)

    ys = []
    for t in range(ref["x_decode"].shape[1]):
        y, cache = apply(graphdef, state, jnp.asarray(ref["x_decode"][:, t : t + 1]), cache, None)
        ys.append(np.asarray(y))
    close(np.concatenate(ys, 1), ref["y_decode"], 1e-4)
    close(cache["conv"], ref["conv_state_decode"][..., 1:], 1e-5)
    close(cache["state"], ref["state_decode"], 1e-4)
    assert cache["state"].dtype == jnp.float32


def test_chunked_equals_recurrent(layer_a):
    """The two evaluations of the delta rule agree, outputs and final state (3 chunks, last partial)."""
    graphdef, state = layer_a
    config = config_from_json("qwen3_5_a")
    x = jax.random.normal(jax.random.key(0), (2, 2 * CHUNK_SIZE + 11, config.hidden_size))  # 139 tokens
    cache0 = GatedDeltaNet.init_cache(config, 2)
    y_c, c_c = apply(graphdef, state, x, cache0, None, "chunk")
    y_r, c_r = apply(graphdef, state, x, cache0, None, "recurrent")
    assert float(jnp.abs(y_c).max()) > 0.1  # not a vacuous comparison
    close(y_c, y_r, 2e-5)
    close(c_c["state"], c_r["state"], 2e-5)
    np.testing.assert_array_equal(np.asarray(c_c["conv"]), np.asarray(c_r["conv"]))


def test_prefill_then_decode_equals_full_forward(layer_a):
    """Chunked prefill of a prefix, a second chunked prefill, then token-by-token decode == one full pass."""
    graphdef, state = layer_a
    config = config_from_json("qwen3_5_a")
    x = jax.random.normal(jax.random.key(1), (2, 90, config.hidden_size))
    full, _ = apply(graphdef, state, x, None, None)
    y1, cache = apply(graphdef, state, x[:, :37], GatedDeltaNet.init_cache(config, 2), None)
    y2, cache = apply(graphdef, state, x[:, 37:86], cache, None)
    ys = [y1, y2]
    for t in range(86, 90):
        y, cache = apply(graphdef, state, x[:, t : t + 1], cache, None)
        ys.append(y)
    close(jnp.concatenate(ys, 1), full, 2e-5)
    assert 49 > RECURRENT_MAX_SEQ  # the second prefill really is chunked


def test_padding_leaves_state_as_after_last_real_token(layer_a):
    """Right padding: outputs at real tokens, conv tail and state equal the unpadded row's; a row with no real
    token keeps its cache bit for bit; decoding after a padded prefill equals decoding after an exact one."""
    graphdef, state = layer_a
    config = config_from_json("qwen3_5_a")
    seq, n = 90, 37
    x = jax.random.normal(jax.random.key(2), (2, seq, config.hidden_size))
    start = jax.tree.map(
        lambda a: jax.random.normal(jax.random.key(3), a.shape, a.dtype), GatedDeltaNet.init_cache(config, 2)
    )
    mask = jnp.arange(seq)[None, :] < jnp.asarray([n, 0])[:, None]  # row 1: no real token at all
    y_pad, c_pad = apply(graphdef, state, x, start, mask)
    y_ref, c_ref = apply(graphdef, state, x[:, :n], start, None)  # row 0 without padding
    close(y_pad[0, :n], y_ref[0], 2e-5)
    close(c_pad["conv"][0], c_ref["conv"][0], 1e-6)
    close(c_pad["state"][0], c_ref["state"][0], 2e-5)
    np.testing.assert_array_equal(np.asarray(c_pad["conv"][1]), np.asarray(start["conv"][1]))
    np.testing.assert_array_equal(np.asarray(c_pad["state"][1]), np.asarray(start["state"][1]))

    x_next = jax.random.normal(jax.random.key(4), (2, 1, config.hidden_size))
    y_next_pad, c_next_pad = apply(graphdef, state, x_next, c_pad, None)
    y_next_ref, _ = apply(graphdef, state, x_next, c_ref, None)
    close(y_next_pad[0], y_next_ref[0], 2e-5)
    # padding in a decode step (an idle slot): mask False leaves that row's cache exactly as it was
    _, c_idle = apply(graphdef, state, x_next, c_pad, jnp.asarray([[True], [False]]))
    np.testing.assert_array_equal(np.asarray(c_idle["state"][1]), np.asarray(c_pad["state"][1]))
    np.testing.assert_array_equal(np.asarray(c_idle["conv"][1]), np.asarray(c_pad["conv"][1]))
    close(c_idle["conv"][0], c_next_pad["conv"][0], 1e-6)  # a 1-token conv tail: old columns shifted
    close(c_idle["state"][0], c_next_pad["state"][0], 1e-6)
    assert not np.array_equal(np.asarray(c_idle["state"][0]), np.asarray(c_pad["state"][0]))


def test_gradients_of_chunked_form_match_recurrent(layer_a):
    """Training differentiates the chunked form (a triangular solve): its gradients equal the recurrence's."""
    graphdef, state = layer_a
    config = config_from_json("qwen3_5_a")
    x = jax.random.normal(jax.random.key(5), (1, CHUNK_SIZE + 9, config.hidden_size))

    def loss(params, mode):
        y, _ = nnx.merge(graphdef, params)(x, mode=mode)
        return jnp.sum(jnp.sin(y))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_c, g_r = grad(state, "chunk"), grad(state, "recurrent")
    leaves = jax.tree_util.tree_leaves_with_path
    for (path, a), (_, b) in zip(leaves(g_c), leaves(g_r), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), path
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()), rtol=0, err_msg=str(path))
    assert np.abs(np.asarray(g_c["A_log"].get_value())).max() > 0


def test_params_cache_description_and_hf_map():
    """HF_PARAMS covers every parameter once; logical axes are set; cache_shapes/cache_axes agree."""
    config = config_from_json("qwen3_5_b")
    layer = nnx.eval_shape(lambda: GatedDeltaNet(config, rngs=nnx.Rngs(0)))
    params = nnx.state(layer, nnx.Param)
    paths = {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(params)}
    assert set(paths) == {p for p, _ in HF_PARAMS.values()}
    for name, var in paths.items():
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == var.get_value().ndim, name
    with safe_open(os.path.join(GOLDEN, "qwen3_5_b", "model.safetensors"), "np") as f:
        prefix = "model.layers.1.linear_attn."
        hf_suffixes = {k[len(prefix) :] for k in f.keys() if k.startswith(prefix)}
    assert hf_suffixes == set(HF_PARAMS)

    shapes = GatedDeltaNet.cache_shapes(config, 3)
    axes = GatedDeltaNet.cache_axes()
    assert set(shapes) == set(axes) == {"conv", "state"}
    conv_dim = 2 * 1 * 8 + 3 * 12
    assert shapes["conv"] == ((3, conv_dim, 2), jnp.dtype("float32"))
    assert shapes["state"] == ((3, 3, 8, 12), jnp.dtype("float32"))
    for name, (shape, _) in shapes.items():
        assert len(axes[name]) == len(shape)
    assert axes["conv"][:2] == ("cache_batch", "conv") and axes["state"][:2] == ("cache_batch", "lin_heads")


def test_bad_inputs_name_the_problem():
    config = config_from_json("qwen3_5_b")
    layer = nnx.eval_shape(lambda: GatedDeltaNet(config, rngs=nnx.Rngs(0)))  # inputs are checked before use
    x = jnp.zeros((2, 5, config.hidden_size))
    bad = GatedDeltaNet.init_cache(config, 2)
    bad["conv"] = jnp.zeros((2, 7, 2))
    with pytest.raises(ValueError, match=r"cache\['conv'\] shape \(2, 7, 2\) != expected \(2, 52, 2\)"):
        layer(x, cache=bad)
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\)"):
        layer(x, mask=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        GatedDeltaNet(config.replace(linear_num_key_heads=0, layer_types=("full_attention",) * 3),
                      rngs=nnx.Rngs(0))
