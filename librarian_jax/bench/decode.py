"""Decode throughput: ``engine.generate`` vs Hugging Face ``generate`` vs the matmul-only limit.

    python -m librarian_jax.bench.decode [--batches=32,1] [--new_tokens=128] [--prompt_len=16] [--repeats=3]
        [--compilation_cache_dir=none]

Model: the ``decode_bench`` preset (Qwen3-style, ~12M params: hidden 384, 6 layers, 6 heads / 2 KV heads,
head_dim 64, intermediate 1024, vocab 8000, tied embeddings), random weights, fp32, greedy, KV cache on.
The HF side (PyTorch CPU, ``torch.set_num_threads(2)``, the same config as ``Qwen3ForCausalLM``) runs only
when torch and transformers import (e.g. ``/work/tvenv/bin/python -m librarian_jax.bench.decode``); otherwise
only our figures are printed. The limit is the time of the same decode steps' matrix products alone: a jitted
loop of ``new_tokens`` steps of the projections, MLP and LM head at the same batch, without attention, norms,
sampling or cache updates.

Each line gives the first call's wall time (compilation, or reading the persistent compilation cache that
`--compilation_cache_dir` points at, plus one run) apart from the steady state (best of `--repeats`), and the
steady state's ratio to the limit and to transformers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from librarian_jax import compile_cache, models
from librarian_jax.bench.common import best_time, first_and_best, load_average
from librarian_jax.engine import generate

FLAGS = flags.FLAGS
flags.DEFINE_string("batches", "32,1", "comma-separated batch sizes")
flags.DEFINE_integer("new_tokens", 128, "new tokens per row")
flags.DEFINE_integer("prompt_len", 16, "prompt tokens per row")
flags.DEFINE_integer("repeats", 3, "timed repeats (best is reported)")
flags.DEFINE_string("preset", "decode_bench", "model preset")
flags.DEFINE_string("compilation_cache_dir", None, "compilation cache dir (default: compile_cache's); none")


def matmul_limit_seconds(config: models.ModelConfig, batch: int, steps: int, repeats: int) -> float:
    """Time of ``steps`` decode steps' matrix products alone (one jitted ``fori_loop``)."""
    rng = np.random.default_rng(0)
    h, q, kv, f, v = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    )

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)

    layers = [
        dict(q=w(h, q), k=w(h, kv), v=w(h, kv), o=w(q, h), gate=w(h, f), up=w(h, f), down=w(f, h))
        for _ in range(config.num_layers)
    ]
    head = w(h, v)

    @jax.jit
    def run(x: jax.Array) -> jax.Array:
        def step(_, x):
            for p in layers:
                a = x @ p["q"]
                kk = x @ p["k"]
                vv = x @ p["v"]
                x = x + a @ p["o"] + (kk.sum() + vv.sum()) * 1e-9
                x = x + (x @ p["gate"] * (x @ p["up"])) @ p["down"]
            logits = x @ head
            return x + logits[:, :1] * 1e-9

        return jax.lax.fori_loop(0, steps, step, x)

    x0 = jnp.ones((batch, h), jnp.float32)
    return best_time(lambda: run(x0).block_until_ready(), repeats)[0]


def hf_seconds(
    config: models.ModelConfig, prompts: np.ndarray, new_tokens: int, repeats: int
) -> float | None:
    """Time of HF transformers' greedy ``generate`` on the same config (None without torch/transformers)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.set_num_threads(2)
    torch.manual_seed(0)
    hf_config = transformers.Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        tie_word_embeddings=True,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=4096,
    )
    model = transformers.Qwen3ForCausalLM(hf_config).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long)
    attention = torch.ones_like(ids)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + new_tokens

    return best_time(run, repeats)[0]


def main(argv: list[str]) -> None:
    del argv
    cache_dir = compile_cache.enable(FLAGS.compilation_cache_dir)
    config = models.get_preset(FLAGS.preset)
    model = models.Transformer(config, rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    lines = [
        f"decode bench: preset {FLAGS.preset} ({params / 1e6:.1f}M params), prompt {FLAGS.prompt_len}, "
        f"{FLAGS.new_tokens} new tokens, greedy, {jax.devices()[0].platform} x{jax.device_count()}, "
        f"load average before {load_average()}; compilation cache {cache_dir or 'off'}"
    ]
    rng = np.random.default_rng(0)
    for batch in [int(b) for b in FLAGS.batches.split(",")]:
        prompts = rng.integers(0, config.vocab_size, size=(batch, FLAGS.prompt_len))
        tokens = batch * FLAGS.new_tokens

        def ours(prompts: np.ndarray = prompts) -> None:
            out = generate(model, prompts.tolist(), FLAGS.new_tokens)
            assert all(len(o) == FLAGS.new_tokens for o in out)

        t_first, t_ours = first_and_best(ours, FLAGS.repeats)
        t_limit = matmul_limit_seconds(config, batch, FLAGS.new_tokens, FLAGS.repeats)
        t_hf = hf_seconds(config, prompts, FLAGS.new_tokens, FLAGS.repeats)
        line = (
            f"batch {batch:3d}: first call {t_first:6.2f} s (compile {max(t_first - t_ours, 0.0):6.2f} s) | "
            f"generate {tokens / t_ours:9.1f} tok/s | "
            f"matmul limit {tokens / t_limit:9.1f} tok/s "
            f"(ours = {t_limit / t_ours:.2f} of limit)"
        )
        if t_hf is None:
            line += " | transformers: not measured (torch/transformers not importable in this python)"
        else:
            line += f" | transformers {tokens / t_hf:9.1f} tok/s (ours = {t_hf / t_ours:.2f}x)"
        lines.append(line)
        logging.info(line)
    lines.append(f"load average after {load_average()}")
    print("\n".join(lines))  # noqa: T201 - a CLI report


if __name__ == "__main__":
    app.run(main)
