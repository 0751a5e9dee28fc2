"""Qwen3.5 hybrid prefill and decode: our chunked Gated DeltaNet prefill and recurrent decode vs transformers.

    python -m librarian_jax.bench.prefill [--seq_lens=256,512,1024,2048,4096] [--decode_batches=1,8]
        [--decode_steps=64] [--decode_prompt=256] [--repeats=3] [--torch_threads=2]

Model: a Qwen3.5-style hybrid (`bench_config`): hidden 256, 4 layers [linear, linear, linear, full],
Gated DeltaNet with 2 key heads / 4 value heads of 64, conv kernel 4; gated full attention 4 heads / 2 KV
heads of 64 with partial rotary 0.25; intermediate 768, vocab 8000, tied embeddings; random weights, fp32.

Prefill: one cached call over `seq` tokens at batch 1 (the DeltaNet layers run the 64-token chunked form and
fill their conv/recurrent state; all logits are computed on both sides, as HF's forward does).
Layer: the first Gated DeltaNet layer alone on the same lengths (ours jitted vs HF's module with a fresh
DynamicCache, best of 5 x `repeats`), which isolates the delta rule from the dense parts both sides share.
Decode: `decode_steps` greedy tokens after a `decode_prompt`-token prefill, one token per call (the DeltaNet
layers run the recurrent form); ours is one jitted on-device `lax.scan` over the steps, transformers a Python
loop over `model(input_ids=tok, cache=cache)` with argmax. Times are the best of `repeats` after a warm-up.
Our side compiles ahead of time first; the `compile s` columns are that lowering + compile, apart from the
run times.

The transformers side (`Qwen3_5ForCausalLM` loaded from our `save_hf` export, so the weights are identical;
torch CPU with `torch.set_num_threads(torch_threads)`) runs only when torch and transformers import, e.g.
`/work/tvenv/bin/python -m librarian_jax.bench.prefill`; otherwise only our figures are printed. HF uses its
PyTorch fallbacks for the delta rule and the conv when flash-linear-attention / causal-conv1d are absent.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from librarian_jax import models
from librarian_jax.bench import cached_lm
from librarian_jax.bench.common import best_time, compile_seconds, load_average
from librarian_jax.models.gated_deltanet import GatedDeltaNet

FLAGS = flags.FLAGS
flags.DEFINE_string("seq_lens", "256,512,1024,2048,4096", "comma-separated prefill lengths (batch 1)")
flags.DEFINE_string("decode_batches", "1,8", "comma-separated decode batch sizes")
flags.DEFINE_integer("decode_steps", 64, "greedy tokens decoded per row")
flags.DEFINE_integer("decode_prompt", 256, "prompt tokens prefilled before decoding")
flags.DEFINE_integer("repeats", 3, "timed repeats (best is reported)")
flags.DEFINE_integer("torch_threads", 2, "torch.set_num_threads for the transformers side")


def bench_config() -> models.ModelConfig:
    """The Qwen3.5-style hybrid this benchmark runs (see the module docstring)."""
    return models.ModelConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, rope_theta=10_000_000.0, rms_norm_eps=1e-6, tie_embeddings=True,
        model_type="qwen3_5_text", layer_types=("linear_attention",) * 3 + ("full_attention",),
        qk_norm=True, norm_plus_one=True, attn_output_gate=True, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=8192,
    )


# ----------------------------------------------------------------------------------------------- ours


@jax.jit
def _layer_prefill(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, cache: dict[str, jax.Array]):
    """One Gated DeltaNet layer, chunked, filling its cache: x `[batch, seq, hidden]` -> (y, cache)."""
    return nnx.merge(graphdef, state)(x, cache=cache)


def ours_layer_prefill(
    model: models.Transformer, x: np.ndarray, repeats: int
) -> tuple[float, float, np.ndarray]:
    """The first DeltaNet layer alone (the part this benchmark is about, without MLPs, attention, logits):
    (compile seconds, best run seconds, output `[batch, seq, hidden]`)."""
    graphdef, state = nnx.split(model.layers[0].linear_attn)
    xs = jnp.asarray(x)
    cache = GatedDeltaNet.init_cache(model.config, xs.shape[0])
    layer, compile_s = compile_seconds(_layer_prefill, graphdef, state, xs, cache)

    def run():
        y, _ = layer(graphdef, state, xs, cache)
        return np.asarray(jax.block_until_ready(y))

    seconds, y = best_time(run, repeats)
    return compile_s, seconds, y


# ----------------------------------------------------------------------------------------------- transformers


class TorchSide(cached_lm.TorchLM):
    """transformers' Qwen3_5ForCausalLM with our weights (via save_hf), or `available = False`."""

    def __init__(self, model: models.Transformer, threads: int) -> None:
        super().__init__(model, threads, "Qwen3_5ForCausalLM")

    def layer_prefill(self, x: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
        """HF's first Qwen3_5GatedDeltaNet alone, filling a fresh DynamicCache."""
        import transformers

        torch = self.torch
        xs = torch.as_tensor(x)
        layer = self.model.model.layers[0].linear_attn

        def run():
            cache = transformers.DynamicCache(config=self.model.config)
            with torch.inference_mode():
                return layer(hidden_states=xs, cache=cache).numpy()

        return best_time(run, repeats)


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    del argv
    config = bench_config()
    model = models.Transformer(config, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    hf = TorchSide(model, FLAGS.torch_threads)
    lines = [
        f"Qwen3.5-style hybrid ({params / 1e6:.2f}M params, layers {list(config.layer_types)}), fp32, "
        f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPUs, "
        f"load average before {load_average()}",
        "transformers side: " + (hf.version if hf.available else
                                  "not measured (torch/transformers not importable in this python)"),
        "",
    ]
    rng = np.random.default_rng(0)
    seqs = [int(s) for s in FLAGS.seq_lens.split(",")]
    lines += cached_lm.prefill_rows(model, hf, seqs, FLAGS.repeats, rng)

    lines += [
        "",
        "one Gated DeltaNet layer alone (chunked prefill filling its cache, batch 1, x ~ N(0, 1))",
        f"{'layer seq':>11} | {'compile s':>9} | {'ours ms':>9} | {'HF ms':>9} | {'HF/ours':>7} | "
        f"{'max|dy|':>9}",
    ]
    for seq in seqs:
        x = rng.standard_normal((1, seq, config.hidden_size)).astype(np.float32)
        c_ours, t_ours, y_ours = ours_layer_prefill(model, x, 5 * FLAGS.repeats)  # cheap calls: more repeats
        row = f"{seq:>11} | {c_ours:9.2f} | {t_ours * 1e3:9.2f} | "
        if hf.available:
            t_hf, y_hf = hf.layer_prefill(x, 5 * FLAGS.repeats)
            diff = float(np.abs(y_ours - y_hf).max())
            row += f"{t_hf * 1e3:9.2f} | {t_hf / t_ours:7.2f} | {diff:9.1e}"
        else:
            row += f"{'-':>9} | {'-':>7} | {'-':>9}"
        lines.append(row)
        logging.info(row)

    lines += ["", *cached_lm.decode_rows(model, hf, [int(b) for b in FLAGS.decode_batches.split(",")],
                                         FLAGS.decode_steps, FLAGS.decode_prompt, FLAGS.repeats, rng)]
    lines.append(f"load average after {load_average()}")
    print("\n".join(lines))  # noqa: T201 - the CLI's report


if __name__ == "__main__":
    app.run(main)
