"""Suite-wide setup: with `LIBRARIAN_JAX_TEST_COMPILATION_CACHE` set (tests/run.sh sets it to a fresh
directory for each run), every pytest worker reads and writes JAX's persistent compilation cache there, so a
program that several test files compile (the tiny model's prefill, decode round, update step, ...) is compiled
once per run rather than once per file and worker (the suite ran 11:51 instead of 14:00 with it). The main
commands tests start as subprocesses use it too (`$LIBRARIAN_JAX_COMPILATION_CACHE`), instead of the user's
`~/.cache`. The directory starts empty in every run, so no test reads a program compiled by another checkout;
tests that check the cache itself, or need a launch to compile alone, pass their own directory or "none"."""

from __future__ import annotations

import os

from librarian_jax import compile_cache

_DIR = os.environ.get("LIBRARIAN_JAX_TEST_COMPILATION_CACHE", "")
if _DIR:
    compile_cache.enable(_DIR, min_compile_s=0.0)
    os.environ[compile_cache.ENV] = _DIR
