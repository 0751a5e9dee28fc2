"""Unit tests of the workspace: every action, every invariant, every bad input with its code and message."""

from __future__ import annotations

import pytest

from librarian_jax.data.schema import Document, content_hash
from librarian_jax.workspace import ERROR_CODES, ActionResult, Workspace
from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R


def corpus() -> list[Document]:
    long_lines = "\n".join(f"line {i} of the long report about harbour tides" for i in range(1, 251))
    return [
        Document(
            "d-alpha",
            "Alpha text.\nThe alpha bridge opened in 1931.\n",
            title="Alpha Bridge",
            url="https://example.org/alpha",
        ),
        Document("d-beta", "Beta text.\nBeta rivers flood in spring.\n", title="Beta Rivers"),
        Document("d-gamma", "Gamma text about the gamma observatory.\n", title="Gamma Observatory"),
        Document("d-delta", long_lines, title="Harbour Tides Report"),
        Document("d-eps", "x" * 40_000, title=""),  # no title: the slug comes from the doc_id
        Document("d-zeta", "Zeta text.\n", title="Zeta / ../../etc Notes"),
    ]


@pytest.fixture
def ws() -> Workspace:
    return Workspace.from_documents(corpus())


def built() -> Workspace:
    """Two files, a directory holding them, one more file at the root."""
    w = Workspace.from_documents(corpus())
    assert w.create_file("Bridges", ["raw_0001", "raw_0002"], "Bridge notes.", turn=1).ok
    assert w.create_file("Skies", ["raw_docs/raw_0003__gamma_observatory.txt"], "Sky notes.", turn=2).ok
    assert w.merge_files("Infrastructure", ["cluster_0001__bridges.txt", "cluster_0002"], "Infra.", turn=3).ok
    assert w.create_file("Tides", ["raw_0004", "merge_0001__infrastructure"], "Tide notes.", turn=4).ok
    return w


def err(r: ActionResult, code: str, *fragments: str) -> None:
    assert not r.ok, r
    assert r.code == code, r
    assert r.code in ERROR_CODES
    for f in fragments:
        assert f in r.message, (f, r.message)
    assert r.render().startswith(f"ERROR [{code}]: ")


# ------------------------------------------------------------------------------------------------- layout
def test_raw_documents_handles_names_and_hashes(ws: Workspace) -> None:
    names = [d.path for d in ws.raw_docs]
    assert names == [
        "raw_docs/raw_0001__alpha_bridge.txt",
        "raw_docs/raw_0002__beta_rivers.txt",
        "raw_docs/raw_0003__gamma_observatory.txt",
        "raw_docs/raw_0004__harbour_tides_report.txt",
        "raw_docs/raw_0005__d_eps.txt",
        "raw_docs/raw_0006__zeta_etc_notes.txt",
    ]
    assert [d.sha for d in ws.raw_docs] == [content_hash(d.text) for d in corpus()]
    with pytest.raises(ValueError, match="duplicate doc_id 'd-alpha'"):
        Workspace.from_documents(corpus() + [Document("d-alpha", "again")])


def test_root_listing_and_raw_listing(ws: Workspace) -> None:
    r = ws.list_dir()
    assert r.ok and r.data["entries"] == ["README.md", "raw_docs"]
    assert "raw_docs/  [directory] 6 raw documents" in r.text
    assert ws.list_dir("./").text == r.text and ws.list_dir("").text == r.text
    raw = ws.list_dir("raw_docs/")
    assert raw.data["total"] == 6
    assert 'raw_0001__alpha_bridge.txt  [raw] "Alpha Bridge" (doc_id=d-alpha, 45 chars)' in raw.text


def test_long_listing_is_paged() -> None:
    w = Workspace.from_documents(
        [Document(f"doc{i}", "t", title=f"A rather long document title number {i}") for i in range(400)]
    )
    first = w.list_dir("raw_docs")
    assert first.ok and first.data["truncated"] and len(first.text) <= 16_000
    shown = len(first.data["entries"])
    assert 100 < shown < 400
    assert first.text.endswith(
        f"[showing entries 1-{shown} of 400; continue with list_files('raw_docs', start={shown + 1})]"
    )
    rest = w.list_dir("raw_docs", start=shown + 1)
    assert (
        rest.ok
        and rest.data["entries"][0]
        == f"raw_docs/raw_{shown + 1:04d}__a_rather_long_document_title_number_{shown}.txt"
    )
    pages, start = [], 1
    while True:
        page = w.list_dir("raw_docs", start=start)
        pages += page.data["entries"]
        if not page.data["truncated"]:
            break
        start += len(page.data["entries"])
    assert pages == [d.path for d in w.raw_docs]


def test_raw_file_rendering(ws: Workspace) -> None:
    r = ws.read_file("raw_docs/raw_0001__alpha_bridge.txt")
    assert r.ok
    lines = r.text.split("\n")
    assert lines[0] == "[raw_docs/raw_0001__alpha_bridge.txt | lines 1-9 of 9]"
    assert lines[1:] == [
        "    1| TITLE: Alpha Bridge",
        "    2| KIND: raw document (read-only)",
        "    3| PATH: raw_docs/raw_0001__alpha_bridge.txt",
        "    4| DOC_ID: d-alpha",
        "    5| URL: https://example.org/alpha",
        f"    6| SHA256: {content_hash(corpus()[0].text)}",
        "    7| ---",
        "    8| Alpha text.",
        "    9| The alpha bridge opened in 1931.",
        "[end of file]",
    ]
    assert r.data["total_lines"] == 9 and r.data["next_start_line"] is None


def test_create_file_renders_header_and_body() -> None:
    w = built()
    r = w.read_file("cluster_0003__tides.txt")
    assert r.ok
    body = [line.split("| ", 1)[1] for line in r.text.split("\n")[1:-1]]
    sha4 = w.raw_docs[3].sha
    assert body == [
        "TITLE: Tides",
        "KIND: file (create_file)",
        "PATH: cluster_0003__tides.txt",
        "SOURCES_RAW:",
        f"- raw_docs/raw_0004__harbour_tides_report.txt (sha256:{sha4})",
        "SOURCES_SYNTHETIC:",
        '- merge_0001__infrastructure/summary.txt ("Infrastructure")',
        "RAW_PROVENANCE: 4 raw documents in total, reached through the synthetic sources' headers",
        "---",
        "Tide notes.",
    ]


def test_merge_moves_children_and_lists_counts() -> None:
    w = built()
    root = w.list_dir()
    assert root.data["entries"] == [
        "README.md",
        "raw_docs",
        "merge_0001__infrastructure",
        "cluster_0003__tides.txt",
    ]
    assert (
        'merge_0001__infrastructure/  [directory] "Infrastructure" (2 files, 0 directories, summary.txt)'
        in root.text
    )
    sub = w.list_dir("merge_0001__infrastructure")
    assert sub.data["entries"] == [
        "merge_0001__infrastructure/summary.txt",
        "merge_0001__infrastructure/cluster_0001__bridges.txt",
        "merge_0001__infrastructure/cluster_0002__skies.txt",
    ]
    s = w.read_file("merge_0001__infrastructure/summary.txt")
    assert "KIND: directory summary (merge_files)" in s.text
    assert "CHILDREN: 2 (list_files 'merge_0001__infrastructure' to see them)" in s.text
    n = w.nodes["cluster_0001"]
    assert n.parent == "merge_0001" and n.raw_sources == ("raw_0001", "raw_0002") and n.created_turn == 1
    assert w.nodes["merge_0001"].synthetic_sources == ("cluster_0001", "cluster_0002")
    assert w.stats() == {
        "raw_docs": 6,
        "active_files": 3,
        "active_dirs": 1,
        "active_synthetic": 4,
        "deleted": 0,
        "max_depth": 2,
        "synthetic_chars": len("Bridge notes.Sky notes.Infra.Tide notes."),
        "raw_chars": sum(len(d.text) for d in corpus()),
        "root_entries": 2,
    }
    assert w.check_invariants() == []


def test_merge_default_parent_is_deepest_common_directory() -> None:
    w = built()
    assert w.create_file("Inner", ["raw_0005"], "x", parent_path="merge_0001__infrastructure").ok
    r = w.merge_files("Pair", ["cluster_0001", "cluster_0004"], "pair")
    assert r.ok and r.data["path"] == "merge_0001__infrastructure/merge_0002__pair"
    r2 = w.merge_files("Top", ["cluster_0003", "cluster_0002"], "top")
    assert r2.ok and r2.data["path"] == "merge_0003__top"
    assert w.stats()["max_depth"] == 3 and w.check_invariants() == []


def test_nested_merge_and_explicit_parent() -> None:
    w = built()
    r = w.merge_files("Everything", ["merge_0001__infrastructure/", "cluster_0003"], "all", turn=5)
    assert r.ok
    assert (
        w.path_of("cluster_0001")
        == "merge_0002__everything/merge_0001__infrastructure/cluster_0001__bridges.txt"
    )
    r = w.create_file("Deep", ["cluster_0001"], "deep", parent_path="merge_0001")
    assert (
        r.ok and r.data["path"] == "merge_0002__everything/merge_0001__infrastructure/cluster_0004__deep.txt"
    )


# --------------------------------------------------------------------------------------------- deleting
def test_delete_moves_children_up_and_keeps_history() -> None:
    w = built()
    r = w.delete(["merge_0001__infrastructure"], "too coarse", turn=7)
    assert r.ok and r.data["history_paths"] == ["history/merge_0001__infrastructure/summary.txt"]
    assert w.list_dir().data["entries"] == [
        "README.md",
        "raw_docs",
        "history",
        "cluster_0001__bridges.txt",
        "cluster_0002__skies.txt",
        "cluster_0003__tides.txt",
    ]
    h = w.read_file("history/merge_0001__infrastructure/summary.txt")
    assert h.ok and "STATUS: deleted at turn 7: too coarse" in h.text
    assert '[deleted directory] "Infrastructure" (turn 7: too coarse)' in w.list_dir("history").text
    # The file that cites it now points into history.
    assert (
        '- history/merge_0001__infrastructure/summary.txt ("Infrastructure", deleted)'
        in w.read_file("cluster_0003__tides.txt").text
    )
    n = w.nodes["merge_0001"]
    assert (n.active, n.deleted_turn, n.delete_reason) == (False, 7, "too coarse")
    assert w.check_invariants() == []


def test_delete_is_all_or_nothing() -> None:
    w = built()
    before = w.to_json()
    r = w.delete(["cluster_0003", "raw_0001", "nope.txt"], "x")
    err(
        r,
        "raw_immutable",
        "nothing deleted; 2 of 3 targets are unusable",
        "raw_0001",
        "'nope.txt' does not exist",
    )
    assert w.to_json() == before


@pytest.mark.parametrize(
    "target,code,fragment",
    [
        ("raw_docs/raw_0001__alpha_bridge.txt", "raw_immutable", "raw documents can never be deleted"),
        ("raw_docs", "raw_immutable", "raw documents directory"),
        ("README.md", "invalid_argument", "the generated README.md"),
        (".", "invalid_argument", "the workspace root"),
        ("ghost.txt", "path_not_found", "target 'ghost.txt' does not exist"),
        ("/etc/passwd", "path_escape", "is absolute"),
    ],
)
def test_delete_refusals(ws: Workspace, target: str, code: str, fragment: str) -> None:
    err(ws.delete([target], "r"), code, fragment)


def test_delete_twice_and_history_targets() -> None:
    w = built()
    assert w.delete("cluster_0003", "dup").ok  # a single string is a one-element list
    err(
        w.delete(["cluster_0003"], "again"),
        "inactive_path",
        "was deleted at turn 0 (dup)",
        "history/cluster_0003__tides.txt",
    )
    err(w.delete(["history"], "x"), "inactive_path", "only holds deleted nodes")
    err(w.delete([], "x"), "invalid_argument", "target_paths is empty")
    err(w.delete(["cluster_0001"], 5), "invalid_argument", "reason must be a string, got int")
    err(w.delete(["cluster_0001"], "r", turn=-1), "invalid_argument", "turn must be >= 0, got -1")
    err(w.delete(7, "r"), "invalid_argument", "target_paths must be a list of paths, got int")


# --------------------------------------------------------------------------------------- bad create input
@pytest.mark.parametrize(
    "kwargs,code,fragment",
    [
        (dict(title="", input_paths=["raw_0001"]), "invalid_argument", "title is empty"),
        (dict(title=3, input_paths=["raw_0001"]), "invalid_argument", "title must be a string, got int"),
        (dict(title="x" * 201, input_paths=["raw_0001"]), "invalid_argument", "title is 201 characters"),
        (dict(title="T", input_paths=[]), "empty_sources", "input_paths is empty"),
        (dict(title="T", input_paths=None), "invalid_argument", "input_paths must be a list of paths"),
        (dict(title="T", input_paths=[f"raw_{i:04d}" for i in range(70)]), "invalid_argument", "limit is 64"),
        (
            dict(title="T", input_paths=["raw_docs/nothing.txt"]),
            "unknown_source",
            "source 'raw_docs/nothing.txt' does not exist",
        ),
        (dict(title="T", input_paths=["../secret"]), "path_escape", "climbs above the workspace root"),
        (dict(title="T", input_paths=["a\x00b"]), "invalid_path", "NUL or control character"),
        (
            dict(title="T", input_paths=["."]),  # raw_docs is every raw document; the root is no source
            "is_a_directory",
            "source '.' is a plain directory",
        ),
        (dict(title="T", input_paths=["README.md"]), "invalid_argument", "is the generated README.md"),
        (
            dict(title="T", input_paths=["raw_0001"], parent_path="nowhere"),
            "parent_not_found",
            "parent_path 'nowhere' does not exist",
        ),
        (dict(title="T", input_paths=["raw_0001"], parent_path="raw_docs"), "raw_immutable", "read-only"),
        (dict(title="T", input_paths=["raw_0001"], parent_path="README.md"), "not_a_directory", "is a file"),
        (
            dict(title="T", input_paths=["raw_0001"], turn="soon"),
            "invalid_argument",
            "turn must be an integer",
        ),
        (
            dict(title="T", input_paths=["raw_0001"], content=None),
            "invalid_argument",
            "content must be a string, got NoneType",
        ),
        (
            dict(title="T", input_paths=["raw_0001"], content="x" * 200_001),
            "invalid_argument",
            "content is 200,001 characters",
        ),
    ],
)
def test_create_refusals(ws: Workspace, kwargs: dict, code: str, fragment: str) -> None:
    kwargs.setdefault("content", "body")
    before = ws.to_json()
    err(ws.create_file(**kwargs), code, fragment)
    assert ws.to_json() == before


def test_create_refusals_that_need_state() -> None:
    w = built()
    err(
        w.create_file("T", ["raw_0001"], "b", parent_path="cluster_0003"),
        "not_a_directory",
        "parent_path 'cluster_0003' is a file",
    )
    err(
        w.create_file("t", ["raw_0001"], "b", parent_path="merge_0001__infrastructure/summary.txt"),
        "not_a_directory",
        "is a file",
    )
    err(
        w.create_file("  tides ", ["raw_0001"], "b"),
        "duplicate_title",
        "title 'tides' is already used by 'cluster_0003__tides.txt'",
    )
    assert w.delete(["merge_0001"], "gone").ok
    err(w.create_file("T", ["merge_0001"], "b"), "inactive_path", "source 'merge_0001' was deleted at turn 0")
    err(w.create_file("T", ["raw_0001"], "b", parent_path="merge_0001"), "inactive_path", "parent_path")
    err(w.create_file("T", ["raw_0001"], "b", parent_path="history"), "inactive_path", "only holds deleted")
    two = w.create_file("T", ["nope1", "nope2"], "b")
    err(two, "unknown_source", "2 of 2 input_paths are unusable")


def test_deleted_title_can_be_reused_and_ids_never_repeat() -> None:
    w = built()
    assert w.delete(["cluster_0003"], "redo").ok
    r = w.create_file("Tides", ["raw_0004"], "again")
    assert r.ok and r.data["node_id"] == "cluster_0004"


# ----------------------------------------------------------------------------------------- bad merge input
def test_merge_refusals() -> None:
    w = built()
    err(w.merge_files("M", [], "b"), "empty_sources", "child_paths is empty")
    err(w.merge_files("M", ["raw_0001"], "b"), "raw_immutable", "raw documents never move")
    err(w.merge_files("M", ["raw_docs"], "b"), "raw_immutable", "raw_docs directory")
    err(w.merge_files("M", ["cluster_0099"], "b"), "unknown_source", "child 'cluster_0099' does not exist")
    err(
        w.merge_files("M", ["merge_0001", "cluster_0001"], "b"),
        "invalid_argument",
        "is inside another child 'merge_0001__infrastructure'",
    )
    err(
        w.merge_files("M", ["merge_0001"], "b", parent_path="merge_0001"),
        "merge_cycle",
        "parent_path 'merge_0001' is child 'merge_0001__infrastructure'",
    )
    assert w.merge_files("Inner", ["cluster_0001"], "b").ok  # merge_0002 inside merge_0001
    err(
        w.merge_files("M", ["merge_0001"], "b", parent_path="merge_0002"),
        "merge_cycle",
        "lies inside child 'merge_0001__infrastructure'",
    )
    err(w.merge_files("Inner", ["cluster_0003"], "b"), "duplicate_title", "'Inner' is already used")
    assert w.check_invariants() == []


# ------------------------------------------------------------------------------------------------ reading
def test_read_limits_and_continuation(ws: Workspace) -> None:
    p = "raw_docs/raw_0004__harbour_tides_report.txt"
    err(ws.read_file(p, num_lines=101), "read_too_large", "num_lines=101 is above the limit of 100")
    assert ws.read_file(p, num_lines=101).suggestions == (f"read_file('{p}', start_line=1, num_lines=100)",)
    err(ws.read_file(p, num_lines=0), "invalid_argument", "num_lines must be >= 1, got 0")
    err(ws.read_file(p, start_line=0), "invalid_argument", "start_line must be >= 1, got 0")
    err(ws.read_file(p, start_line=True), "invalid_argument", "start_line must be an integer, got True")
    err(ws.read_file(p, start_line=999), "invalid_argument", "start_line=999 is past the end", "(256 lines)")
    r = ws.read_file(p)
    assert r.ok and r.data == {
        "path": p,
        "start_line": 1,
        "end_line": 100,
        "total_lines": 256,
        "truncated": True,
        "next_start_line": 101,
    }
    assert r.text.endswith(
        f"[more lines: lines 101-256 not shown; continue with read_file('{p}', start_line=101)]"
    )
    last = ws.read_file(p, start_line="250", num_lines="10")
    assert last.ok and last.data["end_line"] == 256 and last.text.endswith("[end of file]")
    assert "  256| line 250 of the long report" in last.text


def test_read_char_limit_on_one_huge_line(ws: Workspace) -> None:
    r = ws.read_file("raw_0005")
    assert r.ok and r.data["path"] == "raw_docs/raw_0005__d_eps.txt"
    assert r.text.startswith("[note: 'raw_0005' resolved to 'raw_docs/raw_0005__d_eps.txt' (handle)]")
    assert len(r.text) <= 16_000 + 300
    assert r.data["truncated"] and "16,000-character limit reached" in r.text
    total = r.data["total_lines"]
    assert total == 6 + 20  # header lines + 40,000 chars wrapped at 2,000
    nxt = ws.read_file("raw_0005", start_line=r.data["next_start_line"])
    assert nxt.ok and nxt.data["start_line"] == r.data["end_line"] + 1


def test_read_and_list_kind_errors() -> None:
    w = built()
    err(w.read_file("merge_0001__infrastructure"), "is_a_directory", "is a directory", "summary.txt")
    assert w.read_file("merge_0001").suggestions[0] == "merge_0001__infrastructure/summary.txt"
    err(w.read_file("."), "is_a_directory", "is a directory")
    err(w.read_file("raw_docs"), "is_a_directory", "is a directory")
    err(w.list_dir("cluster_0003__tides.txt"), "not_a_directory", "is a file; read it with read_file")
    err(w.list_dir("raw_docs", start=99), "invalid_argument", "start=99 is outside 1..6")
    err(w.read_file(None), "invalid_path", "path must be a string, got NoneType")
    err(w.read_file("x" * 600), "invalid_path", "600 characters long")
    err(w.read_file("a/" * 70 + "b"), "invalid_path", "deeper than 64 levels")
    err(w.read_file("C:\\Windows\\x"), "path_escape", "is absolute")
    err(w.read_file("~/notes"), "path_escape", "home directory")
    err(w.read_file("file:///etc/passwd"), "path_escape", "is a URL")
    err(w.read_file("raw_docs/../../x"), "path_escape", "climbs above")
    err(w.read_file("raw_docs\\..\\..\\x"), "path_escape", "climbs above")


def test_forgiving_lookup_rules() -> None:
    w = built()
    target = "merge_0001__infrastructure/cluster_0001__bridges.txt"
    for asked, rule in [
        (target, "exact"),
        (target.upper(), "case_insensitive"),
        (target[:-4], "added_extension"),
        ("cluster_0001", "handle"),
        ("cluster_0001__bridges.txt", "unique_basename"),
        ("CLUSTER_0001__BRIDGES", "unique_basename"),
        ("Bridges", "unique_basename"),  # the file's title: the name part after its short id
        ("merge_0001__infrastructure/bridges", "unique_basename"),
        ("cluster_0001__bridge.txt", "fuzzy"),  # similarity 0.98 >= 0.92 (the authors' rule)
        ("merge_0001__infrastructure/cluster_01__bridges.txt", "fuzzy"),
        ("./merge_0001__infrastructure//cluster_0001__bridges.txt/", "exact"),
        ("raw_docs/../" + target, "exact"),
    ]:
        r = w.read_file(asked)
        assert r.ok and r.data["path"] == target, (asked, r)
        assert (r.text.startswith("[note:")) == (rule != "exact"), asked
        if rule != "exact":
            assert f"({rule})]" in r.text.split("\n")[0]
    by_doc_id = w.create_file("From ids", ["d-beta", "raw_docs/D-GAMMA"], "x")  # doc_ids name raw documents
    assert by_doc_id.ok and w.nodes[by_doc_id.data["node_id"]].raw_sources == ("raw_0002", "raw_0003")
    miss = w.read_file("cluster__bridge_notes.txt")  # similarity 0.80 < 0.92 -> suggestions
    err(miss, "path_not_found", "'cluster__bridge_notes.txt' does not exist")
    assert miss.suggestions[0] == target and len(miss.suggestions) <= 3
    assert w.delete(["merge_0001"], "x").ok
    amb = w.read_file("summary.txt")  # only one summary exists (in history): unique basename
    assert amb.ok and amb.data["path"] == "history/merge_0001__infrastructure/summary.txt"
    assert w.merge_files("A", ["cluster_0001"], "a").ok and w.merge_files("B", ["cluster_0002"], "b").ok
    err(w.read_file("summary.txt"), "path_not_found", "is ambiguous: 3 entries are named 'summary.txt'")


def test_paths_module_normalize() -> None:
    assert P.normalize("  ./a//b/./c/ ") == "a/b/c"
    assert P.normalize("a/../b") == "b"
    assert P.normalize(".") == "" and P.normalize("") == ""
    assert P.normalize("../x") == P.PathError(
        "path_escape", "path '../x' climbs above the workspace root with '..'"
    )
    assert P.normalize("/x").code == "path_escape"
    assert P.normalize("a\tb").code == "invalid_path"
    assert P.normalize("a/" + "b" * 256).code == "invalid_path"
    assert P.slugify("Zeta / ../../etc Notes") == "zeta_etc_notes" and P.slugify("!!!") == "untitled"
    assert all(P.is_safe_name(n) for n in ["a", "x.txt"]) and not any(
        P.is_safe_name(n) for n in ["", ".", "..", "a/b", "a\\b", "a\nb"]
    )
    assert R.display_lines("a\n" + "b" * 4500 + "\n") == ["a", "b" * 2000, "b" * 2000, "b" * 500]


# ------------------------------------------------------------------------------------- executor excerpts
def test_source_excerpts_share_the_budget() -> None:
    w = built()
    r = w.source_excerpts(["raw_0001", "raw_0005", "raw_0004", "cluster_0003"], max_chars=3000)
    assert r.ok and len(r.text) <= 3000
    info = {s["path"]: s for s in r.data["sources"]}
    assert not info["raw_docs/raw_0001__alpha_bridge.txt"]["truncated"]  # short sources are whole
    assert not info["cluster_0003__tides.txt"]["truncated"]
    assert (
        info["raw_docs/raw_0005__d_eps.txt"]["truncated"]
        and info["raw_docs/raw_0004__harbour_tides_report.txt"]["truncated"]
    )
    assert (
        abs(
            info["raw_docs/raw_0005__d_eps.txt"]["chars"]
            - info["raw_docs/raw_0004__harbour_tides_report.txt"]["chars"]
        )
        <= 1
    )  # the long ones split the rest evenly
    assert "=== SOURCE 1: raw_docs/raw_0001__alpha_bridge.txt ===\nTITLE: Alpha Bridge\nAlpha text." in r.text
    lines = w.source_excerpts(["raw_0004"], max_lines=3)
    assert lines.text.endswith(
        "line 1 of the long report about harbour tides\nline 2 of the long report about "
        "harbour tides\nline 3 of the long report about harbour tides\n[... excerpt cut]"
    )
    err(w.source_excerpts([]), "empty_sources", "input_paths is empty")
    err(w.source_excerpts(["missing"]), "unknown_source", "'missing' does not exist")


def test_check_create_and_check_merge_do_not_change_state() -> None:
    w = built()
    before = w.to_json()
    c = w.check_create("New", ["raw_0001", "cluster_0003", "raw_0001"], parent_path="merge_0001")
    assert (
        c.ok and c.data["raw_sources"] == ("raw_0001",) and c.data["synthetic_sources"] == ("cluster_0003",)
    )
    assert c.data["parent"] == "merge_0001"
    m = w.check_merge("New", ["cluster_0003"])
    assert m.ok and m.data["children"] == ("cluster_0003",) and m.data["parent"] is None
    assert w.to_json() == before


# --------------------------------------------------------------------------------- readme, provenance, stale
def test_readme_index() -> None:
    w = built()
    r = w.readme()
    shown = [
        line.split("| ", 1)[1] if "| " in line else ""
        for line in w.read_file("README.md").text.split("\n")[1:-1]
    ]
    assert r.ok and shown == r.text.rstrip("\n").split("\n")
    assert (
        "This workspace holds 6 raw documents (under raw_docs/) and 3 synthetic files in 1 synthetic "
        "directories" in r.text
    )
    # the top level only: a directory says how many entries it holds, its files are one list_files away
    assert 'merge_0001__infrastructure/  "Infrastructure" (2 entries)\ncluster_0003__tides.txt' in r.text
    assert "bridges" not in r.text.split("## Synthetic files", 1)[1]
    assert 'merge_0001__infrastructure/  "Infrastructure"\n  cluster_0001__bridges.txt  "Bridges"' in w.tree()
    assert "follow SOURCES_RAW" in r.text
    empty = Workspace.from_documents(corpus()).readme().text
    assert "holds 6 raw documents under raw_docs/. No synthetic files have been written yet" in empty
    assert "(no synthetic files yet)" in empty
    numbered = w.read_file("README.md")
    assert numbered.ok and "    1| # Workspace index" in numbered.text


def test_provenance_is_transitive_with_hashes() -> None:
    w = built()
    r = w.provenance("cluster_0003")
    assert r.ok
    assert [x["handle"] for x in r.data["raw"]] == ["raw_0004", "raw_0001", "raw_0002", "raw_0003"]
    assert all(
        x["sha"] == content_hash(next(d.text for d in corpus() if d.doc_id == x["doc_id"]))
        for x in r.data["raw"]
    )
    assert r.data["synthetic"] == ["merge_0001", "cluster_0001", "cluster_0002"]
    assert w.provenance("raw_0002").data["raw"][0]["doc_id"] == "d-beta"
    err(w.provenance("raw_docs"), "is_a_directory", "is not a raw document or synthetic node")
    assert w.delete(["merge_0001"], "x").ok  # provenance survives deletion of intermediate nodes
    assert len(w.provenance("cluster_0003").data["raw"]) == 4


def test_staleness() -> None:
    w = built()
    docs = corpus()
    new = [d for d in docs if d.doc_id != "d-gamma"]  # removed
    new[0] = Document("d-alpha", "Alpha text, revised.", title="Alpha Bridge")  # changed
    new.append(Document("d-new", "new"))
    r = w.staleness(new)
    assert r.data["changed_docs"] == ["d-alpha"] and r.data["removed_docs"] == ["d-gamma"]
    assert r.data["added_docs"] == ["d-new"]
    stale = {s["node_id"]: s for s in r.data["stale"]}
    assert set(stale) == {"cluster_0001", "cluster_0002", "merge_0001", "cluster_0003"}
    assert stale["cluster_0003"]["changed"] == ["d-alpha"] and stale["cluster_0003"]["removed"] == ["d-gamma"]
    assert stale["cluster_0001"]["removed"] == []
    assert w.staleness(docs).data["stale"] == []


# ------------------------------------------------------------------------------- serialise, copy, ablations
def test_round_trip_copy_and_equality() -> None:
    w = built()
    assert w.delete(["cluster_0002"], "unused", turn=9).ok
    s = w.to_json()
    back = Workspace.from_json(s)
    assert back == w and back.to_json() == s
    assert back.read_file("cluster_0003").text == w.read_file("cluster_0003").text
    snap = w.copy()
    assert w.create_file("After", ["raw_0006"], "later").ok
    assert snap != w and snap.to_json() == s and "cluster_0004" not in snap.nodes
    assert snap.list_dir().data["entries"] != w.list_dir().data["entries"]


def test_snapshot_without_raw_text() -> None:
    w = built()
    small = w.to_json(include_raw_text=False)
    assert len(small) < len(w.to_json()) - 40_000 and "long report about harbour tides" not in small
    back = Workspace.from_json(small, docs=corpus())
    assert back == w and back.to_json() == w.to_json()
    assert w.to_json(include_raw_text=False) == small  # the cached raw section is reused
    with pytest.raises(ValueError, match="no text for raw document 'd-alpha'; pass docs="):
        Workspace.from_json(small)
    changed = [Document("d-alpha", "edited", title="Alpha Bridge"), *corpus()[1:]]
    with pytest.raises(ValueError, match="raw raw_0001: text does not match sha"):
        Workspace.from_json(small, docs=changed)


def test_from_json_refuses_bad_snapshots() -> None:
    w = built()
    with pytest.raises(ValueError, match="not valid JSON"):
        Workspace.from_json("{")
    with pytest.raises(ValueError, match="format None"):
        Workspace.from_json("{}")
    d = w.to_dict()
    d["raw"][0]["text"] = "tampered"
    with pytest.raises(ValueError, match="raw raw_0001: text does not match sha"):
        Workspace.from_dict(d)
    d = w.to_dict()
    d["nodes"][0]["slug"] = "../../escape"
    with pytest.raises(ValueError, match="node cluster_0001: unsafe name"):
        Workspace.from_dict(d)
    d = w.to_dict()
    d["nodes"][2]["parent"] = "cluster_0001"  # merge_0001 inside its own child (which is a file)
    with pytest.raises(ValueError, match="parent 'cluster_0001' is not an active directory"):
        Workspace.from_dict(d)
    d = w.to_dict()
    d["nodes"][0]["synthetic_sources"] = ["cluster_0042"]
    with pytest.raises(ValueError, match="synthetic source 'cluster_0042' does not exist"):
        Workspace.from_dict(d)
    d = w.to_dict()
    d["nodes"].append(dict(d["nodes"][0]))
    with pytest.raises(ValueError, match="node id 'cluster_0001' appears twice"):
        Workspace.from_dict(d)
    d = w.to_dict()
    d["nodes"][0]["body"] = 7
    with pytest.raises(ValueError, match="node cluster_0001: title, body and delete_reason must be strings"):
        Workspace.from_dict(d)
    d = w.to_dict()
    del d["nodes"][0]["title"]
    with pytest.raises(ValueError, match="missing or bad field 'title'"):
        Workspace.from_dict(d)


def test_parent_cycle_is_detected() -> None:
    w = built()
    assert w.merge_files("Outer", ["merge_0001"], "o").ok
    d = w.to_dict()
    d["nodes"][2]["parent"] = "merge_0002"  # merge_0001 -> merge_0002 -> merge_0001
    d["nodes"][4]["parent"] = "merge_0001"
    with pytest.raises(ValueError, match="parent cycle"):
        Workspace.from_dict(d)


def test_flattened_and_shuffled() -> None:
    w = built()
    assert w.merge_files("Sky group", ["cluster_0002"], "sky", parent_path="merge_0001").ok
    assert w.create_file("Loose", ["raw_0006"], "loose", parent_path="merge_0002").ok
    flat = w.flattened()
    assert flat.check_invariants() == []
    assert flat.stats()["max_depth"] == 1 and flat.stats()["active_dirs"] == 0
    assert flat.stats()["synthetic_chars"] == w.stats()["synthetic_chars"]
    assert sorted(flat.list_dir().data["entries"])[:3] == [
        "README.md",
        "cluster_0001__bridges.txt",
        "cluster_0002__skies.txt",
    ]
    assert flat.read_file("merge_0001__infrastructure.txt").text.endswith("Infra.\n[end of file]")
    assert (
        "KIND: file (a directory summary, flattened)" in flat.read_file("merge_0001__infrastructure.txt").text
    )
    for nid, n in w.nodes.items():
        assert flat.nodes[nid].body == n.body and flat.nodes[nid].raw_sources == n.raw_sources
    placements = set()
    for seed in range(8):
        sh = w.shuffled(seed)
        assert sh.check_invariants() == []
        files = [n for n in sh.active_nodes() if n.kind == "file"]
        assert sorted(n.parent or "" for n in files) == sorted(
            n.parent or "" for n in w.active_nodes() if n.kind == "file"
        )
        assert {n.node_id: n.parent for n in sh.active_nodes() if n.kind == "directory"} == {
            n.node_id: n.parent for n in w.active_nodes() if n.kind == "directory"
        }
        placements.add(tuple(n.parent for n in files))
    assert len(placements) > 1
    assert w.shuffled(3) == w.shuffled(3)


def test_action_results_never_raise_on_junk() -> None:
    w = built()
    junk: list[object] = [
        None,
        3,
        2.5,
        b"raw",
        {"a": 1},
        ["raw_0001", None],
        "\x00",
        "",
        "..",
        "/" * 3,
        "?" * 9,
    ]
    for j in junk:
        results = [
            w.read_file(j),
            w.list_dir(j),
            w.delete(j, j),
            w.create_file(j, j, j, j, j),
            w.merge_files(j, j, j, j, j),
            w.source_excerpts(j),
            w.provenance(j),
            w.read_file("README.md", j, j),
        ]
        for r in results:
            assert isinstance(r, ActionResult) and (r.ok == (r.code == "ok"))
    assert w.check_invariants() == []


def test_fuzzy_lookup_needs_one_best_path_above_the_threshold() -> None:
    paths = ["a/cluster_0001__bridges.txt", "b/cluster_0001__bridges.txt", "notes.txt"]
    assert P.fuzzy_best("cluster_0001__bridgez.txt", paths) is None  # two equally close: no guess
    assert P.fuzzy_best("a/cluster_0001__bridgez.txt", paths) == "a/cluster_0001__bridges.txt"
    assert P.fuzzy_best("note.txt", paths) == "notes.txt"  # similarity 0.94
    assert P.fuzzy_best("nodes.md", paths) is None  # 0.71: below 0.92
