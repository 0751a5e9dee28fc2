"""Model-written arguments made safe: integers given as text, one path or many, content a file may hold, and
the documents a corpus brings. Each check returns the cleaned value or an `ActionResult` error; nothing here
raises on model input (`check_document` raises ValueError: a corpus is not model input)."""

from __future__ import annotations

import re

from librarian_jax.data.schema import Document
from librarian_jax.workspace import render as R
from librarian_jax.workspace.nodes import MAX_CONTENT_CHARS, MAX_INT
from librarian_jax.workspace.results import INVALID_ARGUMENT, ActionResult


def short_repr(value: object, n: int = 60) -> str:
    return R.short_repr(value, n)


_INT_TEXT = re.compile(r"[+-]?[0-9]{1,18}", re.ASCII)


def as_int(value: object, name: str) -> int | ActionResult:
    """An integer argument: an `int`, or a decimal string of ASCII digits (`"10"`, `" +3 "`), within
    +-MAX_INT; anything else is an `invalid_argument` result."""
    if isinstance(value, bool):
        return ActionResult.error(INVALID_ARGUMENT, f"{name} must be an integer, got {value!r}")
    out: int | None = None
    if isinstance(value, int):
        out = value
    elif isinstance(value, str) and len(value) <= 64 and _INT_TEXT.fullmatch(value.strip()):
        out = int(value.strip())
    if out is None:
        return ActionResult.error(INVALID_ARGUMENT, f"{name} must be an integer, got {short_repr(value)}")
    if abs(out) > MAX_INT:
        return ActionResult.error(
            INVALID_ARGUMENT,
            f"{name} must be an integer between -{MAX_INT} and {MAX_INT}, got {short_repr(out)}",
        )
    return out


def clean_content(text: str) -> str:
    """`text` made acceptable as a synthetic file's content: NUL characters removed, lone surrogates replaced
    by U+FFFD, cut to MAX_CONTENT_CHARS. Exactly what `create_file` / `merge_files` refuse in `content` is
    what this changes, so a writer (the executor) that passes its output through it is never refused for
    the text itself."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    if not R.encodable(text):
        text = R.replace_surrogates(text)
    return text[:MAX_CONTENT_CHARS]


def as_path_list(value: object, name: str) -> list[object] | ActionResult:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        out: list[object] = []
        for v in value:
            if v not in out:
                out.append(v)
        return out
    return ActionResult.error(INVALID_ARGUMENT, f"{name} must be a list of paths, got {type(value).__name__}")


def check_document(d: object, i: int) -> None:
    """Raise ValueError naming document #i and the field unless `d` is a well-formed `Document`."""
    if not isinstance(d, Document):
        raise ValueError(f"document #{i}: expected a Document, got {type(d).__name__}")
    for field in ("doc_id", "text", "title", "url"):
        value = getattr(d, field)
        if not isinstance(value, str):
            raise ValueError(f"document #{i}: field {field!r} must be a string, got {type(value).__name__}")
        if field in ("doc_id", "text") and not R.encodable(value):  # titles and URLs are made one line
            raise ValueError(f"document #{i}: field {field!r} holds a lone surrogate (not valid Unicode)")
    if not d.doc_id or R.has_control(d.doc_id):
        raise ValueError(
            f"document #{i}: doc_id {d.doc_id[:80]!r} must be non-empty, without control characters or line "
            f"breaks"
        )
    if not isinstance(d.meta, dict):
        raise ValueError(
            f"document #{i} ({d.doc_id!r}): field 'meta' must be a dict, got {type(d.meta).__name__}"
        )


def check_content(content: object) -> str | ActionResult:
    """`content` if a synthetic file may hold it (a string without NUL or lone surrogates, at most
    MAX_CONTENT_CHARS long), else an `invalid_argument` result."""
    if not isinstance(content, str):
        return ActionResult.error(INVALID_ARGUMENT, f"content must be a string, got {type(content).__name__}")
    if len(content) > MAX_CONTENT_CHARS:
        return ActionResult.error(
            INVALID_ARGUMENT,
            f"content is {R.fmt_int(len(content))} characters; the limit is {R.fmt_int(MAX_CONTENT_CHARS)}",
        )
    if "\x00" in content:
        return ActionResult.error(INVALID_ARGUMENT, "content contains a NUL character")
    if not R.encodable(content):
        return ActionResult.error(INVALID_ARGUMENT, "content contains a lone surrogate (not valid Unicode)")
    return content


def check_turn(turn: object) -> int | ActionResult:
    t = as_int(turn, "turn")
    if isinstance(t, int) and t < 0:
        return ActionResult.error(INVALID_ARGUMENT, f"turn must be >= 0, got {t}")
    return t
