"""`librarian_jax.xla_flags`: the XLA flags `import librarian_jax` sets, and that they do their job."""

from __future__ import annotations

import os
import subprocess
import sys

from librarian_jax import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The compiled temporaries of the attention's forward + backward (8 query blocks of 64): with XLA:CPU's
# breadth-first scheduler the blocks' score arrays are alive together, so it needs more.
_PROBE = """
import librarian_jax  # sets XLA_FLAGS before the backend starts
import jax, jax.numpy as jnp
from librarian_jax.models.layers import attend_causal
q = jax.ShapeDtypeStruct((4, 512, 4, 32), jnp.float32)
k = jax.ShapeDtypeStruct((4, 512, 2, 32), jnp.float32)
loss = lambda q, k, v: attend_causal(q, k, v, scale=0.1).sum()
compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile()
print(compiled.memory_analysis().temp_size_in_bytes)
"""


def test_defaults_are_appended_unless_the_user_named_them():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_flags.apply_defaults(env) == ("--xla_force_host_platform_device_count=8 "
                                             "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    assert xla_flags.apply_defaults(env) == env["XLA_FLAGS"]  # once only
    mine = {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"}
    assert xla_flags.apply_defaults(mine) == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    assert xla_flags.apply_defaults({}) == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    # distributed.initialize's collective timeout goes the same way
    assert xla_flags.set_default("xla_cpu_collective_timeout_seconds", "600", mine) == \
        "--xla_cpu_enable_concurrency_optimized_scheduler=true --xla_cpu_collective_timeout_seconds=600"
    assert xla_flags.set_default("xla_cpu_collective_timeout_seconds", "30", mine) == mine["XLA_FLAGS"]


def test_only_a_whole_flag_token_counts_as_the_users_setting():
    """A longer flag containing the name, or a value containing it, is not the user's setting of it."""
    name = "xla_cpu_enable_concurrency_optimized_scheduler"
    longer = {"XLA_FLAGS": f"--{name}_v2=true --xla_dump_to=/tmp/{name}"}
    assert xla_flags.apply_defaults(longer) == f"--{name}_v2=true --xla_dump_to=/tmp/{name} --{name}=false"
    for given in (f"--{name}", f"--{name}=true", f"--xla_dump_to=/tmp --{name}=1", f"--{name} --xla_foo=1"):
        assert xla_flags.apply_defaults({"XLA_FLAGS": given}) == given, given


def test_importing_the_package_gives_training_the_depth_first_cpu_schedule():
    """A fresh process that imports librarian_jax compiles the attention's backward with fewer temporaries
    than one whose XLA_FLAGS keeps XLA:CPU's default scheduler (and so names the flag: the user's wins)."""
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    base["JAX_PLATFORMS"] = "cpu"
    runs = [subprocess.Popen([sys.executable, "-c", _PROBE], cwd=ROOT, env={**base, **extra},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for extra in ({}, {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"})]
    outs = [p.communicate(timeout=300) for p in runs]
    for p, (_, err) in zip(runs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    ours, xla_default = (int(out.split()[-1]) for out, _ in outs)
    assert ours < 0.8 * xla_default, (ours, xla_default)  # seen: 23.4 vs 36.7 MB
