"""Prompt texts: `agents/prompts/<name>.txt`, loaded with importlib.resources, filled with `string.Template`.

Placeholders are `$name` / `${name}` (so JSON braces in prompts need no escaping); a missing placeholder value
raises a KeyError naming the prompt file and the key.
"""

from __future__ import annotations

import functools
import importlib.resources
import string


@functools.cache
def load(name: str) -> str:
    """The raw text of `prompts/<name>.txt`."""
    path = importlib.resources.files("librarian_jax.agents") / "prompts" / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file agents/prompts/{name}.txt")
    return path.read_text(encoding="utf-8")


PROMPT_NAMES = (
    "builder_system",
    "builder_system_compact",
    "builder_user",
    "builder_update",
    "builder_compacted",
    "answerer_system",
    "answerer_user",
    "answerer_forced",
    "executor_system",
    "executor",
    "judge",
    "compaction",
)


def render(name: str, **values: object) -> str:
    """`prompts/<name>.txt` with `$key` placeholders substituted."""
    try:
        return string.Template(load(name)).substitute({k: str(v) for k, v in values.items()})
    except KeyError as e:
        raise KeyError(f"agents/prompts/{name}.txt needs a value for ${e.args[0]}") from None
