"""Regenerate the golden fixtures for Qwen3 (tied, untied), Gemma 3 text and Llama 3 (run by hand).

    /work/tvenv/bin/python tests/make_golden.py [--out tests/fixtures/golden] [--no-check-save]

Each fixture folder holds a small random-weight HF checkpoint (config.json, model.safetensors) and
reference.npz with `input_ids` int32 [batch, seq] and `logits` float32 [batch, seq, vocab] from transformers'
eager fp32 forward pass. Weights are drawn wider than HF's init (and norms away from their identity) so every
op matters. Needs torch + transformers; never imported by the package or the tests.

With the package importable (it is in /work/tvenv), it also checks that `save_hf` output loads back into
transformers with the same logits (the "HF can load what we write" check, which the tests cannot do).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

SEED = 1234


def _configs() -> dict[str, tuple[object, int]]:
    """name -> (HF config, sequence length)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=256)
    gqa = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    gemma_layers = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    gemma_rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    llama_rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return {
        "qwen3_tied": (Qwen3Config(**common, **gqa, num_hidden_layers=2, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}), 16),
        "qwen3_untied": (Qwen3Config(**common, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 16),
        # window 8 < seq 24, mixed layer types, query_pre_attn_scalar != head_dim, logit softcapping, linear
        # rope scaling on the global layer.
        "gemma3": (Gemma3TextConfig(**common, **gqa, num_hidden_layers=4, sliding_window=8,
                                    query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                    layer_types=gemma_layers, rope_parameters=gemma_rope), 24),
        "llama3": (LlamaConfig(**common, **gqa, num_hidden_layers=2, tie_word_embeddings=False,
                               rms_norm_eps=1e-5, rope_parameters=llama_rope), 20),
    }


def _randomize(model: torch.nn.Module, plus_one_norms: bool, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                noise = torch.randn(p.shape, generator=gen) * 0.2
                p.copy_(noise if plus_one_norms else 1.0 + noise)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))


def _logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids).long()).logits.float().numpy()


def make(out: str) -> list[str]:
    made = []
    for i, (name, (config, seq)) in enumerate(_configs().items()):
        gen = torch.Generator().manual_seed(SEED + i)
        torch.manual_seed(SEED + i)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        model.eval()
        _randomize(model, plus_one_norms=config.model_type == "gemma3_text", gen=gen)
        ids = torch.randint(0, config.vocab_size, (2, seq), generator=gen).numpy().astype(np.int32)
        logits = _logits(model, ids)
        folder = os.path.join(out, name)
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder, safe_serialization=True)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(folder, extra)):
                os.remove(os.path.join(folder, extra))
        np.savez_compressed(os.path.join(folder, "reference.npz"), input_ids=ids, logits=logits)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        print(f"{name}: {folder} {size / 1024:.0f} KiB, logits {logits.shape}, "
              f"|logits| max {abs(logits).max():.2f}")
        made.append(folder)
    return made


def check_save_loads_in_hf(folders: list[str]) -> None:
    """load_hf -> save_hf -> transformers.from_pretrained gives the reference logits."""
    import jax.numpy as jnp

    from librarian_jax.models import load_hf, save_hf

    for folder in folders:
        ref = np.load(os.path.join(folder, "reference.npz"))
        ours, _ = load_hf(folder, dtype=jnp.float32)(jnp.asarray(ref["input_ids"]))
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(load_hf(folder), tmp)
            hf = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
            hf_logits = _logits(hf.eval(), ref["input_ids"])
        ours_err = np.abs(np.asarray(ours) - ref["logits"]).max()
        hf_err = np.abs(hf_logits - ref["logits"]).max()
        print(f"{os.path.basename(folder)}: |ours - ref| {ours_err:.2e}, |HF(save_hf) - ref| {hf_err:.2e}")
        assert hf_err < 1e-4 and ours_err < 1e-4, folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "fixtures", "golden"))
    parser.add_argument("--no-check-save", action="store_true")
    args = parser.parse_args()
    folders = make(args.out)
    if not args.no_check_save:
        check_save_loads_in_hf(folders)


if __name__ == "__main__":
    main()
