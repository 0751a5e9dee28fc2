"""`python tests/pause_save.py -m MODULE ARGS...` runs `python -m MODULE ARGS...` with one fault point for
tests/test_multihost.py: the process whose `JAX_PROCESS_ID` is `PAUSE_SAVE_PROCESS`, once Orbax has written
its shards of a checkpoint item of step `PAUSE_SAVE_STEP`, creates the file `PAUSE_SAVE_MARKER` and holds that
save there (the step stays uncommitted), so the test can kill the process while the step is being written.
Nothing of the package changes: the hold wraps Orbax's array writer after `librarian_jax.checkpoint` wrapped
it, and main's own re-execution (huge pages) is off (`LIBRARIAN_JAX_HUGE_PAGES=0`), so the wrapper stays."""

from __future__ import annotations

import asyncio
import os
import runpy
import sys

from orbax.checkpoint._src.serialization import jax_array_handlers

from librarian_jax import checkpoint  # noqa: F401 - installs its digesting writer, which the hold wraps

_write = jax_array_handlers._async_serialize_replica_slices


async def _write_then_hold(values, infos, args, **kwargs):
    out = await _write(values, infos, args, **kwargs)
    step = infos[0].parent_dir.parent.name.split(".", 1)[0] if infos else ""
    if os.environ.get("JAX_PROCESS_ID") == os.environ["PAUSE_SAVE_PROCESS"] and \
            step == os.environ["PAUSE_SAVE_STEP"]:
        with open(os.environ["PAUSE_SAVE_MARKER"], "a"):
            pass
        await asyncio.sleep(3600)
    return out


if __name__ == "__main__":
    jax_array_handlers._async_serialize_replica_slices = _write_then_hold
    if sys.argv[1] != "-m":
        raise SystemExit("usage: pause_save.py -m MODULE ARGS...")
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
