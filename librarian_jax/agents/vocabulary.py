"""The agents' own texts (every prompt file, the builder's and answerer's tool descriptions and example
calls), for training a small tokenizer on them (e.g. the tiny preset's): the agents' prompts then encode
compactly.
"""

from __future__ import annotations

from librarian_jax.agents.answer_start import ANSWERER_TOOLS
from librarian_jax.agents.builder import BUILDER_TOOLS
from librarian_jax.agents.prompt_text import PROMPT_NAMES, load
from librarian_jax.agents.protocol import format_call, render_tools


def all_texts() -> list[str]:
    """Every prompt file's text plus the tool descriptions and one example call of each tool."""
    texts = [load(n) for n in PROMPT_NAMES]
    texts += [render_tools(BUILDER_TOOLS), render_tools(ANSWERER_TOOLS)]
    texts += [
        format_call(t.name, {p.name: p.default for p in t.params}) for t in BUILDER_TOOLS + ANSWERER_TOOLS
    ]
    return texts
