#!/usr/bin/env bash
# The project's test command (see README). Runs the whole suite on the CPU with 8 simulated devices, so the
# mesh tests exercise real sharding, split over 2 worker processes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS=cpu
# Most tests' time is XLA compiling small programs, not running them: compile with XLA's cheapest backend
# optimisation (the same HLO passes, less LLVM work; results unchanged). The run-time-bound embedded learning
# test turns it back off for itself. JAX_DISABLE_MOST_OPTIMIZATIONS=0 compiles everything fully.
export JAX_DISABLE_MOST_OPTIMIZATIONS="${JAX_DISABLE_MOST_OPTIMIZATIONS:-1}"
# And with XLA:CPU's older fusion code generator instead of its tiled fusion emitters (jax >= 0.9.1): at this
# optimisation level the same HLO in a third less compile (the suite on 2 cores, 2026-12-06: 16.0 CPU-minutes
# instead of 22.0, 8:18 instead of 11:25), results equal to the last bit or two. Fully optimised it compiles
# 2-4x slower, so it is the suite's setting, not the users'. Tests of a bit-for-bit property of the users'
# programs (the sampler's fast paths agree exactly) and of fully optimised runs (the embedded learning test)
# rerun themselves without it (tests/production_codegen.py); the multi-process tests set their processes'
# XLA_FLAGS themselves (the users' code generator); every other bit-for-bit comparison is between two runs
# under the same flags. The probe prints the flag only where this XLA knows it and XLA_FLAGS does not name it.
SUITE_CODEGEN_FLAG="$("$PY" tests/production_codegen.py 2>/dev/null || true)"
if [ -n "$SUITE_CODEGEN_FLAG" ]; then export XLA_FLAGS="${XLA_FLAGS} ${SUITE_CODEGEN_FLAG}"; fi
# The commands' huge-page malloc (librarian_jax/host_memory.py), for the whole suite at once: its workers and
# every process a test starts (which then do not re-execute themselves), unless GLIBC_TUNABLES already names it.
case ":${GLIBC_TUNABLES:-}:" in
  *:glibc.malloc.hugetlb=*) ;;
  *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1" ;;
esac
# One persistent compilation cache for the whole suite, new each run: both workers and every process a test
# starts (commands, launches) read what another test already compiled (tests/conftest.py turns it on in the
# workers). A test that measures the cache itself passes its own directory.
SUITE_TMP="$(mktemp -d)"
trap 'rm -rf "$SUITE_TMP"' EXIT
export LIBRARIAN_JAX_COMPILATION_CACHE="${LIBRARIAN_JAX_SUITE_CACHE:-$SUITE_TMP/jax_compilation_cache}"
"$PY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests "$@"
