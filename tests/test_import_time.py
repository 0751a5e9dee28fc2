"""Importing the package and parsing a config start no JAX backend (issue 64, item 4): a third-party module
that runs a JAX program at import (bm25s jits a `top_k`) is imported where it is used, so on a pod nothing
touches the devices before `jax.distributed.initialize`, and a bad setting answers before anything compiles.

Each check runs in a fresh interpreter (this one's backend is long started) that imports every module of
the package, parses every command's presets with its schema, and reports JAX's backends.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

_PROBE = """
import importlib, json, pkgutil, sys
exec(sys.argv[1])  # a planted statement (the check must see a started backend)
import librarian_jax
from absl import flags
from jax._src import xla_bridge
from librarian_jax import config_schema
from librarian_jax.presets import build, eval, grpo, sft
first = None
for m in pkgutil.walk_packages(librarian_jax.__path__, "librarian_jax."):
    if m.name.endswith("__main__"):
        continue
    before = set(flags.FLAGS)
    importlib.import_module(m.name)
    for name in set(flags.FLAGS) - before:  # the benches' command lines name the same flags
        delattr(flags.FLAGS, name)
    if first is None and xla_bridge.backends_are_initialized():
        first = m.name
# SFT's paper presets need a conversations file (the warm start gives them the run's world instead)
for schema, presets, names in ((config_schema.GRPOConfig, grpo, grpo.PRESETS),
                               (config_schema.SFTConfig, sft, ("embedded", "noisy")),
                               (config_schema.EvalConfig, eval, eval.PRESETS)):
    for p in names:
        c = presets.get_config(p)
        try:
            schema.parse(c)
        except config_schema.ConfigError:  # a paper preset without its weights' path: parsed as a plan's
            c.topology = "v5p-8"
            schema.parse(c)
config_schema.BuildConfig.parse(build.get_config())
print(json.dumps({"backends": sorted(xla_bridge._backends), "first": first}))
"""


def _probe(planted: str = "") -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", LIBRARIAN_JAX_HUGE_PAGES="0")
    out = subprocess.run([sys.executable, "-c", _PROBE, planted], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("planted,started", [
    ("", False),
    # a module that jits at import, as bm25s does: the probe sees the backend started
    ("import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.zeros(2))", True),
], ids=["package", "planted_jit"])
def test_importing_the_package_and_parsing_every_preset_start_no_backend(planted, started):
    got = _probe(planted)
    assert bool(got["backends"]) is started, got
    if not started:
        assert got["first"] is None, f"importing librarian_jax... up to {got['first']} started the backend"
