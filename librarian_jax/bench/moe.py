"""Qwen3.5-MoE prefill and decode: our grouped-by-expert routing vs transformers, and the share of routing.

    python -m librarian_jax.bench.moe [--seq_lens=128,512,2048] [--decode_batches=1,8] [--decode_steps=32]
        [--decode_prompt=128] [--repeats=3] [--torch_threads=2]

Model (`bench_config`): a Qwen3.5-MoE-style hybrid, hidden 256, 4 layers [linear, linear, linear, full]
(Gated DeltaNet 2 key / 4 value heads of 64; gated full attention 4 heads / 2 KV heads of 64, partial rotary
0.25), every layer a sparse MoE of 32 experts (top 4, width 128) plus a shared expert of 256; vocab 8000,
untied; random weights, fp32.

Prefill: one cached call over `seq` tokens at batch 1, all logits computed (as HF's forward). Decode:
`decode_steps` greedy tokens after a `decode_prompt`-token prefill; ours one jitted on-device `lax.scan`,
transformers a Python loop over `model(input_ids=tok, cache=cache)`. Best of `repeats` after a warm-up.
Our side compiles ahead of time first; the `compile s` columns are that lowering + compile, apart from the
run times.

Routing share: one MoE layer alone on `seq` hidden states (batch 1): `moe` is the whole block (router,
routed experts, shared expert); `routing` is everything of it that is not an expert matmul: router logits,
softmax / top-k, the sort into expert groups (tiles on CPU), the scatter of rows into groups and the gather
and weighted sum back. The HF columns time its `gate` (router) and its whole block (the kernel transformers
picks for `experts_implementation` is printed).

The transformers side (`Qwen3_5MoeForCausalLM` loaded from our `save_hf` export, identical weights) runs only
when torch and transformers import (an interpreter with both jax and torch, e.g. a venv holding torch,
transformers 5.x, jax and flax with this repository on PYTHONPATH); otherwise only our figures are printed.
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
from librarian_jax.models import moe as moe_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("seq_lens", "128,512,2048", "comma-separated prefill lengths (batch 1)")
flags.DEFINE_string("decode_batches", "1,8", "comma-separated decode batch sizes")
flags.DEFINE_integer("decode_steps", 32, "greedy tokens decoded per row")
flags.DEFINE_integer("decode_prompt", 128, "prompt tokens prefilled before decoding")
flags.DEFINE_integer("repeats", 3, "timed repeats (best is reported)")
flags.DEFINE_integer("torch_threads", 2, "torch.set_num_threads for the transformers side")


def bench_config() -> models.ModelConfig:
    """The Qwen3.5-MoE-style hybrid this benchmark runs (see the module docstring)."""
    return models.get_preset(
        "tiny_moe", vocab_size=8000, hidden_size=256, intermediate_size=128, num_heads=4, num_kv_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, max_position_embeddings=8192,
    )


# ----------------------------------------------------------------------------------------------- ours


@jax.jit
def _moe_block(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(x)


@jax.jit
def _routing_only(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array) -> jax.Array:
    """The MoE block without its matmuls: router, top-k, grouping, scatter into groups, gather and combine."""
    block = nnx.merge(graphdef, state)
    xf = x.reshape(-1, x.shape[-1])
    _, top_w, top_i = moe_lib.route(block.gate(xf), block.top_k)
    t, k = top_i.shape
    ne = block.num_experts
    plan = moe_lib.Plan(top_i.reshape(-1), ne, moe_lib._implementation())
    rows = plan.scatter(jnp.repeat(xf, k, axis=0))
    y = plan.gather(rows).astype(jnp.float32) * top_w.reshape(-1, 1)
    return jnp.sum(y.reshape(t, k, -1), axis=1).astype(x.dtype)


def ours_routing_share(
    model: models.Transformer, x: np.ndarray, repeats: int
) -> tuple[float, float, float]:
    """(compile seconds of the block, seconds of one MoE block, seconds of its routing alone) on hidden states
    x `[1, seq, hidden]`."""
    graphdef, state = nnx.split(model.layers[0].mlp)
    xs = jnp.asarray(x)
    block, compile_s = compile_seconds(_moe_block, graphdef, state, xs)
    routing, _ = compile_seconds(_routing_only, graphdef, state, xs)
    t_moe, _ = best_time(lambda: jax.block_until_ready(block(graphdef, state, xs)), repeats)
    t_route, _ = best_time(lambda: jax.block_until_ready(routing(graphdef, state, xs)), repeats)
    return compile_s, t_moe, t_route


# ----------------------------------------------------------------------------------------------- transformers


class TorchSide(cached_lm.TorchLM):
    """transformers' Qwen3_5MoeForCausalLM with our weights (via save_hf), or `available = False`."""

    def __init__(self, model: models.Transformer, threads: int) -> None:
        super().__init__(model, threads, "Qwen3_5MoeForCausalLM")
        if self.available:
            impl = getattr(self.model.config, "_experts_implementation", None)
            self.version += f", experts_implementation={impl}"

    def routing_share(self, x: np.ndarray, repeats: int) -> tuple[float, float]:
        torch = self.torch
        block = self.model.model.layers[0].mlp
        xs = torch.as_tensor(x)
        flat = xs.reshape(-1, xs.shape[-1])
        with torch.inference_mode():
            t_moe, _ = best_time(lambda: block(xs), repeats)
            t_route, _ = best_time(lambda: block.gate(flat), repeats)
        return t_moe, t_route


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    del argv
    config = bench_config()
    model = models.Transformer(config, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    active = params - config.num_layers * (config.num_experts - config.num_experts_per_tok) * 3 * \
        config.hidden_size * config.moe_intermediate_size
    hf = TorchSide(model, FLAGS.torch_threads)
    lines = [
        f"Qwen3.5-MoE-style hybrid ({params / 1e6:.2f}M params, {active / 1e6:.2f}M active; "
        f"{config.num_experts} experts top-{config.num_experts_per_tok} + shared, "
        f"layers {list(config.layer_types)}), fp32, "
        f"grouped matmul '{moe_lib._implementation()}', jax {jax.__version__} on {jax.devices()[0].platform} "
        f"x{jax.device_count()}, {os.cpu_count()} CPUs, load average before {load_average()}",
        "transformers side: " + (hf.version if hf.available else
                                  "not measured (torch/transformers not importable in this python)"),
        "",
    ]
    rng = np.random.default_rng(0)
    seqs = [int(s) for s in FLAGS.seq_lens.split(",")]
    lines += cached_lm.prefill_rows(model, hf, seqs, FLAGS.repeats, rng)
    lines += ["", *cached_lm.decode_rows(model, hf, [int(b) for b in FLAGS.decode_batches.split(",")],
                                         FLAGS.decode_steps, FLAGS.decode_prompt, FLAGS.repeats, rng)]

    lines += [
        "",
        "one MoE block alone (batch 1, x ~ N(0, 1)): routing = router + top-k + grouping + scatter/gather",
        f"{'tokens':>11} | {'compile s':>9} | {'ours moe ms':>11} | {'routing ms':>10} | {'share':>6} | "
        f"{'HF moe ms':>9} | {'HF router ms':>12} | {'share':>6}",
    ]
    for seq in [1, 8, *seqs]:
        x = rng.standard_normal((1, seq, config.hidden_size)).astype(np.float32)
        c_moe, t_moe, t_route = ours_routing_share(model, x, 5 * FLAGS.repeats)
        row = (f"{seq:>11} | {c_moe:9.2f} | {t_moe * 1e3:11.3f} | {t_route * 1e3:10.3f} | "
               f"{t_route / t_moe:6.0%} | ")
        if hf.available:
            h_moe, h_route = hf.routing_share(x, 5 * FLAGS.repeats)
            row += f"{h_moe * 1e3:9.3f} | {h_route * 1e3:12.3f} | {h_route / h_moe:6.0%}"
        else:
            row += f"{'-':>9} | {'-':>12} | {'-':>6}"
        lines.append(row)
        logging.info(row)
    lines.append(f"load average after {load_average()}")
    print("\n".join(lines))  # noqa: T201 - the CLI's report


if __name__ == "__main__":
    app.run(main)
