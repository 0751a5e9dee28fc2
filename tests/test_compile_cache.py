"""The persistent compilation cache: a second process compiling the same program reads it from disk."""

from __future__ import annotations

import json
import os
import re
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
            "argv = ['main', '--config=configs/grpo.py:embedded', '--dry_run',\n"
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
    assert line.split()[1:] == [str(cache_dir), "0.0", "0"], line  # every program is written
    # nothing of ours compiled (bm25s's import runs one `jax.lax.top_k` to probe JAX; written, as every
    # program now is)
    assert cache_dir.is_dir()
    assert [p.name for p in cache_dir.iterdir() if not p.name.startswith("jit_top_k-")] == []


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


# Each of 2 JAX processes (localhost coordinator) compiles a program on its own first device: what a
# multi-process run's process-local engines do. Prints this process's CompileClock reading.
LOCAL_PROGRAM = r"""
import json, os, sys
from librarian_jax import compile_cache, distributed
assert distributed.initialize()
import jax, jax.numpy as jnp
compile_cache.enable(sys.argv[1])
clock = compile_cache.CompileClock.get()
before = clock.totals()
x = jax.device_put(jnp.ones((16, 16)), jax.local_devices()[0])
f = jax.jit(lambda a: [a := jnp.tanh(a @ a.T + i) for i in range(8)][-1])
f(x).block_until_ready()
spent = clock.since(before)
print("CLOCK", jax.process_index(), json.dumps(dict(programs=spent.programs, hits=spent.cache_hits)))
"""


def _two_processes(tmp_path, cache_dir: str) -> dict[int, dict]:
    from multiproc import free_port, launch_env, wait_all

    port, procs, logs = free_port(), [], []
    for i in range(2):
        env = {**launch_env(), "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i), "XLA_FLAGS": ""}
        logs.append(str(tmp_path / f"p{i}.log"))
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", LOCAL_PROGRAM, cache_dir], env=env, stdout=f,
                                          stderr=subprocess.STDOUT))
    wait_all(procs, logs, 240)
    out = {}
    for log in logs:
        line = next(ln for ln in open(log).read().splitlines() if ln.startswith("CLOCK "))
        _, pid, body = line.split(" ", 2)
        out[int(pid)] = json.loads(body)
    return out


def test_every_process_writes_and_reads_its_own_programs(tmp_path):
    """Process 1's process-local programs are written too (JAX alone writes from process 0 only, and their
    keys name process 1's devices), so a second launch of the same 2-process job compiles nothing new in
    either process (red without `compile_cache._write_local_programs`: process 1 reads 0 programs back)."""
    cache_dir = str(tmp_path / "cache")
    first = _two_processes(tmp_path, cache_dir)
    assert all(r["programs"] >= 1 and r["hits"] == 0 for r in first.values()), first
    second = _two_processes(tmp_path, cache_dir)
    for pid in (0, 1):
        assert second[pid]["programs"] == first[pid]["programs"], (pid, first, second)
        assert second[pid]["hits"] == second[pid]["programs"], (pid, second)  # nothing compiled anew


def _dry_run_compile(cache_dir: str) -> tuple[int, int, str]:
    """`main --config=configs/grpo.py --dry_run --compile` in a fresh process: (programs it compiled, read
    from the persistent cache, its output)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "librarian_jax.main", "--config=configs/grpo.py:embedded",
                          "--dry_run", "--compile", f"--compilation_cache_dir={cache_dir}"], cwd=root,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"compiled ahead: (\d+) programs .*this process: (\d+) programs compiled, (\d+) from the "
                  r"persistent cache", out.stdout)
    assert m, out.stdout[-3000:]
    assert int(m.group(1)) >= 40, out.stdout  # the policy engine's prefill buckets x slots x lengths, decode
    return int(m.group(2)), int(m.group(3)), out.stdout


def test_a_second_process_compiles_none_of_the_embedded_defaults_programs(tmp_path):
    """`--dry_run --compile` builds the embedded default's run and compiles its engines' programs (every
    prefill bucket and slot count and decode length of the policy engine: its frozen roles are model-free)
    into the cache; a second process doing the same on that cache compiles nothing and reads every program
    back (red with JAX's own cache threshold: its programs under 1 s would be compiled again)."""
    cache_dir = str(tmp_path / "cache")
    compiled, hits, _ = _dry_run_compile(cache_dir)
    assert compiled >= 40 and hits == 0, (compiled, hits)
    again, hits_again, text = _dry_run_compile(cache_dir)
    assert again == 0 and hits_again >= compiled, text[-2000:]
