"""What every benchmark shares: timing a call and reporting the machine's load alongside the figures."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from librarian_jax import models
from librarian_jax.rl import train_step as ts


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(best wall time in seconds of `repeats` calls after one warm-up call, the last call's result)."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def first_and_best(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(wall time of the first call, which compiles or reads the persistent compilation cache; best wall time
    of `repeats` further calls, the steady state)."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    return first, best_time(fn, repeats)[0] if repeats > 0 else first


def alternate_best(
    fns: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, tuple[float, float, Any]]:
    """Per name (first call's wall time, best of ``repeats`` further calls, the last call's result), the
    calls of different names alternating so that a change of the shared machine's load hits them alike."""
    first, out = {}, {}
    for name, fn in fns.items():
        t = time.perf_counter()
        out[name] = fn()
        first[name] = time.perf_counter() - t
    best = dict(first) if repeats < 1 else dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            out[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: (first[name], best[name], out[name]) for name in fns}


def compile_seconds(jitted: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """Lowers and compiles a `jax.jit` function ahead of time for these arguments (static ones included, by
    their names): (the compiled executable, called with the non-static arguments only; the wall seconds of
    lowering + compiling). Benches report this apart from the steady state's run time."""
    t = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    return compiled, time.perf_counter() - t


def engine_program_seconds(engine: Any) -> dict[str, float]:
    """An engine's decode-round and first-bucket all-slot prefill programs, each lowered and compiled ahead
    of time on its own: their lower / compile seconds and the total `compile_s`."""
    programs, params = engine._programs, engine._program_params
    out: dict[str, float] = {}
    for name, fn, args in (("decode", programs.decode, engine._idle_decode_args()),
                           ("prefill", programs.prefill_all,
                            engine._idle_prefill_all_args(engine.prefill_buckets[0]))):
        t0 = time.perf_counter()
        lowered = fn.lower(params, engine.cache, *args)
        t1 = time.perf_counter()
        lowered.compile()
        out[f"{name}_lower_s"], out[f"{name}_compile_s"] = t1 - t0, time.perf_counter() - t1
    out["compile_s"] = sum(out.values())
    return out


def load_average() -> str:
    """The 1/5/15-minute load averages, e.g. "1.43 1.81 2.44" (figures on a shared machine need them)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def hf_causal_lm(config: models.ModelConfig, *, min_positions: int = 0, device: str = "cpu",
                 **hf_kwargs: Any) -> Any:
    """transformers' model of `config`'s own architecture, random weights in its parameter dtype:
    `AutoModelForCausalLM` from `models.hf_io.config_to_hf`, the config.json our checkpoints are saved with
    (`max_position_embeddings` raised to `min_positions`; `hf_kwargs` go to the config, e.g.
    `attn_implementation`), built on `device`. Needs torch and transformers."""
    import torch
    import transformers

    hf = models.config_to_hf(config)
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], min_positions)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf, **hf_kwargs), dtype=getattr(torch, config.param_dtype))


def make_batch(vocab: int, rows: int, seq: int, seed: int = 0, loss_mask: str = "all"
               ) -> dict[str, np.ndarray]:
    """Random training rows `[rows, seq]`; the loss mask covers positions 1.. ("all") or the second half."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, 1 if loss_mask == "all" else seq // 2:] = 1.0
    return {"tokens": rng.integers(0, vocab, (rows, seq)).astype(np.int32),
            "valid": np.ones((rows, seq), bool), "loss_mask": mask,
            "sampler_logprobs": np.full((rows, seq), -np.log(vocab), np.float32) * mask,
            "advantages": (rng.normal(size=(rows, 1)) * mask).astype(np.float32),
            "row_weights": np.ones((rows,), np.float32)}


def compile_abstract(model: nnx.Module, config: ts.TrainConfig, batch: dict[str, np.ndarray]
                     ) -> dict[str, float]:
    """Lowers and compiles the update of an abstract model (`nnx.eval_shape`) from shapes alone: params,
    AdamW state and batch are `jax.ShapeDtypeStruct`s, so nothing of the model's size is allocated."""
    config = ts._static_config(dataclasses.replace(config, remat=ts.remat_mode(config.remat)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = jax.eval_shape(ts.make_optimizer(config.optim).init, params)
    m = config.micro_batches
    arrays = dict(batch)
    if config.logits_chunk and config.logits_at == "loss":
        mask = np.asarray(arrays["loss_mask"]) > 0
        capacity = ts.positions_bucket(int(mask[:, 1:].sum(axis=1).max()), arrays["tokens"].shape[1])
        if capacity:
            arrays["positions"] = ts.loss_positions(arrays["loss_mask"], capacity)
    device_batch = {k: jax.ShapeDtypeStruct((m, v.shape[0] // m, *v.shape[1:]), v.dtype)
                    for k, v in arrays.items()}
    t0 = time.perf_counter()
    compiled = ts._update_step.lower(graphdef, config, None, params, opt_state, rest, None, device_batch,
                                     jax.ShapeDtypeStruct((), jnp.float32)).compile()
    out = {"compile_s": time.perf_counter() - t0}
    stats = compiled.memory_analysis()
    if stats is not None:
        out["temp_gib"] = stats.temp_size_in_bytes / 2**30
        out["peak_gib"] = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                           + stats.output_size_in_bytes - stats.alias_size_in_bytes) / 2**30
    return out
