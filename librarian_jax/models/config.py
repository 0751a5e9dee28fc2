"""Model configuration and presets for the decoder-only families (Qwen3, Gemma 3 text, Llama 3, Qwen3.5,
Qwen3.5-MoE).

One frozen dataclass describes every family; the family is selected by switches (qk norm, `(1 + w)` norms,
post norms, embedding scale, activation, rope scaling, sliding-window layers, gated attention output, partial
rotary, Gated DeltaNet dims, sparse mixture-of-experts feed-forward). Field names follow Hugging Face's
config.json where one exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only transformer.

    Dtypes are stored as strings (`"float32"`, `"bfloat16"`) so configs stay hashable and printable; use
    `config.jnp_dtype` / `config.jnp_param_dtype` for the jnp dtype.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    # One entry per layer; empty means every layer is "full_attention".
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Which Hugging Face model_type `save_hf` writes ("qwen3", "gemma3_text", "llama", "qwen3_5_text").
    model_type: str = "qwen3"
    max_position_embeddings: int = 32_768
    # --- family switches ---
    qk_norm: bool = True  # RMSNorm over head_dim on q and k (Qwen3, Gemma 3, Qwen3.5)
    norm_plus_one: bool = False  # Gemma / Qwen3.5 RMSNorm: x_hat * (1 + w), weights initialised at 0
    post_norms: bool = False  # Gemma 3: post-attention and pre/post-feedforward norms
    embed_scale: bool = False  # Gemma: embeddings * sqrt(hidden_size) (in the activation dtype)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5 instead of head_dim
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    final_logit_softcapping: float | None = None
    # RoPE of full-attention layers (Gemma 3 local layers always use the default type at rope_local_theta).
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_local_theta: float | None = None  # Gemma 3 `rope_local_base_freq` for sliding layers
    # Qwen3.5 full-attention layers.
    attn_output_gate: bool = False  # q_proj gives [query, gate] per head; output *= sigmoid(gate)
    partial_rotary_factor: float = 1.0  # rotate only the first int(head_dim * factor) dims
    # Qwen3.5 Gated DeltaNet ("linear_attention") layers.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Qwen3.5-MoE sparse feed-forward (every layer when num_experts > 0; `intermediate_size` is then unused):
    # router softmax over all experts, top-k renormalised, plus a shared expert of
    # `shared_expert_intermediate_size` (0: none) behind a sigmoid gate. See `models/moe.py`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"ModelConfig.layer_types has {len(self.layer_types)} entries "
                f"but num_layers is {self.num_layers}"
            )
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ValueError(f"ModelConfig.layer_types[{i}] = {t!r}; expected one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("ModelConfig has sliding_attention layers but sliding_window is not set")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"ModelConfig.rope_type = {self.rope_type!r}; expected one of {ROPE_TYPES}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation = {self.activation!r}; expected one of {ACTIVATIONS}")
        rot = self.rotary_dim
        if rot % 2 or rot <= 0 or rot > self.head_dim:
            raise ValueError(
                f"ModelConfig: rotary dim int(head_dim {self.head_dim} * partial_rotary_factor "
                f"{self.partial_rotary_factor}) = {rot} must be even and in (0, head_dim]"
            )
        if "linear_attention" in self.layer_types:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(
                        f"ModelConfig has linear_attention layers but {name} is {getattr(self, name)}"
                    )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"ModelConfig.num_experts_per_tok = {self.num_experts_per_tok}; expected 1..num_experts "
                    f"({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("ModelConfig has num_experts > 0 but moe_intermediate_size is not set")
        jnp.dtype(self.dtype)
        jnp.dtype(self.param_dtype)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        """dataclasses.replace; a new `num_layers` without `layer_types` repeats a uniform layer type."""
        if "num_layers" in changes and "layer_types" not in changes and len(set(self.layer_types)) == 1:
            changes["layer_types"] = (self.layer_types[0],) * changes["num_layers"]
        return dataclasses.replace(self, **changes)


def _pattern(n: int, every: int, other: str, last: str) -> tuple[str, ...]:
    """`other` everywhere except each `every`-th layer (1-based), which is `last` (HF's interval rule)."""
    return tuple(last if (i + 1) % every == 0 else other for i in range(n))


_QWEN3 = dict(model_type="qwen3", qk_norm=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              max_position_embeddings=40_960)
_GEMMA3 = dict(model_type="gemma3_text", qk_norm=True, norm_plus_one=True, post_norms=True, embed_scale=True,
               activation="gelu_tanh", rope_theta=1_000_000.0, rope_local_theta=10_000.0, rms_norm_eps=1e-6,
               query_pre_attn_scalar=256.0, tie_embeddings=True)

PRESETS: dict[str, ModelConfig] = {
    # CPU preset: Qwen3-style, vocab of the tiny SentencePiece tokenizer.
    "tiny": ModelConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=32, tie_embeddings=True, max_position_embeddings=4096,
                        **{k: v for k, v in _QWEN3.items() if k != "max_position_embeddings"}),
    # The embedded default's model: tiny with an 8k vocabulary (its SentencePiece, trained on the synthetic
    # world and the agents' prompts, then encodes a builder episode in about half the tokens of a 2k one).
    "tiny_8k": ModelConfig(vocab_size=8192, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=32, tie_embeddings=True, max_position_embeddings=4096,
                           **{k: v for k, v in _QWEN3.items() if k != "max_position_embeddings"}),
    "decode_bench": ModelConfig(vocab_size=8000, hidden_size=384, intermediate_size=1024, num_layers=6,
                                num_heads=6, num_kv_heads=2, head_dim=64, tie_embeddings=True, **_QWEN3),
    # Qwen/Qwen3-0.6B config.json
    "qwen3_0_6b": ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, tie_embeddings=True,
                              dtype="bfloat16", param_dtype="bfloat16", **_QWEN3),
    # Qwen/Qwen3-4B config.json
    "qwen3_4b": ModelConfig(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, tie_embeddings=True,
                            dtype="bfloat16", param_dtype="bfloat16", **_QWEN3),
    # google/gemma-3-1b-pt config.json
    "gemma3_1b": ModelConfig(vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_layers=26,
                             num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512,
                             layer_types=_pattern(26, 6, "sliding_attention", "full_attention"),
                             max_position_embeddings=32_768, dtype="bfloat16", param_dtype="bfloat16",
                             **_GEMMA3),
    # google/gemma-3-4b-pt config.json, text_config (global layers use linear rope scaling x8)
    "gemma3_4b": ModelConfig(vocab_size=262_208, hidden_size=2560, intermediate_size=10_240, num_layers=34,
                             num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=1024,
                             layer_types=_pattern(34, 6, "sliding_attention", "full_attention"),
                             rope_type="linear", rope_factor=8.0, max_position_embeddings=131_072,
                             dtype="bfloat16", param_dtype="bfloat16", **_GEMMA3),
    # meta-llama/Llama-3.2-1B config.json
    "llama3_2_1b": ModelConfig(vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                               num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500_000.0,
                               rms_norm_eps=1e-5, tie_embeddings=True, model_type="llama", qk_norm=False,
                               rope_type="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                               rope_high_freq_factor=4.0, rope_original_max_position=8192,
                               max_position_embeddings=131_072, dtype="bfloat16", param_dtype="bfloat16"),
    # Qwen/Qwen3.5-4B config.json, text_config (hybrid: 3 Gated DeltaNet layers, then 1 gated full attention)
    "qwen3_5_4b": ModelConfig(vocab_size=248_320, hidden_size=2560, intermediate_size=9216, num_layers=32,
                              num_heads=16, num_kv_heads=4, head_dim=256, rope_theta=10_000_000.0,
                              rms_norm_eps=1e-6, tie_embeddings=True, model_type="qwen3_5_text",
                              layer_types=_pattern(32, 4, "linear_attention", "full_attention"),
                              qk_norm=True, norm_plus_one=True, attn_output_gate=True,
                              partial_rotary_factor=0.25, linear_num_key_heads=16, linear_num_value_heads=32,
                              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                              max_position_embeddings=262_144, dtype="bfloat16", param_dtype="bfloat16"),
    # Qwen/Qwen3.5-35B-A3B config.json, text_config (transformers' Qwen3_5MoeTextConfig defaults are this
    # checkpoint): 40 hybrid layers (3 Gated DeltaNet, 1 gated full attention), each with a sparse MoE of 256
    # experts (top 8, 512 wide) plus a 512-wide shared expert; untied embeddings. The paper's executor.
    "qwen3_5_35b_a3b": ModelConfig(vocab_size=248_320, hidden_size=2048, intermediate_size=512, num_layers=40,
                                   num_heads=16, num_kv_heads=2, head_dim=256, rope_theta=10_000_000.0,
                                   rms_norm_eps=1e-6, tie_embeddings=False, model_type="qwen3_5_moe_text",
                                   layer_types=_pattern(40, 4, "linear_attention", "full_attention"),
                                   qk_norm=True, norm_plus_one=True, attn_output_gate=True,
                                   partial_rotary_factor=0.25, linear_num_key_heads=16,
                                   linear_num_value_heads=32, linear_key_head_dim=128,
                                   linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
                                   num_experts_per_tok=8, moe_intermediate_size=512,
                                   shared_expert_intermediate_size=512, max_position_embeddings=262_144,
                                   dtype="bfloat16", param_dtype="bfloat16"),
    # A CPU-sized Qwen3.5-MoE for tests and `bench/moe.py` (same layer pattern and routing, tiny dims).
    "tiny_moe": ModelConfig(vocab_size=2048, hidden_size=128, intermediate_size=64, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=32, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
                            tie_embeddings=False, model_type="qwen3_5_moe_text",
                            layer_types=_pattern(4, 4, "linear_attention", "full_attention"), qk_norm=True,
                            norm_plus_one=True, attn_output_gate=True, partial_rotary_factor=0.25,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                            linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, max_position_embeddings=4096),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """Return preset `name` (see `PRESETS`), with field overrides (e.g. `dtype="float32"`)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    config = PRESETS[name]
    return config.replace(**overrides) if overrides else config
