"""Helpers of the tests that launch several JAX processes (tests/test_multihost.py,
tests/test_eval_multiprocess.py): a launch's environment, a free localhost port for the coordinator, and
waiting for launches."""

from __future__ import annotations

import os
import socket
import subprocess
import time

# kept from the suite's environment in a launch's: the compile effort tests/run.sh chose
KEPT_JAX_SETTINGS = ("JAX_DISABLE_MOST_OPTIMIZATIONS",)


def launch_env() -> dict[str, str]:
    """This process's environment without its JAX_ and TPU_ settings (each launch sets its own platform,
    devices and coordinator), except KEPT_JAX_SETTINGS."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("JAX_", "TPU_")) or k in KEPT_JAX_SETTINGS}


def free_port() -> int:
    """A localhost TCP port nothing listens on (for `JAX_COORDINATOR_ADDRESS` or the launcher's --port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs: list[subprocess.Popen], logs: list[str], timeout: float) -> None:
    """Waits for every process (`timeout` seconds in all); a process still running then kills them all and
    raises; one that exited non-zero fails the test with the end of its log."""
    deadline = time.time() + timeout
    for p, log in zip(procs, logs, strict=True):
        try:
            rc = p.wait(max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert rc == 0, f"{log} exited {rc}:\n{open(log).read()[-3000:]}"
