"""Writes the Qwen3.5 golden fixtures (tests/fixtures/golden/qwen3_5_*/). Run by hand (torch + transformers):

    /work/tvenv/bin/python tests/make_golden_qwen3_5.py

Each fixture is a small random-weight `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`) saved with
`save_pretrained` (config.json + model.safetensors, float32), plus
- `reference.npz`: `input_ids` int32 [batch, seq] and the fp32 `logits` [batch, seq, vocab] of the full model;
- `linear_layer.npz`: one Gated DeltaNet layer (`layer_index`) run alone through HF's cache path:
  `x` [batch, seq, hidden] -> `y`, then the cache after it (`conv_state` [batch, conv_dim, K] as HF keeps
  it, of which our cache holds the last K - 1 columns, and `state` [batch, v_heads, dk, dv]), then two
  single-token decode steps `x_decode` [batch, 2, hidden] -> `y_decode`, and the cache after them
  (`conv_state_decode`, `state_decode`).
Weights are re-drawn at larger scales than HF's init (std 0.02 would make every output nearly zero and the
parity tests weak): linear kernels N(0, 0.15), embeddings N(0, 0.5), norm weights around their neutral value,
dt_bias N(0, 0.5) and A = exp(A_log) in [0.01, 4] so some heads keep a long memory across chunk boundaries.
Sequence lengths exceed one 64-token chunk and are not multiples of it.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "golden")

LIN, FULL = "linear_attention", "full_attention"

FIXTURES: dict[str, dict] = {
    # 3 linear + 1 full (the real interval-4 pattern), GQA 2 in DeltaNet (2 k heads, 4 v heads), untied.
    "qwen3_5_a": dict(
        layer_types=[LIN, LIN, LIN, FULL], hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        seq=80,
    ),
    # full first, ratio 3 (1 k head, 3 v heads), dk != dv, kernel 3, tied embeddings, MQA in full attention.
    "qwen3_5_b": dict(
        layer_types=[FULL, LIN, LIN], hidden_size=24, intermediate_size=48, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3, tie_word_embeddings=True,
        seq=70,
    ),
    # equal k/v heads (no grouping), longer sequence (3 chunks), head_dim 32 with partial rotary 0.25.
    "qwen3_5_c": dict(
        layer_types=[LIN, FULL], hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        seq=150,
    ),
}
VOCAB = 128
BATCH = 2


def make_config(spec: dict) -> Qwen3_5TextConfig:
    spec = {k: v for k, v in spec.items() if k != "seq"}
    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        num_hidden_layers=len(spec["layer_types"]),
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        **spec,
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            p.copy_(torch.empty(shape).uniform_(0.01, 4.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(shape, generator=gen) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):  # gated norm: plain w, neutral at 1
            p.copy_(1.0 + 0.2 * torch.randn(shape, generator=gen))
        elif "norm" in name:  # (1 + w) norms: neutral at 0
            p.copy_(0.2 * torch.randn(shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(0.5 * torch.randn(shape, generator=gen))
        elif "conv1d" in name:
            p.copy_(0.5 * torch.randn(shape, generator=gen))
        else:
            p.copy_(0.15 * torch.randn(shape, generator=gen))


@torch.no_grad()
def linear_layer_reference(
    model: Qwen3_5ForCausalLM, layer_index: int, seq: int, gen: torch.Generator
) -> dict[str, np.ndarray]:
    hidden = model.config.hidden_size
    layer = model.model.layers[layer_index].linear_attn
    x = torch.randn(BATCH, seq, hidden, generator=gen)
    x_decode = torch.randn(BATCH, 2, hidden, generator=gen)
    cache = DynamicCache(config=model.config)
    y = layer(hidden_states=x, cache=cache, attention_mask=None)
    conv_state = cache.get_conv_state(layer_index).clone()
    state = cache.get_recurrent_state(layer_index).clone()
    y_dec = [layer(hidden_states=x_decode[:, t : t + 1], cache=cache, attention_mask=None) for t in range(2)]
    y_no_cache = layer(hidden_states=x, cache=None, attention_mask=None)
    assert torch.allclose(y, y_no_cache, atol=1e-6)
    return {
        "layer_index": np.int32(layer_index),
        "x": x.numpy(),
        "y": y.numpy(),
        "conv_state": conv_state.numpy(),
        "state": state.float().numpy(),
        "x_decode": x_decode.numpy(),
        "y_decode": torch.cat(y_dec, dim=1).numpy(),
        "conv_state_decode": cache.get_conv_state(layer_index).numpy(),
        "state_decode": cache.get_recurrent_state(layer_index).float().numpy(),
    }


def main() -> None:
    torch.set_num_threads(2)
    for index, (name, spec) in enumerate(sorted(FIXTURES.items())):
        gen = torch.Generator().manual_seed(1000 + index)
        torch.manual_seed(1000 + index)
        config = make_config(spec)
        model = Qwen3_5ForCausalLM(config).eval().float()
        randomize(model, gen)
        out = os.path.join(ROOT, name)
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, safe_serialization=True)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(out, extra)):
                os.remove(os.path.join(out, extra))
        seq = spec["seq"]
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().numpy()
        np.savez(os.path.join(out, "reference.npz"), input_ids=ids.numpy().astype(np.int32), logits=logits)
        lin_index = spec["layer_types"].index(LIN)
        np.savez(os.path.join(out, "linear_layer.npz"), **linear_layer_reference(model, lin_index, seq, gen))
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        assert size < 1_000_000, f"{name}: {size} bytes"
        with open(os.path.join(out, "config.json")) as f:
            model_type = json.load(f)["model_type"]
        top = np.abs(logits).max()
        print(f"{name}: {size / 1e3:.0f} kB, model_type {model_type}, logits |max| {top:.2f}")


if __name__ == "__main__":
    main()
