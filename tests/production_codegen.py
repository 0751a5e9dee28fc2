"""The suite's compile setting and the tests that must not use it.

`tests/run.sh` compiles with XLA:CPU's older fusion code generator (`SUITE_FLAG`): with the suite's cheapest
optimisation level a third less compile time for the same HLO, results equal to the last bit or two (fully
optimised, the other way round: `bench.compile`'s train step at 32 layers 118 s instead of 30). A test of a
bit-for-bit property of the programs users run (two code paths that must agree exactly under the compiler
users get), or one that runs fully optimised programs (`test_learning_embedded.py`), starts with

    if production_codegen.rerun(request):
        return

which, under the suite's setting, runs that one test again in a fresh pytest process with the users' code
generator and passes or fails with it; outside the suite (or in that process) it returns False and the test
runs here.

`python tests/production_codegen.py` is `tests/run.sh`'s probe: it prints SUITE_FLAG when this XLA starts
with it (XLA aborts on a flag it does not know), and nothing when XLA_FLAGS already names the flag (the
user's setting wins).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SUITE_FLAG_NAME = "xla_cpu_use_fusion_emitters"
SUITE_FLAG = f"--{SUITE_FLAG_NAME}=false"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def active(environ: dict[str, str] | None = None) -> bool:
    """Whether this process compiles with the suite's code generator (its XLA_FLAGS hold SUITE_FLAG)."""
    return SUITE_FLAG in (os.environ if environ is None else environ).get("XLA_FLAGS", "").split()


def suite_flags() -> str:
    """SUITE_FLAG where this process has it, else "": for a subprocess that sets XLA_FLAGS of its own and may
    compile as the suite does."""
    return SUITE_FLAG if active() else ""


def rerun(request: pytest.FixtureRequest) -> bool:
    """Under the suite's code generator: runs `request`'s test in a fresh pytest process without it, asserts
    that it passed, and returns True (the caller returns). Otherwise returns False (the caller runs its
    body)."""
    if not active():
        return False
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f != SUITE_FLAG)
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", request.node.nodeid]
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"{request.node.nodeid} with the users' code generator:\n{out.stdout[-6000:]}"
    assert re.search(r"(?m)^1 passed", out.stdout), out.stdout[-3000:]  # it ran, and was not skipped
    return True


def _probe() -> None:
    from librarian_jax import xla_flags

    flags = os.environ.get("XLA_FLAGS", "")
    if xla_flags.names(flags, SUITE_FLAG_NAME):
        return
    os.environ["XLA_FLAGS"] = f"{flags} {SUITE_FLAG}"
    import jax

    jax.devices()  # starts the backend, which reads XLA_FLAGS
    print(SUITE_FLAG)  # noqa: T201


if __name__ == "__main__":
    _probe()
