"""Hugging Face checkpoints: config.json <-> ModelConfig, safetensors <-> Transformer parameters.

`load_hf` builds the model abstractly (`nnx.eval_shape`) and fills every parameter from the (possibly sharded)
safetensors files, one tensor at a time, straight to its NamedSharding when a mesh is given, so a large model
is never randomly initialised nor fully copied onto every device. `save_hf` writes HF names and layouts
(`[out, in]` linear weights), so transformers' `from_pretrained` loads the folder.

Qwen3.5-MoE routed experts are read from either layout a checkpoint uses: fused 3-d tensors
`mlp.experts.gate_up_proj` `[experts, 2 * moe, hidden]` / `mlp.experts.down_proj` `[experts, hidden, moe]`
(the published Qwen3.5-35B-A3B files, and transformers' in-memory layout) or per-expert
`mlp.experts.{j}.{gate,up,down}_proj.weight` (what transformers' `save_pretrained` writes); `save_hf` writes
either (`expert_layout`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from librarian_jax.models.config import ModelConfig
from librarian_jax.models.gated_deltanet import HF_PARAMS
from librarian_jax.models.moe import bind_mesh
from librarian_jax.models.partitioning import Rules, named_sharding, variable_axes
from librarian_jax.models.transformer import Transformer

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "gemma3_text", "gemma3", "qwen3_5_text", "qwen3_5",
                         "qwen3_5_moe_text", "qwen3_5_moe")
_MULTIMODAL = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
# transformers' config-class defaults for fields a config.json may omit (Gemma 3 multimodal text_configs do).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(vocab_size=151_936, hidden_size=4096, intermediate_size=22_016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32_768),
    "llama": dict(vocab_size=32_000, hidden_size=4096, intermediate_size=11_008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048),
    "gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        max_position_embeddings=131_072, query_pre_attn_scalar=256, sliding_window=4096,
                        hidden_activation="gelu_pytorch_tanh"),
    "qwen3_5_text": dict(vocab_size=248_320, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=32,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                         max_position_embeddings=32_768),
    "qwen3_5_moe_text": dict(vocab_size=248_320, hidden_size=2048, num_hidden_layers=40,
                             num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                             max_position_embeddings=32_768,
                             moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
                             num_experts_per_tok=8, tie_word_embeddings=False),
}
_POSITIVE_INTS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "hidden_size", "intermediate_size", "head_dim", "max_position_embeddings")
# safetensors dtype names of weights a quantised checkpoint stores (int weights, fp8, packed 4-bit)
_QUANTISED = ("I8", "U8", "I4", "U4", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4")
_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_EMBED_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


# ----------------------------------------------------------------------------------------------- config


def _rope_block(d: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of a config dict in either HF v5 (`rope_parameters`) or v4 (`rope_theta`,
    `rope_scaling`) form, for one layer type when the model keeps them per layer type (Gemma 3)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        return dict(params[layer_type] or {})
    if isinstance(params, dict) and layer_type is None and "rope_theta" in params:
        return dict(params)
    block: dict[str, Any] = {}
    if d.get("rope_scaling"):
        block.update(d["rope_scaling"])
    if layer_type == "sliding_attention":
        block = {"rope_type": "default"}
        if "rope_local_base_freq" in d:
            block["rope_theta"] = d["rope_local_base_freq"]
    elif "rope_theta" in d:
        block["rope_theta"] = d["rope_theta"]
    return block


def _rope_fields(block: dict[str, Any], default_theta: float) -> dict[str, Any]:
    rope_type = block.get("rope_type", block.get("type", "default")) or "default"
    out: dict[str, Any] = {"rope_theta": float(block.get("rope_theta", default_theta))}
    if rope_type == "default":
        return out
    if rope_type == "linear":
        return out | {"rope_type": "linear", "rope_factor": float(block["factor"])}
    if rope_type == "llama3":
        return out | {
            "rope_type": "llama3", "rope_factor": float(block["factor"]),
            "rope_low_freq_factor": float(block["low_freq_factor"]),
            "rope_high_freq_factor": float(block["high_freq_factor"]),
            "rope_original_max_position": int(block["original_max_position_embeddings"]),
        }
    raise NotImplementedError(
        f"config.json: rope_type {rope_type!r} is not supported (default, linear, llama3)"
    )


def _activation(d: dict[str, Any]) -> str:
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if act == "silu":
        return "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise NotImplementedError(f"config.json: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")


def config_from_hf(d: dict[str, Any], *, dtype: Any = "float32", param_dtype: Any = None) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (qwen3, llama, gemma3_text / gemma3 text part,
    qwen3_5_text / qwen3_5 text part, qwen3_5_moe_text / qwen3_5_moe text part)."""
    d, model_type, tie = _text_config(d)
    _check_supported(d, model_type)
    n_layers = int(d["num_hidden_layers"])
    heads = int(d["num_attention_heads"])
    fields: dict[str, Any] = dict(
        vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_layers=n_layers, num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), tie_embeddings=tie, model_type=model_type,
        max_position_embeddings=int(d.get("max_position_embeddings", 32_768)), activation=_activation(d),
        dtype=jnp.dtype(dtype).name, param_dtype=jnp.dtype(param_dtype or dtype).name,
    )
    if model_type in ("qwen3", "llama"):
        fields |= _dense_fields(d, model_type, n_layers)
    elif model_type == "gemma3_text":
        fields |= _gemma3_fields(d, n_layers)
    else:  # qwen3_5_text, qwen3_5_moe_text
        fields |= _qwen3_5_fields(d, model_type, n_layers)
    return ModelConfig(**fields)


def _text_config(d: dict[str, Any]) -> tuple[dict[str, Any], str, bool]:
    """(the text model's fields with transformers' defaults filled in, its model_type, tied embeddings) of
    a config.json: a multimodal one's `text_config`, the tie flag read where each family keeps it."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    top = d
    if model_type in _MULTIMODAL:
        if "text_config" not in d:
            raise ValueError(f"config.json: model_type {model_type!r} needs a 'text_config' entry")
        d = dict(d["text_config"])
        tie_default = model_type == "gemma3"
        tie = bool(top.get("tie_word_embeddings", d.get("tie_word_embeddings", tie_default)))
        model_type = _MULTIMODAL[model_type]
    else:
        tie = bool(d.get("tie_word_embeddings", model_type == "gemma3_text"))
    defaults = _HF_DEFAULTS[model_type]
    if model_type == "qwen3_5_moe_text":
        tie = bool(d.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
        # no dense MLP: intermediate_size (unused) mirrors the experts' width
        d = dict(d, intermediate_size=d.get("intermediate_size") or
                 d.get("moe_intermediate_size", defaults["moe_intermediate_size"]))
    d = defaults | {k: v for k, v in d.items() if v is not None or k not in defaults}
    return d, model_type, tie


def _check_supported(d: dict[str, Any], model_type: str) -> None:
    """Refuses what the models do not implement (NotImplementedError) and malformed or missing sizes
    (ValueError), each naming the field."""
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise NotImplementedError(f"config.json: {key}=true is not supported")
    if d.get("use_sliding_window") and model_type == "qwen3":
        raise NotImplementedError("config.json: use_sliding_window=true is not supported for qwen3")
    if d.get("use_bidirectional_attention"):
        raise NotImplementedError("config.json: use_bidirectional_attention=true is not supported")

    for key in _POSITIVE_INTS:
        if key not in d:
            continue
        v = d[key]
        if v is None and key in ("num_key_value_heads", "head_dim"):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.json: {key} must be an integer >= 1, got {v!r}")
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "vocab_size", "hidden_size",
                           "intermediate_size") if k not in d]
    if missing:
        raise ValueError(f"config.json: missing field {missing[0]!r}")


def _dense_fields(d: dict[str, Any], model_type: str, n_layers: int) -> dict[str, Any]:
    """qwen3 / llama: full attention in every layer (qk-norm for qwen3)."""
    layer_types = d.get("layer_types")
    fields = _rope_fields(_rope_block(d), 10_000.0)
    fields |= dict(qk_norm=model_type == "qwen3", layer_types=("full_attention",) * n_layers)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(f"config.json: layer_types {sorted(set(layer_types))} for {model_type}")
    return fields


def _gemma3_fields(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """gemma3_text: sliding and full attention layers (each with its rope), Gemma's norms and scalings."""
    layer_types = d.get("layer_types")
    if not layer_types:
        every = int(d.get("sliding_window_pattern", 6))
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)
        ]
    local = _rope_block(d, "sliding_attention")
    if local.get("rope_type", "default") != "default":
        raise NotImplementedError(f"config.json: sliding-layer rope {local} is not supported")
    if d.get("attn_logit_softcapping"):
        logging.warning("config.json: attn_logit_softcapping is ignored (HF Gemma 3 does not apply it)")
    fields = _rope_fields(_rope_block(d, "full_attention"), 1_000_000.0)
    fields |= dict(
        layer_types=tuple(layer_types), sliding_window=int(d.get("sliding_window") or 4096),
        rope_local_theta=float(local.get("rope_theta", 10_000.0)), qk_norm=True, norm_plus_one=True,
        post_norms=True, embed_scale=True,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=d.get("final_logit_softcapping"),
    )
    return fields


def _qwen3_5_fields(d: dict[str, Any], model_type: str, n_layers: int) -> dict[str, Any]:
    """qwen3_5_text / qwen3_5_moe_text: Gated DeltaNet and gated full attention layers (the MoE's experts)."""
    fields: dict[str, Any] = {}
    if model_type == "qwen3_5_moe_text":
        if d.get("mlp_only_layers") or int(d.get("decoder_sparse_step", 1)) != 1:
            raise NotImplementedError("config.json: qwen3_5_moe with dense (mlp_only) layers")
        fields |= dict(
            num_experts=int(d["num_experts"]), num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
        )
        if not d.get("norm_topk_prob", True):
            raise NotImplementedError("config.json: norm_topk_prob=false in qwen3_5_moe: not supported")
    layer_types = d.get("layer_types")
    if not layer_types:
        every = int(d.get("full_attention_interval", 4))
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)
        ]
    rope = _rope_block(d)
    partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    fields |= _rope_fields(rope, 10_000.0)
    fields |= dict(
        layer_types=tuple(layer_types), qk_norm=True, norm_plus_one=True,
        attn_output_gate=bool(d.get("attn_output_gate", True)), partial_rotary_factor=partial,
        linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
    )
    return fields


def _rope_params_hf(config: ModelConfig) -> dict[str, Any]:
    block: dict[str, Any] = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type == "linear":
        block["factor"] = config.rope_factor
    elif config.rope_type == "llama3":
        block |= dict(factor=config.rope_factor, low_freq_factor=config.rope_low_freq_factor,
                      high_freq_factor=config.rope_high_freq_factor,
                      original_max_position_embeddings=config.rope_original_max_position)
    return block


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json dict (transformers v5 form) for `config`."""
    mt = config.model_type
    if mt not in _ARCHITECTURES:
        raise ValueError(f"save_hf: ModelConfig.model_type {mt!r} is not one of {sorted(_ARCHITECTURES)}")
    d: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[mt]], "model_type": mt, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "dtype": config.param_dtype, "layer_types": list(config.layer_types),
    }
    act = "silu" if config.activation == "silu" else "gelu_pytorch_tanh"
    if mt == "gemma3_text":
        d |= {
            "hidden_activation": act, "sliding_window": config.sliding_window,
            "query_pre_attn_scalar": _int_if_whole(config.query_pre_attn_scalar),
            "final_logit_softcapping": config.final_logit_softcapping,
            "rope_parameters": {
                "full_attention": _rope_params_hf(config),
                "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta},
            },
        }
    else:
        d["hidden_act"] = act
        d["rope_parameters"] = _rope_params_hf(config)
    if mt == "llama":
        d["mlp_bias"] = False
    if mt == "qwen3_5_moe_text":
        del d["intermediate_size"]  # no dense MLP in this family (transformers' config has no such key)
        d |= {
            "num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            "router_aux_loss_coef": 0.001, "output_router_logits": False,
        }
    if mt in ("qwen3_5_text", "qwen3_5_moe_text"):
        d["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
        d |= {
            "partial_rotary_factor": config.partial_rotary_factor,
            "attn_output_gate": config.attn_output_gate,
            "linear_num_key_heads": config.linear_num_key_heads,
            "linear_num_value_heads": config.linear_num_value_heads,
            "linear_key_head_dim": config.linear_key_head_dim,
            "linear_value_head_dim": config.linear_value_head_dim,
            "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        }
    return d


# ----------------------------------------------------------------------------------------------- names


def hf_param_names(config: ModelConfig) -> dict[tuple[Any, ...], tuple[str, bool | str]]:
    """nnx parameter path -> (HF tensor name without the "model." prefix, conversion).

    The conversion is True / False (transpose the last two axes or not) or, for the routed experts of an MoE
    layer, "gate_up" / "down" (name is then the fused tensor; see `_read_experts` for both layouts).
    The embedding is "embed_tokens.weight" and the untied head "lm_head.weight" (kept without prefix).
    """
    names: dict[tuple[Any, ...], tuple[str, bool]] = {
        ("embed_tokens", "embedding"): ("embed_tokens.weight", False),
        ("norm", "weight"): ("norm.weight", False),
    }
    if not config.tie_embeddings:
        names[("lm_head", "kernel")] = ("lm_head.weight", True)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.post_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i, layer_type in enumerate(config.layer_types):
        pre = f"layers.{i}."
        for n in norms:
            names[("layers", i, n, "weight")] = (f"{pre}{n}.weight", False)
        if config.num_experts:
            names[("layers", i, "mlp", "gate", "kernel")] = (f"{pre}mlp.gate.weight", True)
            names[("layers", i, "mlp", "experts", "gate_up_proj")] = (
                f"{pre}mlp.experts.gate_up_proj", "gate_up")
            names[("layers", i, "mlp", "experts", "down_proj")] = (f"{pre}mlp.experts.down_proj", "down")
            if config.shared_expert_intermediate_size:
                for p in ("gate_proj", "up_proj", "down_proj"):
                    names[("layers", i, "mlp", "shared_expert", p, "kernel")] = (
                        f"{pre}mlp.shared_expert.{p}.weight", True)
                names[("layers", i, "mlp", "shared_expert_gate", "kernel")] = (
                    f"{pre}mlp.shared_expert_gate.weight", True)
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                names[("layers", i, "mlp", p, "kernel")] = (f"{pre}mlp.{p}.weight", True)
        if layer_type == "linear_attention":
            for suffix, (attr, transpose) in HF_PARAMS.items():
                path = ("layers", i, "linear_attn", *attr.split("."))
                names[path] = (f"{pre}linear_attn.{suffix}", transpose)
        else:
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names[("layers", i, "self_attn", p, "kernel")] = (f"{pre}self_attn.{p}.weight", True)
            if config.qk_norm:
                for p in ("q_norm", "k_norm"):
                    names[("layers", i, "self_attn", p, "weight")] = (f"{pre}self_attn.{p}.weight", False)
    return names


def _to_ours(arr: np.ndarray, transpose: bool | str) -> np.ndarray:
    """HF layout -> ours: swap the last two axes (linear weights, fused down_proj); fused gate_up_proj
    `[experts, 2 * moe, hidden]` -> `[experts, hidden, 2, moe]`."""
    if transpose == "gate_up":
        e, two_m, h = arr.shape
        return np.ascontiguousarray(np.swapaxes(arr, 1, 2)).reshape(e, h, 2, two_m // 2)
    return np.swapaxes(arr, -1, -2) if transpose and arr.ndim >= 2 else arr


def _to_hf(arr: np.ndarray, transpose: bool | str) -> np.ndarray:
    """Ours -> HF layout (the inverse of `_to_ours`)."""
    if transpose == "gate_up":
        e, h, _, m = arr.shape
        return np.swapaxes(arr.reshape(e, h, 2 * m), 1, 2)
    return np.swapaxes(arr, -1, -2) if transpose and arr.ndim >= 2 else arr


def _per_expert_keys(key: str, conversion: str, j: int) -> tuple[str, ...]:
    """The per-expert tensor names standing for fused tensor `key` (`...mlp.experts.gate_up_proj`)."""
    base = key.rsplit(".", 1)[0]
    parts = ("gate_proj", "up_proj") if conversion == "gate_up" else ("down_proj",)
    return tuple(f"{base}.{j}.{p}.weight" for p in parts)


def _read_experts(tensors: _Tensors, key: str, conversion: str, num_experts: int, used: set[str]
                  ) -> np.ndarray | None:
    """The routed experts' tensor in our layout from the per-expert names (None if the first is absent)."""
    if _per_expert_keys(key, conversion, 0)[0] not in tensors:
        return None
    mats = []
    for j in range(num_experts):
        keys = _per_expert_keys(key, conversion, j)
        for k in keys:
            if k not in tensors:
                raise KeyError(f"load_hf: missing tensor {k!r} (per-expert layout of {key!r})")
        if conversion == "gate_up":  # gate, up [moe, hidden] -> [hidden, 2, moe]
            mats.append(np.stack([tensors.get(k).T for k in keys], axis=1))
        else:  # down [hidden, moe] -> [moe, hidden]
            mats.append(tensors.get(keys[0]).T)
        used.update(keys)
    return np.stack(mats)


def _path_str(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


# ----------------------------------------------------------------------------------------------- load


def _place(host: np.ndarray, var: nnx.Variable, shape: tuple[int, ...], mesh: Mesh | None,
           rules: Rules | None) -> jax.Array:
    """A host array onto the device (its NamedSharding slices only, with a mesh)."""
    host = np.ascontiguousarray(host)
    if mesh is None:
        return jnp.asarray(host)
    sharding = named_sharding(variable_axes(var), mesh, shape, rules)
    return jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx])


class HFLoadError(ValueError):
    """A Hugging Face folder that cannot be loaded as the model its config.json describes; the message names
    the file and the tensor or field."""


@jax.jit
def _nonfinite_count(x: jax.Array) -> jax.Array:
    """How many entries of `x` are NaN or infinite: one jitted reduction per array, on its device(s)."""
    return jnp.sum(~jnp.isfinite(x))


def _read_config(directory: str, dtype: Any) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, raw dict) of `directory/config.json`; errors name the file and the field."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise HFLoadError(f"load_hf: {path} is missing") from None
    except (OSError, ValueError) as e:
        raise HFLoadError(f"load_hf: {path} is not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HFLoadError(f"load_hf: {path} holds {type(raw).__name__}, not an object")
    try:
        return config_from_hf(raw, dtype=dtype), raw
    except NotImplementedError as e:
        raise NotImplementedError(f"load_hf: {path}: {str(e).removeprefix('config.json: ')}") from None
    except (ValueError, KeyError, TypeError) as e:
        msg = str(e).removeprefix("config.json: ") if isinstance(e, ValueError) else f"field {e} ({e!r})"
        raise HFLoadError(f"load_hf: {path}: {msg}") from None


def read_config(directory: str, dtype: Any = "bfloat16") -> ModelConfig:
    """The `ModelConfig` of a Hugging Face folder's `config.json` alone (no weights read): the shapes a
    plan compiles with (`cluster.abstract_model`)."""
    return _read_config(directory, dtype)[0]


def _declared_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype config.json declares for the weights (`torch_dtype`/`dtype`, top level or text_config)."""
    for d in (raw.get("text_config") or {}, raw):
        for key in ("torch_dtype", "dtype"):
            if isinstance(d.get(key), str):
                return d[key]
    return None


class _Tensors:
    """Lazy view of the safetensors files of a checkpoint folder: key -> (file, shape)."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(x for x in os.listdir(directory) if x.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"load_hf: no *.safetensors files in {directory}")
        self.handles = []
        self.where: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        for f in files:
            path = os.path.join(directory, f)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"load_hf: {path} is missing (named by model.safetensors.index.json)")
            try:
                h = safe_open(path, framework="np")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
                raise HFLoadError(f"load_hf: {path} is not a readable safetensors file "
                                  f"({os.path.getsize(path)} bytes; {type(e).__name__}: {e})") from None
            self.handles.append(h)
            for k in h.keys():
                self.where[k] = h
                self.file_of[k] = path

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.where[key].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype name (`F32`, `BF16`, `I8`, ...)."""
        return str(self.where[key].get_slice(key).get_dtype())

    def get(self, key: str) -> np.ndarray:
        try:
            return self.where[key].get_tensor(key)
        except Exception as e:  # noqa: BLE001 - a truncated file fails only when its tensor is read
            raise HFLoadError(f"load_hf: {self.file_of[key]}: tensor {key!r} cannot be read "
                              f"({type(e).__name__}: {e})") from None

    def keys(self) -> Iterator[str]:
        return iter(self.where)


def _layer_index(key: str, prefix: str) -> int | None:
    """`i` of a `{prefix}layers.{i}.` tensor name, else None."""
    head = prefix + "layers."
    part = key[len(head):].split(".")[0] if key.startswith(head) else ""
    return int(part) if part.isdigit() else None


def _find_prefix(tensors: _Tensors, directory: str) -> str:
    for prefix in _EMBED_PREFIXES:
        if f"{prefix}embed_tokens.weight" in tensors:
            return prefix
    raise KeyError(
        f"missing tensor: none of {[p + 'embed_tokens.weight' for p in _EMBED_PREFIXES]} in {directory}"
    )


def load_hf(
    directory: str,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
    *,
    strict: bool = True,
    allow_nonfinite: bool = False,
) -> Transformer:
    """Transformer with the weights of the HF checkpoint in `directory` (config.json + *.safetensors).

    Params and activations in `dtype`. With `mesh`, each tensor is placed straight onto its NamedSharding
    (logical axes of the parameter mapped through `rules`, default `DEFAULT_RULES`); each device receives
    only its slice.

    Strict: every error names the file and the tensor or field. A missing tensor is a KeyError; a shape
    mismatch, a tensor of the text model the config does not use (a bias with `attention_bias=false`, layers
    beyond `num_hidden_layers`), a weight whose dtype is not the one config.json declares (float32 weights
    are accepted in a bfloat16/float16 checkpoint: a loss-free widening some checkpoints use for a few
    tensors), an integer or fp8 weight (a quantised checkpoint: refused until a quantised path exists), an
    unreadable file or config field are `HFLoadError`s (ValueErrors). `strict=False` turns the unexpected
    tensors and dtype mismatches into WARNING lines. Tensors outside the text model (a vision tower, `mtp.`)
    are skipped with an INFO line. Non-finite weights are counted on device (one jitted reduction per array)
    and refused unless `allow_nonfinite`.
    """
    config, raw = _read_config(directory, dtype)
    tensors = _Tensors(directory)
    prefix = _find_prefix(tensors, directory)
    checks = _Checks(tensors, _declared_dtype(raw), strict)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    names = hf_param_names(config)
    used: set[str] = set()
    new_leaves = []
    counts: list[tuple[str, jax.Array]] = []
    for path, var in nnx.to_flat_state(state):
        if path not in names:
            raise KeyError(f"load_hf: model variable {_path_str(path)} has no Hugging Face tensor name")
        name, transpose = names[path]
        key = name if name == "lm_head.weight" else prefix + name
        if key == "lm_head.weight":
            key = next((k for k in _LM_HEAD_KEYS if k in tensors), key)
        expected = tuple(var.get_value().shape)
        if transpose in ("gate_up", "down"):
            host = _read_moe_tensor(tensors, key, transpose, expected, path, config, checks, used)
        else:
            host = _read_tensor(tensors, key, transpose, expected, path, checks, used)
        placed = _place(host.astype(config.jnp_param_dtype, copy=False), var, expected, mesh, rules)
        counts.append((key, _nonfinite_count(placed)))
        new_leaves.append((path, var.replace(placed)))
    _check_unused(tensors, used, config, prefix, checks)
    _check_finite(tensors, counts, allow_nonfinite)
    model = nnx.merge(graphdef, nnx.from_flat_state(new_leaves))
    if mesh is not None and config.num_experts:
        bind_mesh(model, mesh, rules)
    logging.info("load_hf: %s (%s, %d layers) from %s", config.model_type, config.param_dtype,
                 config.num_layers, directory)
    return model


class _Checks:
    """`load_hf`'s checks of a tensor against what config.json declares: a problem raises (`strict`) or
    warns."""

    def __init__(self, tensors: _Tensors, declared: str | None, strict: bool):
        self.tensors, self.declared, self.strict = tensors, declared, strict

    def problem(self, msg: str) -> None:
        if self.strict:
            raise HFLoadError(f"load_hf: {msg}")
        logging.warning("load_hf (strict=False): %s", msg)

    def dtype(self, key: str) -> None:
        """A float weight of the declared dtype (float32 in a bfloat16/float16 checkpoint allowed: a
        loss-free widening); a quantised or non-float one is refused, strict or not."""
        have = self.tensors.dtype(key)
        where = self.tensors.file_of[key]
        if have in _QUANTISED or have not in _FLOATS:
            raise HFLoadError(f"load_hf: {where}: tensor {key!r} is {have}: a quantised checkpoint (or a "
                              "non-float weight) is not supported; load an unquantised (bf16/fp32) one")
        declared = self.declared
        if declared and _FLOATS[have] != declared and not (have == "F32" and declared in ("bfloat16",
                                                                                          "float16")):
            self.problem(f"{where}: tensor {key!r} is {_FLOATS[have]} but config.json declares {declared}")


def _read_moe_tensor(tensors: _Tensors, key: str, transpose: str, expected: tuple[int, ...], path: Any,
                     config: ModelConfig, checks: _Checks, used: set[str]) -> np.ndarray:
    """An MoE layer's stacked expert weights (`gate_up` / `down`) in our layout: one fused tensor, or the
    per-expert tensors stacked; every tensor read is added to `used`."""
    arr = tensors.get(key) if key in tensors else None
    if arr is not None:
        checks.dtype(key)
        arr = _to_ours(arr, transpose)
        used.add(key)
    else:
        before = set(used)
        arr = _read_experts(tensors, key, transpose, config.num_experts, used)
        for k in sorted(used - before):
            checks.dtype(k)
    if arr is None:
        raise KeyError(f"load_hf: missing tensor {key!r} (or its per-expert form "
                       f"{_per_expert_keys(key, transpose, 0)}) in {tensors.directory}")
    if tuple(arr.shape) != expected:
        raise ValueError(f"load_hf: shape mismatch for tensor {key!r} in {tensors.directory}: checkpoint "
                         f"gives {tuple(arr.shape)} in model layout but the model expects {expected} "
                         f"for "
                         f"{_path_str(path)}")
    return arr


def _read_tensor(tensors: _Tensors, key: str, transpose: Any, expected: tuple[int, ...], path: Any,
                 checks: _Checks, used: set[str]) -> np.ndarray:
    """One tensor in our layout (2-D ones transposed where `transpose`), its shape and dtype checked first;
    added to `used`."""
    if key not in tensors:
        hf_expected = expected[::-1] if transpose else expected
        raise KeyError(
            f"load_hf: missing tensor {key!r} (expected HF shape {hf_expected}, model shape {expected}) "
            f"in {tensors.directory}"
        )
    hf_shape = tensors.shape(key)
    ours = hf_shape[::-1] if transpose and len(hf_shape) == 2 else hf_shape
    if ours != expected:
        raise ValueError(
            f"load_hf: shape mismatch for tensor {key!r} in {tensors.file_of[key]}: checkpoint shape "
            f"{hf_shape} (as model layout {ours}) but the model expects {expected} for {_path_str(path)}"
        )
    checks.dtype(key)
    host = _to_ours(tensors.get(key), transpose)
    used.add(key)
    return host


def _check_unused(tensors: _Tensors, used: set[str], config: ModelConfig, prefix: str,
                  checks: _Checks) -> None:
    """The checkpoint's tensors the model did not read: the text model's are a problem (layers beyond
    `num_hidden_layers`, a bias the config turns off), the rest (a vision tower, `mtp.`) an INFO line. Not
    weights, so never reported: a tied LM head, rotary inverse frequencies, a width-0 shared expert."""
    directory = tensors.directory
    ignored = [k for k in tensors.keys() if k not in used]
    if config.tie_embeddings:
        ignored = [k for k in ignored if k not in _LM_HEAD_KEYS]
    # buffers some older checkpoints carry (rotary inverse frequencies) are not weights
    ignored = [k for k in ignored if not k.endswith("rotary_emb.inv_freq")]
    if config.num_experts and not config.shared_expert_intermediate_size:
        # a width-0 shared expert (transformers writes its empty weights and its unused gate)
        ignored = [k for k in ignored if not (k.endswith("shared_expert_gate.weight")
                                              or (".shared_expert." in k and 0 in tensors.shape(k)))]
    ours = [k for k in ignored if k.startswith(prefix) or k in _LM_HEAD_KEYS]
    beyond = {k: i for k in ours if (i := _layer_index(k, prefix)) is not None and i >= config.num_layers}
    if beyond:
        k = min(beyond, key=beyond.get)
        checks.problem(f"{tensors.file_of[k]} holds layers {min(beyond.values())}..{max(beyond.values())} "
                       f"(e.g. tensor {k!r}) but {os.path.join(directory, 'config.json')} has "
                       f"num_hidden_layers={config.num_layers}")
    elif ours:
        checks.problem(f"{tensors.file_of[ours[0]]}: tensor {ours[0]!r} is not used by the model config.json "
                       f"describes ({len(ours)} such tensor(s); e.g. a bias with attention_bias=false)")
    other = [k for k in ignored if k not in ours]
    if other:
        logging.info("load_hf: skipped %d tensors outside the text model (e.g. %s) in %s",
                     len(other), other[0], directory)


def _check_finite(tensors: _Tensors, counts: list[tuple[str, jax.Array]], allow_nonfinite: bool) -> None:
    """Refuses (or, `allow_nonfinite`, warns about) tensors holding NaN/inf: `counts` are each placed
    tensor's non-finite entries, counted on device and fetched here at once."""
    bad = [(k, int(n)) for (k, _), n in zip(counts, jax.device_get([c for _, c in counts]), strict=True) if n]
    if not bad:
        return
    msg = (f"load_hf: {len(bad)} tensor(s) hold non-finite values, e.g. {bad[0][0]!r} in "
           f"{tensors.file_of.get(bad[0][0], tensors.directory)} ({bad[0][1]} NaN/inf entries)")
    if not allow_nonfinite:
        raise HFLoadError(msg + "; refused (allow_nonfinite=True loads them anyway)")
    logging.warning("%s; loaded anyway (allow_nonfinite=True)", msg)


# ----------------------------------------------------------------------------------------------- save


def _host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save_hf(model: Transformer, directory: str, *, max_shard_bytes: int = 2 * 1024**3,
            expert_layout: str = "fused") -> None:
    """Writes config.json and model.safetensors (or model-0000i-of-0000n.safetensors + index when larger
    than `max_shard_bytes`) in Hugging Face names and layouts. Only process 0 writes.

    MoE experts: `expert_layout="fused"` writes `mlp.experts.gate_up_proj` / `down_proj` 3-d tensors (the
    published Qwen3.5-MoE layout), "per_expert" writes `mlp.experts.{j}.{gate,up,down}_proj.weight` (what
    transformers' `save_pretrained` writes); transformers loads both."""
    if expert_layout not in ("fused", "per_expert"):
        raise ValueError(f"save_hf: expert_layout {expert_layout!r} is not 'fused' or 'per_expert'")
    config = model.config
    names = hf_param_names(config)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    tensors: dict[str, np.ndarray] = {}
    for path, var in flat:
        if path not in names:
            raise KeyError(f"save_hf: model variable {_path_str(path)} has no Hugging Face tensor name")
        name, transpose = names[path]
        key = name if name == "lm_head.weight" else "model." + name
        hf = _to_hf(_host(var.get_value()), transpose)
        if transpose in ("gate_up", "down") and expert_layout == "per_expert":
            for j in range(hf.shape[0]):
                keys = _per_expert_keys(key, transpose, j)
                halves = np.split(hf[j], len(keys), axis=0)  # gate_up [2 * moe, hidden] -> gate, up
                for k, part in zip(keys, halves, strict=True):
                    tensors[k] = np.ascontiguousarray(part)
            continue
        tensors[key] = np.ascontiguousarray(hf)
    if config.num_experts and not config.shared_expert_intermediate_size:
        # transformers always builds a shared expert: width 0 and a zero gate say "none"
        h, dt = config.hidden_size, tensors["model.norm.weight"].dtype
        for i in range(config.num_layers):
            pre = f"model.layers.{i}.mlp.shared_expert"
            tensors[f"{pre}.gate_proj.weight"] = np.zeros((0, h), dt)
            tensors[f"{pre}.up_proj.weight"] = np.zeros((0, h), dt)
            tensors[f"{pre}.down_proj.weight"] = np.zeros((h, 0), dt)
            tensors[f"{pre}_gate.weight"] = np.zeros((1, h), dt)
    if jax.process_index() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f, indent=2, sort_keys=True)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, "model.safetensors"), metadata=meta)
        for stale in os.listdir(directory):  # a previous sharded save would shadow this file
            if stale == "model.safetensors.index.json" or (stale.startswith("model-") and "-of-" in stale):
                os.remove(os.path.join(directory, stale))
    else:
        n = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(shard, os.path.join(directory, fname), metadata=meta)
            weight_map |= {k: fname for k in shard}
        total = int(sum(t.nbytes for t in tensors.values()))
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    logging.info("save_hf: %d tensors (%.1f MB) in %d file(s) to %s", len(tensors),
                 sum(t.nbytes for t in tensors.values()) / 1e6, len(shards), directory)
