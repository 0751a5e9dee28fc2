"""The path index: which path names what (the root, README, raw documents, synthetic files and directories,
history), each node's current path, each directory's children, the titles in use, and the forgiving name
lookup of `paths.NameIndex`.

Two layers. `RawLayer` covers the part that never changes (root, README, `raw_docs/`, the raw documents): it
is built once and shared by every copy and snapshot. `Index` covers the synthetic nodes. It is built once
from the node table (`Index.build`), then kept up to date by each action (`add_file`, `detach` + `on_merge`,
`detach` + `on_delete`), touching only the paths that change. Its tables are persistent maps
(`immutables.Map`, a hash array mapped trie), so `Index.copy()` (taken with every workspace snapshot) shares
them in O(1) and a write on either side afterwards copies only the trie nodes on the changed paths, never the
whole index. Each change runs as one batch (`editing()`: the tables are `MapMutation`s for its duration, so a
node it copies once it then changes in place). A directory's children are a persistent map too (child id ->
None), nested in `children`, so moving one child of a 2,000-child directory copies a path, not the list.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import immutables

from librarian_jax.workspace import paths as P
from librarian_jax.workspace.nodes import (
    DIRECTORY,
    HISTORY_DIR,
    RAW_DIR,
    README,
    SUMMARY,
    RawDoc,
    SyntheticNode,
    norm_title,
)

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
DIR_ENTRIES = (E_ROOT, E_RAW_DIR, E_HISTORY_DIR, E_DIR)


@dataclasses.dataclass(frozen=True)
class Entry:
    """What a path names: its `kind` (one of the E_* above) and `ref`, a raw handle or node id."""

    kind: str
    ref: str = ""


class RawLayer:
    """Lookup state for the fixed part of a workspace (root, README, raw_docs/, the raw documents): built once
    and shared by every copy and snapshot of it."""

    def __init__(self, raw: Sequence[RawDoc]):
        self.entries: dict[str, Entry] = {
            "": Entry(E_ROOT),
            README: Entry(E_README),
            RAW_DIR: Entry(E_RAW_DIR),
        }
        for doc in raw:
            self.entries[doc.path] = Entry(E_RAW, doc.handle)
        handles = {d.doc_id: d.path for d in raw if P.is_safe_name(d.doc_id)}  # doc_ids name documents too
        handles.update({d.handle: d.path for d in raw})  # ... but never shadow a raw_NNNN handle
        self.names = P.NameIndex([p for p in self.entries if p], handles)
        self.cache: dict[str, str] = {}  # serialised raw sections (see Serialisation.to_json)


class Index:
    """Derived lookup state for the synthetic nodes of one workspace state, on top of the raw layer (see the
    module docstring). `nodes` arguments are the workspace's node table after (or, for `detach`, before)
    the change being recorded."""

    __slots__ = ("raw", "entries", "dir_path", "children", "titles", "has_history", "names")
    TABLES = ("entries", "dir_path", "children", "titles")

    def __init__(self, raw: RawLayer):
        """An empty index (no synthetic nodes); use `build` for a populated one."""
        self.raw = raw
        self.entries: immutables.Map[str, Entry] = immutables.Map()
        self.dir_path: immutables.Map[str, str] = immutables.Map()  # node id -> dir path (dirs) or file path
        # parent node id (None: the root) -> its active children (a set: child id -> None)
        self.children: immutables.Map[str | None, immutables.Map[str, None]] = immutables.Map()
        self.titles: immutables.Map[str, str] = immutables.Map()  # normalised title of an active node -> id
        self.has_history = False
        self.names = P.NameIndex((), {}, base=raw.names)

    def editing(self) -> contextlib.AbstractContextManager[None]:
        """One batch of changes: every table (the name index's too) is a `MapMutation` inside the block. An
        action runs all its index changes in one (see `actions.py`); each change method opens one itself
        when called outside."""
        return P.editing((self, self.TABLES), (self.names, self.names.TABLES))

    @classmethod
    def build(cls, nodes: Mapping[str, SyntheticNode], raw: RawLayer) -> Index:
        """The index of `nodes` (in creation order). Raises RuntimeError on a parent cycle."""
        idx = cls(raw)
        with idx.editing():
            idx._build(nodes)
        return idx

    def _build(self, nodes: Mapping[str, SyntheticNode]) -> None:
        """Fill this empty index from `nodes`, inside `editing()`."""
        kids: dict[str | None, dict[str, None]] = {}
        for nid, node in nodes.items():
            if node.active:
                kids.setdefault(node.parent, {})[nid] = None
                self.titles[norm_title(node.title)] = nid
            else:
                self.has_history = True
        for parent, mine in kids.items():
            self.children[parent] = immutables.Map(mine)
        if self.has_history:
            self.entries[HISTORY_DIR] = Entry(E_HISTORY_DIR)
            self.names.add(HISTORY_DIR)
        dir_path: dict[str, str] = {}

        def path_of(nid: str, depth: int = 0) -> str:
            if nid in dir_path:
                return dir_path[nid]
            node = nodes[nid]
            if not node.active:
                p = f"{HISTORY_DIR}/{node.name}"
            elif node.parent is None:
                p = node.name
            else:
                if depth > len(nodes):
                    raise RuntimeError(f"workspace has a parent cycle through {nid}")
                p = f"{path_of(node.parent, depth + 1)}/{node.name}"
            dir_path[nid] = p
            return p

        for nid in nodes:
            path_of(nid)
        for nid, node in nodes.items():
            self._put(node, dir_path[nid])

    def copy(self) -> Index:
        """An independent index in O(1): the tables are immutable, so both share them until either changes."""
        out = Index.__new__(Index)
        out.raw = self.raw
        out.entries = self.entries
        out.dir_path = self.dir_path
        out.children = self.children
        out.titles = self.titles
        out.has_history = self.has_history
        out.names = self.names.copy()
        return out

    def tables(self) -> tuple[immutables.Map[Any, Any], ...]:
        """Every persistent table of this index (for measuring what copying them would cost)."""
        n = self.names
        return (
            self.entries,
            self.dir_path,
            self.children,
            self.titles,
            n._paths,
            n._lower,
            n._base,
            n._handles,
            n._handle_of,
        )

    # ------------------------------------------------------------------------------------------ changes
    # The public changes each run as one `editing()` batch; the private helpers run inside one.
    def _add_child(self, parent: str | None, kids: Iterable[str]) -> None:
        mine = self.children.get(parent)
        self.children[parent] = (immutables.Map() if mine is None else mine).update(dict.fromkeys(kids))

    def add_file(self, node: SyntheticNode) -> None:
        """Record a newly created active file (nothing else moves on a create)."""
        with self.editing():
            self._add_child(node.parent, (node.node_id,))
            self.titles[norm_title(node.title)] = node.node_id
            self._put(node)

    def _put(self, node: SyntheticNode, path: str | None = None) -> None:
        """Enter one node's path(s), computed from its parent's current path unless given."""
        nid = node.node_id
        if path is not None:
            p = path
        elif not node.active:
            p = f"{HISTORY_DIR}/{node.name}"
        elif node.parent is None:
            p = node.name
        else:
            p = f"{self.dir_path[node.parent]}/{node.name}"
        self.dir_path[nid] = p
        if node.kind == DIRECTORY:
            self.entries[p] = Entry(E_DIR, nid)
            self.entries[f"{p}/{SUMMARY}"] = Entry(E_SUMMARY, nid)
            self.names.add(f"{p}/{SUMMARY}")
        else:
            self.entries[p] = Entry(E_FILE, nid)
        self.names.add(p, nid)

    def _drop(self, nid: str) -> None:
        p = self.dir_path.pop(nid)
        if self.entries.pop(p).kind == E_DIR:
            del self.entries[f"{p}/{SUMMARY}"]
            self.names.remove(f"{p}/{SUMMARY}")
        self.names.remove(p)

    def detach(self, nodes: Mapping[str, SyntheticNode], roots: Sequence[str]) -> list[str]:
        """Before `roots` move: drop the paths of their whole subtrees (returned in preorder), take the roots
        out of their parents' child lists."""
        order: list[str] = []
        stack = list(reversed(roots))
        while stack:
            nid = stack.pop()
            order.append(nid)
            if nodes[nid].kind == DIRECTORY:
                stack.extend(self.children.get(nid, ()))
        with self.editing():
            for nid in order:
                self._drop(nid)
            for r in roots:
                parent = nodes[r].parent
                self.children[parent] = self.children[parent].delete(r)
        return order

    def on_merge(self, nodes: Mapping[str, SyntheticNode], new_id: str, moved: list[str]) -> None:
        """After a merge made `new_id` (children already re-parented in `nodes`)."""
        node = nodes[new_id]
        with self.editing():
            self._add_child(node.parent, (new_id,))
            self._add_child(new_id, node.synthetic_sources)
            self.titles[norm_title(node.title)] = new_id
            self._put(node)
            for nid in moved:
                self._put(nodes[nid])

    def on_delete(self, nodes: Mapping[str, SyntheticNode], gone: str, moved: list[str]) -> None:
        """After `gone` was deleted (children already re-parented in `nodes`); `moved` is from `detach`."""
        node = nodes[gone]
        with self.editing():
            kids = self.children.pop(gone, None)
            if kids:
                self._add_child(nodes[next(iter(kids))].parent, kids)
            self.titles.pop(norm_title(node.title), None)
            if not self.has_history:
                self.has_history = True
                self.entries[HISTORY_DIR] = Entry(E_HISTORY_DIR)
                self.names.add(HISTORY_DIR)
            for nid in moved:
                self._put(nodes[nid])

    # ------------------------------------------------------------------------------------------ lookups
    def signature(self) -> tuple[Any, ...]:
        """Everything lookups depend on, comparably (to check incremental updates against a rebuild)."""
        kids = {k: sorted(v) for k, v in self.children.items() if v}
        n = self.names
        return (
            dict(self.all_entries()),
            dict(self.dir_path.items()),
            dict(self.titles.items()),
            kids,
            self.has_history,
            sorted(n.paths),
            dict(n._handles.items()),
            sorted((k, sorted(v)) for k, v in n._base.items()),
            sorted((k, sorted(v)) for k, v in n._lower.items()),
        )

    def entry(self, path: str) -> Entry:
        hit = self.entries.get(path)
        return hit if hit is not None else self.raw.entries[path]

    def all_entries(self) -> list[tuple[str, Entry]]:
        """(path, entry) for every path: the raw layer's in order, then the synthetic ones (in no order)."""
        return [*self.raw.entries.items(), *self.entries.items()]

    def file_path(self, node: SyntheticNode) -> str:
        p = self.dir_path[node.node_id]
        return f"{p}/{SUMMARY}" if node.kind == DIRECTORY else p
