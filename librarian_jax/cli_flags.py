"""Command-line flags as one line each: `app.run(main, flags_parser=cli_flags.parse_flags)`.

absl parses `--config=configs/grpo.py --config.train.num_stepz=3` inside `app.run`; ml_collections' override
parser then raises an `AttributeError` from deep inside `ConfigDict`, and the user sees a library traceback.
`parse_flags` parses the same flags and turns every failure into one line on stderr and exit status 2:

    error: config.train.num_stepz: unknown key (did you mean config.train.num_steps?)
    error: config.trian: unknown key (did you mean config.train?)
    error: config.train.max_seq_len: renamed to train.max_row_len
    error: flag --config.train.num_steps=abc: ...

The bad override is found by walking each `--config.a.b.c` path through the config file's own ConfigDict
(`get_config(preset)` of the file `--config` names), so the message holds the whole path and the closest key.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from absl import flags

from librarian_jax import config_schema

_OVERRIDE = re.compile(r"^--?(config(?:\.[^=\s]+)+)(?:=.*)?$")


def fail(message: str) -> NoReturn:
    """Prints `error: message` (one line) to stderr and exits with status 2 (a usage error)."""
    print(f"error: {message}", file=sys.stderr)  # noqa: T201 - the CLI's own one-line error
    raise SystemExit(2)


def _config_arg(argv: Sequence[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(("--config=", "-config=")):
            return a.split("=", 1)[1]
        if a in ("--config", "-config") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def load_config_file(spec: str) -> Any:
    """The config of `path[:preset]` as ml_collections' `DEFINE_config_file` loads it (`get_config()` or
    `get_config(preset)`)."""
    path, _, preset = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_librarian_jax_cli_config", path)
    if module_spec is None or module_spec.loader is None:
        raise FileNotFoundError(path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(preset) if preset else module.get_config()


def _keys(node: Any) -> list[str] | None:
    if isinstance(node, Mapping) or hasattr(node, "keys") and hasattr(node, "__getitem__"):
        return [str(k) for k in node.keys()]
    return None


def unknown_key(config: Any, path: str) -> str | None:
    """The one-line message for the first component of `config.<path>` that `config` does not hold (with the
    closest existing key), or None when every component exists."""
    node, done = config, ["config"]
    for part in path.split("."):
        keys = _keys(node)
        if keys is None:  # past a leaf: `--config.train.num_steps.x`
            return f"{'.'.join(done)}: is a value, not a section (no key {part!r})"
        if part not in keys:
            renamed = config_schema.renamed_key_message(".".join([*done[1:], part]))
            if renamed:
                return renamed
            close = difflib.get_close_matches(part, keys, n=1, cutoff=0.6)
            hint = f" (did you mean {'.'.join([*done, close[0]])}?)" if close else f" (known: {sorted(keys)})"
            return f"{'.'.join([*done, part])}: unknown key{hint}"
        node, done = node[part], [*done, part]
    return None


def diagnose(argv: Sequence[str], error: BaseException) -> str:
    """The one line for a flag-parsing `error`: the first `--config.` override naming a key the config does
    not hold, else the error's own first line."""
    spec = _config_arg(argv[1:])
    if spec is not None:
        try:
            config = load_config_file(spec)
        except Exception as e:  # noqa: BLE001 - a config file that does not load is itself the error
            return f"--config={spec}: cannot load ({type(e).__name__}: {e})".splitlines()[0]
        for a in argv[1:]:
            m = _OVERRIDE.match(a)
            if m:
                msg = unknown_key(config, m.group(1).split(".", 1)[1])
                if msg:
                    return msg
    keyed = isinstance(error, KeyError | AttributeError) and error.args
    text = str(error.args[0] if keyed else error).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a repr'd key
        text = text[1:-1].replace("\\n", " ").replace("\\'", "'")
    return (text.splitlines()[0] if text else type(error).__name__).strip()


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (`flags.FLAGS(argv)`), with every failure one line on stderr and exit status 2
    instead of a traceback. Returns the remaining arguments, as absl's own parser does."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        fail(diagnose(argv, e))
