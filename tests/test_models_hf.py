"""HF parity, checkpoint round trip, mesh loading and bad-input errors for the model families."""

from __future__ import annotations

import json
import os
import shutil

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from librarian_jax.models import (
    DEFAULT_RULES,
    config_from_hf,
    config_to_hf,
    get_preset,
    load_hf,
    save_hf,
)
from librarian_jax.models.partitioning import logical_to_spec

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "golden")
FAMILIES = ["qwen3_tied", "qwen3_untied", "gemma3", "llama3"]


def _forward(model, ids):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids):
        logits, _ = nnx.merge(graphdef, state)(ids)
        return logits

    return np.asarray(run(state, jnp.asarray(ids)))


@pytest.mark.parametrize("name", FAMILIES)
def test_fp32_logits_match_hf_reference(name):
    ref = np.load(os.path.join(GOLDEN, name, "reference.npz"))
    model = load_hf(os.path.join(GOLDEN, name), dtype=jnp.float32)
    logits = _forward(model, ref["input_ids"])
    assert logits.dtype == np.float32
    assert logits.shape == ref["logits"].shape
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


def test_configs_read_family_switches():
    gemma = config_from_hf(json.load(open(os.path.join(GOLDEN, "gemma3", "config.json"))))
    sliding, full = "sliding_attention", "full_attention"
    assert gemma.layer_types == (sliding, sliding, full, sliding)
    assert (gemma.sliding_window, gemma.query_pre_attn_scalar) == (8, 24.0)
    assert gemma.final_logit_softcapping == 30.0
    assert (gemma.rope_type, gemma.rope_factor, gemma.rope_local_theta) == ("linear", 2.0, 10_000.0)
    assert gemma.norm_plus_one and gemma.post_norms and gemma.embed_scale and gemma.activation == "gelu_tanh"
    llama = config_from_hf(json.load(open(os.path.join(GOLDEN, "llama3", "config.json"))))
    assert (llama.rope_type, llama.rope_factor, llama.rope_original_max_position) == ("llama3", 8.0, 64)
    assert not llama.qk_norm and not llama.tie_embeddings
    # multimodal Qwen3.5 layout: the text part of a nested config, top-level tie flag
    qwen35 = config_from_hf({
        "model_type": "qwen3_5", "tie_word_embeddings": True,
        "text_config": {"model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64,
                        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
                        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}},
    })
    assert qwen35.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert qwen35.tie_embeddings and qwen35.attn_output_gate and qwen35.rotary_dim == 8
    assert qwen35.rope_theta == 1e7
    # google/gemma-3-4b-it's published config.json leaves most text fields to the HF class defaults
    gemma_4b = config_from_hf({
        "model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"},
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
    }, dtype="bfloat16")
    assert gemma_4b == get_preset("gemma3_4b")
    # every preset survives config_to_hf -> config_from_hf
    for preset in ("qwen3_4b", "gemma3_4b", "llama3_2_1b", "qwen3_5_4b"):
        cfg = get_preset(preset)
        assert config_from_hf(config_to_hf(cfg), dtype=cfg.dtype) == cfg, preset


@pytest.mark.parametrize("name", ["qwen3_tied", "gemma3", "llama3"])
def test_load_save_load_is_exact(name, tmp_path):
    src = os.path.join(GOLDEN, name)
    model = load_hf(src)
    save_hf(model, str(tmp_path))
    # the written tensors are the original ones, bit for bit, under the same names
    original = load_file(os.path.join(src, "model.safetensors"))
    written = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(written) == set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    again = load_hf(str(tmp_path))
    for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again)),
                                  strict=True):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(v1.get_value()), np.asarray(v2.get_value()))


def test_save_shards_with_index_and_loads_back(tmp_path):
    model = load_hf(os.path.join(GOLDEN, "qwen3_untied"))
    save_hf(model, str(tmp_path), max_shard_bytes=200_000)
    index = json.load(open(os.path.join(tmp_path, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(os.path.exists(os.path.join(tmp_path, f)) for f in files)
    again = load_hf(str(tmp_path))
    ids = np.load(os.path.join(GOLDEN, "qwen3_untied", "reference.npz"))["input_ids"]
    np.testing.assert_array_equal(_forward(again, ids), _forward(model, ids))


def test_bf16_load_runs_with_float32_logits():
    model = load_hf(os.path.join(GOLDEN, "gemma3"), dtype=jnp.bfloat16)
    assert model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    ref = np.load(os.path.join(GOLDEN, "gemma3", "reference.npz"))
    logits = _forward(model, ref["input_ids"])
    assert logits.dtype == np.float32
    assert np.abs(logits - ref["logits"]).max() < 0.5  # bf16 is close, not exact


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host_platform_device_count=8)")
def test_mesh_load_shards_params_and_matches():
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    name = "qwen3_untied"
    ref = np.load(os.path.join(GOLDEN, name, "reference.npz"))
    model = load_hf(os.path.join(GOLDEN, name), mesh=mesh)
    q = model.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    # each device holds a quarter of the kernel, not a full copy
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 4)}
    head = model.lm_head.kernel[...]
    assert head.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    logits = _forward(model, ref["input_ids"])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


def test_logical_to_spec_drops_missing_and_non_dividing_axes():
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    assert logical_to_spec(("embed", "heads"), mesh, DEFAULT_RULES) == P(None, None)  # one device: no split
    fake = type("M", (), {"shape": {"data": 2, "tensor": 4}})()
    assert logical_to_spec(("embed", "heads"), fake, DEFAULT_RULES) == P(None, "tensor")  # no "fsdp" axis
    assert logical_to_spec(("kv_heads", "head_dim"), fake, shape=(2, 8)) == P(None, None)  # 4 !| 2
    assert logical_to_spec(("cache_batch", "kv_heads"), fake, shape=(4, 8)) == P("data", "tensor")


# ------------------------------------------------------------------------------------------ bad input


def _copy(name, tmp_path):
    dst = os.path.join(tmp_path, name)
    shutil.copytree(os.path.join(GOLDEN, name), dst)
    return dst


def test_unknown_model_type_raises(tmp_path):
    folder = _copy("qwen3_tied", tmp_path)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["model_type"] = "bert"
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(ValueError, match="unknown model_type 'bert'"):
        load_hf(folder)


def test_missing_tensor_names_key_and_shapes(tmp_path):
    folder = _copy("llama3", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(128, 64\).*\(64, 128\)"):
        load_hf(folder)


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    folder = _copy("gemma3", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.2.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(48, 64\).*\(64, 32\)"):
        load_hf(folder)


def test_multimodal_prefix_is_read_and_extras_ignored(tmp_path):
    folder = _copy("qwen3_untied", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.weight"] = np.zeros((4, 4), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    os.remove(path)
    save_file(renamed, path, metadata={"format": "pt"})
    ref = np.load(os.path.join(GOLDEN, "qwen3_untied", "reference.npz"))
    np.testing.assert_allclose(_forward(load_hf(folder), ref["input_ids"]), ref["logits"], atol=1e-4, rtol=0)
