"""What every benchmark shares: timing a call and reporting the machine's load alongside the figures."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


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


def load_average() -> str:
    """The 1/5/15-minute load averages, e.g. "1.43 1.81 2.44" (figures on a shared machine need them)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"
