"""Compile time against depth: the engine's prefill and decode programs and the train step, scanned and not.

    python -m librarian_jax.bench.compile [--depths=4,8,16,32,36] [--preset=tiny] [--parts=engine,train]
        [--scan_layers=false,true] [--batch=4 --prompt_len=64 --new_tokens=32] [--rows=8 --seq=512]
        [--repeats=3] [--abstract_presets=qwen3_4b,qwen3_5_4b --abstract_batches=1,64]

For each depth (the preset with `num_layers` overridden: a uniform stack of its layer type, random weights,
fp32 on the CPU) and each `--scan_layers` value:

- engine: the engine `engine.generate` builds for `--batch` prompts of `--prompt_len` tokens and
  `--new_tokens` new ones (`Engine(scan_layers=...)`); its decode-round program and its all-slot prefill
  program (the first bucket) are lowered and compiled ahead of time, each timed on its own (lower / compile
  seconds), then `generate` runs (greedy) and its steady state is timed (best of `--repeats`): ms per
  generated token, the two settings' calls alternating so that a change of the shared machine's load hits
  both alike, and the ratio of the unrolled engine's time to the scanned one's (1.00 = as fast; 0.80 = the
  scan takes 25% longer).
- train: the GRPO update (`rl.train_step.Trainer`, full fine-tuning, AdamW, `train.scan_layers`) on a random
  `[--rows, --seq]` batch: lower + compile of the update program, then the best of `--repeats` steps, the
  settings' steps alternating.

The compilation cache is off in this bench (every figure is a real compile) and each program is new to the
process. A line per (part, depth, scan) as it is measured, then one table per part: compile seconds by depth,
unrolled and scanned, each depth's compile over the shallowest depth's (the "within 2x" question) and the
step ratio.

`--abstract_presets` (e.g. the paper's `qwen3_4b,qwen3_5_4b`): lower and compile, from abstract shapes
(`jax.ShapeDtypeStruct`: nothing of the model's size is allocated), one decode round of the engine at each
`--abstract_batches` slot count (`--prompt_len` + `--new_tokens` positions) and one train step (`--rows` x
`--seq`; LoRA off, mode full), scanned and not; nothing runs. `--abstract_timeout_s` skips the rest of a
preset after a compile that took longer.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from librarian_jax import models
from librarian_jax.bench.common import (
    alternate_best,
    compile_abstract,
    engine_program_seconds,
    load_average,
    make_batch,
)
from librarian_jax.engine import generate
from librarian_jax.engine import slots as slot_programs
from librarian_jax.engine.engine import generate_engine
from librarian_jax.models.cache import stack_cache
from librarian_jax.models.transformer import scan_plan, stack_layers
from librarian_jax.rl import train_step as ts

FLAGS = flags.FLAGS
flags.DEFINE_list("depths", ["4", "8", "16", "32", "36"], "decoder layer counts to compile")
flags.DEFINE_string("preset", "tiny", "model preset whose width and layer type each depth uses")
flags.DEFINE_list("parts", ["engine", "train"], "what to measure: engine and/or train")
flags.DEFINE_list("scan_layers", ["false", "true"], "scan_layers values to measure")
flags.DEFINE_integer("batch", 4, "engine: prompts per generate call (the decode batch)")
flags.DEFINE_integer("prompt_len", 64, "engine: prompt tokens")
flags.DEFINE_integer("new_tokens", 32, "engine: new tokens per prompt")
flags.DEFINE_integer("rows", 8, "train: rows per batch")
flags.DEFINE_integer("seq", 512, "train: tokens per row")
flags.DEFINE_integer("repeats", 3, "timed repeats of each steady state")
flags.DEFINE_list("abstract_presets", [], "presets compiled from abstract shapes (decode round, train step)")
flags.DEFINE_list("abstract_batches", ["1", "64"], "engine slot counts of the abstract decode rounds")
flags.DEFINE_float("abstract_timeout_s", 600.0, "after a compile longer than this, skip the preset's rest")


def _config(preset: str, depth: int | None = None) -> models.ModelConfig:
    overrides: dict[str, Any] = {"dtype": "float32", "param_dtype": "float32"} \
        if jax.default_backend() == "cpu" else {}
    if depth:
        overrides["num_layers"] = depth
    return models.get_preset(preset, **overrides)


def _lower_compile(jitted: Any, *args: Any, **kwargs: Any) -> tuple[float, float]:
    """(lower seconds, compile seconds) of a `jax.jit` function for these arguments."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def engine_compile(model: nnx.Module, scan: bool) -> dict[str, float]:
    """The decode-round and all-slot prefill programs of `generate`'s engine, lowered and compiled ahead."""
    return engine_program_seconds(
        generate_engine(model, FLAGS.batch, FLAGS.prompt_len, FLAGS.new_tokens, scan_layers=scan))


def engine_steps(model: nnx.Module, scans: list[bool]) -> tuple[dict[bool, float], dict[bool, Any]]:
    """ms per generated token of `generate`'s steady state for each scan setting, the settings' calls
    alternating (best of `--repeats` each), and each setting's tokens."""
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size,
                                                (FLAGS.batch, FLAGS.prompt_len)).tolist()

    def call(scan: bool) -> Any:
        return generate(model, prompts, FLAGS.new_tokens, scan_layers=scan)

    fns = {scan: functools.partial(call, scan) for scan in scans}
    timed = alternate_best(fns, FLAGS.repeats)
    return ({scan: 1e3 * best / FLAGS.new_tokens for scan, (_, best, _) in timed.items()},
            {scan: out for scan, (_, _, out) in timed.items()})


def train_cases(model: nnx.Module, scans: list[bool]) -> dict[bool, dict[str, float]]:
    """Per scan setting: the update's lower + compile, then the median of `--repeats` steps, the settings'
    steps alternating."""
    batch = make_batch(model.config.vocab_size, FLAGS.rows, FLAGS.seq)
    trainers, out = {}, {}
    for scan in scans:
        config = ts.TrainConfig(scan_layers=scan, scan_min_layers=0, logits_chunk=1024)
        trainers[scan] = ts.Trainer(model, config)
        t0 = time.perf_counter()
        trainers[scan].memory_analysis(batch)  # lowers and compiles the update (cached for `update`)
        out[scan] = {"compile_s": time.perf_counter() - t0}
    fns = {scan: functools.partial(trainers[scan].update, batch) for scan in scans}
    timed = alternate_best(fns, FLAGS.repeats)
    for scan, (_, best, _) in timed.items():
        out[scan]["step_ms"] = 1e3 * best
    return out


def abstract_decode(config: models.ModelConfig, batch: int, scan: bool) -> tuple[float, float]:
    """(lower s, compile s) of one decode round of an engine of `batch` slots for `config`, from shapes."""
    model = nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    capacity = FLAGS.prompt_len + FLAGS.new_tokens
    plan = scan_plan(list(model.layers), model) if scan else None
    if plan is not None and not plan.period:
        plan = None
    cache = jax.eval_shape(lambda: models.init_cache(config, batch, capacity))
    params: Any = state
    if plan is not None:
        cache = jax.eval_shape(lambda: stack_cache(models.init_cache(config, batch, capacity), plan.period,
                                                   plan.periods))
        stacked = jax.eval_shape(lambda st: stack_layers(list(nnx.merge(graphdef, st).layers), plan).states,
                                 state)
        params = (state, stacked)
    programs = slot_programs.programs(graphdef, None, capacity, 32, False, plan is not None)
    zi = jax.ShapeDtypeStruct((batch,), jnp.int32)
    zf = jax.ShapeDtypeStruct((batch,), jnp.float32)
    zb = jax.ShapeDtypeStruct((batch,), jnp.bool_)
    stops = jax.ShapeDtypeStruct((batch, 8), jnp.int32)
    return _lower_compile(programs.decode, params, cache, zi, zb, zi, stops, zf, zf, zi, zi, zi)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _table(part: str, results: dict[tuple[int, bool], dict[str, float]], scans: list[bool]) -> None:
    depths = sorted({d for d, _ in results})
    base = depths[0]
    head = ["depth"]
    for s in scans:
        name = "scan" if s else "unrolled"
        head += [f"{name} compile s", f"{name} / {base} layers", f"{name} step ms"]
    if len(scans) == 2:
        head.append("step unrolled / scan")
    print(f"\n{part}: compile (lower + compile) and steady step by depth")  # noqa: T201
    print(" | ".join(head))  # noqa: T201
    for d in depths:
        row = [str(d)]
        for s in scans:
            r = results.get((d, s))
            if r is None:
                row += ["-", "-", "-"]
                continue
            row += [f"{r['compile_s']:.2f}", _ratio(r["compile_s"], results[(base, s)]["compile_s"]),
                    f"{r['step_ms']:.2f}"]
        if len(scans) == 2 and (d, False) in results and (d, True) in results:
            row.append(_ratio(results[(d, True)]["step_ms"] ** -1, results[(d, False)]["step_ms"] ** -1))
        print(" | ".join(row))  # noqa: T201


def main(argv: list[str]) -> None:
    del argv
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # every figure a real compile
    try:
        run()
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


def run() -> None:
    scans = [x.strip().lower() in ("true", "1") for x in FLAGS.scan_layers]
    print(f"compile bench: preset {FLAGS.preset}, backend {jax.default_backend()} x{jax.device_count()}, "  # noqa: T201
          f"engine batch {FLAGS.batch} x ({FLAGS.prompt_len} + {FLAGS.new_tokens}), train [{FLAGS.rows}, "
          f"{FLAGS.seq}], load average before {load_average()}", flush=True)
    tables: dict[str, dict[tuple[int, bool], dict[str, float]]] = {p: {} for p in FLAGS.parts}
    for depth in [int(d) for d in FLAGS.depths]:
        model = models.Transformer(_config(FLAGS.preset, depth), rngs=nnx.Rngs(0))
        for part in FLAGS.parts:
            if part == "engine":
                results = {scan: engine_compile(model, scan) for scan in scans}
                steps, outs = engine_steps(model, scans)
                for scan in scans:
                    results[scan]["step_ms"] = steps[scan]
                if len(outs) == 2:
                    same = sum(a == b for a, b in zip(outs[False], outs[True], strict=True))
                    print(f"engine depth {depth}: scanned tokens equal the unrolled in {same}/"  # noqa: T201
                          f"{len(outs[False])} rows", flush=True)
            else:
                results = train_cases(model, scans)
            for scan, r in results.items():
                tables[part][(depth, scan)] = r
                extra = " ".join(f"{k} {v:.2f}" for k, v in r.items()
                                 if k.endswith("_s") and k != "compile_s")
                print(f"{part} depth {depth} scan {'on ' if scan else 'off'}: compile {r['compile_s']:.2f}s"  # noqa: T201
                      f"{f' ({extra})' if extra else ''} | step {r['step_ms']:.2f} ms | "
                      f"load {load_average()}", flush=True)
        del model
    for part, results in tables.items():
        if results:
            _table(part, results, scans)
    for preset in FLAGS.abstract_presets:
        config = models.get_preset(preset)  # its own dtypes (bf16 for the 4B presets): what a GPU compiles
        print(f"\n{preset} ({config.num_layers} layers, hidden {config.hidden_size}, {config.dtype}), "  # noqa: T201
              "from abstract shapes:", flush=True)
        skip = False
        for scan in scans:
            for b in [int(x) for x in FLAGS.abstract_batches]:
                if skip:
                    break
                lo, co = abstract_decode(config, b, scan)
                print(f"  decode round, {b} slots, scan {'on ' if scan else 'off'}: lower {lo:.1f}s compile "  # noqa: T201
                      f"{co:.1f}s | load {load_average()}", flush=True)
                skip = co > FLAGS.abstract_timeout_s
            if skip:
                print("  (rest skipped: --abstract_timeout_s)")  # noqa: T201
                break
            model = nnx.eval_shape(lambda config=config: models.Transformer(config, rngs=nnx.Rngs(0)))
            tc = ts.TrainConfig(scan_layers=scan, scan_min_layers=0, logits_chunk=1024, remat="full")
            r = compile_abstract(model, tc, make_batch(config.vocab_size, FLAGS.rows, FLAGS.seq))
            print(f"  train step [{FLAGS.rows}, {FLAGS.seq}] full fine-tuning, remat full, scan "  # noqa: T201
                  f"{'on ' if scan else 'off'}: lower + compile {r['compile_s']:.1f}s | "
                  f"load {load_average()}", flush=True)
            skip = r["compile_s"] > FLAGS.abstract_timeout_s
    print(f"load average after {load_average()}")  # noqa: T201


if __name__ == "__main__":
    app.run(main)
