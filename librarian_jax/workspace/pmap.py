"""Structural sharing for workspace snapshots: a persistent hash map (`PMap`) and an append-only log (`Log`).

A probe takes a snapshot of the workspace every few builder turns, and both the snapshot and the live
workspace may change afterwards. With plain dicts a snapshot must either copy every table or share them and
rebuild them on the next write; both cost O(files). Here each table is a `PMap`, a hash array mapped trie
(HAMT): `copy()` is O(1) (the two maps share every trie node) and a write after a copy copies only the trie
nodes on the path to the changed key (one leaf of at most `LEAF_MAX` entries and about log32(n / LEAF_MAX)
internal nodes of at most `WIDTH` entries). Nodes that a
map created since its last copy belong to it (an ownership token) and are changed in place, so a workspace
that takes no snapshot pays little for this.

Iteration order is the trie's (by hash), not insertion order; `Log` keeps an order where one matters.

Pure Python, no dependencies; keys must be hashable and their hash stable within the process.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

BITS = 5
WIDTH = 1 << BITS  # children per internal node
LEAF_MAX = 128  # entries a leaf holds before it splits (a copied leaf is one C-level dict copy)
_CHUNK = WIDTH - 1
_HASH_MASK = (1 << 30) - 1  # the hash bits the trie uses (a one-digit int: cheap to mask and shift)
_MAX_SHIFT = 30  # below this depth a leaf never splits (only keys whose hashes agree on 30 bits get there)
_MISSING: Any = object()


class _Node:
    """A trie node: a leaf (`table` maps key -> value) or internal (`table` maps a 5-bit hash chunk -> child).
    `owner` is the token of the one map allowed to change it in place."""

    __slots__ = ("owner", "leaf", "table")

    def __init__(self, owner: object, leaf: bool, table: dict[Any, Any]):
        self.owner = owner
        self.leaf = leaf
        self.table = table


class PMap(Mapping[K, V], Generic[K, V]):
    """A mutable mapping with O(1) `copy()`: the copy and the original share structure, and a write to either
    copies only the O(log n) trie nodes it touches (see the module docstring). Supports `m[k]`, `m.get`,
    `in`, `len`, iteration, `m[k] = v`, `del m[k]`, `m.pop(k, default)`, `copy()`."""

    __slots__ = ("_root", "_len", "_owner")

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()):
        self._owner = object()
        self._root = _Node(self._owner, True, {})
        self._len = 0
        for k, v in items.items() if isinstance(items, Mapping) else items:
            self[k] = v

    # ---------------------------------------------------------------------------------------------- reading
    def get(self, key: K, default: Any = None) -> Any:
        node = self._root
        if node.leaf:
            return node.table.get(key, default)
        h = hash(key) & _HASH_MASK
        node = node.table.get(h & _CHUNK)
        while node is not None:
            if node.leaf:
                return node.table.get(key, default)
            h >>= BITS
            node = node.table.get(h & _CHUNK)
        return default

    def __getitem__(self, key: K) -> V:
        node = self._root
        if not node.leaf:
            h = hash(key) & _HASH_MASK
            node = node.table.get(h & _CHUNK)
            while node is not None and not node.leaf:
                h >>= BITS
                node = node.table.get(h & _CHUNK)
            if node is None:
                raise KeyError(key)
        return node.table[key]

    def __contains__(self, key: object) -> bool:
        node = self._root
        if not node.leaf:
            h = hash(key) & _HASH_MASK
            node = node.table.get(h & _CHUNK)
            while node is not None and not node.leaf:
                h >>= BITS
                node = node.table.get(h & _CHUNK)
            if node is None:
                return False
        return key in node.table

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        if self._root.leaf:
            return iter(self._root.table)
        return itertools.chain.from_iterable(self._leaves(self._root))

    def items(self) -> Iterator[tuple[K, V]]:  # type: ignore[override]
        if self._root.leaf:
            return iter(self._root.table.items())
        return itertools.chain.from_iterable(t.items() for t in self._leaves(self._root))

    def values(self) -> Iterator[V]:  # type: ignore[override]
        if self._root.leaf:
            return iter(self._root.table.values())
        return itertools.chain.from_iterable(t.values() for t in self._leaves(self._root))

    @staticmethod
    def _leaves(node: _Node) -> Iterator[dict[Any, Any]]:
        if node.leaf:
            yield node.table
            return
        stack = [node]
        while stack:
            for child in stack.pop().table.values():
                if child.leaf:
                    yield child.table
                else:
                    stack.append(child)

    def __repr__(self) -> str:
        return f"PMap({dict(self.items())!r})"

    # ---------------------------------------------------------------------------------------------- sharing
    def copy(self) -> PMap[K, V]:
        """An independent map with the same entries, in O(1): both maps give up ownership of every node, so
        whichever writes first copies only the nodes on its path."""
        out = PMap.__new__(PMap)
        out._root = self._root
        out._len = self._len
        out._owner = object()
        self._owner = object()
        return out

    def _leaf_for(self, key: object) -> tuple[_Node, int]:
        """The leaf that holds (or would hold) `key`, made owned (copied where shared) on the way down, and
        its depth in bits."""
        owner = self._owner
        node = self._root
        if node.owner is not owner:
            node = self._root = _Node(owner, node.leaf, dict(node.table))
        if node.leaf:
            return node, 0
        h = hash(key) & _HASH_MASK
        shift = 0
        while True:
            table = node.table
            chunk = (h >> shift) & _CHUNK
            node = table.get(chunk)
            if node is None:
                node = table[chunk] = _Node(owner, True, {})
            elif node.owner is not owner:
                node = table[chunk] = _Node(owner, node.leaf, dict(node.table))
            shift += BITS
            if node.leaf:
                return node, shift

    def adopted(self, owner: object) -> PMap[K, V]:
        """This map as one whose writes belong to `owner`: itself when it already does, else a new map that
        shares every node (and copies them on write). For maps nested as values in another persistent
        structure, whose holder changes `owner` at every copy (see `index.Index.children`); `copy()` is the
        right call everywhere else."""
        if self._owner is owner:
            return self
        out = PMap.__new__(PMap)
        out._root = self._root
        out._len = self._len
        out._owner = owner
        return out

    # ---------------------------------------------------------------------------------------------- writing
    def __setitem__(self, key: K, value: V) -> None:
        leaf = self._root
        if leaf.leaf and leaf.owner is self._owner:  # a small map no copy shares: skip the walk
            shift = 0
        else:
            leaf, shift = self._leaf_for(key)
        table = leaf.table
        n = len(table)
        table[key] = value
        if len(table) > n:
            self._len += 1
            if n >= LEAF_MAX and shift < _MAX_SHIFT:
                self._split(leaf, shift)

    def _split(self, node: _Node, shift: int) -> None:
        """Turn an owned, overfull leaf into an internal node (recursively while a part is still overfull)."""
        parts: dict[int, dict[Any, Any]] = {}
        for k, v in node.table.items():
            parts.setdefault(((hash(k) & _HASH_MASK) >> shift) & _CHUNK, {})[k] = v
        node.leaf = False
        node.table = {c: _Node(self._owner, True, t) for c, t in parts.items()}
        for child in node.table.values():
            if len(child.table) > LEAF_MAX and shift + BITS < _MAX_SHIFT:
                self._split(child, shift + BITS)

    def __delitem__(self, key: K) -> None:
        if self.pop(key, _MISSING) is _MISSING:
            raise KeyError(key)

    def pop(self, key: K, default: Any = _MISSING) -> Any:
        """Remove `key` and return its value (`default` when absent; KeyError without a default)."""
        leaf, _ = self._leaf_for(key)  # (when `key` is absent this may copy a path for nothing: harmless)
        value = leaf.table.pop(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._len -= 1
        return value

    def update(self, items: Mapping[K, V] | Iterable[tuple[K, V]]) -> None:
        for k, v in items.items() if isinstance(items, Mapping) else items:
            self[k] = v


def shared_entries(a: PMap[Any, Any], b: PMap[Any, Any]) -> tuple[int, int]:
    """(entries of `a` held in trie leaves that `b` shares, entries of `a`): how much of `a` a write did not
    copy. A measuring aid for tests and benchmarks."""
    theirs: set[int] = set()
    stack = [b._root]
    while stack:
        node = stack.pop()
        theirs.add(id(node))
        if not node.leaf:
            stack.extend(node.table.values())
    shared = total = 0
    stack = [a._root]
    while stack:
        node = stack.pop()
        if node.leaf:
            total += len(node.table)
            shared += len(node.table) if id(node) in theirs else 0
        elif id(node) in theirs:  # a shared subtree: count its leaves without descending node by node
            n = sum(len(t) for t in PMap._leaves(node))
            total += n
            shared += n
        else:
            stack.extend(node.table.values())
    return shared, total


class Log(Generic[T]):
    """An immutable append-only sequence with cheap appends: full chunks of `WIDTH` items are shared between
    every log that grew from the same one; an append copies at most one chunk (and, once in `WIDTH` appends,
    the tuple of chunk references). Used for the order in which synthetic nodes were created."""

    __slots__ = ("_chunks", "_tail")

    def __init__(self, items: Iterable[T] = ()):
        seq = tuple(items)
        self._chunks: tuple[tuple[T, ...], ...] = tuple(
            seq[i : i + WIDTH] for i in range(0, len(seq) - len(seq) % WIDTH, WIDTH)
        )
        self._tail: tuple[T, ...] = seq[len(seq) - len(seq) % WIDTH :]

    def append(self, item: T) -> Log[T]:
        out = Log.__new__(Log)
        tail = self._tail + (item,)
        if len(tail) == WIDTH:
            out._chunks, out._tail = self._chunks + (tail,), ()
        else:
            out._chunks, out._tail = self._chunks, tail
        return out

    def __iter__(self) -> Iterator[T]:
        for chunk in self._chunks:
            yield from chunk
        yield from self._tail

    def __len__(self) -> int:
        return len(self._chunks) * WIDTH + len(self._tail)
