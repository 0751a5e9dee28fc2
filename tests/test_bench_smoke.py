"""Every `librarian_jax.bench` module runs end to end with flag values small enough for seconds, so a bench
never rots unseen. The figures are not checked; that each bench's `main` returns and prints its table is
(and, where a bench checks itself, e.g. `bench.sessions` comparing its two modes' tokens, that check).

One subprocess runs them all, one after another, as `python -m librarian_jax.bench.X --flags` would (each
module's absl flags parsed from its smoke flags, then its `main`): JAX is imported once, and XLA compiles
with its cheap CPU settings (the smoke run measures nothing). A bench that raises is reported with its
traceback and the others still run.
"""
from __future__ import annotations

import json
import os
import pkgutil
import re
import subprocess
import sys

import production_codegen
import pytest

from librarian_jax import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# module -> (smoke flags, a string its output must contain)
SMOKE: dict[str, tuple[list[str], str]] = {
    "cache_layout": (["--slots=8", "--max_len=1024", "--layers=1", "--head_dim=128", "--steps=2"],
                     "| keys |"),
    "checkpoint": (["--preset=tiny", "--num_layers=1", "--rows=2", "--seq=16", "--steps=2", "--repeats=1",
                    "--project=tiny", "--hosts=2"], "| digests on the writer |"),
    "compile": (["--depths=2", "--batch=1", "--prompt_len=4", "--new_tokens=2", "--rows=2", "--seq=16",
                 "--repeats=1"], "engine: compile (lower + compile) and steady step by depth"),
    "decode": (["--preset=tiny", "--num_layers=1", "--batches=2", "--new_tokens=4", "--prompt_len=4",
                "--repeats=1", "--transformers=false", "--memory_gbps=20", "--compilation_cache_dir=none"],
               "of roofline"),
    "moe": (["--seq_lens=8", "--decode_batches=1", "--decode_steps=2", "--decode_prompt=4", "--repeats=1"],
            "one MoE block alone"),
    "prefill": (["--seq_lens=8", "--decode_batches=1", "--decode_steps=2", "--decode_prompt=4",
                 "--repeats=1"], "one Gated DeltaNet layer alone"),
    "rollout": (["--preset=tiny", "--num_layers=1", "--num_tasks=1", "--group_size=2", "--max_turns=1",
                 "--builder_new_tokens=4", "--answerer_turns=1", "--answerer_new_tokens=4", "--questions=1",
                 "--repeats=1", "--policy_slots=2", "--frozen_slots=4", "--round_steps=4",
                 "--compilation_cache_dir=none"],
                "episodes 2, answerer runs"),  # and its first batch's compile: "(compile: N programs ..."
    "sessions": (["--preset=tiny", "--sessions=2", "--turns=2", "--prompt_len=8", "--min_new=2",
                  "--max_new=4", "--min_obs=2", "--max_obs=4", "--round_steps=4"],
                 "identical token records in both modes: True"),
    "train_step": (["--presets=tiny", "--num_layers=1", "--modes=full", "--vocab=256", "--rows=2", "--seq=16",
                    "--repeats=1", "--remat=none", "--logits_chunk=8"], "tiny full"),
    "update": (["--corpora=2"], "| updated |"),
    "workspace": (["--docs=8", "--synthetic=4", "--ops=10"], "ops/s"),
    "world": (["--corpora=1", "--styles=early_stop", "--ks=1"], "agentic@1"),
}
HELPERS = {"cached_lm", "common"}  # library code of the benches, not commands
HOST_ONLY = {"update", "workspace", "world"}  # benches that jit nothing, so have no compile time to report

RUNNER = r"""
import contextlib, importlib, io, json, sys, traceback
from absl import flags

FLAGS = flags.FLAGS
for name, args in json.loads(sys.argv[1]):
    # the flags of the bench before this one go, so this module can define its own (several share names)
    for f in list(FLAGS):
        if FLAGS.find_module_defining_flag(f, "").startswith("librarian_jax.bench."):
            delattr(FLAGS, f)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            module = importlib.import_module("librarian_jax.bench." + name)
            FLAGS.unparse_flags()
            FLAGS(["librarian_jax.bench." + name, *args])
            module.main(["librarian_jax.bench." + name])
        status = "ok"
    except BaseException:
        status = "failed\n" + traceback.format_exc()
    print(json.dumps({"bench": name, "status": status, "stdout": out.getvalue()}), flush=True)
"""


@pytest.fixture(scope="module")
def smoke_runs() -> dict[str, dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           # one device, and XLA's fastest compile on CPU: the smoke run times nothing
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                        + production_codegen.suite_flags()}
    arg = json.dumps([[name, args] for name, (args, _) in sorted(SMOKE.items())])
    proc = subprocess.run([sys.executable, "-c", RUNNER, arg], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=900)
    runs = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"bench"'):
            rec = json.loads(line)
            runs[rec["bench"]] = {**rec, "log": proc.stderr}  # absl logging goes to stderr
    assert runs, f"the bench runner printed nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return runs


def test_every_bench_module_has_a_smoke_run():
    modules = {m.name for m in pkgutil.iter_modules(bench.__path__)}
    assert modules - HELPERS == set(SMOKE), "add the new bench module to SMOKE with seconds-long flags"


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_bench_runs(smoke_runs, name):
    rec = smoke_runs.get(name)
    assert rec is not None, f"bench {name} did not report (an earlier bench killed the runner?)"
    assert rec["status"] == "ok", rec["status"]
    assert SMOKE[name][1] in rec["stdout"] + rec["log"], rec["stdout"][-3000:]


@pytest.mark.parametrize("name", sorted(set(SMOKE) - HOST_ONLY))
def test_bench_reports_compile_time_apart_from_run_time(smoke_runs, name):
    """Every bench that compiles prints its compile time in its table (issue 15), not folded into a figure."""
    rec = smoke_runs.get(name)
    assert rec is not None and rec["status"] == "ok", f"bench {name} did not run"
    assert "compile" in rec["stdout"].lower(), rec["stdout"][-3000:]
    if name == "rollout":  # counted by `compile_cache.CompileClock`: its warm-up batch compiles programs
        out = rec["stdout"]
        assert re.search(r"first batch [0-9.]+s \(compile: [1-9][0-9]* programs", out), out


def test_decode_reports_the_limit_with_attention_beside_the_matmul_only_one(smoke_runs):
    """`bench.decode` prints both limits and our share of each: the matmul-only one (issue 15's) and the one
    that also reads each attention layer's K/V cache (`matmul_limit_seconds(..., context)`)."""
    out = smoke_runs["decode"]["stdout"]
    assert re.search(r"matmul limit +[0-9.]+ tok/s \(ours = [0-9.]+ of limit\) \| with attention over the "
                     r"cache +[0-9.]+ tok/s \(ours = [0-9.]+\)", out), out[-3000:]


def test_decode_roofline_bytes_are_the_weights_the_live_kv_and_the_state():
    """`bench.decode`'s roofline (issue 15's H200 target): the bytes a decode step must move, from the
    presets' own cache shapes, against hand counts from the published configs."""
    from librarian_jax import models
    from librarian_jax.bench.decode import decode_step_bytes

    # Qwen3-4B: 36 layers x (K, V) x 8 KV heads x 128 x bf16 per cached position; with its 4,022,468,096
    # bf16 parameters at 4.8 TB/s, 512 + 64 positions: the table's 590 tok/s at batch 1
    per_position = 36 * 2 * 8 * 128 * 2
    qwen3, weights = models.get_preset("qwen3_4b"), 2 * 4_022_468_096
    assert decode_step_bytes(qwen3, 0, 1, 1) == per_position
    assert decode_step_bytes(qwen3, weights, 64, 576) == weights + 64 * 576 * per_position
    assert round(1 * 4.8e12 / decode_step_bytes(qwen3, weights, 1, 576)) == 590
    assert round(64 * 4.8e12 / decode_step_bytes(qwen3, weights, 64, 576)) == 22_788  # and its batch 64
    # Gemma 3 1B: 4 global layers read every position, 22 sliding layers at most their 512-token window
    gemma = models.get_preset("gemma3_1b")
    assert gemma.layer_types.count("full_attention") == 4
    assert decode_step_bytes(gemma, 0, 1, 2000) == 2 * 1 * 256 * 2 * (4 * 2000 + 22 * 512)
    # Qwen3.5-4B: 8 attention layers' K/V per position; each of 24 Gated DeltaNet layers' fp32 state
    # [32 heads, 128, 128] and bf16 conv window [2 x 16 x 128 + 32 x 128 channels, 3] read and written
    qwen35 = models.get_preset("qwen3_5_4b")
    state = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2
    assert decode_step_bytes(qwen35, 0, 2, 100) == 2 * (8 * 2 * 4 * 256 * 2 * 100 + 24 * 2 * state)
