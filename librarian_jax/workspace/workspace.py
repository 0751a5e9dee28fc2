"""The workspace: the corpus filesystem a builder edits and an answerer reads, as host-side Python state.

Layout (paths relative to the workspace root; synthetic nodes live AT THE ROOT, next to the raw documents,
so the answerer's first listing shows the builder's top-level files directly and the raw documents stay one
`raw_docs/` away)::

    README.md                              generated index: what is where, counts, how to read
    raw_docs/raw_0001__<slug>.txt          raw documents: immutable, undeletable
    cluster_0001__<slug>.txt               a synthetic file (a CreateFile result)
    merge_0001__<slug>/summary.txt         a synthetic directory (a MergeFiles result) and its summary
    merge_0001__<slug>/cluster_0002__...   ... holding its children (files or further directories)
    history/cluster_0003__<slug>.txt       deleted synthetic nodes, still readable (only once one exists)

Raw documents get a short handle (`raw_0001`, in corpus order) and a file name from a slug of their title (or,
without one, their doc_id). Synthetic node ids count up per kind (`cluster_0001`, `merge_0001`) and never
repeat, so every name is unique and a node keeps its basename when it moves. Names are built only from handles
and slugs (`[a-z0-9_]`), which can never escape a directory.

Every action returns an `ActionResult(ok, code, message, suggestions, text, data)`; bad model input never
raises. Codes (see `results.py`):

- `ok`: success.
- `path_escape`: an absolute path, `~`, a URL, or `..` climbing above the root.
- `invalid_path`: not a string, NUL/control characters, too long (> 512 chars, a segment > 255, > 64 levels).
- `path_not_found`: nothing by that name (after the forgiving rules of `paths.py`); up to 3 suggestions.
- `not_a_directory`: listing a file, or a file given as `parent_path`.
- `is_a_directory`: reading a directory, or a plain directory (`raw_docs/`, `history/`, the root) given as a
  source.
- `inactive_path`: the node was deleted (it stays readable under `history/`, but cannot be a source, a child,
  a parent or deleted again); `history/` itself as a parent.
- `parent_not_found`: `parent_path` names nothing.
- `raw_immutable`: deleting a raw document or `raw_docs/`, moving raw documents into a directory (merge), or
  writing into `raw_docs/`.
- `unknown_source`: a create/merge source or child that names nothing.
- `merge_cycle`: the merge's parent is one of its children or lies inside one of them.
- `empty_sources`: no sources (create), no children (merge).
- `duplicate_title`: an active synthetic node already has this title (case and spacing ignored).
- `invalid_argument`: a wrong type or value (empty title, bad line numbers, non-string content, a target list
  that is empty, a child nested inside another child, README.md as a source or target...).
- `read_too_large`: `num_lines` above `MAX_READ_LINES` (100) in one read.

Text meant for a model (messages, suggestions, README, continuation hints) names the agents' tools:
`list_files(path)` (this class's `list_dir`) and `read_file(path, start_line, num_lines)`.

Reads return at most `MAX_READ_LINES` display lines and `MAX_READ_CHARS` characters (16,000) and say how to
continue. Lines longer than 2,000 characters are shown as several display lines (`render.display_lines`).

Forgiving argument handling (documented, nothing else is guessed): a single string where a list of paths is
expected counts as a one-element list; duplicate paths in a list count once; integers given as decimal
strings of ASCII digits (`"10"`, `" +3 "`) are accepted for line numbers, list starts and turns (any integer
beyond +-MAX_INT is refused); a merge directory and its `summary.txt` name the same node (as a source, a merge
child or a delete target); titles and delete reasons are put on one line (`render.one_line`: control
characters and line breaks become spaces) and a delete reason is cut to 500 characters.

Headers cannot be forged: every header line is built from a structured field that holds no line break or
control character (titles, reasons, raw titles and URLs are put on one line when they enter the workspace;
doc_ids with control characters are refused), and a header ends at its first `---` line, so a body can never
add a header line (`render.parse_header` reads one back). Content refused by create/merge (NUL, lone
surrogates, too long) is exactly what `clean_content` removes. A bad snapshot raises `SnapshotError`.

`merge_files` without `parent_path` puts the new directory in the deepest directory containing all children.
Deleting a directory moves its children up to its parent. Deleting never touches anything that cites the
deleted node: citations then point into `history/`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from absl import logging

from librarian_jax.data.schema import Document, content_hash
from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R
from librarian_jax.workspace.results import (
    DUPLICATE_TITLE,
    EMPTY_SOURCES,
    INACTIVE_PATH,
    INVALID_ARGUMENT,
    IS_A_DIRECTORY,
    MERGE_CYCLE,
    NOT_A_DIRECTORY,
    PARENT_NOT_FOUND,
    PATH_NOT_FOUND,
    RAW_IMMUTABLE,
    READ_TOO_LARGE,
    UNKNOWN_SOURCE,
    ActionResult,
)

FORMAT = "librarian_jax.workspace/1"
RAW_DIR = "raw_docs"
HISTORY_DIR = "history"
README = "README.md"
SUMMARY = "summary.txt"
MANIFEST = "manifest.json"

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

# Kinds of index entries.
E_ROOT, E_README, E_RAW_DIR, E_RAW, E_HISTORY_DIR, E_FILE, E_DIR, E_SUMMARY = (
    "root",
    "readme",
    "raw_dir",
    "raw",
    "history_dir",
    "node_file",
    "node_dir",
    "node_summary",
)
_DIR_ENTRIES = (E_ROOT, E_RAW_DIR, E_HISTORY_DIR, E_DIR)
_NODE_ID = re.compile(r"(cluster|merge)_([0-9]{4,12})", re.ASCII)


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


@dataclasses.dataclass(frozen=True)
class _Entry:
    kind: str
    ref: str = ""  # raw handle or node id


class _RawLayer:
    """Lookup state for the fixed part of a workspace (root, README, raw_docs/, the raw documents): built once
    and shared by every copy and snapshot of it."""

    def __init__(self, raw: Sequence[RawDoc]):
        self.entries: dict[str, _Entry] = {
            "": _Entry(E_ROOT),
            README: _Entry(E_README),
            RAW_DIR: _Entry(E_RAW_DIR),
        }
        for doc in raw:
            self.entries[doc.path] = _Entry(E_RAW, doc.handle)
        handles = {d.doc_id: d.path for d in raw if P.is_safe_name(d.doc_id)}  # doc_ids name documents too
        handles.update({d.handle: d.path for d in raw})  # ... but never shadow a raw_NNNN handle
        self.names = P.NameIndex([p for p in self.entries if p], handles)
        self.cache: dict[str, str] = {}  # serialised raw sections (see Workspace.to_json)


class _Index:
    """Derived lookup state for the synthetic nodes of one workspace state, on top of the raw layer. Rebuilt
    lazily after a merge or delete; extended in place by a create (`add_file`) when no copy shares it."""

    def __init__(self, nodes: dict[str, SyntheticNode], raw: _RawLayer):
        self.raw = raw
        self.entries: dict[str, _Entry] = {}
        self.dir_path: dict[str, str] = {}  # node id -> directory path (directories) or file path (files)
        self.children: dict[str | None, list[str]] = {None: []}
        self.titles: dict[str, str] = {}  # normalised title of an active node -> node id
        self.has_history = False
        for nid, node in nodes.items():
            if node.active:
                self.children.setdefault(node.parent, []).append(nid)
                self.titles[_norm_title(node.title)] = nid
            else:
                self.has_history = True
        if self.has_history:
            self.entries[HISTORY_DIR] = _Entry(E_HISTORY_DIR)

        def path_of(nid: str, depth: int = 0) -> str:
            if nid in self.dir_path:
                return self.dir_path[nid]
            node = nodes[nid]
            if not node.active:
                p = f"{HISTORY_DIR}/{node.name}"
            elif node.parent is None:
                p = node.name
            else:
                if depth > len(nodes):
                    raise RuntimeError(f"workspace has a parent cycle through {nid}")
                p = f"{path_of(node.parent, depth + 1)}/{node.name}"
            self.dir_path[nid] = p
            return p

        handles: dict[str, str] = {}
        for nid, node in nodes.items():
            p = path_of(nid)
            if node.kind == DIRECTORY:
                self.entries[p] = _Entry(E_DIR, nid)
                self.entries[f"{p}/{SUMMARY}"] = _Entry(E_SUMMARY, nid)
            else:
                self.entries[p] = _Entry(E_FILE, nid)
            handles[nid] = p
        self.names = P.NameIndex(self.entries, handles, base=raw.names)

    def add_file(self, node: SyntheticNode) -> None:
        """Extend the index by a newly created active file (nothing else moves on a create)."""
        parent = "" if node.parent is None else self.dir_path[node.parent] + "/"
        p = parent + node.name
        self.dir_path[node.node_id] = p
        self.entries[p] = _Entry(E_FILE, node.node_id)
        self.children.setdefault(node.parent, []).append(node.node_id)
        self.titles[_norm_title(node.title)] = node.node_id
        self.names.add(p, node.node_id)

    def _put(self, node: SyntheticNode) -> None:
        """Enter one node's path(s), computed from its parent's current path."""
        nid = node.node_id
        if not node.active:
            p = f"{HISTORY_DIR}/{node.name}"
        elif node.parent is None:
            p = node.name
        else:
            p = f"{self.dir_path[node.parent]}/{node.name}"
        self.dir_path[nid] = p
        if node.kind == DIRECTORY:
            self.entries[p] = _Entry(E_DIR, nid)
            self.entries[f"{p}/{SUMMARY}"] = _Entry(E_SUMMARY, nid)
            self.names.add(f"{p}/{SUMMARY}")
        else:
            self.entries[p] = _Entry(E_FILE, nid)
        self.names.add(p, nid)

    def _drop(self, nid: str) -> None:
        p = self.dir_path.pop(nid)
        if self.entries.pop(p).kind == E_DIR:
            del self.entries[f"{p}/{SUMMARY}"]
            self.names.remove(f"{p}/{SUMMARY}")
        self.names.remove(p)

    def detach(self, nodes: dict[str, SyntheticNode], roots: Sequence[str]) -> list[str]:
        """Before `roots` move: drop the paths of their whole subtrees (returned in preorder), take the roots
        out of their parents' child lists."""
        order: list[str] = []
        stack = list(reversed(roots))
        while stack:
            nid = stack.pop()
            order.append(nid)
            if nodes[nid].kind == DIRECTORY:
                stack.extend(reversed(self.children.get(nid, [])))
        for nid in order:
            self._drop(nid)
        for r in roots:
            self.children[nodes[r].parent].remove(r)
        return order

    def on_merge(self, nodes: dict[str, SyntheticNode], new_id: str, moved: list[str]) -> None:
        """After a merge made `new_id` (children already re-parented in `nodes`)."""
        node = nodes[new_id]
        self.children.setdefault(node.parent, []).append(new_id)
        self.children[new_id] = list(node.synthetic_sources)
        self.titles[_norm_title(node.title)] = new_id
        self._put(node)
        for nid in moved:
            self._put(nodes[nid])

    def on_delete(self, nodes: dict[str, SyntheticNode], gone: str, moved: list[str]) -> None:
        """After `gone` was deleted (children already re-parented in `nodes`); `moved` is from `detach`."""
        node = nodes[gone]
        kids = self.children.pop(gone, [])
        self.children.setdefault(nodes[kids[0]].parent if kids else None, []).extend(kids)
        self.titles.pop(_norm_title(node.title), None)
        if not self.has_history:
            self.has_history = True
            self.entries[HISTORY_DIR] = _Entry(E_HISTORY_DIR)
            self.names.add(HISTORY_DIR)
        for nid in moved:
            self._put(nodes[nid])

    def signature(self) -> tuple[Any, ...]:
        """Everything lookups depend on, comparably (to check incremental updates against a rebuild)."""
        kids = {k: sorted(v) for k, v in self.children.items() if v}
        n = self.names
        return (
            dict(self.all_entries()),
            self.dir_path,
            self.titles,
            kids,
            self.has_history,
            sorted(n.paths),
            n._handles,
            sorted((k, sorted(v)) for k, v in n._base.items()),
            sorted((k, sorted(v)) for k, v in n._lower.items()),
        )

    def entry(self, path: str) -> _Entry:
        hit = self.entries.get(path)
        return hit if hit is not None else self.raw.entries[path]

    def all_entries(self) -> list[tuple[str, _Entry]]:
        return [*self.raw.entries.items(), *self.entries.items()]

    def file_path(self, node: SyntheticNode) -> str:
        p = self.dir_path[node.node_id]
        return f"{p}/{SUMMARY}" if node.kind == DIRECTORY else p


@dataclasses.dataclass(frozen=True)
class _Resolved:
    asked: str
    path: str
    entry: _Entry
    rule: str


def _kind_label(node: SyntheticNode) -> str:
    if node.kind == DIRECTORY:
        return "directory summary (merge_files)"
    if node.node_id.startswith("merge_"):
        return "file (a directory summary, flattened)"
    return "file (create_file)"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _norm_title(title: str) -> str:
    return " ".join(title.split()).casefold()


def _short_repr(value: object, n: int = 60) -> str:
    return R.short_repr(value, n)


_INT_TEXT = re.compile(r"[+-]?[0-9]{1,18}", re.ASCII)


def _as_int(value: object, name: str) -> int | ActionResult:
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
        return ActionResult.error(INVALID_ARGUMENT, f"{name} must be an integer, got {_short_repr(value)}")
    if abs(out) > MAX_INT:
        return ActionResult.error(
            INVALID_ARGUMENT,
            f"{name} must be an integer between -{MAX_INT} and {MAX_INT}, got {_short_repr(out)}",
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


def _as_path_list(value: object, name: str) -> list[object] | ActionResult:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        out: list[object] = []
        for v in value:
            if v not in out:
                out.append(v)
        return out
    return ActionResult.error(INVALID_ARGUMENT, f"{name} must be a list of paths, got {type(value).__name__}")


def _check_document(d: object, i: int) -> None:
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


class SnapshotError(ValueError):
    """A workspace snapshot (`from_json` / `from_dict`) that `to_json` could not have written; `field` names
    the offending field (`nodes[3].created_turn`), or is empty when the problem is not one field's."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


_TYPE_NAMES = {str: "a string", bool: "a boolean", list: "a list", dict: "an object", int: "an integer"}


def _field(x: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """`x[key]`, checked to be of `kind` (a bool is never an int here); SnapshotError naming the field."""
    path = f"{where}.{key}" if where else key
    if key not in x:
        raise SnapshotError(
            f"malformed workspace snapshot: missing or bad field {key!r} (at {path!r}: missing)", path
        )
    value = x[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(_TYPE_NAMES.get(k, "null") for k in kinds)
        raise SnapshotError(
            f"malformed workspace snapshot: missing or bad field {key!r} (at {path!r}: expected {want}, "
            f"got {type(value).__name__})",
            path,
        )
    return value


def _int_field(x: dict[str, Any], key: str, where: str, low: int = 0) -> int:
    value = _field(x, key, int, where)
    if not low <= value <= MAX_INT:
        path = f"{where}.{key}" if where else key
        raise SnapshotError(
            f"malformed workspace snapshot: field {path!r} must be between {low} and {MAX_INT}, got "
            f"{_short_repr(value)}",
            path,
        )
    return value


def _strings(x: dict[str, Any], key: str, where: str) -> list[str]:
    values = _field(x, key, list, where)
    for j, v in enumerate(values):
        if not isinstance(v, str):
            path = f"{where}.{key}[{j}]"
            raise SnapshotError(
                f"malformed workspace snapshot: field {path!r} must be a string, got {type(v).__name__}", path
            )
    return values


class Workspace:
    """The workspace state and its actions (the module docstring has layout, codes, forgiving rules)."""

    def __init__(
        self,
        raw: Sequence[RawDoc],
        nodes: dict[str, SyntheticNode] | None = None,
        next_ids: dict[str, int] | None = None,
    ):
        self._raw: tuple[RawDoc, ...] = tuple(raw)
        self._raw_by_handle: dict[str, RawDoc] = {d.handle: d for d in self._raw}
        self._nodes: dict[str, SyntheticNode] = dict(nodes or {})
        self._next = dict(next_ids or {FILE: 1, DIRECTORY: 1})
        self._index_cache: _Index | None = None
        self._index_shared = False  # True while a copy holds the same _Index object
        self._raw_layer_cache: _RawLayer | None = None

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def from_documents(cls, docs: Iterable[Document]) -> Workspace:
        """A fresh workspace holding `docs` under `raw_docs/` (in order) and no synthetic nodes.

        Titles and URLs are put on one line (`render.one_line`: control characters and line breaks become
        spaces), so no header can be forged through them; texts are kept exactly. Raises ValueError (this is
        corpus input, not model input) on a repeated doc_id, and on a document that is not a `Document` of
        strings: a doc_id that is empty or holds a control character or line break, a text that UTF-8
        cannot encode (a lone surrogate), a non-string title or URL, a meta that is not a dict. (A lone
        surrogate in a title or URL becomes U+FFFD with the rest of the one-line conversion.)"""
        raw: list[RawDoc] = []
        seen: set[str] = set()
        for i, d in enumerate(docs, start=1):
            _check_document(d, i)
            if d.doc_id in seen:
                raise ValueError(f"duplicate doc_id {d.doc_id!r} (document #{i})")
            seen.add(d.doc_id)
            handle = f"raw_{i:04d}"
            title = R.one_line(d.title)
            slug = P.slugify(title or d.doc_id, fallback="doc")
            raw.append(
                RawDoc(
                    handle,
                    d.doc_id,
                    title,
                    R.one_line(d.url),
                    d.text,
                    content_hash(d.text),
                    f"{handle}__{slug}.txt",
                    dict(d.meta),
                )
            )
        return cls(raw)

    @property
    def _raw_layer(self) -> _RawLayer:
        if self._raw_layer_cache is None:
            self._raw_layer_cache = _RawLayer(self._raw)
        return self._raw_layer_cache

    @property
    def _index(self) -> _Index:
        if self._index_cache is None:
            self._index_cache = _Index(self._nodes, self._raw_layer)
            self._index_shared = False
        return self._index_cache

    def _changed(self) -> None:
        self._index_cache = None

    @property
    def raw_docs(self) -> tuple[RawDoc, ...]:
        return self._raw

    @property
    def nodes(self) -> dict[str, SyntheticNode]:
        """All synthetic nodes (active and deleted) by id, in creation order (a copy)."""
        return dict(self._nodes)

    def active_nodes(self) -> list[SyntheticNode]:
        return [n for n in self._nodes.values() if n.active]

    def path_of(self, ref: str) -> str:
        """The current path of a raw handle, a doc_id or a node id (a directory's path for a directory)."""
        if ref in self._raw_by_handle:
            return self._raw_by_handle[ref].path
        if ref in self._nodes:
            return self._index.dir_path[ref]
        for d in self._raw:
            if d.doc_id == ref:
                return d.path
        raise KeyError(f"no raw handle, doc_id or node id {ref!r}")

    def file_path_of(self, node_id: str) -> str:
        """The readable file of a node: the file itself or a directory's `summary.txt`."""
        return self._index.file_path(self._nodes[node_id])

    # --------------------------------------------------------------------------------------------- resolving
    def _resolve(
        self, arg: object, not_found_code: str = PATH_NOT_FOUND, what: str = "path"
    ) -> _Resolved | ActionResult:
        norm = P.normalize(arg)
        if isinstance(norm, P.PathError):
            return ActionResult.error(
                norm.code, norm.message if what == "path" else f"{what}: {norm.message}"
            )
        if norm == "":
            return _Resolved(str(arg), "", _Entry(E_ROOT), "exact")
        m = self._index.names.resolve(norm)
        if m.path is None:
            if m.ambiguous:
                msg = (
                    f"{what} {arg!r} is ambiguous: {len(m.ambiguous)} entries are named "
                    f"{P.basename(norm)!r}; give the full path"
                )
            else:
                msg = f"{what} {arg!r} does not exist"
            return ActionResult.error(not_found_code, msg, m.suggestions)
        return _Resolved(str(arg), m.path, self._index.entry(m.path), m.rule)

    @staticmethod
    def _note(r: _Resolved) -> str:
        return "" if r.rule == "exact" else f"[note: {r.asked!r} resolved to {r.path!r} ({r.rule})]\n"

    def _deleted_msg(self, node: SyntheticNode, what: str, asked: str) -> str:
        return (
            f"{what} {asked!r} was deleted at turn {node.deleted_turn}"
            f"{' (' + node.delete_reason + ')' if node.delete_reason else ''}; it is readable at "
            f"{self._index.file_path(node)!r} but is no longer part of the workspace"
        )

    def _source(self, arg: object, *, as_child: bool) -> tuple[str, str] | ActionResult:
        """Resolve one create source / merge child to ("raw", handle) or ("node", node id)."""
        what = "child" if as_child else "source"
        r = self._resolve(arg, UNKNOWN_SOURCE, what)
        if isinstance(r, ActionResult):
            return r
        kind = r.entry.kind
        if kind == E_RAW:
            if as_child:
                return ActionResult.error(
                    RAW_IMMUTABLE,
                    f"child {r.asked!r} is a raw document; raw documents never move. Create a "
                    f"synthetic file from it with create_file and merge that instead",
                )
            return ("raw", r.entry.ref)
        if kind in (E_FILE, E_DIR, E_SUMMARY):
            node = self._nodes[r.entry.ref]
            if not node.active:
                return ActionResult.error(INACTIVE_PATH, self._deleted_msg(node, what, r.asked))
            return ("node", node.node_id)
        if kind == E_RAW_DIR and as_child:
            return ActionResult.error(
                RAW_IMMUTABLE, f"child {r.asked!r} is the raw_docs directory; raw documents never move"
            )
        if kind in _DIR_ENTRIES:
            return ActionResult.error(
                IS_A_DIRECTORY,
                f"{what} {r.asked!r} is a plain directory; name the files in it",
                (f"list_files({r.path or '.'!r})",),
            )
        return ActionResult.error(
            INVALID_ARGUMENT, f"{what} {r.asked!r} is the generated {README}; name the files it lists instead"
        )

    def _sources(self, args: object, *, as_child: bool) -> list[tuple[str, str]] | ActionResult:
        name = "child_paths" if as_child else "input_paths"
        lst = _as_path_list(args, name)
        if isinstance(lst, ActionResult):
            return lst
        if not lst:
            return ActionResult.error(
                EMPTY_SOURCES,
                f"{name} is empty; name at least one {'synthetic file or directory' if as_child else 'file'}",
            )
        if len(lst) > MAX_SOURCES:
            return ActionResult.error(
                INVALID_ARGUMENT, f"{name} has {len(lst)} entries; the limit is {MAX_SOURCES}"
            )
        out: list[tuple[str, str]] = []
        errors: list[ActionResult] = []
        for a in lst:
            s = self._source(a, as_child=as_child)
            if isinstance(s, ActionResult):
                errors.append(s)
            elif s not in out:
                out.append(s)
        if errors:
            first = errors[0]
            if len(errors) == 1:
                return first
            msg = "; ".join(e.message for e in errors)
            return ActionResult.error(
                first.code,
                f"{len(errors)} of {len(lst)} {name} are unusable: {msg}",
                tuple(s for e in errors for s in e.suggestions)[: P.MAX_SUGGESTIONS],
            )
        return out

    def _parent(self, arg: object) -> tuple[str | None] | ActionResult:
        """Resolve `parent_path` to (node id,) of an active directory or (None,) for the root."""
        if arg is None:
            return (None,)
        r = self._resolve(arg, PARENT_NOT_FOUND, "parent_path")
        if isinstance(r, ActionResult):
            return r
        kind = r.entry.kind
        if kind == E_ROOT:
            return (None,)
        if kind == E_DIR:
            node = self._nodes[r.entry.ref]
            if not node.active:
                return ActionResult.error(INACTIVE_PATH, self._deleted_msg(node, "parent_path", r.asked))
            return (node.node_id,)
        if kind in (E_RAW_DIR, E_RAW):
            return ActionResult.error(
                RAW_IMMUTABLE,
                f"parent_path {r.asked!r} is inside {RAW_DIR}/, which is "
                f"read-only; use a merge directory or the root",
            )
        if kind == E_HISTORY_DIR:
            return ActionResult.error(
                INACTIVE_PATH, f"parent_path {r.asked!r} is {HISTORY_DIR}/, which only holds deleted nodes"
            )
        sugg = (P.dirname(r.path),) if kind == E_SUMMARY else ()
        return ActionResult.error(
            NOT_A_DIRECTORY, f"parent_path {r.asked!r} is a file, not a directory made by merge_files", sugg
        )

    def _check_title(self, title: object) -> str | ActionResult:
        if not isinstance(title, str):
            return ActionResult.error(INVALID_ARGUMENT, f"title must be a string, got {type(title).__name__}")
        t = R.one_line(title)
        if not t:
            return ActionResult.error(INVALID_ARGUMENT, "title is empty")
        if len(t) > MAX_TITLE_CHARS:
            return ActionResult.error(
                INVALID_ARGUMENT, f"title is {len(t)} characters long; the limit is {MAX_TITLE_CHARS}"
            )
        other = self._index.titles.get(_norm_title(t))
        if other is not None:
            where = self._index.file_path(self._nodes[other])
            return ActionResult.error(
                DUPLICATE_TITLE,
                f"title {t!r} is already used by {where!r}; pick a distinct title or delete that node first",
                (where,),
            )
        return t

    @staticmethod
    def _check_turn(turn: object) -> int | ActionResult:
        t = _as_int(turn, "turn")
        if isinstance(t, int) and t < 0:
            return ActionResult.error(INVALID_ARGUMENT, f"turn must be >= 0, got {t}")
        return t

    # ------------------------------------------------------------------------------------------------ create
    def _check_title_turn_sources(
        self, title: object, turn: object, paths: object, *, as_child: bool
    ) -> tuple[str, int, list[tuple[str, str]]] | ActionResult:
        """The checks create_file and merge_files share: title, turn, then the source / child paths."""
        t = self._check_title(title)
        if isinstance(t, ActionResult):
            return t
        turn_v = self._check_turn(turn)
        if isinstance(turn_v, ActionResult):
            return turn_v
        srcs = self._sources(paths, as_child=as_child)
        if isinstance(srcs, ActionResult):
            return srcs
        return t, turn_v, srcs

    def check_create(
        self, title: object, input_paths: object, parent_path: object = None, turn: object = 0
    ) -> ActionResult:
        """Validate a create_file call without changing anything (so an executor is only run for valid calls).

        On success `data` holds `title`, `raw_sources` (handles), `synthetic_sources` (node ids), `parent`
        (node id or None), `turn` and `source_paths`."""
        common = self._check_title_turn_sources(title, turn, input_paths, as_child=False)
        if isinstance(common, ActionResult):
            return common
        t, turn_v, srcs = common
        par = self._parent(parent_path)
        if isinstance(par, ActionResult):
            return par
        raw = tuple(ref for k, ref in srcs if k == "raw")
        syn = tuple(ref for k, ref in srcs if k == "node")
        return ActionResult.success(
            "create_file arguments are valid",
            title=t,
            raw_sources=raw,
            synthetic_sources=syn,
            parent=par[0],
            turn=turn_v,
            source_paths=[self._ref_file_path(k, r) for k, r in srcs],
        )

    def create_file(
        self,
        title: object,
        input_paths: object,
        content: object,
        parent_path: object = None,
        turn: object = 0,
    ) -> ActionResult:
        """CreateFile: a new synthetic file `cluster_NNNN__<slug>.txt` with `content` as its body, citing
        `input_paths` (raw and/or synthetic), placed in the merge directory `parent_path` (default: root)."""
        chk = self.check_create(title, input_paths, parent_path, turn)
        if not chk.ok:
            return chk
        body = self._check_content(content)
        if isinstance(body, ActionResult):
            return body
        d = chk.data
        nid = self._new_id(FILE)
        node = SyntheticNode(
            nid,
            FILE,
            d["title"],
            P.slugify(d["title"]),
            body,
            d["parent"],
            d["raw_sources"],
            d["synthetic_sources"],
            d["turn"],
        )
        self._nodes[nid] = node
        if self._index_cache is not None and not self._index_shared:
            self._index_cache.add_file(node)
        else:
            self._changed()
        path = self._index.file_path(node)
        logging.debug("workspace: created %s", path)
        return ActionResult.success(
            f"created {path} ({len(node.raw_sources)} raw + {len(node.synthetic_sources)} synthetic sources, "
            f"{R.fmt_int(len(body))} chars)",
            node_id=nid,
            path=path,
        )

    @staticmethod
    def _check_content(content: object) -> str | ActionResult:
        if not isinstance(content, str):
            return ActionResult.error(
                INVALID_ARGUMENT, f"content must be a string, got {type(content).__name__}"
            )
        if len(content) > MAX_CONTENT_CHARS:
            return ActionResult.error(
                INVALID_ARGUMENT,
                f"content is {R.fmt_int(len(content))} characters; the "
                f"limit is {R.fmt_int(MAX_CONTENT_CHARS)}",
            )
        if "\x00" in content:
            return ActionResult.error(INVALID_ARGUMENT, "content contains a NUL character")
        if not R.encodable(content):
            return ActionResult.error(
                INVALID_ARGUMENT, "content contains a lone surrogate (not valid Unicode)"
            )
        return content

    def _new_id(self, kind: str) -> str:
        n = self._next[kind]
        self._next[kind] = n + 1
        return f"{'cluster' if kind == FILE else 'merge'}_{n:04d}"

    # ------------------------------------------------------------------------------------------------- merge
    def _ancestors(self, nid: str | None) -> list[str]:
        """Node ids from `nid` up to the root (inclusive of `nid`)."""
        out: list[str] = []
        while nid is not None:
            out.append(nid)
            nid = self._nodes[nid].parent
            if len(out) > len(self._nodes):
                raise RuntimeError("parent cycle")
        return out

    def check_merge(
        self, title: object, child_paths: object, parent_path: object = None, turn: object = 0
    ) -> ActionResult:
        """Validate a merge_files call without changing anything. On success `data` holds `title`,
        `children` (node ids), `parent` (node id or None, the default already applied), `turn`,
        `child_paths`."""
        common = self._check_title_turn_sources(title, turn, child_paths, as_child=True)
        if isinstance(common, ActionResult):
            return common
        t, turn_v, srcs = common
        children = [ref for _, ref in srcs]
        child_set = set(children)
        for c in children:
            for a in self._ancestors(self._nodes[c].parent):
                if a in child_set:
                    return ActionResult.error(
                        INVALID_ARGUMENT,
                        f"child {self._index.dir_path[c]!r} is inside another child "
                        f"{self._index.dir_path[a]!r}; name only the outer one or merge them separately",
                    )
        if parent_path is None:
            chains = [list(reversed(self._ancestors(self._nodes[c].parent))) for c in children]
            common: str | None = None
            for level in zip(*chains, strict=False):
                if all(x == level[0] for x in level):
                    common = level[0]
                else:
                    break
            parent: str | None = common
        else:
            par = self._parent(parent_path)
            if isinstance(par, ActionResult):
                return par
            parent = par[0]
            for a in self._ancestors(parent):
                if a in child_set:
                    where = "is" if a == parent else "lies inside"
                    return ActionResult.error(
                        MERGE_CYCLE,
                        f"parent_path {parent_path!r} {where} child {self._index.dir_path[a]!r}; "
                        f"a directory cannot contain itself",
                    )
        return ActionResult.success(
            "merge_files arguments are valid",
            title=t,
            children=tuple(children),
            parent=parent,
            turn=turn_v,
            child_paths=[self._index.file_path(self._nodes[c]) for c in children],
        )

    def merge_files(
        self,
        title: object,
        child_paths: object,
        content: object,
        parent_path: object = None,
        turn: object = 0,
    ) -> ActionResult:
        """MergeFiles: a new directory `merge_NNNN__<slug>/` whose `summary.txt` body is `content`; the
        children (synthetic files or directories) move into it. Default parent: the deepest directory
        containing every child."""
        chk = self.check_merge(title, child_paths, parent_path, turn)
        if not chk.ok:
            return chk
        body = self._check_content(content)
        if isinstance(body, ActionResult):
            return body
        d = chk.data
        nid = self._new_id(DIRECTORY)
        node = SyntheticNode(
            nid, DIRECTORY, d["title"], P.slugify(d["title"]), body, d["parent"], (), d["children"], d["turn"]
        )
        idx = self._index_cache if not self._index_shared else None
        moved = idx.detach(self._nodes, d["children"]) if idx is not None else []
        self._nodes[nid] = node
        for c in d["children"]:
            self._nodes[c] = dataclasses.replace(self._nodes[c], parent=nid)
        if idx is not None:
            idx.on_merge(self._nodes, nid, moved)
        else:
            self._changed()
        path = self._index.dir_path[nid]
        return ActionResult.success(
            f"created directory {path}/ with {len(d['children'])} children and "
            f"{SUMMARY} ({R.fmt_int(len(body))} chars)",
            node_id=nid,
            path=path,
            summary_path=f"{path}/{SUMMARY}",
        )

    # ------------------------------------------------------------------------------------------------ delete
    def delete(self, target_paths: object, reason: object = "", turn: object = 0) -> ActionResult:
        """Delete active synthetic nodes (all or nothing). A deleted directory's children move up to its
        parent; deleted nodes stay readable under `history/`."""
        lst = _as_path_list(target_paths, "target_paths")
        if isinstance(lst, ActionResult):
            return lst
        if not lst:
            return ActionResult.error(
                INVALID_ARGUMENT, "target_paths is empty; name the synthetic files or directories to delete"
            )
        if reason is None:
            reason = ""
        if not isinstance(reason, str):
            return ActionResult.error(
                INVALID_ARGUMENT, f"reason must be a string, got {type(reason).__name__}"
            )
        turn_v = self._check_turn(turn)
        if isinstance(turn_v, ActionResult):
            return turn_v
        targets: list[str] = []
        errors: list[ActionResult] = []
        for a in lst:
            r = self._resolve(a, PATH_NOT_FOUND, "target")
            if isinstance(r, ActionResult):
                errors.append(r)
                continue
            k = r.entry.kind
            if k in (E_RAW, E_RAW_DIR):
                errors.append(
                    ActionResult.error(
                        RAW_IMMUTABLE,
                        f"target {r.asked!r} is a raw document"
                        f"{'s directory' if k == E_RAW_DIR else ''}; raw documents "
                        f"can never be deleted",
                    )
                )
            elif k in (E_FILE, E_DIR, E_SUMMARY):
                node = self._nodes[r.entry.ref]
                if not node.active:
                    errors.append(
                        ActionResult.error(INACTIVE_PATH, self._deleted_msg(node, "target", r.asked))
                    )
                elif node.node_id not in targets:
                    targets.append(node.node_id)
            elif k == E_HISTORY_DIR:
                errors.append(
                    ActionResult.error(
                        INACTIVE_PATH, f"target {r.asked!r} is {HISTORY_DIR}/, which only holds deleted nodes"
                    )
                )
            else:
                errors.append(
                    ActionResult.error(
                        INVALID_ARGUMENT,
                        f"target {r.asked!r} is "
                        f"{'the workspace root' if k == E_ROOT else 'the generated ' + README}"
                        f"; only synthetic files and directories can be deleted",
                    )
                )
        if errors:
            if len(errors) == 1:
                return errors[0]
            return ActionResult.error(
                errors[0].code,
                f"nothing deleted; {len(errors)} of {len(lst)} targets are "
                f"unusable: " + "; ".join(e.message for e in errors),
                tuple(s for e in errors for s in e.suggestions)[: P.MAX_SUGGESTIONS],
            )
        why = R.one_line(reason)[:MAX_REASON_CHARS].rstrip()
        old_paths = [self._index.dir_path[t] for t in targets]
        idx = self._index if not self._index_shared else None
        for t in targets:
            node = self._nodes[t]
            moved = idx.detach(self._nodes, [t]) if idx is not None else []
            kids = (
                idx.children.get(t, [])
                if idx is not None
                else [cid for cid, c in self._nodes.items() if c.active and c.parent == t]
            )
            for cid in kids:
                self._nodes[cid] = dataclasses.replace(self._nodes[cid], parent=node.parent)
            self._nodes[t] = dataclasses.replace(node, active=False, deleted_turn=turn_v, delete_reason=why)
            if idx is not None:
                idx.on_delete(self._nodes, t, moved)
        if idx is None:
            self._changed()
        new_paths = [self._index.file_path(self._nodes[t]) for t in targets]
        return ActionResult.success(
            f"deleted {', '.join(old_paths)}; readable under {HISTORY_DIR}/",
            node_ids=targets,
            deleted_paths=old_paths,
            history_paths=new_paths,
        )

    # -------------------------------------------------------------------------------------------- rendering
    def _ref_file_path(self, kind: str, ref: str) -> str:
        if kind == "raw":
            return self._raw_by_handle[ref].path
        return self._index.file_path(self._nodes[ref])

    def _raw_provenance(self, node_id: str) -> list[str]:
        """Raw handles reached from a node through synthetic sources (deleted ones included), in order."""
        seen_nodes: set[str] = set()
        out: list[str] = []
        stack = [node_id]
        while stack:
            nid = stack.pop()
            if nid in seen_nodes:
                continue
            seen_nodes.add(nid)
            node = self._nodes[nid]
            for h in node.raw_sources:
                if h not in out:
                    out.append(h)
            stack.extend(reversed(node.synthetic_sources))
        return out

    def render_raw(self, doc: RawDoc) -> str:
        lines = [
            f"TITLE: {doc.title or doc.doc_id}",
            "KIND: raw document (read-only)",
            f"PATH: {doc.path}",
            f"DOC_ID: {doc.doc_id}",
        ]
        if doc.url:
            lines.append(f"URL: {doc.url}")
        lines += [f"SHA256: {doc.sha}", "---"]
        return "\n".join(lines) + "\n" + doc.text

    def render_node(self, node: SyntheticNode) -> str:
        """A synthetic node's file exactly as agents read it: a header, `---`, then the body."""
        idx = self._index
        lines = [
            f"TITLE: {node.title}",
            f"KIND: {_kind_label(node)}",
            f"PATH: {idx.file_path(node)}",
        ]
        if not node.active:
            lines.append(
                f"STATUS: deleted at turn {node.deleted_turn}"
                + (f": {node.delete_reason}" if node.delete_reason else "")
            )
        if node.raw_sources:
            lines.append("SOURCES_RAW:")
            for h in node.raw_sources:
                d = self._raw_by_handle[h]
                lines.append(f"- {d.path} (sha256:{d.sha})")
        else:
            lines.append("SOURCES_RAW: (none)")
        if node.synthetic_sources:
            lines.append("SOURCES_SYNTHETIC:")
            for s in node.synthetic_sources:
                sn = self._nodes[s]
                status = "" if sn.active else ", deleted"
                lines.append(f'- {idx.file_path(sn)} ("{R.clip(sn.title, 80)}"{status})')
            prov = self._raw_provenance(node.node_id)
            lines.append(
                f"RAW_PROVENANCE: {len(prov)} raw documents in total, reached through the synthetic sources' "
                f"headers"
            )
        else:
            lines.append("SOURCES_SYNTHETIC: (none)")
        if node.kind == DIRECTORY and node.active:
            kids = idx.children.get(node.node_id, [])
            lines.append(f"CHILDREN: {len(kids)} (list_files {idx.dir_path[node.node_id]!r} to see them)")
        lines.append("---")
        return "\n".join(lines) + "\n" + node.body

    def _text_of(self, entry: _Entry) -> str:
        if entry.kind == E_RAW:
            return self.render_raw(self._raw_by_handle[entry.ref])
        if entry.kind == E_README:
            return self.readme_text()
        return self.render_node(self._nodes[entry.ref])

    def _entry_line(self, path: str, entry: _Entry) -> str:
        idx = self._index
        name = P.basename(path)
        k = entry.kind
        if k == E_README:
            return f"{README}  [index] how this workspace is organised and how to read it"
        if k == E_RAW_DIR:
            return f"{RAW_DIR}/  [directory] {len(self._raw)} raw documents (read-only originals)"
        if k == E_HISTORY_DIR:
            n = sum(1 for x in self._nodes.values() if not x.active)
            return f"{HISTORY_DIR}/  [directory] {n} deleted synthetic nodes (read-only)"
        if k == E_RAW:
            d = self._raw_by_handle[entry.ref]
            return (
                f'{name}  [raw] "{R.clip(d.title or d.doc_id, 100)}" (doc_id={d.doc_id}, '
                f"{R.fmt_int(len(d.text))} chars)"
            )
        node = self._nodes[entry.ref]
        title = R.clip(node.title, 100)
        if k == E_SUMMARY:
            return f'{name}  [summary] "{title}" ({R.fmt_int(len(node.body))} chars)'
        if not node.active:
            what = "deleted directory" if node.kind == DIRECTORY else "deleted file"
            why = f": {R.clip(node.delete_reason, 80)}" if node.delete_reason else ""
            return f'{name}{"/" if k == E_DIR else ""}  [{what}] "{title}" (turn {node.deleted_turn}{why})'
        if k == E_DIR:
            kids = [self._nodes[c] for c in idx.children.get(node.node_id, [])]
            nd = sum(1 for c in kids if c.kind == DIRECTORY)
            return f'{name}/  [directory] "{title}" ({len(kids) - nd} files, {nd} directories, {SUMMARY})'
        return (
            f'{name}  [file] "{title}" ({len(node.raw_sources)} raw + {len(node.synthetic_sources)} '
            f"synthetic sources, {R.fmt_int(len(node.body))} chars)"
        )

    def _dir_children(self, path: str, entry: _Entry) -> list[str]:
        """Paths directly inside a directory entry, in listing order."""
        idx = self._index

        def node_sort(nids: list[str]) -> list[str]:
            nodes = [self._nodes[n] for n in nids]
            dirs = sorted((n for n in nodes if n.kind == DIRECTORY), key=lambda n: n.name)
            files = sorted((n for n in nodes if n.kind != DIRECTORY), key=lambda n: n.name)
            return [idx.dir_path[n.node_id] for n in dirs + files]

        k = entry.kind
        if k == E_ROOT:
            head = [README, RAW_DIR] + ([HISTORY_DIR] if idx.has_history else [])
            return head + node_sort(idx.children.get(None, []))
        if k == E_RAW_DIR:
            return [d.path for d in self._raw]
        if k == E_HISTORY_DIR:
            return node_sort([n for n, x in self._nodes.items() if not x.active])
        node = self._nodes[entry.ref]
        kids = idx.children.get(node.node_id, []) if node.active else []
        return [f"{path}/{SUMMARY}"] + node_sort(kids)

    # ---------------------------------------------------------------------------------------------- reading
    def list_dir(
        self, path: object = ".", start: object = 1, max_chars: int = MAX_LIST_CHARS
    ) -> ActionResult:
        """One line per entry (kind, title, counts). Long listings stop at `max_chars` and say how to go on
        (`start` is the 1-based entry to begin with)."""
        r = self._resolve(path)
        if isinstance(r, ActionResult):
            return r
        if r.entry.kind not in _DIR_ENTRIES:
            return ActionResult.error(
                NOT_A_DIRECTORY, f"{r.asked!r} is a file; read it with read_file", (f"read_file({r.path!r})",)
            )
        start_v = _as_int(start, "start")
        if isinstance(start_v, ActionResult):
            return start_v
        cap = _as_int(max_chars, "max_chars")
        if isinstance(cap, ActionResult):
            return cap
        max_chars = cap
        kids = self._dir_children(r.path, r.entry)
        if start_v < 1 or (start_v > len(kids) and kids):
            return ActionResult.error(INVALID_ARGUMENT, f"start={start_v} is outside 1..{len(kids)}")
        shown = r.path + "/" if r.path else ". (workspace root)"
        head = f"{self._note(r)}Directory {shown}: {len(kids)} entries"
        rows: list[str] = []
        used = len(head)
        last = start_v - 1
        for i in range(start_v - 1, len(kids)):
            row = self._entry_line(kids[i], self._index.entry(kids[i]))
            if rows and used + len(row) + 1 > max_chars - 200:
                break
            rows.append(row)
            used += len(row) + 1
            last = i + 1
        text = head + "\n" + "\n".join(rows)
        truncated = last < len(kids)
        if truncated:
            text += (
                f"\n[showing entries {start_v}-{last} of {len(kids)}; continue with "
                f"list_files({r.path or '.'!r}, start={last + 1})]"
            )
        return ActionResult.success(
            f"listed {r.path or '.'} ({len(kids)} entries)",
            text,
            path=r.path,
            entries=kids[start_v - 1 : last],
            total=len(kids),
            truncated=truncated,
        )

    def read_file(
        self, path: object, start_line: object = 1, num_lines: object = MAX_READ_LINES
    ) -> ActionResult:
        """Numbered display lines `start_line..` of a file: at most 100 lines and 16,000 characters, with a
        footer saying whether the file ends here or how to read on."""
        s = _as_int(start_line, "start_line")
        if isinstance(s, ActionResult):
            return s
        n = _as_int(num_lines, "num_lines")
        if isinstance(n, ActionResult):
            return n
        if n > MAX_READ_LINES:
            return ActionResult.error(
                READ_TOO_LARGE,
                f"num_lines={n} is above the limit of {MAX_READ_LINES} "
                f"lines per read; read in windows of at most "
                f"{MAX_READ_LINES} lines",
                (f"read_file({_short_repr(path, 200)}, start_line={s}, num_lines={MAX_READ_LINES})",),
            )
        if n < 1:
            return ActionResult.error(INVALID_ARGUMENT, f"num_lines must be >= 1, got {n}")
        if s < 1:
            return ActionResult.error(INVALID_ARGUMENT, f"start_line must be >= 1, got {s}")
        r = self._resolve(path)
        if isinstance(r, ActionResult):
            return r
        k = r.entry.kind
        if k in _DIR_ENTRIES:
            sugg = [f"{r.path}/{SUMMARY}"] if k == E_DIR else [README] if k == E_ROOT else []
            sugg.append(f"list_files({r.path or '.'!r})")
            return ActionResult.error(
                IS_A_DIRECTORY,
                f"{r.asked!r} is a directory; list it with list_files"
                + (f" or read its {SUMMARY}" if k == E_DIR else ""),
                sugg,
            )
        lines = R.display_lines(self._text_of(r.entry))
        if s > len(lines):
            return ActionResult.error(
                INVALID_ARGUMENT,
                f"start_line={s} is past the end of {r.path!r} ({len(lines)} lines)",
                (f"read_file({r.path!r}, start_line=1)",),
            )
        rows, last = R.window(lines, s, n, MAX_READ_CHARS)
        head = f"{self._note(r)}[{r.path} | lines {s}-{last} of {len(lines)}]"
        if last >= len(lines):
            foot, nxt = "[end of file]", None
        else:
            cut = "16,000-character limit reached" if last < min(len(lines), s + n - 1) else "more lines"
            foot = (
                f"[{cut}: lines {last + 1}-{len(lines)} not shown; continue with "
                f"read_file({r.path!r}, start_line={last + 1})]"
            )
            nxt = last + 1
        text = head + "\n" + "\n".join(rows) + "\n" + foot
        return ActionResult.success(
            f"read {r.path} lines {s}-{last} of {len(lines)}",
            text,
            path=r.path,
            start_line=s,
            end_line=last,
            total_lines=len(lines),
            truncated=nxt is not None,
            next_start_line=nxt,
        )

    def source_excerpts(
        self, paths: object, max_lines: int = MAX_READ_LINES, max_chars: int = MAX_READ_CHARS
    ) -> ActionResult:
        """What an executor is given: the title and first `max_lines` body lines of each source, all together
        at most `max_chars` characters (the budget is shared fairly: short sources leave room for long ones).
        Accepts the same paths as create_file sources and merge_files children (raw, files, directories).

        `data["sources"]` lists, per source in order, `path`, `title` (one line), `excerpt` (the body text
        given, with the cut marker when cut), `chars` and `truncated`: the structured form of `text`, for
        callers that need each source apart (never re-parse `text`: a document may hold lines that look like
        its `=== SOURCE n: ... ===` headers)."""
        lim = _as_int(max_lines, "max_lines")
        if isinstance(lim, ActionResult):
            return lim
        cap = _as_int(max_chars, "max_chars")
        if isinstance(cap, ActionResult):
            return cap
        max_lines, max_chars = max(0, lim), max(0, cap)
        srcs = self._sources(paths, as_child=False)
        if isinstance(srcs, ActionResult):
            return srcs
        items: list[tuple[str, str, str, bool, str]] = []  # header, body excerpt, path, lines cut, title
        for kind, ref in srcs:
            if kind == "raw":
                d = self._raw_by_handle[ref]
                title, body, path = d.title or d.doc_id, d.text, d.path
            else:
                node = self._nodes[ref]
                title, body, path = node.title, node.body, self._index.file_path(node)
            all_lines = R.display_lines(body)
            excerpt = "\n".join(all_lines[:max_lines])
            title = R.one_line(title)
            header = f"=== SOURCE {len(items) + 1}: {path} ===\nTITLE: {title}\n"
            items.append((header, excerpt, path, len(all_lines) > max_lines, title))
        marker = "\n[... excerpt cut]"
        fixed = sum(len(h) + len(marker) + 2 for h, _, _, _, _ in items)
        budget = max(0, max_chars - fixed)
        alloc = [0] * len(items)
        order = sorted(range(len(items)), key=lambda i: len(items[i][1]))
        remaining = budget
        for pos, i in enumerate(order):
            share = remaining // (len(items) - pos)
            alloc[i] = min(len(items[i][1]), share)
            remaining -= alloc[i]
        parts: list[str] = []
        info = []
        for (h, body, path, lines_cut, title), a in zip(items, alloc, strict=True):
            cut = lines_cut or len(body) > a
            excerpt = body[:a] + (marker if cut else "")
            parts.append(h + excerpt)
            info.append({"path": path, "title": title, "excerpt": excerpt, "chars": a, "truncated": cut})
        text = "\n\n".join(parts)
        if len(text) > max_chars:  # only when the headers alone exceed the budget
            text = text[:max_chars]
        return ActionResult.success(
            f"excerpts of {len(items)} sources ({R.fmt_int(len(text))} chars)", text, sources=info
        )

    def tree(self, max_lines: int = README_TREE_LINES) -> str:
        """The active synthetic hierarchy, one indented line per node (directories with a trailing `/`)."""
        idx = self._index
        out: list[str] = []
        total = len(self.active_nodes())

        def walk(parent: str | None, depth: int) -> None:
            nodes = sorted(
                (self._nodes[c] for c in idx.children.get(parent, [])),
                key=lambda n: (n.kind != DIRECTORY, n.name),
            )
            for n in nodes:
                if len(out) >= max_lines:
                    return
                slash = "/" if n.kind == DIRECTORY else ""
                out.append(f'{"  " * depth}{n.name}{slash}  "{R.clip(n.title, 90)}"')
                if n.kind == DIRECTORY:
                    walk(n.node_id, depth + 1)

        walk(None, 0)
        if len(out) < total:
            out.append(f"... ({total - len(out)} more synthetic nodes; use list_files)")
        return "\n".join(out) if out else "(no synthetic files yet)"

    def readme_text(self) -> str:
        st = self.stats()
        if st["active_synthetic"]:
            intro = (
                f"This workspace holds {st['raw_docs']} raw documents (under {RAW_DIR}/) and "
                f"{st['active_files']} synthetic files in {st['active_dirs']} synthetic directories (nesting "
                f"depth {st['max_depth']}), written from those documents to make them easier to navigate."
            )
        else:
            intro = (
                f"This workspace holds {st['raw_docs']} raw documents under {RAW_DIR}/. No synthetic files "
                f"have been written yet: list {RAW_DIR}/ to see the documents."
            )
        lines = [
            "# Workspace index",
            "",
            intro,
            "",
            "## How to read",
            f"- list_files(path) lists a directory; read_file(path, start_line, num_lines) reads at most "
            f"{MAX_READ_LINES} lines and {R.fmt_int(MAX_READ_CHARS)} characters at a time and says how to "
            f"continue.",
            "- Every synthetic file starts with a header: TITLE, KIND, PATH, SOURCES_RAW (the original "
            "documents it was written from, with content hashes) and SOURCES_SYNTHETIC (other synthetic "
            "files it builds on), then `---` and its text.",
            "- Synthetic files summarise; when a detail is missing, follow SOURCES_RAW to the original "
            f"document under {RAW_DIR}/.",
            "",
            "## Layout",
            "- cluster_NNNN__<name>.txt: a synthetic file written from the sources in its header.",
            f"- merge_NNNN__<name>/: a synthetic directory; its {SUMMARY} describes what it holds.",
            f"- {RAW_DIR}/: the {st['raw_docs']} original documents, unchanged (raw_NNNN__<name>.txt).",
        ]
        if st["deleted"]:
            lines.append(
                f"- {HISTORY_DIR}/: {st['deleted']} synthetic nodes the builder deleted (kept for "
                f"reference; may be outdated)."
            )
        lines += ["", "## Synthetic files", self.tree()]
        return "\n".join(lines) + "\n"

    def readme(self) -> ActionResult:
        """The root README (also readable as `README.md`)."""
        text = self.readme_text()
        return ActionResult.success(f"{README} ({R.fmt_int(len(text))} chars)", text, path=README)

    # ------------------------------------------------------------------------------------------- provenance
    def provenance(self, path: object) -> ActionResult:
        """Every raw document a file rests on, followed through synthetic sources (deleted ones too), with its
        content hash. `data["raw"]` is a list of {handle, doc_id, path, sha}; `data["synthetic"]` the node
        ids passed through."""
        r = self._resolve(path)
        if isinstance(r, ActionResult):
            return r
        k = r.entry.kind
        if k == E_RAW:
            handles, through = [r.entry.ref], []
        elif k in (E_FILE, E_DIR, E_SUMMARY):
            handles = self._raw_provenance(r.entry.ref)
            through = self._synthetic_closure(r.entry.ref)
        else:
            return ActionResult.error(
                IS_A_DIRECTORY if k in _DIR_ENTRIES else INVALID_ARGUMENT,
                f"{r.asked!r} is not a raw document or synthetic node",
            )
        raws = [self._raw_by_handle[h] for h in handles]
        rows = [{"handle": d.handle, "doc_id": d.doc_id, "path": d.path, "sha": d.sha} for d in raws]
        text = "\n".join(f"{d.path} (doc_id={d.doc_id}, sha256:{d.sha})" for d in raws)
        return ActionResult.success(
            f"{r.path} rests on {len(rows)} raw documents", text, path=r.path, raw=rows, synthetic=through
        )

    def _synthetic_closure(self, node_id: str) -> list[str]:
        out: list[str] = []
        stack = list(reversed(self._nodes[node_id].synthetic_sources))
        while stack:
            nid = stack.pop()
            if nid in out or nid == node_id:
                continue
            out.append(nid)
            stack.extend(reversed(self._nodes[nid].synthetic_sources))
        return out

    def staleness(self, new_docs: Iterable[Document]) -> ActionResult:
        """Which active synthetic nodes rest (transitively) on a raw document that `new_docs` changes (same
        doc_id, other text) or drops (doc_id absent). `data["stale"]` lists {node_id, path, changed, removed}
        (doc_ids); `data` also has `changed_docs`, `removed_docs`, `added_docs`."""
        new = {d.doc_id: d.sha for d in new_docs}
        changed = {d.handle for d in self._raw if d.doc_id in new and new[d.doc_id] != d.sha}
        removed = {d.handle for d in self._raw if d.doc_id not in new}
        known = {d.doc_id for d in self._raw}
        stale = []
        for n in self.active_nodes():
            prov = self._raw_provenance(n.node_id)
            c = [self._raw_by_handle[h].doc_id for h in prov if h in changed]
            rm = [self._raw_by_handle[h].doc_id for h in prov if h in removed]
            if c or rm:
                stale.append(
                    {"node_id": n.node_id, "path": self._index.file_path(n), "changed": c, "removed": rm}
                )
        text = "\n".join(f"{s['path']}: changed {s['changed']}, removed {s['removed']}" for s in stale)
        by_h = self._raw_by_handle
        return ActionResult.success(
            f"{len(stale)} active synthetic nodes rest on changed or removed documents",
            text or "(none stale)",
            stale=stale,
            changed_docs=sorted(by_h[h].doc_id for h in changed),
            removed_docs=sorted(by_h[h].doc_id for h in removed),
            added_docs=sorted(set(new) - known),
        )

    # -------------------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, int]:
        """Counts for rewards and logging: raw docs, active files / directories, deleted nodes, deepest
        nesting of active nodes (root level = 1), characters of active synthetic bodies and raw texts,
        entries at the root."""
        active = self.active_nodes()
        depth_memo: dict[str, int] = {}

        def depth(nid: str) -> int:
            if nid not in depth_memo:
                p = self._nodes[nid].parent
                depth_memo[nid] = 1 if p is None else 1 + depth(p)
            return depth_memo[nid]

        return {
            "raw_docs": len(self._raw),
            "active_files": sum(1 for n in active if n.kind == FILE),
            "active_dirs": sum(1 for n in active if n.kind == DIRECTORY),
            "active_synthetic": len(active),
            "deleted": len(self._nodes) - len(active),
            "max_depth": max((depth(n.node_id) for n in active), default=0),
            "synthetic_chars": sum(len(n.body) for n in active),
            "raw_chars": sum(len(d.text) for d in self._raw),
            "root_entries": len(self._index.children.get(None, [])),
        }

    # ------------------------------------------------------------------------------------------- invariants
    def check_invariants(self) -> list[str]:
        """Every broken invariant as a sentence (empty when the state is sound): raw texts match hashes;
        ids, handles and names are well formed and unique; every source resolves; active nodes sit in active
        directories; the parent relation has no cycle; every path is unique."""
        errs: list[str] = []
        handles = set()
        for i, d in enumerate(self._raw, start=1):
            if not R.encodable(d.text):
                errs.append(f"raw {d.handle}: text holds a lone surrogate (not valid Unicode)")
            elif content_hash(d.text) != d.sha:
                errs.append(f"raw {d.handle}: text does not match sha {d.sha}")
            if not d.doc_id or R.has_control(d.doc_id):
                errs.append(f"raw {d.handle}: doc_id must be one non-empty line without control characters")
            if not (R.is_one_line(d.title) and R.is_one_line(d.url)):
                errs.append(f"raw {d.handle}: title and url must be single lines without control characters")
            if d.handle != f"raw_{i:04d}" or d.handle in handles:
                errs.append(f"raw #{i}: bad or repeated handle {d.handle!r}")
            handles.add(d.handle)
            if not P.is_safe_name(d.filename) or not d.filename.startswith(d.handle + "__"):
                errs.append(f"raw {d.handle}: unsafe file name {d.filename!r}")
        if len({d.doc_id for d in self._raw}) != len(self._raw):
            errs.append("repeated doc_id among raw documents")
        titles: dict[str, str] = {}
        for nid, n in self._nodes.items():
            m = _NODE_ID.fullmatch(nid) if isinstance(nid, str) else None
            if (
                n.node_id != nid
                or m is None
                or int(m.group(2)) >= self._next[FILE if m.group(1) == "cluster" else DIRECTORY]
            ):
                errs.append(f"node {_short_repr(nid)}: bad id")
                continue
            if n.kind not in (FILE, DIRECTORY):
                errs.append(f"node {nid}: bad kind {n.kind!r}")
            if not (
                isinstance(n.title, str) and isinstance(n.body, str) and isinstance(n.delete_reason, str)
            ):
                errs.append(f"node {nid}: title, body and delete_reason must be strings")
                continue
            if not n.title or not R.is_one_line(n.title) or len(n.title) > MAX_TITLE_CHARS:
                errs.append(
                    f"node {nid}: title must be one non-empty line of at most {MAX_TITLE_CHARS} characters"
                )
            elif n.active:
                other = titles.setdefault(_norm_title(n.title), nid)
                if other != nid:
                    errs.append(
                        f"node {nid}: title {n.title[:80]!r} is also the title of active node {other}"
                    )
            if not R.is_one_line(n.delete_reason) or len(n.delete_reason) > MAX_REASON_CHARS:
                errs.append(
                    f"node {nid}: delete_reason must be one line of at most {MAX_REASON_CHARS} characters"
                )
            if isinstance(self._check_content(n.body), ActionResult):
                errs.append(f"node {nid}: body is not valid content (NUL, lone surrogate or too long)")
            turns = (n.created_turn,) if n.deleted_turn is None else (n.created_turn, n.deleted_turn)
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_INT for x in turns):
                errs.append(f"node {nid}: turns must be integers between 0 and {MAX_INT}")
            if not isinstance(n.active, bool) or not (n.parent is None or isinstance(n.parent, str)):
                errs.append(f"node {nid}: active must be a boolean and parent a node id or None")
                continue
            if not all(isinstance(x, str) for x in (*n.raw_sources, *n.synthetic_sources, n.slug)):
                errs.append(f"node {nid}: slug and sources must be strings")
                continue
            if not P.is_safe_name(n.name) or P.slugify(n.slug) != n.slug:
                errs.append(f"node {nid}: unsafe name {n.name!r}")
            for h in n.raw_sources:
                if h not in self._raw_by_handle:
                    errs.append(f"node {nid}: raw source {h!r} does not exist")
            for s in n.synthetic_sources:
                if s not in self._nodes:
                    errs.append(f"node {nid}: synthetic source {s!r} does not exist")
            if n.active:
                if n.parent is not None:
                    p = self._nodes.get(n.parent)
                    if p is None or not p.active or p.kind != DIRECTORY:
                        errs.append(f"node {nid}: parent {n.parent!r} is not an active directory")
                if n.deleted_turn is not None:
                    errs.append(f"node {nid}: active but has a deleted turn")
            elif n.deleted_turn is None:
                errs.append(f"node {nid}: deleted without a deleted turn")
            seen = {nid}
            p = n.parent if n.active else None
            while isinstance(p, str) and p in self._nodes:
                if p in seen:
                    errs.append(f"node {nid}: parent cycle")
                    break
                seen.add(p)
                p = self._nodes[p].parent
        if not errs:
            try:
                idx = _Index(self._nodes, _RawLayer(self._raw))
                n_expected = (
                    3 + len(self._raw) + sum(2 if n.kind == DIRECTORY else 1 for n in self._nodes.values())
                )
                n_expected += 1 if any(not n.active for n in self._nodes.values()) else 0
                n_paths = len({p for p, _ in idx.all_entries()})
                if n_paths != n_expected:
                    errs.append(f"paths are not unique: {n_paths} distinct paths, {n_expected} expected")
                if self._index_cache is not None and self._index_cache.signature() != idx.signature():
                    errs.append("the incrementally updated path index differs from a fresh build")
            except RuntimeError as e:
                errs.append(str(e))
        return errs

    # --------------------------------------------------------------------------------------- serialisation
    @staticmethod
    def _raw_dict(d: RawDoc, with_text: bool) -> dict[str, Any]:
        out = {
            "handle": d.handle,
            "doc_id": d.doc_id,
            "title": d.title,
            "url": d.url,
            "sha": d.sha,
            "filename": d.filename,
            "meta": d.meta,
        }
        if with_text:
            out["text"] = d.text
        return out

    def _nodes_list(self) -> list[dict[str, Any]]:
        return [
            {
                "node_id": n.node_id,
                "kind": n.kind,
                "title": n.title,
                "slug": n.slug,
                "parent": n.parent,
                "raw_sources": list(n.raw_sources),
                "synthetic_sources": list(n.synthetic_sources),
                "created_turn": n.created_turn,
                "active": n.active,
                "deleted_turn": n.deleted_turn,
                "delete_reason": n.delete_reason,
                "body": n.body,
            }
            for n in self._nodes.values()
        ]

    def to_dict(self, include_raw_text: bool = True) -> dict[str, Any]:
        """The state as plain JSON-able data (see `to_json`)."""
        return {
            "format": FORMAT,
            "next_ids": {"cluster": self._next[FILE], "merge": self._next[DIRECTORY]},
            "raw": [self._raw_dict(d, include_raw_text) for d in self._raw],
            "nodes": self._nodes_list(),
        }

    def to_json(self, include_raw_text: bool = True) -> str:
        """The whole state as JSON; `Workspace.from_json(ws.to_json())` restores it exactly.

        With `include_raw_text=False` raw documents are recorded by doc_id, hash and name only (a snapshot of
        a few kilobytes instead of the whole corpus, e.g. for episode records); `from_json(text, docs=...)`
        then needs the documents back and checks their hashes. The serialised raw section is cached (raw
        documents never change), so repeated snapshots cost only the synthetic part."""
        key = "raw_json" if include_raw_text else "raw_json_notext"
        layer = self._raw_layer
        cached = layer.cache.get(key)
        if cached is None:
            cached = _dumps([self._raw_dict(d, include_raw_text) for d in self._raw])
            layer.cache[key] = cached
        head = _dumps(
            {"format": FORMAT, "next_ids": {"cluster": self._next[FILE], "merge": self._next[DIRECTORY]}}
        )
        return f'{head[:-1]},"raw":{cached},"nodes":{_dumps(self._nodes_list())}}}'

    @classmethod
    def from_dict(cls, d: dict[str, Any], docs: Iterable[Document] | None = None) -> Workspace:
        """Restore `to_dict` data (`docs` supplies raw texts a snapshot left out; see `to_json`).

        Raises `SnapshotError` (a ValueError) naming the field on anything `to_dict` would not have
        written: a wrong type (a float or bool turn, a non-string title, a list handle...), a missing key, an
        out-of-range id counter, or a state that breaks `check_invariants` (texts that do not match their
        hashes, titles or reasons spread over several lines, unsafe names, dangling sources, cycles)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise SnapshotError(
                f"not a workspace snapshot: format {_short_repr(got)}, expected {FORMAT!r}", "format"
            )
        texts: dict[str, str] = {}
        for i, x in enumerate(docs if docs is not None else ()):
            if not isinstance(x, Document) or not isinstance(x.doc_id, str) or not isinstance(x.text, str):
                raise SnapshotError(
                    f"docs[{i}] is not a Document with a string doc_id and text", f"docs[{i}]"
                )
            texts[x.doc_id] = x.text
        raw = []
        for i, x in enumerate(_field(d, "raw", list, "")):
            where = f"raw[{i}]"
            if not isinstance(x, dict):
                raise SnapshotError(f"malformed workspace snapshot: field {where!r} must be an object", where)
            doc_id = _field(x, "doc_id", str, where)
            if "text" in x:
                text = _field(x, "text", str, where)
            elif doc_id in texts:
                text = texts[doc_id]
            else:
                raise SnapshotError(
                    f"snapshot has no text for raw document {doc_id!r}; pass docs=", f"{where}.text"
                )
            meta = x.get("meta", {})
            if not isinstance(meta, dict):
                raise SnapshotError(
                    f"malformed workspace snapshot: field '{where}.meta' must be an object", where
                )
            raw.append(
                RawDoc(
                    _field(x, "handle", str, where),
                    doc_id,
                    _field(x, "title", str, where),
                    _field(x, "url", str, where),
                    text,
                    _field(x, "sha", str, where),
                    _field(x, "filename", str, where),
                    dict(meta),
                )
            )
        nodes: dict[str, SyntheticNode] = {}
        for i, x in enumerate(_field(d, "nodes", list, "")):
            where = f"nodes[{i}]"
            if not isinstance(x, dict):
                raise SnapshotError(f"malformed workspace snapshot: field {where!r} must be an object", where)
            nid = _field(x, "node_id", str, where)
            if nid in nodes:
                raise SnapshotError(
                    f"malformed workspace snapshot: node id {nid!r} appears twice", f"{where}.node_id"
                )
            texts_ok = all(isinstance(x.get(k), str) for k in ("title", "body", "delete_reason") if k in x)
            if not texts_ok:
                raise SnapshotError(
                    f"node {nid}: title, body and delete_reason must be strings "
                    f"(malformed workspace snapshot at {where})",
                    where,
                )
            deleted = x.get("deleted_turn")
            nodes[nid] = SyntheticNode(
                nid,
                _field(x, "kind", str, where),
                _field(x, "title", str, where),
                _field(x, "slug", str, where),
                _field(x, "body", str, where),
                _field(x, "parent", (str, type(None)), where),
                tuple(_strings(x, "raw_sources", where)),
                tuple(_strings(x, "synthetic_sources", where)),
                _int_field(x, "created_turn", where),
                _field(x, "active", bool, where),
                None if deleted is None and "deleted_turn" in x else _int_field(x, "deleted_turn", where),
                _field(x, "delete_reason", str, where),
            )
        counters = _field(d, "next_ids", dict, "")
        next_ids = {
            FILE: _int_field(counters, "cluster", "next_ids", low=1),
            DIRECTORY: _int_field(counters, "merge", "next_ids", low=1),
        }
        ws = cls(raw, nodes, next_ids)
        errs = ws.check_invariants()
        if errs:
            raise SnapshotError("workspace snapshot breaks invariants: " + "; ".join(errs[:5]), "")
        return ws

    @classmethod
    def from_json(cls, text: str, docs: Iterable[Document] | None = None) -> Workspace:
        """Restore a `to_json` snapshot; raises `SnapshotError` (a ValueError) naming the problem if it is
        malformed or unsound (a raw text that does not match its recorded hash included)."""
        if not isinstance(text, str | bytes | bytearray):
            raise SnapshotError(f"workspace snapshot must be JSON text, got {type(text).__name__}", "")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits, too deep
            raise SnapshotError(f"workspace snapshot is not valid JSON: {str(e)[:200]}", "") from e
        return cls.from_dict(d, docs)

    def copy(self) -> Workspace:
        """An independent snapshot. Cheap: raw documents and nodes are immutable and shared; only the node
        table is copied."""
        ws = Workspace.__new__(Workspace)
        ws._raw = self._raw
        ws._raw_by_handle = self._raw_by_handle
        ws._nodes = dict(self._nodes)
        ws._next = dict(self._next)
        ws._raw_layer_cache = self._raw_layer_cache
        ws._index_cache = self._index_cache  # derived from identical state; dropped on the next change
        ws._index_shared = self._index_shared = self._index_cache is not None
        return ws

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Workspace):
            return NotImplemented
        return (
            self._raw == other._raw
            and list(self._nodes.items()) == list(other._nodes.items())
            and self._next == other._next
        )

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------------------------------------- ablations
    def flattened(self) -> Workspace:
        """Hierarchy ablation: every active synthetic node at the root as a plain file with the same title,
        sources and text (a directory becomes the file `merge_NNNN__<slug>.txt` holding its summary)."""
        ws = self.copy()
        for nid, n in self._nodes.items():
            if n.active:
                ws._nodes[nid] = dataclasses.replace(n, parent=None, kind=FILE)
        ws._changed()
        return ws

    def shuffled(self, seed: int) -> Workspace:
        """Hierarchy ablation: the same files and directories, but which directory holds each synthetic file
        is a random permutation (seeded) of the original placements; directories keep their places, so every
        directory holds as many files as before."""
        ws = self.copy()
        files = [n for n in self._nodes.values() if n.active and n.kind == FILE]
        slots = [n.parent for n in files]
        random.Random(seed).shuffle(slots)
        for n, slot in zip(files, slots, strict=True):
            ws._nodes[n.node_id] = dataclasses.replace(n, parent=slot)
        ws._changed()
        return ws

    # ------------------------------------------------------------------------------------------------ export
    def files(self) -> dict[str, str]:
        """Every readable file of the workspace (README, raw documents, synthetic files and summaries,
        history) by path, rendered exactly as read_file shows it (without line numbers)."""
        return {
            p: self._text_of(e)
            for p, e in self._index.all_entries()
            if e.kind in (E_README, E_RAW, E_FILE, E_SUMMARY)
        }

    def manifest(self) -> dict[str, Any]:
        idx = self._index
        return {
            "format": FORMAT,
            "stats": self.stats(),
            "raw_docs": [
                {
                    "path": d.path,
                    "handle": d.handle,
                    "doc_id": d.doc_id,
                    "title": d.title,
                    "url": d.url,
                    "sha256_16": d.sha,
                }
                for d in self._raw
            ],
            "synthetic": [
                {
                    "node_id": n.node_id,
                    "kind": n.kind,
                    "title": n.title,
                    "path": idx.file_path(n),
                    "parent": n.parent,
                    "active": n.active,
                    "created_turn": n.created_turn,
                    "deleted_turn": n.deleted_turn,
                    "delete_reason": n.delete_reason,
                    "raw_sources": [self._raw_by_handle[h].path for h in n.raw_sources],
                    "synthetic_sources": [idx.file_path(self._nodes[s]) for s in n.synthetic_sources],
                    "raw_provenance": [
                        {"path": self._raw_by_handle[h].path, "sha256_16": self._raw_by_handle[h].sha}
                        for h in self._raw_provenance(n.node_id)
                    ],
                }
                for n in self._nodes.values()
            ],
        }

    def export(self, directory: str | os.PathLike[str]) -> ActionResult:
        """Write the workspace as a real directory tree: README.md, raw_docs/, the synthetic files (with
        headers) and directories, history/, and manifest.json. Refuses (writing nothing) if `directory` is a
        symlink, or if any file would land outside it or pass through a symlink; never follows or writes
        symlinks."""
        from librarian_jax.workspace.export import write_tree

        files = self.files()
        files[MANIFEST] = json.dumps(self.manifest(), ensure_ascii=False, indent=1) + "\n"
        return write_tree(Path(directory), files)
