"""Benchmark of the GRPO train step: compile and run time, tokens/s, MFU, compiled memory, and transformers.

    python -m librarian_jax.bench.train_step [--presets=tiny,decode_bench --rows=8 --seq=512 --repeats=3]
    # side by side with transformers' forward + backward + AdamW (torch and transformers must import):
    /work/tvenv/bin/python -m librarian_jax.bench.train_step --presets=decode_bench --modes=full \\
        --rows=8 --seq=512
    # large vocabulary: logits chunked vs one [rows, seq, vocab] array, with/without per-layer remat
    python -m librarian_jax.bench.train_step --presets=tiny --vocab=65536 --rows=2 --seq=1024 --modes=full \\
        --logits_chunk=0,256 --remat=none,layer
    # compile time with the layers scanned (train.scan_layers) and one by one (the default); compile only
    # for a deep model (its optimizer state is never allocated: the step is lowered from abstract shapes)
    python -m librarian_jax.bench.train_step --presets=tiny --modes=full --rows=8 --seq=1152 \\
        --scan_layers=true,false
    python -m librarian_jax.bench.train_step --presets=qwen3_4b --modes=full --rows=1 --seq=1024 \\
        --scan_layers=true,false --compile_only
    # a run's steps of varying row counts: one program per row count (micro_batch_rows 0) against fixed
    # micro-batches of 4 rows (one program for every count): programs compiled, wall time with and without
    # compiling
    python -m librarian_jax.bench.train_step --presets=tiny --modes=full --seq=1280 --loss_mask=half \\
        --row_counts=16,12,20,4,16 --micro_batch_rows=0,4 --transformers=false

For each model preset (random weights, fp32 on CPU, the preset's dtype elsewhere; `--vocab` overrides the
vocabulary), each mode (full, LoRA rank 8 on the attention and MLP projections), each `--remat` and each
`--logits_chunk`, the update is compiled (`compile` = lower + compile, reported apart), run once to warm up,
then `repeats` timed updates on the same `[rows, seq]` batch; the median is reported. `--scan_layers`
lists the `train.scan_layers` values to time (each compiles its own program). `--compile_only`: the update is
lowered from abstract shapes (`jax.ShapeDtypeStruct`: no params, optimizer state or batch is allocated, so a
4B model's step can be compiled on a small machine) and compiled; nothing runs. tokens/s counts every
row token (forward + backward over the whole row). `--loss_mask`: "all" (default) puts every position but the
first in the loss, as transformers' cross-entropy over the whole batch does, so the two columns compute the
LM head and its softmax at the same positions; "half" masks in only the second half of each row (a GRPO row's
"generated" part), where a trainer that runs the LM head only at loss positions (`train.logits_at="loss"`)
does half the head's work.

MFU = 6 * N * tokens/s / peak, N = the parameters that take part in matmuls (every parameter but the
embedding table, which counts once when it is tied to the LM head; attention's score products are not
counted). The peak is `--peak_tflops` when given (e.g. 989 for an H200's dense bf16), else measured: the
best rate of a jitted `[1024, 1024] x [1024, 1024]` matmul in the step's dtype on this backend.

`--row_counts`: instead of one shape, a run's sequence of steps of those row counts (`--seq` tokens each),
once from nothing compiled (this bench uses no persistent compilation cache) and again with every program
compiled, for each `--micro_batch_rows` value: the update programs compiled, both wall times, their
difference (compiling) and the tokens/s of the compiled pass.

Memory is XLA's `memory_analysis()` of the compiled step on one device: `temp` (activations, logits, gradients
in flight) and `peak` (temp + arguments + outputs - donated).

transformers column (mode full, when torch and transformers import): `Qwen3ForCausalLM` built from the same
config (Qwen3-style presets: RoPE, qk-norm, GQA, tied embeddings), fp32, sdpa attention, next-token
cross-entropy over the whole batch, `clip_grad_norm_(1.0)`, `torch.optim.AdamW`; its steps alternate with
ours so both see the same machine load. `ratio` = our tokens/s / transformers' tokens/s.

GEMM line (with the transformers column): the step's largest matrix product, the MLP's `[rows * seq,
hidden] x [hidden, intermediate]`, in its forward form (`x @ W`) and its weight-gradient form (`x^T @ g`),
jitted by XLA and run by torch on the same threads, alternately, best of 10 each. Their ratio bounds what
the whole step can reach against transformers while XLA:CPU's matrix products are what they are: a step
made only of such products runs at that ratio.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from librarian_jax import models
from librarian_jax.bench.common import (
    alternate_best,
    compile_abstract,
    hf_causal_lm,
    load_average,
    make_batch,
)
from librarian_jax.rl import train_step as ts

FLAGS = flags.FLAGS
flags.DEFINE_list("presets", ["tiny", "decode_bench"], "model presets to time")
flags.DEFINE_list("modes", ["full", "lora"], "full and/or lora")
flags.DEFINE_integer("vocab", 0, "vocabulary size override (0 = the preset's)")
flags.DEFINE_integer("num_layers", 0, "decoder layers override (0 = the preset's; a uniform layer type)")
flags.DEFINE_integer("rows", 8, "rows per batch")
flags.DEFINE_integer("seq", 512, "tokens per row")
flags.DEFINE_integer("micro_batches", 1, "micro-batches per step")
flags.DEFINE_list("micro_batch_rows", ["0"], "train.micro_batch_rows values to time (0 = micro_batches "
                  "equal micro-batches in one program per row count; > 0 = micro-batches of this many rows)")
flags.DEFINE_list("row_counts", [], "time a run's steps of these row counts instead of one shape (see the "
                  "module doc)")
flags.DEFINE_enum("loss_mask", "all", ["all", "half"], "loss positions: every position (like transformers' "
                  "cross-entropy) or the second half of each row")
flags.DEFINE_integer("repeats", 3, "timed steps")
flags.DEFINE_integer("lora_rank", 8, "LoRA rank")
flags.DEFINE_list("remat", ["none"], "train.remat values to time: none | full | layer")
flags.DEFINE_list("logits_chunk", ["1024"], "train.logits_chunk values to time (0 = unchunked logits)")
flags.DEFINE_bool("memory_only", False, "only compile and report memory (no timed steps)")
flags.DEFINE_list("scan_layers", ["false"], "train.scan_layers values to time: true (layers under lax.scan) "
                  "and/or false (one by one: train.scan_layers' default)")
flags.DEFINE_bool("compile_only", False, "lower the update from abstract shapes and compile it (nothing "
                  "allocated, nothing run): compile time and memory of models too large for this machine")
flags.DEFINE_bool("transformers", True, "time transformers' forward + backward + AdamW beside ours "
                  "(mode full; needs torch and transformers)")
flags.DEFINE_float("peak_tflops", 0.0, "the chip's peak for MFU, TFLOP/s (0 = measure a matmul)")


def model_config(preset: str) -> models.ModelConfig:
    overrides = {"dtype": "float32", "param_dtype": "float32"} if jax.default_backend() == "cpu" else {}
    if FLAGS.vocab:
        overrides["vocab_size"] = FLAGS.vocab
    if FLAGS.num_layers:
        overrides["num_layers"] = FLAGS.num_layers
    return models.get_preset(preset, **overrides)


def make_model(preset: str, mode: str) -> nnx.Module:
    if FLAGS.compile_only:  # abstract: shapes and dtypes only
        model = nnx.eval_shape(lambda: models.Transformer(model_config(preset), rngs=nnx.Rngs(0)))
        if mode == "lora":
            raise app.UsageError("--compile_only times mode full only")
        return model
    model = models.Transformer(model_config(preset), rngs=nnx.Rngs(0))
    if mode == "lora":
        model = ts.apply_lora(model, FLAGS.lora_rank, 2.0 * FLAGS.lora_rank,
                              ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*")
    return model


def matmul_params(model: nnx.Module) -> int:
    """N of 6·N·tokens: every parameter but the embedding table (counted once when tied to the LM head)."""
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    config = model.config
    return n if config.tie_embeddings else n - config.vocab_size * config.hidden_size


def measured_peak_flops(dtype: jnp.dtype, size: int = 1024, repeats: int = 30) -> float:
    """FLOP/s of the best of `repeats` jitted `[size, size] x [size, size]` matmuls in `dtype`. Many short
    calls, not a few: on a shared CPU box a best of 5 read 0.107 TFLOP/s where the same process read 0.19 a
    moment earlier (a slow stretch covered all 5), and the MFU column moved with it."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def gemm_ceiling(config: models.ModelConfig, tokens: int, repeats: int = 10) -> dict[str, float] | None:
    """Seconds of the MLP's `[tokens, hidden] x [hidden, intermediate]` product and of its weight gradient
    `[hidden, tokens] x [tokens, intermediate]`, XLA (jitted) and torch, timed alternately (best of
    `repeats`); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, config.hidden_size), np.float32)
    w = rng.standard_normal((config.hidden_size, config.intermediate_size), np.float32)
    g = rng.standard_normal((tokens, config.intermediate_size), np.float32)
    jx, jw, jg = jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)
    tx, tw, tg = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(g)
    fwd, wgrad = jax.jit(lambda a, b: a @ b), jax.jit(lambda a, b: a.T @ b)
    cases = {"xla_fwd": lambda: fwd(jx, jw).block_until_ready(),
             "torch_fwd": lambda: tx @ tw,
             "xla_wgrad": lambda: wgrad(jx, jg).block_until_ready(),
             "torch_wgrad": lambda: tx.T @ tg}
    return {name: best for name, (_, best, _) in alternate_best(cases, repeats).items()}


def transformers_step(config: models.ModelConfig, batch: dict[str, np.ndarray]) -> Callable[[], None] | None:
    """One transformers forward + backward + clip + AdamW step on `batch["tokens"]` (a closure), or None when
    torch / transformers do not import, or for a model whose transformers CPU path is not its real one (Gated
    DeltaNet layers fall back to a reference PyTorch loop without flash-linear-attention; MoE experts).

    The model is the preset's own architecture, `bench.common.hf_causal_lm`, with SDPA attention."""
    try:
        import torch
        import transformers  # noqa: F401 - hf_causal_lm's; here only whether it imports
    except ImportError:
        return None
    if "linear_attention" in config.layer_types or config.num_experts:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = hf_causal_lm(config, min_positions=batch["tokens"].shape[1], attn_implementation="sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    ids = torch.as_tensor(batch["tokens"], dtype=torch.long)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def train_config(remat: str, chunk: int, scan: bool, micro_rows: int) -> ts.TrainConfig:
    """The timed update's config: the flags' micro-batching and one case's settings."""
    return ts.TrainConfig(micro_batches=FLAGS.micro_batches, micro_batch_rows=micro_rows, remat=remat,
                          logits_chunk=chunk, scan_layers=scan, scan_min_layers=0)


def programs() -> int:
    """Update programs compiled in this process so far (one-program updates, micro-batch and optimizer
    programs)."""
    return sum(f._cache_size() for f in (ts._update_step, ts._micro_step, ts._apply_step))


def time_run(model: nnx.Module, remat: str, chunk: int, scan: bool, micro_rows: int) -> str:
    """One line: a run's steps of `--row_counts` rows (padded to the trainer's row multiple), first
    compiling, then again compiled; tokens/s counts the real rows' tokens."""
    config = train_config(remat, chunk, scan, micro_rows)
    counts = [int(r) for r in FLAGS.row_counts]
    batches = [make_batch(model.config.vocab_size, r, FLAGS.seq, seed=i, loss_mask=FLAGS.loss_mask)
               for i, r in enumerate(counts)]
    trainer = ts.Trainer(model, config)
    m = trainer.row_multiple()  # padded as `rl.rows.build_rows` pads a run's rows (padding rows weigh 0)
    batches = [ts.pad_rows(b, -(-len(b["tokens"]) // m) * m, FLAGS.seq) for b in batches]
    before = programs()
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        for batch in batches:
            trainer.update(batch)
        walls.append(time.perf_counter() - t0)
    tokens = sum(counts) * FLAGS.seq
    return (f"micro_batch_rows={micro_rows}: rows {','.join(FLAGS.row_counts)} x {FLAGS.seq} | "
            f"{programs() - before} programs compiled | first pass {walls[0]:6.1f}s, compiled pass "
            f"{walls[1]:6.1f}s (compiling {walls[0] - walls[1]:5.1f}s) | {tokens / walls[1]:7.0f} tok/s "
            f"compiled")


def time_case(model: nnx.Module, remat: str, chunk: int, hf_step: Callable[[], None] | None,
              scan: bool = True, micro_rows: int = 0) -> dict[str, float]:
    config = train_config(remat, chunk, scan, micro_rows)
    batch = make_batch(model.config.vocab_size, FLAGS.rows, FLAGS.seq, loss_mask=FLAGS.loss_mask)
    nan = float("nan")
    if FLAGS.compile_only:
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        return {"trainable": n, "temp_gib": nan, "peak_gib": nan, "step_s": nan, "tokens_per_s": nan,
                "hf_step_s": nan, **compile_abstract(model, config, batch)}
    trainer = ts.Trainer(model, config)
    t0 = time.perf_counter()
    mem = trainer.memory_analysis(batch) or {}  # lowers and compiles the update (cached for `update`)
    out = {"trainable": trainer.num_trainable, "temp_gib": mem.get("temp_bytes", nan) / 2**30,
           "peak_gib": mem.get("peak_bytes", nan) / 2**30, "compile_s": time.perf_counter() - t0,
           "step_s": nan, "tokens_per_s": nan, "hf_step_s": nan}
    if FLAGS.memory_only:
        return out
    t0 = time.perf_counter()
    trainer.update(batch)  # the first step: runs the cached program (and warms up)
    out["first_step_s"] = time.perf_counter() - t0
    if hf_step is not None:
        hf_step()  # warm-up
    times, hf_times = [], []
    for _ in range(FLAGS.repeats):  # alternating, so both sides see the same load
        t0 = time.perf_counter()
        trainer.update(batch)  # returns host floats: the step has finished
        times.append(time.perf_counter() - t0)
        if hf_step is not None:
            t0 = time.perf_counter()
            hf_step()
            hf_times.append(time.perf_counter() - t0)
    out["step_s"] = float(np.median(times))
    out["tokens_per_s"] = FLAGS.rows * FLAGS.seq / out["step_s"]
    if hf_times:
        out["hf_step_s"] = float(np.median(hf_times))
    return out


def main(argv: list[str]) -> None:
    del argv
    tokens = FLAGS.rows * FLAGS.seq
    cpu = jax.default_backend() == "cpu"
    print(f"backend {jax.default_backend()} x{jax.device_count()}, batch [{FLAGS.rows}, {FLAGS.seq}], "  # noqa: T201
          f"vocab {FLAGS.vocab or 'preset'}, micro_batches {FLAGS.micro_batches}, "
          f"loss mask {FLAGS.loss_mask}, median of {FLAGS.repeats}, "
          f"load average before {load_average()}")
    for preset in FLAGS.presets:
        if FLAGS.peak_tflops:
            peak, how = FLAGS.peak_tflops * 1e12, "given"
        else:
            peak, how = measured_peak_flops(model_config(preset).jnp_dtype), "measured 1024^3 matmul"
        print(f"{preset}: peak for MFU {peak / 1e12:.3f} TFLOP/s ({how})")  # noqa: T201
        for mode in FLAGS.modes:
            model = make_model(preset, mode)
            n = matmul_params(model)
            hf_step = None
            if mode == "full" and FLAGS.transformers and not FLAGS.memory_only and not FLAGS.compile_only \
                    and cpu:
                hf_step = transformers_step(model.config, make_batch(model.config.vocab_size, FLAGS.rows,
                                                                     FLAGS.seq))
            if hf_step is not None:
                gemm = gemm_ceiling(model.config, tokens)
                if gemm is not None:
                    c = model.config
                    print(f"{preset:>12} GEMM [{tokens}, {c.hidden_size}] x [{c.hidden_size}, "  # noqa: T201
                          f"{c.intermediate_size}]: x@W XLA {gemm['xla_fwd'] * 1e3:.1f} ms / torch "
                          f"{gemm['torch_fwd'] * 1e3:.1f} ms "
                          f"(ratio {gemm['torch_fwd'] / gemm['xla_fwd']:.2f}x)"
                          f"; x^T@g XLA {gemm['xla_wgrad'] * 1e3:.1f} ms / torch "
                          f"{gemm['torch_wgrad'] * 1e3:.1f} ms (ratio "
                          f"{gemm['torch_wgrad'] / gemm['xla_wgrad']:.2f}x)")
            scans = [x.lower() in ("true", "1") for x in FLAGS.scan_layers]
            chunks = [int(c) for c in FLAGS.logits_chunk]
            micro = [int(r) for r in FLAGS.micro_batch_rows]
            for remat, chunk, scan, micro_rows in itertools.product(FLAGS.remat, chunks, scans, micro):
                if FLAGS.row_counts:
                    print(f"{preset:>12} {mode:>4} remat={remat} chunk={chunk} scan={scan}: "  # noqa: T201
                          f"{time_run(model, remat, chunk, scan, micro_rows)}", flush=True)
                    continue
                r = time_case(model, remat, chunk, hf_step, scan, micro_rows)
                mfu = 6 * n * r["tokens_per_s"] / peak
                line = (f"{preset:>12} {mode:>4} V={model.config.vocab_size:<7d} remat={remat:<5} "
                        f"chunk={chunk:<5d} scan={'on ' if scan else 'off'} micro_rows={micro_rows}: "
                        f"{r['trainable']:>10,d} "
                        f"trainable, N={n / 1e6:.1f}M "
                        f"| compile {r['compile_s']:6.1f}s | temp {r['temp_gib']:7.3f} GiB "
                        f"peak {r['peak_gib']:7.3f} GiB | step {r['step_s'] * 1000:8.1f} ms "
                        f"| {r['tokens_per_s']:7.0f} tok/s | MFU {mfu:6.1%}")
                if not np.isnan(r["hf_step_s"]):
                    hf_tps = tokens / r["hf_step_s"]
                    line += (f" | transformers {r['hf_step_s'] * 1000:8.1f} ms {hf_tps:7.0f} tok/s "
                             f"| ratio {r['tokens_per_s'] / hf_tps:5.2f}x")
                print(line, flush=True)  # noqa: T201
    print(f"load average after {load_average()}")  # noqa: T201


if __name__ == "__main__":
    app.run(main)
