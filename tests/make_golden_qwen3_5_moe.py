"""Writes the Qwen3.5-MoE golden fixtures (tests/fixtures/golden/qwen3_5moe_*/). Run by hand (torch +
transformers 5.x, e.g. a venv with torch and transformers==5.24.0):

    /tmp/goldenv/bin/python tests/make_golden_qwen3_5_moe.py               # writes the fixtures
    /tmp/goldenv/bin/python tests/make_golden_qwen3_5_moe.py --check-save  # save_hf output -> transformers

Each fixture is a small random-weight `Qwen3_5MoeForCausalLM` (float32) plus `reference.npz`: `input_ids`
int32 [batch, seq], the fp32 `logits` [batch, seq, vocab] of the full model, and `greedy` int32 [new]: the
tokens transformers' `generate` (greedy, its own cache) appends to `input_ids[0, :prompt]` (`prompt` stored).
Folders (named so the `qwen3_5_*` glob of the dense tests does not pick them up):
- written by `save_pretrained` (model_type `qwen3_5_moe_text`, per-expert `mlp.experts.{j}.*_proj.weight`);
- `qwen3_5moe_c` is written in the published Qwen3.5-35B-A3B layout instead: a multimodal config.json
  (`qwen3_5_moe` with a `text_config`), tensors under `model.language_model.` and fused 3-d experts
  `mlp.experts.gate_up_proj` / `down_proj` (transformers' in-memory names).
Weights are re-drawn larger than HF's init (as make_golden_qwen3_5.py), the router at 0.5 so routing is
decisive (no near-ties between the k-th and k+1-th expert that fp32 rounding could flip).

`--check-save` loads each fixture with librarian_jax (the project venv, `JAX_VENV`), writes it with `save_hf`
in both expert layouts, loads each folder back into transformers and prints the max |logit - reference|.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "fixtures", "golden")
JAX_VENV = os.environ.get("JAX_VENV", os.path.join(HERE, "..", ".venv", "bin", "python"))

LIN, FULL = "linear_attention", "full_attention"
FIXTURES: dict[str, dict] = {
    # the real 3 linear + 1 full pattern, top-2 of 8 experts, shared expert, untied.
    "qwen3_5moe_a": dict(
        layer_types=[LIN, LIN, LIN, FULL], hidden_size=24, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=6,
        shared_expert_intermediate_size=12, tie_word_embeddings=False, seq=70,
    ),
    # full attention first, top-1 of 4 experts, NO shared expert (width 0), tied embeddings.
    "qwen3_5moe_b": dict(
        layer_types=[FULL, LIN], hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=12,
        num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=0,
        tie_word_embeddings=True, seq=66,
    ),
    # published layout (multimodal config, language_model prefix, fused experts), top-3 of 6, untied.
    "qwen3_5moe_c": dict(
        layer_types=[LIN, FULL, LIN], hidden_size=24, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, tie_word_embeddings=False, seq=72, published_layout=True,
    ),
}
VOCAB = 64
BATCH = 2
PROMPT, NEW = 12, 6


def make_config(spec: dict) -> Qwen3_5MoeTextConfig:
    spec = {k: v for k, v in spec.items() if k not in ("seq", "published_layout")}
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, num_hidden_layers=len(spec["layer_types"]), hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=512, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        **spec,
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        shape = p.shape
        if p.numel() == 0:
            continue
        if name.endswith("A_log"):
            p.copy_(torch.empty(shape).uniform_(0.01, 4.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(shape, generator=gen) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(shape, generator=gen))
        elif "norm" in name:
            p.copy_(0.2 * torch.randn(shape, generator=gen))
        elif "embed_tokens" in name or "conv1d" in name or name.endswith("mlp.gate.weight"):
            p.copy_(0.5 * torch.randn(shape, generator=gen))
        else:
            p.copy_(0.15 * torch.randn(shape, generator=gen))


def write_published_layout(model: Qwen3_5MoeForCausalLM, config: Qwen3_5MoeTextConfig, out: str) -> None:
    """config.json as `qwen3_5_moe` (multimodal) + model.language_model.* tensors with fused experts."""
    tensors = {}
    for key, t in model.state_dict().items():
        if key.startswith("model."):
            key = "model.language_model." + key[len("model."):]
        tensors[key] = t.detach().contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    text = json.loads(config.to_json_string())
    text.pop("transformers_version", None)
    top = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": config.tie_word_embeddings,
           "vision_config": {"model_type": "qwen3_5_moe_vision"}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(top, f, indent=2)


def main() -> None:
    torch.set_num_threads(2)
    for index, (name, spec) in enumerate(sorted(FIXTURES.items())):
        gen = torch.Generator().manual_seed(2000 + index)
        torch.manual_seed(2000 + index)
        config = make_config(spec)
        config._experts_implementation = "eager"  # the reference loop over experts (no grouped_mm kernel)
        model = Qwen3_5MoeForCausalLM(config).eval().float()
        randomize(model, gen)
        out = os.path.join(ROOT, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        if spec.get("published_layout"):
            write_published_layout(model, config, out)
        else:
            model.save_pretrained(out, safe_serialization=True)
            for extra in ("generation_config.json",):
                if os.path.exists(os.path.join(out, extra)):
                    os.remove(os.path.join(out, extra))
        ids = torch.randint(0, VOCAB, (BATCH, spec["seq"]), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().numpy()
            greedy = model.generate(ids[:1, :PROMPT], max_new_tokens=NEW, do_sample=False,
                                    min_new_tokens=NEW, pad_token_id=0, eos_token_id=None)[0, PROMPT:].numpy()
        np.savez(os.path.join(out, "reference.npz"), input_ids=ids.numpy().astype(np.int32), logits=logits,
                 greedy=greedy.astype(np.int32), prompt=np.int32(PROMPT))
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        assert size < 210_000, f"{name}: {size} bytes"
        top = np.abs(logits).max()
        print(f"{name}: {size / 1e3:.0f} kB, logits |max| {top:.2f}, greedy {greedy.tolist()}")


SAVE_SNIPPET = """
import sys
from librarian_jax.models import load_hf, save_hf
m = load_hf(sys.argv[1])
save_hf(m, sys.argv[2], expert_layout="fused")
save_hf(m, sys.argv[3], expert_layout="per_expert")
"""


def check_save() -> None:
    """save_hf (fused and per-expert) output loads into transformers with the reference logits."""
    for name in sorted(FIXTURES):
        folder = os.path.join(ROOT, name)
        ref = np.load(os.path.join(folder, "reference.npz"))
        with tempfile.TemporaryDirectory() as tmp:
            fused, per = os.path.join(tmp, "fused"), os.path.join(tmp, "per_expert")
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            subprocess.run([JAX_VENV, "-c", SAVE_SNIPPET, folder, fused, per], check=True, env=env)
            for layout, path in (("fused", fused), ("per_expert", per)):
                model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
                with torch.no_grad():
                    logits = model(input_ids=torch.as_tensor(ref["input_ids"]).long()).logits.numpy()
                diff = float(np.abs(logits - ref["logits"]).max())
                print(f"{name} save_hf({layout}) -> transformers: max |diff| {diff:.2e}")
                assert diff < 1e-4, (name, layout, diff)


if __name__ == "__main__":
    check_save() if "--check-save" in sys.argv else main()
