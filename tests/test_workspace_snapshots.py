"""Snapshots share the workspace's state (issue 16): a snapshot never sees later writes (nor the workspace a
snapshot's writes), and a write after a snapshot copies only what it changes instead of rebuilding or
copying the path index (the tables are `immutables.Map`s), and nodes keep their creation order through it."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Callable

from librarian_jax.data.schema import Document
from librarian_jax.workspace import Workspace


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
    # ... nor copies the tables: a write allocates a small fraction of what copying every table (node table,
    # path index, name index) into a plain dict costs, as a copy-on-write snapshot would.
    tables = ws._tables()
    assert sum(len(t) for t in tables) > 6_000
    full_copy = _peak_bytes(lambda: [dict(t.items()) for t in tables])
    snap = ws.copy()
    write = _peak_bytes(lambda: ws.create_file("One more", ["raw_0002"], "m", parent_path="merge_0002"))
    assert write < full_copy / 10, (write, full_copy)
    assert snap.check_invariants() == [] and "One more" not in snap.to_json()


def test_nodes_keep_creation_order_through_snapshots() -> None:
    ws = _built(30)
    made = list(ws.nodes)  # files and directories interleaved, numbered per kind
    assert made[:30] == [f"cluster_{i:04d}" for i in range(1, 31)] and made[30] == "merge_0001"
    snap = ws.copy()
    more = [ws.create_file("After a", ["raw_0001"], "a").data["node_id"],
            ws.merge_files("After dir", ["cluster_0030", "cluster_0029"], "d").data["node_id"],
            ws.create_file("After b", ["raw_0002"], "b").data["node_id"]]
    theirs = snap.create_file("Snapshot only", ["raw_0003"], "s").data["node_id"]
    assert list(ws.nodes) == made + more and list(snap.nodes) == [*made, theirs]
    assert [n["node_id"] for n in json.loads(ws.to_json(include_raw_text=False))["nodes"]] == made + more
    assert list(Workspace.from_json(ws.to_json()).nodes) == made + more
