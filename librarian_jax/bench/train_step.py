"""Benchmark of the GRPO train step: step time and tokens/s, full fine-tuning and LoRA.

    python -m librarian_jax.bench.train_step [--presets=tiny,decode_bench --rows=8 --seq=512 --repeats=3]

For each model preset (random weights, fp32 on CPU, the preset's dtype elsewhere) and each mode (full,
LoRA rank 8 on the attention and MLP projections), one `Trainer.update` is run to compile, then `repeats`
timed updates on the same `[rows, seq]` batch (half of each row is a loss-masked "generated" part).
tokens/s counts every row token (forward + backward over the whole row).
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from librarian_jax import models
from librarian_jax.rl import train_step as ts

FLAGS = flags.FLAGS
flags.DEFINE_list("presets", ["tiny", "decode_bench"], "model presets to time")
flags.DEFINE_list("modes", ["full", "lora"], "full and/or lora")
flags.DEFINE_integer("rows", 8, "rows per batch")
flags.DEFINE_integer("seq", 512, "tokens per row")
flags.DEFINE_integer("micro_batches", 1, "micro-batches per step")
flags.DEFINE_integer("repeats", 3, "timed steps")
flags.DEFINE_integer("lora_rank", 8, "LoRA rank")
flags.DEFINE_bool("remat", False, "rematerialise the forward pass")


def make_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, seq // 2:] = 1.0
    return {"tokens": rng.integers(0, vocab, (rows, seq)).astype(np.int32),
            "valid": np.ones((rows, seq), bool), "loss_mask": mask,
            "sampler_logprobs": np.full((rows, seq), -np.log(vocab), np.float32) * mask,
            "advantages": (rng.normal(size=(rows, 1)) * mask).astype(np.float32),
            "row_weights": np.ones((rows,), np.float32)}


def time_mode(preset: str, mode: str) -> dict[str, float]:
    overrides = {"dtype": "float32", "param_dtype": "float32"} if jax.default_backend() == "cpu" else {}
    model = models.Transformer(models.get_preset(preset, **overrides), rngs=nnx.Rngs(0))
    if mode == "lora":
        model = ts.apply_lora(model, FLAGS.lora_rank, 2.0 * FLAGS.lora_rank,
                              ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*")
    trainer = ts.Trainer(model, ts.TrainConfig(micro_batches=FLAGS.micro_batches, remat=FLAGS.remat))
    batch = make_batch(model.config.vocab_size, FLAGS.rows, FLAGS.seq)
    t0 = time.perf_counter()
    trainer.update(batch)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        trainer.update(batch)  # returns host floats: the step has finished
        times.append(time.perf_counter() - t0)
    step = float(np.median(times))
    return {"trainable": trainer.num_trainable, "compile_s": compile_s, "step_s": step,
            "tokens_per_s": FLAGS.rows * FLAGS.seq / step}


def main(argv: list[str]) -> None:
    del argv
    print(f"backend {jax.default_backend()} x{jax.device_count()}, batch [{FLAGS.rows}, {FLAGS.seq}], "  # noqa: T201
          f"micro_batches {FLAGS.micro_batches}, remat {FLAGS.remat}, median of {FLAGS.repeats}")
    for preset in FLAGS.presets:
        for mode in FLAGS.modes:
            r = time_mode(preset, mode)
            print(f"{preset:>12} {mode:>4}: {r['trainable']:>10,d} trainable | "  # noqa: T201
                  f"compile+first {r['compile_s']:6.1f}s | step {r['step_s'] * 1000:8.1f} ms | "
                  f"{r['tokens_per_s']:9.0f} tok/s")


if __name__ == "__main__":
    app.run(main)
