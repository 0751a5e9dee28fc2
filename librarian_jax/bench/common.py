"""What every benchmark shares: timing a call and reporting the machine's load alongside the figures."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from librarian_jax import models


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
