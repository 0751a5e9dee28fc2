"""Snapshots share the workspace's state (issue 16): a snapshot never sees later writes (nor the workspace a
snapshot's writes), and a write after a snapshot copies only what it changes instead of rebuilding or
copying the path index. Also the persistent map underneath (`workspace/pmap.py`) against a dict model."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable

from librarian_jax.data.schema import Document
from librarian_jax.workspace import Workspace
from librarian_jax.workspace.pmap import LEAF_MAX, Log, PMap, shared_entries


def _docs(n: int) -> list[Document]:
    return [Document(f"d{i}", f"text {i}\nline two", title=f"Doc {i}") for i in range(n)]


def _built(n_files: int, seed: int = 0) -> Workspace:
    """A workspace with `n_files` synthetic files, some merged into (nested) directories, some deleted."""
    rng = random.Random(seed)
    ws = Workspace.from_documents(_docs(20))
    for i in range(n_files):
        assert ws.create_file(f"File {i}", [f"raw_{rng.randint(1, 20):04d}"], f"body {i}", turn=i).ok
    for j in range(n_files // 10):
        kids = [f"cluster_{3 * j + 1:04d}", f"cluster_{3 * j + 2:04d}"]
        assert ws.merge_files(f"Dir {j}", kids, f"summary {j}", turn=j).ok
    assert ws.merge_files("Outer", ["merge_0001", "merge_0002"], "outer").ok
    assert ws.delete(["cluster_0003", "merge_0003"], "bench", turn=9).ok
    return ws


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_snapshot_is_unaffected_by_later_writes_either_way() -> None:
    ws = _built(40)
    ws.read_file("README.md")  # the index exists before the snapshot
    snap = ws.copy()
    text, listing = snap.to_json(), snap.list_dir("merge_0004__outer").text
    files = snap.files()
    # Writes of every kind on the workspace, including moves of directories the snapshot still lists.
    assert ws.create_file("Later", ["raw_0001"], "later", parent_path="merge_0001").ok
    assert ws.merge_files("Later dir", ["merge_0004", "cluster_0030"], "later").ok
    assert ws.delete(["merge_0001"], "gone", turn=11).ok
    assert snap.to_json() == text and snap.files() == files
    assert snap.list_dir("merge_0004__outer").text == listing
    assert snap.read_file("Later").code == "path_not_found"
    assert snap.check_invariants() == []  # its index still equals one built from its own nodes
    # ... and the other way: the snapshot's writes never show in the workspace.
    mine = ws.to_json()
    assert snap.create_file("Snapshot only", ["raw_0002"], "x", parent_path="merge_0001").ok
    assert snap.delete(["merge_0004"], "snap", turn=12).ok
    assert ws.to_json() == mine and ws.read_file("Snapshot only").code == "path_not_found"
    assert ws.check_invariants() == [] and snap.check_invariants() == []
    # A snapshot of a snapshot, both written after: three independent states.
    snap2 = snap.copy()
    assert snap2.create_file("Third", ["raw_0003"], "y").ok
    assert snap.create_file("Third", ["raw_0004"], "z").ok
    assert snap2.nodes["cluster_0042"].raw_sources == ("raw_0003",)
    assert snap.nodes["cluster_0042"].raw_sources == ("raw_0004",) and "cluster_0042" not in ws.nodes


def test_write_after_snapshot_does_not_rebuild_or_copy_the_index() -> None:
    ws = _built(600)
    ws.read_file("README.md")
    rebuild = _peak_bytes(ws.check_invariants)  # builds a whole fresh index (and checks it)
    assert _peak_bytes(ws.copy) < rebuild / 50  # the snapshot itself copies no table
    for parent in (None, "merge_0001"):  # at the root (the largest directory) and in a directory
        snap = ws.copy()
        write = _peak_bytes(lambda p=parent: ws.create_file(f"New in {p}", ["raw_0001"], "n", parent_path=p))
        # What the write allocates is a few trie leaves, not a rebuilt or copied index (the old
        # copy-on-write index rebuilt everything here: the same order of memory as `rebuild`).
        assert write < rebuild / 10, (parent, write, rebuild)
        assert snap.check_invariants() == [] and f"New in {parent}" not in snap.to_json()
    # Structurally: every table still shares all but the leaves on the changed paths with the snapshot.
    snap = ws.copy()
    assert ws.create_file("One more", ["raw_0002"], "m", parent_path="merge_0002").ok
    copied = total = 0
    for mine, theirs in zip(ws._tables(), snap._tables(), strict=True):
        shared, n = shared_entries(mine, theirs)
        copied += n - shared
        total += n
    assert total > 6_000 and copied <= min(total // 10, 10 * LEAF_MAX), (copied, total)


def test_pmap_matches_a_dict_through_copies() -> None:
    class Colliding:  # keys whose hashes collide, to reach the deepest leaves
        def __init__(self, v: int) -> None:
            self.v = v

        def __hash__(self) -> int:
            return self.v % 3

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Colliding) and other.v == self.v

    rng = random.Random(0)
    maps: list[tuple[PMap[object, int], dict[object, int]]] = [(PMap(), {})]
    for step in range(6000):
        m, d = maps[rng.randrange(len(maps))]
        key = rng.choice([rng.randrange(600), f"s{rng.randrange(600)}", Colliding(rng.randrange(300))])
        x = rng.random()
        if x < 0.6:
            m[key] = d[key] = step
        elif x < 0.85:
            assert m.pop(key, None) == d.pop(key, None)
        elif x < 0.87 and len(maps) < 6:
            maps.append((m.copy(), dict(d)))
        else:
            assert m.get(key) == d.get(key) and (key in m) == (key in d)
    for m, d in maps:
        assert len(m) == len(d) and dict(m.items()) == d and m == d
    base = Log(range(70))
    assert list(base.append(70)) == list(range(71)) and list(base.append(-1))[-1] == -1 and len(base) == 70
