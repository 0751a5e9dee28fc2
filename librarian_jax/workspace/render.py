"""Text rendering helpers shared by the workspace: display lines, numbered windows, compact numbers."""

from __future__ import annotations

import re

WRAP_CHARS = 2000  # a stored line longer than this is shown as several display lines
LINE_NUMBER_WIDTH = 5


def display_lines(text: str, wrap: int = WRAP_CHARS) -> list[str]:
    """Split `text` into display lines: on `\\n`, then each line longer than `wrap` cut in `wrap`-char pieces.

    Line numbers in reads count these display lines, so a document stored as one huge line stays readable
    window by window.
    """
    out: list[str] = []
    for line in text.split("\n"):
        if len(line) <= wrap:
            out.append(line)
        else:
            out.extend(line[i : i + wrap] for i in range(0, len(line), wrap))
    if len(out) > 1 and out[-1] == "":
        out.pop()  # a trailing newline does not make an extra empty line
    return out


def numbered(line_no: int, line: str) -> str:
    return f"{line_no:>{LINE_NUMBER_WIDTH}}| {line}"


def window(lines: list[str], start_line: int, num_lines: int, max_chars: int) -> tuple[list[str], int]:
    """Numbered lines from `start_line` (1-based), at most `num_lines` lines and `max_chars` characters
    (newlines included). Returns the rendered lines and the number of the last line shown. The first line is
    always shown (display lines are at most `WRAP_CHARS` long, below any sensible `max_chars`)."""
    out: list[str] = []
    used = 0
    last = start_line - 1
    for i in range(start_line - 1, min(len(lines), start_line - 1 + num_lines)):
        row = numbered(i + 1, lines[i])
        if out and used + len(row) + 1 > max_chars:
            break
        out.append(row)
        used += len(row) + 1
        last = i + 1
    return out, last


def fmt_int(n: int) -> str:
    return f"{n:,}"


def clip(text: str, n: int) -> str:
    """`text` on one line, cut to `n` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: max(0, n - 1)] + "…"


# ---------------------------------------------------------------------------------------- header-safe text
# Characters that may never appear in one header line: C0/C1 controls (NUL, newline, CR, ESC...), DEL, the
# Unicode line and paragraph separators, and lone surrogates (which no file can hold).
_UNSAFE = frozenset(
    [chr(c) for c in range(0x20)] + [chr(c) for c in range(0x7F, 0xA0)] + ["\u2028", "\u2029"]
)


_UNSAFE_RE = re.compile("[" + re.escape("".join(sorted(_UNSAFE))) + "]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def replace_surrogates(text: str) -> str:
    """`text` with every lone surrogate (which UTF-8 cannot encode) replaced by U+FFFD."""
    return _SURROGATE_RE.sub("\ufffd", text)


def one_line(text: str) -> str:
    """`text` as one header-safe line: control characters and line separators become spaces, lone
    surrogates become U+FFFD, runs of whitespace one space, no surrounding whitespace."""
    return " ".join(replace_surrogates(_UNSAFE_RE.sub(" ", text)).split())


def has_control(text: str) -> bool:
    """Whether `text` holds a character no header line may hold (a control character, a line or paragraph
    separator, a lone surrogate)."""
    return bool(_UNSAFE_RE.search(text) or _SURROGATE_RE.search(text))


def is_one_line(text: str) -> bool:
    """Whether `text` is already what `one_line` makes of it."""
    return one_line(text) == text


def encodable(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def short_repr(value: object, n: int = 60) -> str:
    """`repr(value)` cut to `n` characters; never raises (the repr of an integer of more than 4,300 digits
    does, so such a number is described instead)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 (a model-written value must never crash the workspace)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= n else text[: max(0, n - 3)] + "..."


HEADER_END = "---"


def parse_header(text: str) -> tuple[dict[str, str | list[str]], str]:
    """Split a rendered workspace file into (header fields, body): the header is every line before the first
    `---` line; `KEY: value` lines give strings, a `KEY:` line followed by `- item` lines gives a list.
    Used by tests to check that a header says exactly what the workspace's structured fields say."""
    head, sep, body = text.partition("\n" + HEADER_END + "\n")
    if not sep:
        raise ValueError("no header end line")
    fields: dict[str, str | list[str]] = {}
    current: list[str] | None = None
    for line in head.split("\n"):
        if line.startswith("- ") and current is not None:
            current.append(line[2:])
            continue
        key, colon, value = line.partition(":")
        if not colon or not key or key != key.upper() or key in fields:
            raise ValueError(f"not a header line: {line!r}")
        if value:
            fields[key] = value[1:] if value.startswith(" ") else value
            current = None
        else:
            current = []
            fields[key] = current
    return fields, body
