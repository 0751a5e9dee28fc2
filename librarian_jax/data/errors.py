"""The one error type the data layer raises for bad input files."""

from __future__ import annotations

from typing import Any


class DataError(ValueError):
    """A corpus file is malformed: the message names the file, the 1-based line (if any) and the field.

    Example: ``tasks.jsonl:17: field 'docs[3].text': expected a string, got null``.
    """

    def __init__(self, path: str, message: str, *, line: int | None = None, field: str | None = None):
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = message
        where = self.path if line is None else f"{self.path}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{message}")


def json_type_name(value: Any) -> str:
    """How a JSON value's type reads in an error message (`null`, `a string`, `a list`, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
