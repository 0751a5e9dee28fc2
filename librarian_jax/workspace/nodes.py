"""What a workspace holds: the layout's fixed names, the limits every action enforces, and the two records,
`RawDoc` (an immutable raw document) and `SyntheticNode` (a file or directory the builder wrote)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

FORMAT = "librarian_jax.workspace/1"
RAW_DIR = "raw_docs"
HISTORY_DIR = "history"
README = "README.md"
SUMMARY = "summary.txt"
MANIFEST = "manifest.json"
RAW_KIND = "raw document (read-only)"  # the KIND line of a raw document's header

MAX_READ_LINES = 100
MAX_READ_CHARS = 16_000
MAX_LIST_CHARS = 16_000
MAX_TITLE_CHARS = 200
MAX_CONTENT_CHARS = 200_000
MAX_SOURCES = 64
MAX_REASON_CHARS = 500
README_TREE_LINES = 120
MAX_INT = 10**15  # integer arguments (lines, turns, list starts) beyond this are refused

FILE = "file"  # a CreateFile result
DIRECTORY = "directory"  # a MergeFiles result

NODE_ID = re.compile(r"(cluster|merge)_([0-9]{4,12})", re.ASCII)
RAW_HANDLE = re.compile(r"raw_([0-9]{4,12})", re.ASCII)


@dataclasses.dataclass(frozen=True)
class RawDoc:
    """A raw document as the workspace holds it. `handle` is like `raw_0001`; `sha` = `content_hash(text)`."""

    handle: str
    doc_id: str
    title: str
    url: str
    text: str
    sha: str
    filename: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def path(self) -> str:
        return f"{RAW_DIR}/{self.filename}"


@dataclasses.dataclass(frozen=True)
class SyntheticNode:
    """A synthetic file (`kind="file"`) or directory with a summary (`kind="directory"`).

    `parent` is the node id of the directory holding it (None: the root). `raw_sources` are the raw handles it
    was written from directly, `synthetic_sources` the node ids (for a directory: its children at merge time).
    A deleted node keeps `parent` as it was when deleted.
    """

    node_id: str
    kind: str
    title: str
    slug: str
    body: str
    parent: str | None
    raw_sources: tuple[str, ...]
    synthetic_sources: tuple[str, ...]
    created_turn: int
    active: bool = True
    deleted_turn: int | None = None
    delete_reason: str = ""

    @property
    def name(self) -> str:
        base = f"{self.node_id}__{self.slug}"
        return base if self.kind == DIRECTORY else base + ".txt"


def norm_title(title: str) -> str:
    """The form in which two titles count as the same (case and spacing ignored)."""
    return " ".join(title.split()).casefold()


def kind_label(node: SyntheticNode) -> str:
    """The KIND line of a synthetic node's header."""
    if node.kind == DIRECTORY:
        return "directory summary (merge_files)"
    if node.node_id.startswith("merge_"):
        return "file (a directory summary, flattened)"
    return "file (create_file)"
