"""The workspace's state and snapshots: the raw documents, the synthetic node table, the id counters and the
path index, with `copy()` (a snapshot) and equality. Every concern module (`actions`, `views`, `provenance`,
`serialisation`, `invariants`, `ablations`, `export`) adds methods on top of `WorkspaceState`; `workspace.py`
puts them together as `Workspace`.

State (all of it immutable or persistent, so a snapshot shares everything):

- `_raw`: the raw documents (a tuple of frozen `RawDoc`), `_raw_by_handle`, and `_raw_layer_cache` (their
  part of the path index): never change, shared by every copy.
- `_nodes`: node id -> `SyntheticNode` (frozen; a change replaces the record), an `immutables.Map`.
- `_order`: creation number (0, 1, ...) -> node id, an `immutables.Map` used as a persistent vector: the
  order of `nodes`, `to_json`, the manifest (an append is one `set`; ids are never removed).
- `_next`: the next number per node kind (ids never repeat).
- `_retired`: raw documents an update (`workspace.update`) took out of the corpus (removed, or replaced by a
  new version under a new handle) that some synthetic node still cites: in `_raw_by_handle` (so headers and
  provenance still name the path and hash a node was written from), but not in `_raw`, not listed, not
  readable, not exported as files. Their text is not kept (""). Empty for every workspace built from scratch.
- `_index_cache`: the synthetic part of the path index (`index.Index`), built on first use and then kept up
  to date by every action.

`copy()` is O(1) in the number of files, and so is the first write after it: the maps are hash array mapped
tries (MagicStack's `immutables`), so a write copies only the O(log n) trie nodes on its key's path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Self

import immutables

from librarian_jax.data.schema import Document, content_hash
from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R
from librarian_jax.workspace.arguments import check_document
from librarian_jax.workspace.index import Index, RawLayer
from librarian_jax.workspace.nodes import DIRECTORY, FILE, RawDoc, SyntheticNode


class WorkspaceState:
    """The state every concern module works on (see the module docstring)."""

    def __init__(
        self,
        raw: Sequence[RawDoc],
        nodes: dict[str, SyntheticNode] | None = None,
        next_ids: dict[str, int] | None = None,
        retired: Sequence[RawDoc] = (),
    ):
        self._raw: tuple[RawDoc, ...] = tuple(raw)
        self._retired: tuple[RawDoc, ...] = tuple(retired)
        self._raw_by_handle: dict[str, RawDoc] = {d.handle: d for d in (*self._retired, *self._raw)}
        self._nodes: immutables.Map[str, SyntheticNode] = immutables.Map(nodes or {})
        self._order: immutables.Map[int, str] = immutables.Map(enumerate(nodes or {}))
        self._next = dict(next_ids or {FILE: 1, DIRECTORY: 1})
        self._index_cache: Index | None = None
        self._raw_layer_cache: RawLayer | None = None

    @classmethod
    def from_documents(cls, docs: Iterable[Document]) -> Self:
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
            check_document(d, i)
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

    # ------------------------------------------------------------------------------------------- the index
    @property
    def _raw_layer(self) -> RawLayer:
        if self._raw_layer_cache is None:
            self._raw_layer_cache = RawLayer(self._raw)
        return self._raw_layer_cache

    @property
    def _index(self) -> Index:
        if self._index_cache is None:
            self._index_cache = Index.build(self.nodes, self._raw_layer)
        return self._index_cache

    def _changed(self) -> None:
        """Forget the index (after a change that moves many nodes at once; see `ablations.py`)."""
        self._index_cache = None

    # ----------------------------------------------------------------------------------------- the nodes
    def _node_items(self) -> Iterator[tuple[str, SyntheticNode]]:
        """(node id, node) in creation order."""
        nodes = self._nodes
        for nid in map(self._order.__getitem__, range(len(self._order))):
            yield nid, nodes[nid]

    def _add_node(self, node: SyntheticNode) -> None:
        self._nodes = self._nodes.set(node.node_id, node)
        self._order = self._order.set(len(self._order), node.node_id)

    def _new_id(self, kind: str) -> str:
        n = self._next[kind]
        self._next[kind] = n + 1
        return f"{'cluster' if kind == FILE else 'merge'}_{n:04d}"

    @property
    def raw_docs(self) -> tuple[RawDoc, ...]:
        return self._raw

    @property
    def retired_docs(self) -> tuple[RawDoc, ...]:
        """Raw documents an update took out that synthetic nodes still cite (see the module docstring)."""
        return self._retired

    @property
    def nodes(self) -> dict[str, SyntheticNode]:
        """All synthetic nodes (active and deleted) by id, in creation order (a copy)."""
        return dict(self._node_items())

    def active_nodes(self) -> list[SyntheticNode]:
        return [n for _, n in self._node_items() if n.active]

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

    def _ancestors(self, nid: str | None) -> list[str]:
        """Node ids from `nid` up to the root (inclusive of `nid`)."""
        out: list[str] = []
        while nid is not None:
            out.append(nid)
            nid = self._nodes[nid].parent
            if len(out) > len(self._nodes):
                raise RuntimeError("parent cycle")
        return out

    # ----------------------------------------------------------------------------------------- snapshots
    def copy(self) -> Self:
        """An independent snapshot, O(1) in the number of files: raw documents and nodes are immutable, the
        node table and the path index are persistent maps shared with this workspace; a later write to
        either copies only what it changes."""
        ws = type(self).__new__(type(self))
        ws._raw = self._raw
        ws._retired = self._retired
        ws._raw_by_handle = self._raw_by_handle
        ws._nodes = self._nodes
        ws._order = self._order
        ws._next = dict(self._next)
        ws._raw_layer_cache = self._raw_layer_cache
        ws._index_cache = None if self._index_cache is None else self._index_cache.copy()
        return ws

    def _tables(self) -> tuple[immutables.Map[Any, Any], ...]:
        """The persistent tables of this state: node table, then the index's (for measuring sharing)."""
        return (self._nodes, *self._index.tables())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkspaceState):
            return NotImplemented
        return (
            self._raw == other._raw
            and self._retired == other._retired
            and list(self._node_items()) == list(other._node_items())
            and self._next == other._next
        )

    __hash__ = None  # type: ignore[assignment]
