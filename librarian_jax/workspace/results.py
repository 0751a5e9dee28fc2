"""`ActionResult`: what every workspace action returns, and the codes it may carry."""

from __future__ import annotations

import dataclasses
from typing import Any

# Success.
OK = "ok"
# Path problems.
PATH_NOT_FOUND = "path_not_found"
PATH_ESCAPE = "path_escape"
INVALID_PATH = "invalid_path"
NOT_A_DIRECTORY = "not_a_directory"
IS_A_DIRECTORY = "is_a_directory"
INACTIVE_PATH = "inactive_path"
PARENT_NOT_FOUND = "parent_not_found"
# Rules of the state.
RAW_IMMUTABLE = "raw_immutable"
UNKNOWN_SOURCE = "unknown_source"
MERGE_CYCLE = "merge_cycle"
EMPTY_SOURCES = "empty_sources"
DUPLICATE_TITLE = "duplicate_title"
INVALID_ARGUMENT = "invalid_argument"
READ_TOO_LARGE = "read_too_large"

ERROR_CODES = (
    PATH_NOT_FOUND,
    PATH_ESCAPE,
    INVALID_PATH,
    NOT_A_DIRECTORY,
    IS_A_DIRECTORY,
    INACTIVE_PATH,
    PARENT_NOT_FOUND,
    RAW_IMMUTABLE,
    UNKNOWN_SOURCE,
    MERGE_CYCLE,
    EMPTY_SOURCES,
    DUPLICATE_TITLE,
    INVALID_ARGUMENT,
    READ_TOO_LARGE,
)


@dataclasses.dataclass(frozen=True)
class ActionResult:
    """The outcome of one action.

    `ok` is False exactly when `code != "ok"`; `message` is one model-readable sentence (on failure it names
    the bad argument); `suggestions` are paths or calls worth trying instead; `text` is the rendered
    observation (a listing, a file window) on success; `data` holds machine-readable details (resolved paths,
    new node ids, counts).
    """

    ok: bool
    code: str
    message: str
    suggestions: tuple[str, ...] = ()
    text: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def success(cls, message: str, text: str = "", **data: Any) -> ActionResult:
        return cls(True, OK, message, (), text, dict(data))

    @classmethod
    def error(
        cls, code: str, message: str, suggestions: tuple[str, ...] | list[str] = (), **data: Any
    ) -> ActionResult:
        assert code in ERROR_CODES, code
        return cls(False, code, message, tuple(suggestions), "", dict(data))

    def render(self) -> str:
        """The observation text an agent reads: the result text on success, else the error and suggestions."""
        if self.ok:
            return self.text or self.message
        out = f"ERROR [{self.code}]: {self.message}"
        if self.suggestions:
            out += "\nDid you mean: " + ", ".join(self.suggestions)
        return out
