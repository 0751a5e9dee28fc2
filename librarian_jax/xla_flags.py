"""XLA flags this stack sets by default, where XLA reads them: `XLA_FLAGS`, once, when the backend starts.

`import librarian_jax` (every command, bench and test does it before its first JAX computation) calls
`apply_defaults()`, which appends each flag of DEFAULTS to `XLA_FLAGS` unless `XLA_FLAGS` already names it, so
a user's own setting wins. Imported after the backend has started, it changes nothing.

- `--xla_cpu_enable_concurrency_optimized_scheduler=false`: XLA:CPU's default, breadth-first
  ("concurrency-optimised") HLO scheduler runs independent work at once, in a training step the attention's
  query blocks (`models.layers.attend_causal`), and keeps all their score arrays alive together. With the
  depth-first scheduler instead, the tiny preset's GRPO update at 16 x 1,792 needed 4.3 GiB of temporaries
  instead of 7.3 and ran ~1.3x faster, the warm start's SFT step at 8 x 1,152 1.7 GiB instead of 2.3 and
  compiled ~20% faster; decode ran alike (BENCHMARKS.md, "The train step's CPU schedule"). XLA:CPU takes this
  choice from the flags, not from a program's `compiler_options`, hence here. A CPU option: other backends
  ignore it.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

DEFAULTS: dict[str, str] = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def set_default(name: str, value: str, environ: MutableMapping[str, str] | None = None) -> str:
    """Appends `--name=value` to `environ["XLA_FLAGS"]` (default `os.environ`) unless it already names `name`
    (the user's setting wins); returns the resulting XLA_FLAGS. Also `distributed.initialize`'s way to give
    CPU collectives their timeout. "Names it" means a whole `--name` or `--name=...` token: a longer flag
    that contains `name`, or a value that does, is not the user's setting of this one."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if not names(flags, name):
        flags = f"{flags} --{name}={value}".strip()
    environ["XLA_FLAGS"] = flags
    return flags


def names(flags: str, name: str) -> bool:
    """Whether the whitespace-separated XLA_FLAGS string `flags` holds `--name` or `--name=value`."""
    return re.search(rf"(?:^|\s)--{re.escape(name)}(?:=|\s|$)", flags) is not None


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> str:
    """`set_default` for each of DEFAULTS; returns the resulting XLA_FLAGS."""
    environ = os.environ if environ is None else environ
    for name, value in DEFAULTS.items():
        set_default(name, value, environ)
    return environ.get("XLA_FLAGS", "")
