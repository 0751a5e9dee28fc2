"""Remembering pure functions of a text with bounded memory: `short_texts(entries, max_chars)`.

The scripted answerer and the extractive executor read the same texts again and again (every question of a
corpus, every episode of a group, every demonstration), while the texts themselves may come from a model and
be of any length: only texts up to `max_chars` are remembered, so the memo never holds more than
`entries x max_chars` characters whatever is written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


def short_texts(entries: int, max_chars: int) -> Callable[[Callable[[str], R]], Callable[[str], R]]:
    """Decorator: `fn(text)` remembered (least recently used first out) for up to `entries` texts of at most
    `max_chars` characters; a longer text is computed each time. `fn` must be pure and return an immutable
    value (callers copy it into a list or set to hand out). The wrapper keeps `cache_info` / `cache_clear`."""

    def wrap(fn: Callable[[str], R]) -> Callable[[str], R]:
        cached = functools.lru_cache(maxsize=entries)(fn)

        @functools.wraps(fn)
        def call(text: str) -> R:
            return cached(text) if len(text) <= max_chars else fn(text)

        wrapped: Any = call
        wrapped.cache_info, wrapped.cache_clear = cached.cache_info, cached.cache_clear
        return call

    return wrap
