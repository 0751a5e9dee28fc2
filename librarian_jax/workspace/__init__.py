"""librarian_jax.workspace: the corpus filesystem (raw documents + synthetic source-linked files) as host-side
state, with the builder's actions (create / merge / delete), the readers' actions (list / read), provenance,
staleness, serialisation, export and the hierarchy ablations. No model, no jax. See `workspace.py`."""

from librarian_jax.workspace.exported import ExportError, LoadedExport, load_export
from librarian_jax.workspace.results import ERROR_CODES, OK, ActionResult
from librarian_jax.workspace.update import UPDATE_META, CorpusChanges, UpdateStart, carry_over, diff_corpus
from librarian_jax.workspace.workspace import (
    DIRECTORY,
    FILE,
    HISTORY_DIR,
    MAX_READ_CHARS,
    MAX_READ_LINES,
    RAW_DIR,
    README,
    RawDoc,
    SnapshotError,
    SyntheticNode,
    Workspace,
    clean_content,
)

__all__ = [
    "UPDATE_META",
    "CorpusChanges",
    "UpdateStart",
    "carry_over",
    "diff_corpus",
    "ERROR_CODES",
    "ExportError",
    "LoadedExport",
    "load_export",
    "OK",
    "ActionResult",
    "DIRECTORY",
    "FILE",
    "HISTORY_DIR",
    "MAX_READ_CHARS",
    "MAX_READ_LINES",
    "RAW_DIR",
    "README",
    "RawDoc",
    "SnapshotError",
    "SyntheticNode",
    "Workspace",
    "clean_content",
]
