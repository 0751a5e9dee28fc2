"""JAX's persistent compilation cache, so a second run of the same programs starts warm.

`enable()` points `jax_compilation_cache_dir` at a directory (by default `$LIBRARIAN_JAX_COMPILATION_CACHE`,
else `~/.cache/librarian_jax/jax_compilation_cache`); every program that took at least `min_compile_s` to
compile is written there, keyed by its HLO, the compile options, the JAX/XLA version and the devices, and a
later process that compiles the same program reads it back instead. The main command and the benches call it
before compiling anything; `--compilation_cache_dir=none` (or the variable set to `none`) turns it off.
Multi-host runs: each host keeps its own local directory.
"""

from __future__ import annotations

import os

import jax
from absl import logging

ENV = "LIBRARIAN_JAX_COMPILATION_CACHE"
OFF = ("", "none", "off")


def default_dir() -> str:
    """`$LIBRARIAN_JAX_COMPILATION_CACHE`, else `~/.cache/librarian_jax/jax_compilation_cache`."""
    return os.environ.get(ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "librarian_jax", "jax_compilation_cache"
    )


def enable(cache_dir: str | None = None, *, min_compile_s: float = 0.2) -> str | None:
    """Turns the persistent compilation cache on at `cache_dir` (None: `default_dir()`).

    Args:
      cache_dir: directory for compiled programs (created if missing); "none" / "off" / "" turns it off.
      min_compile_s: programs that compiled faster than this are not written (JAX's default is 1 s; the
        embedded default's programs take 0.2-3 s each on a CPU, and together dominate its start-up).
    Returns:
      The directory in use, or None when off.
    """
    path = default_dir() if cache_dir is None else cache_dir
    if path.strip().lower() in OFF:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run
        logging.warning("compilation cache off: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logging.info("persistent compilation cache: %s", path)
    return path


FLAG_HELP = ("JAX persistent compilation cache directory (a second run starts warm); default "
             "$LIBRARIAN_JAX_COMPILATION_CACHE or ~/.cache/librarian_jax/jax_compilation_cache; 'none': off.")


def define_flag() -> None:
    """Defines `--compilation_cache_dir` (absl) unless already defined: the main command and every bench
    share the one flag, and a process may import several of them (the test suite does)."""
    from absl import flags

    if "compilation_cache_dir" not in flags.FLAGS:
        flags.DEFINE_string("compilation_cache_dir", None, FLAG_HELP)
