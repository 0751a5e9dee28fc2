"""Property tests: random action sequences (valid and invalid) never break a workspace invariant, failed
actions change nothing, and snapshots round-trip exactly."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from librarian_jax.data.schema import Document
from librarian_jax.workspace import ActionResult, Workspace

DOCS = [
    Document(f"doc-{i}", f"Document {i}.\n" + "body line\n" * (i * 7), title=f"Topic {i % 3} item {i}")
    for i in range(6)
]
JUNK = [
    "",
    ".",
    "..",
    "../x",
    "/abs",
    "raw_docs",
    "README.md",
    "history",
    "nope.txt",
    "a\x00b",
    "summary.txt",
    "RAW_0001",
    "cluster_0001",
    "merge_0001",
]


def _paths(ws: Workspace) -> list[str]:
    """Every current path a model might name: raw files, active and deleted nodes (file and dir paths)."""
    out = [d.path for d in ws.raw_docs]
    for nid, n in ws.nodes.items():
        out.append(ws.path_of(nid))
        if n.kind == "directory":
            out.append(ws.file_path_of(nid))
    return out


def _dirs(ws: Workspace) -> list[str]:
    return [ws.path_of(n.node_id) for n in ws.nodes.values() if n.kind == "directory"]


@st.composite
def name(draw: st.DrawFn, ws: Workspace) -> str:
    """A current path most of the time, sometimes junk a model might write."""
    if draw(st.integers(0, 9), label="junk?") == 0:
        return draw(st.sampled_from(JUNK))
    return draw(st.sampled_from(_paths(ws)))


TITLES = ["Alpha", "beta", "Gamma  ray", "ALPHA", "", "Delta", "Group A", "group b", "Group A "]


def _check_sound(ws: Workspace) -> None:
    assert ws.check_invariants() == []
    assert ws.raw_docs == Workspace.from_documents(DOCS).raw_docs  # raw documents never change
    seen: set[str] = set()
    for n in ws.active_nodes():
        path = ws.file_path_of(n.node_id)
        assert path not in seen
        seen.add(path)
        text = ws.read_file(path).text
        for h in n.raw_sources:  # every source resolves and is named in the header
            assert ws.read_file(ws.path_of(h)).ok and ws.path_of(h) in text
        for s in n.synthetic_sources:
            assert ws.read_file(ws.file_path_of(s)).ok and ws.file_path_of(s) in text
        if n.parent is not None:
            assert ws.nodes[n.parent].active and ws.nodes[n.parent].kind == "directory"
    listed = ws.list_dir(".")
    assert (
        listed.ok
        and listed.data["total"] == 2 + (1 if ws.stats()["deleted"] else 0) + ws.stats()["root_entries"]
    )


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_action_sequences_keep_invariants(data: st.DataObject) -> None:
    ws = Workspace.from_documents(DOCS)
    for i in range(data.draw(st.integers(0, 4), label="seed files")):  # a few files to merge and delete
        assert ws.create_file(f"Seed {i}", [f"raw_{i + 1:04d}"], f"seed {i}").ok
    snaps: list[tuple[Workspace, str]] = []
    n_steps = data.draw(st.integers(min_value=1, max_value=30), label="steps")
    for turn in range(n_steps):
        before = ws.to_json()
        op = data.draw(
            st.sampled_from(["create", "create", "merge", "delete", "read", "list", "snap"]), label="op"
        )
        if op == "create":
            srcs = data.draw(
                st.lists(name(ws), min_size=data.draw(st.sampled_from([0, 1, 1, 1])), max_size=4),
                label="sources",
            )
            parent = data.draw(
                st.one_of(st.none(), st.none(), st.sampled_from(_dirs(ws) + JUNK[:9])), label="p"
            )
            title = data.draw(
                st.sampled_from(["Alpha", "beta", "Gamma  ray", "ALPHA", "", "Delta"]), label="t"
            )
            r = ws.create_file(title, srcs, f"content {turn}", parent_path=parent, turn=turn)
        elif op == "merge":
            live = [ws.path_of(n.node_id) for n in ws.active_nodes()]
            pool = st.one_of(name(ws), *[st.sampled_from(live)] * 4) if live else name(ws)
            lo = data.draw(st.sampled_from([0, 1, 1, 1, 2]), label="min children")
            kids = data.draw(st.lists(pool, min_size=lo, max_size=3), label="children")
            parent = data.draw(
                st.one_of(st.none(), st.none(), st.sampled_from(_dirs(ws) + JUNK[:9])), label="p"
            )
            title = data.draw(st.sampled_from([*TITLES, f"Dir {turn}"]), label="t")
            r = ws.merge_files(title, kids, f"summary {turn}", parent_path=parent, turn=turn)
        elif op == "delete":
            live = [ws.path_of(n.node_id) for n in ws.active_nodes()]
            pool = st.one_of(st.sampled_from(live), st.sampled_from(live), name(ws)) if live else name(ws)
            targets = data.draw(st.lists(pool, min_size=1, max_size=2), label="targets")
            r = ws.delete(targets, "cleanup", turn=turn)
        elif op == "read":
            r = ws.read_file(
                data.draw(name(ws), label="path"),
                data.draw(st.integers(-1, 40), label="start"),
                data.draw(st.integers(-1, 120), label="n"),
            )
        elif op == "list":
            r = ws.list_dir(data.draw(name(ws), label="path"))
        else:  # a snapshot shares state with ws; changing either must never show in the other
            snaps.append((ws.copy(), before))
            r = ws.readme()
        assert isinstance(r, ActionResult) and r.ok == (r.code == "ok")
        event(f"{op} {r.code}")
        if not r.ok or op in ("read", "list", "snap"):
            assert ws.to_json() == before, (op, r)  # refused actions and reads change nothing
        _check_sound(ws)
    for i, (old, text) in enumerate(snaps):
        assert old.to_json() == text and old.check_invariants() == []
        if i % 2 == 0:  # mutating a snapshot leaves the workspace alone
            mine = ws.to_json()
            old.create_file("Snapshot only", [ws.raw_docs[0].path], "x")
            assert old.check_invariants() == [] and ws.to_json() == mine
    snap = ws.to_json()
    back = Workspace.from_json(snap)
    assert back == ws and back.to_json() == snap
    assert back.readme().text == ws.readme().text
    assert ws.copy() == ws
    flat, shuf = ws.flattened(), ws.shuffled(data.draw(st.integers(0, 100), label="seed"))
    assert flat.check_invariants() == [] and shuf.check_invariants() == []
    assert flat.stats()["max_depth"] <= 1
    assert shuf.stats()["active_synthetic"] == ws.stats()["active_synthetic"]
    assert sorted(n.body for n in flat.active_nodes()) == sorted(n.body for n in ws.active_nodes())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.text(max_size=80))
def test_any_path_text_is_answered_never_raises(text: str) -> None:
    ws = Workspace.from_documents(DOCS[:2])
    for r in (
        ws.read_file(text),
        ws.list_dir(text),
        ws.delete([text], "x"),
        ws.create_file("T", [text], "b"),
        ws.provenance(text),
    ):
        assert isinstance(r, ActionResult)
        if r.ok:
            path = r.data.get("path", "")
            assert ".." not in path.split("/") and not path.startswith("/")
    assert ws.check_invariants() == []
