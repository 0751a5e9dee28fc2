"""Benchmark of the GRPO train step: step time, tokens/s and compiled memory, full fine-tuning and LoRA.

    python -m librarian_jax.bench.train_step [--presets=tiny,decode_bench --rows=8 --seq=512 --repeats=3]
    # large vocabulary: logits chunked vs one [rows, seq, vocab] array, with/without per-layer remat
    python -m librarian_jax.bench.train_step --presets=tiny --vocab=65536 --rows=2 --seq=1024 --modes=full \\
        --logits_chunk=0,256 --remat=none,layer

For each model preset (random weights, fp32 on CPU, the preset's dtype elsewhere; `--vocab` overrides the
vocabulary), each mode (full, LoRA rank 8 on the attention and MLP projections), each `--remat` and each
`--logits_chunk`, one `Trainer.update` is run to compile, then `repeats` timed updates on the same
`[rows, seq]` batch (half of each row is a loss-masked "generated" part). tokens/s counts every row token
(forward + backward over the whole row). Memory is XLA's `memory_analysis()` of the compiled step on one
device: `temp` (activations, logits, gradients in flight) and `peak` (temp + arguments + outputs - donated).
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
flags.DEFINE_integer("vocab", 0, "vocabulary size override (0 = the preset's)")
flags.DEFINE_integer("rows", 8, "rows per batch")
flags.DEFINE_integer("seq", 512, "tokens per row")
flags.DEFINE_integer("micro_batches", 1, "micro-batches per step")
flags.DEFINE_integer("repeats", 3, "timed steps")
flags.DEFINE_integer("lora_rank", 8, "LoRA rank")
flags.DEFINE_list("remat", ["none"], "train.remat values to time: none | full | layer")
flags.DEFINE_list("logits_chunk", ["1024"], "train.logits_chunk values to time (0 = unchunked logits)")
flags.DEFINE_bool("memory_only", False, "only compile and report memory (no timed steps)")


def make_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, seq // 2:] = 1.0
    return {"tokens": rng.integers(0, vocab, (rows, seq)).astype(np.int32),
            "valid": np.ones((rows, seq), bool), "loss_mask": mask,
            "sampler_logprobs": np.full((rows, seq), -np.log(vocab), np.float32) * mask,
            "advantages": (rng.normal(size=(rows, 1)) * mask).astype(np.float32),
            "row_weights": np.ones((rows,), np.float32)}


def make_model(preset: str, mode: str) -> nnx.Module:
    overrides = {"dtype": "float32", "param_dtype": "float32"} if jax.default_backend() == "cpu" else {}
    if FLAGS.vocab:
        overrides["vocab_size"] = FLAGS.vocab
    model = models.Transformer(models.get_preset(preset, **overrides), rngs=nnx.Rngs(0))
    if mode == "lora":
        model = ts.apply_lora(model, FLAGS.lora_rank, 2.0 * FLAGS.lora_rank,
                              ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*")
    return model


def time_case(model: nnx.Module, remat: str, chunk: int) -> dict[str, float]:
    trainer = ts.Trainer(model, ts.TrainConfig(micro_batches=FLAGS.micro_batches, remat=remat,
                                               logits_chunk=chunk))
    batch = make_batch(model.config.vocab_size, FLAGS.rows, FLAGS.seq)
    t0 = time.perf_counter()
    mem = trainer.memory_analysis(batch) or {}
    out = {"trainable": trainer.num_trainable, "temp_gib": mem.get("temp_bytes", float("nan")) / 2**30,
           "peak_gib": mem.get("peak_bytes", float("nan")) / 2**30, "compile_s": time.perf_counter() - t0,
           "step_s": float("nan"), "tokens_per_s": float("nan")}
    if FLAGS.memory_only:
        return out
    trainer.update(batch)  # the compiled program is cached: this first step runs it (and warms up)
    times = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        trainer.update(batch)  # returns host floats: the step has finished
        times.append(time.perf_counter() - t0)
    out["step_s"] = float(np.median(times))
    out["tokens_per_s"] = FLAGS.rows * FLAGS.seq / out["step_s"]
    return out


def main(argv: list[str]) -> None:
    del argv
    print(f"backend {jax.default_backend()} x{jax.device_count()}, batch [{FLAGS.rows}, {FLAGS.seq}], "  # noqa: T201
          f"vocab {FLAGS.vocab or 'preset'}, micro_batches {FLAGS.micro_batches}, median of {FLAGS.repeats}")
    for preset in FLAGS.presets:
        for mode in FLAGS.modes:
            model = make_model(preset, mode)
            for remat in FLAGS.remat:
                for chunk in (int(c) for c in FLAGS.logits_chunk):
                    r = time_case(model, remat, chunk)
                    print(f"{preset:>12} {mode:>4} V={model.config.vocab_size:<7d} remat={remat:<5} "  # noqa: T201
                          f"chunk={chunk:<5d}: {r['trainable']:>10,d} trainable "
                          f"| compile {r['compile_s']:6.1f}s"
                          f" | temp {r['temp_gib']:7.3f} GiB peak {r['peak_gib']:7.3f} GiB | "
                          f"step {r['step_s'] * 1000:8.1f} ms | {r['tokens_per_s']:9.0f} tok/s")


if __name__ == "__main__":
    app.run(main)
