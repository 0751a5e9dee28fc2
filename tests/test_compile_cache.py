"""The persistent compilation cache: a second process compiling the same program reads it from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from librarian_jax import compile_cache

# A program that takes a while to compile (an unrolled stack of matmuls and nonlinearities) run in a fresh
# process; reports the compile time and what `CompileClock` counted (programs, persistent-cache hits).
SCRIPT = r"""
import json, sys, time
import jax, jax.numpy as jnp
from librarian_jax import compile_cache
clock = compile_cache.CompileClock.get()
path = compile_cache.enable(sys.argv[1], min_compile_s=0.0)

def f(x):
    for i in range(40):
        x = jnp.tanh(x @ x.T + i) * jnp.sin(x) + jnp.cumsum(x, axis=i % 2)
    return x

t = time.perf_counter()
compiled = jax.jit(f).lower(jnp.ones((16, 16))).compile()
wall = time.perf_counter() - t
spent = clock.totals()
print(json.dumps(dict(path=path, compile_s=wall, hits=spent.cache_hits, programs=spent.programs,
                      clock_s=spent.compile_s + spent.lower_s)))
"""


def _run(cache_dir: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, cache_dir], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reads_the_compiled_program(tmp_path):
    cache_dir = str(tmp_path / "cache")
    first = _run(cache_dir)
    assert first["path"] == cache_dir and first["hits"] == 0
    assert first["programs"] >= 1 and 0 < first["clock_s"] <= first["compile_s"] * 1.05
    assert os.listdir(cache_dir)  # the program was written
    second = _run(cache_dir)
    assert second["hits"] >= 1 and second["programs"] == first["programs"]  # f, and the programs around it
    # Reading back is faster than compiling (by ~10x on an idle CPU; only the direction is asserted).
    assert second["compile_s"] < first["compile_s"]


@pytest.mark.parametrize("off", ["none", "off", ""])
def test_off(off):
    assert compile_cache.enable(off) is None


def test_default_dir(monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, "/tmp/somewhere")
    assert compile_cache.default_dir() == "/tmp/somewhere"
    monkeypatch.delenv(compile_cache.ENV)
    want = os.path.join(".cache", "librarian_jax", "jax_compilation_cache")
    assert compile_cache.default_dir().endswith(want)


def test_main_command_enables_it(tmp_path):
    """The main command turns the cache on with its settings before anything compiles: after `main.main` (a
    dry run, which compiles nothing) JAX's cache directory is the flag's and the entry thresholds are ours
    (red when `main` does not call `compile_cache.enable`: JAX's defaults stay)."""
    cache_dir = tmp_path / "main_cache"
    code = ("import sys, jax\n"
            "from absl import flags\n"
            "from librarian_jax import main\n"
            "argv = ['main', '--config=configs/grpo.py', '--dry_run',\n"
            f"        '--compilation_cache_dir={cache_dir}']\n"
            "flags.FLAGS(argv)\n"
            "main.main(argv[:1])\n"
            "print('CACHE', jax.config.jax_compilation_cache_dir,\n"
            "      jax.config.jax_persistent_cache_min_compile_time_secs,\n"
            "      jax.config.jax_persistent_cache_min_entry_size_bytes)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("CACHE "))
    assert line.split()[1:] == [str(cache_dir), "0.2", "0"], line
    assert cache_dir.is_dir() and not list(cache_dir.iterdir())  # nothing compiled, nothing written


def test_compile_clock_counts_each_new_program_once():
    """`CompileClock` (what the main command logs per step and in its summary): a program XLA compiles counts
    once, with its seconds; calling it again, or a program already compiled, adds nothing."""
    import jax
    import jax.numpy as jnp

    clock = compile_cache.CompileClock.get()
    assert compile_cache.CompileClock.get() is clock  # one listener per process
    x = jnp.ones((8, 8))
    y = x + 1
    before = clock.totals()
    f = jax.jit(lambda a: jnp.tanh(a @ a.T) + 0.125)  # a new function: a new program
    f(x)
    first = clock.since(before)
    assert first.programs == 1 and first.cache_hits == 0
    assert first.compile_s > 0 and first.trace_s > 0 and first.lower_s > 0
    assert first.total_s == first.compile_s + first.trace_s + first.lower_s
    assert first.line().startswith("1 programs ") and first.metrics()["compile/programs"] == 1.0
    again = clock.totals()
    f(x)
    f(y)
    assert clock.since(again) == compile_cache.CompileTotals()
    assert compile_cache.CompileTotals().line() == ""
