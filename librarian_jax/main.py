"""The command line: parse and validate the config, then run one command.

    python -m librarian_jax.main --config=configs/grpo.py [--config.train.num_steps=N --config.workdir=DIR]
    python -m librarian_jax.main --config=configs/grpo.py:qwen3_5_4b --config.model.path=... --dry_run
    python -m librarian_jax.main --config=configs/grpo.py:qwen3_5_4b --dry_run --compile \\
        --config.topology=v5p-64
    python -m librarian_jax.main --config=configs/sft.py | configs/eval.py | configs/build.py

`config.command` picks the command: "train" (`training.train_command`, GRPO), "sft"
(`warm_start.sft.main`), "eval" (`eval.cli.run_eval`), "build" (`eval.cli.run_build`). The logic lives in
those modules; nothing in the library imports this one. Multi-process runs
(`JAX_COORDINATOR_ADDRESS`/`JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`, or a TPU pod slice) call
`jax.distributed.initialize` first; see launch/README.md.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from librarian_jax import host_memory

if __name__ == "__main__":  # first, before JAX loads: glibc reads its malloc tunables when a process starts
    host_memory.reexec_with_huge_pages()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from librarian_jax import cli_flags, compile_cache, config_schema, config_validation, distributed  # noqa: E402
from librarian_jax.models.hf_io import HFLoadError  # noqa: E402
from librarian_jax.rl.train_step import NonFiniteUpdates  # noqa: E402

# Defined once per process (a test that imports this module next to `python -m` must not define them twice).
if "config" not in flags.FLAGS:
    config_flags.DEFINE_config_file("config", None, "Path to a config file, e.g. configs/grpo.py[:preset].")
    flags.DEFINE_bool("dry_run", False, "Validate the config, say what would run, and exit.")
    flags.DEFINE_bool("compile", False, "With --dry_run: compile the run's programs, then exit. With "
                      "--config.topology=ACCEL (train, eval, build): the plan for that TPU slice, from "
                      "shapes (WORKDIR/plan.json); without it (train): its engines' programs for this "
                      "host, into the persistent compilation cache (warms a cache).")
compile_cache.define_flag()


def _command(name: str) -> Any:
    """The function of command `name` (imported on first use: a config error or --dry_run answers before the
    model / engine / rollout stack is imported)."""
    if name == "train":
        from librarian_jax import training

        return training.train_command
    if name == "sft":
        from librarian_jax.warm_start import sft

        return sft.main
    from librarian_jax.eval import cli

    return {"eval": cli.run_eval, "build": cli.run_build}[name]


# config.command -> what main runs (configs/grpo.py: train, sft.py: sft, eval.py: eval, build.py: build)
COMMANDS = ("train", "sft", "eval", "build")


def _quiet_library_info_logs() -> None:
    """Orbax logs several INFO lines per save; keep the console to our progress lines and warnings."""
    import logging as py_logging

    def keep(record: py_logging.LogRecord) -> bool:
        return record.levelno >= py_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname

    logging.get_absl_handler().addFilter(keep)


def main(argv: list[str]) -> None:
    _quiet_library_info_logs()
    logging.info("host memory: %s", host_memory.describe())
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = flags.FLAGS["config"].value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/grpo.py")
    multi = distributed.initialize()
    compile_cache.enable(flags.FLAGS.compilation_cache_dir)  # before anything compiles
    command = config.get("command", "train")
    try:
        if command not in COMMANDS:
            raise config_validation.ConfigError(
                f"config.command: must be one of {list(COMMANDS)}, got {command!r}")
        # every key's type, bounds and choices (the schema, pure Python) before the command's modules are
        # imported: a bad setting answers in about two seconds, before the JAX backend starts or compiles
        config_schema.schema_for(config).parse(config)
        extra = {}
        if flags.FLAGS.compile:
            if command == "sft" or not flags.FLAGS.dry_run:
                raise config_validation.ConfigError(
                    "--compile: only with --dry_run, for the train, eval and build commands; a run "
                    "compiles its engines' programs ahead itself (rollout.compile_ahead)")
            extra["compile_programs"] = True
        _command(command)(config, dry_run=flags.FLAGS.dry_run, **extra)
    except (config_validation.ConfigError, HFLoadError, NonFiniteUpdates) as e:
        # a bad setting or file, or a run whose updates keep failing: one line naming it, exit 2
        logging.error("%s", e)
        print(f"error: {e}", file=sys.stderr)  # noqa: T201
        if multi:
            distributed.abort(f"error: {e}", 2)
        sys.exit(2)
    except Exception as e:
        if not multi:
            raise
        # several processes: fail fast (the others stop on this one's missing heartbeats, naming it) rather
        # than wait minutes in the distributed shutdown barrier while they wait in a collective
        traceback.print_exc()
        distributed.abort(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_flags)
