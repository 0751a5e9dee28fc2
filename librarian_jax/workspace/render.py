"""Text rendering helpers shared by the workspace: display lines, numbered windows, compact numbers."""

from __future__ import annotations

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
