"""Export: a real directory tree, identical to what agents read, that never leaves its directory."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from librarian_jax.data.schema import Document
from librarian_jax.workspace import ExportError, Workspace, load_export
from librarian_jax.workspace.export import EXPORT_FORMAT, write_tree


def built() -> Workspace:
    docs = [Document(f"d{i}", f"text {i}\nmore {i}\n", title=f"Doc {i}") for i in range(4)]
    docs.append(Document("evil", "payload", title="../../../../tmp/evil"))
    w = Workspace.from_documents(docs)
    assert w.create_file("One", ["raw_0001", "raw_0002"], "one body").ok
    assert w.create_file("Two", ["raw_0003"], "two body").ok
    assert w.merge_files("Group", ["cluster_0001", "cluster_0002"], "group body").ok
    assert w.create_file("Three", ["merge_0001", "raw_0005"], "three body").ok
    assert w.create_file("Gone", ["raw_0004"], "gone body").ok
    assert w.delete(["cluster_0004"], "redundant", turn=3).ok
    return w


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_export_writes_the_tree_agents_see(tmp_path: Path) -> None:
    w = built()
    out = tmp_path / "export"
    r = w.export(out)
    assert r.ok and r.data["files"] == len(w.files()) + 1
    tree = _tree(out)
    assert set(tree) == {
        "README.md",
        "manifest.json",
        "raw_docs/raw_0001__doc_0.txt",
        "raw_docs/raw_0002__doc_1.txt",
        "raw_docs/raw_0003__doc_2.txt",
        "raw_docs/raw_0004__doc_3.txt",
        "raw_docs/raw_0005__tmp_evil.txt",
        "merge_0001__group/summary.txt",
        "merge_0001__group/cluster_0001__one.txt",
        "merge_0001__group/cluster_0002__two.txt",
        "cluster_0003__three.txt",
        "history/cluster_0004__gone.txt",
    }
    for path, text in w.files().items():
        # the same text read_file shows, line for line
        shown = [line.split("| ", 1)[1] for line in w.read_file(path).text.split("\n")[1:-1]]
        assert shown == text.rstrip("\n").split("\n")
        if path.startswith("raw_docs/"):
            continue
        assert tree[path] == text
    m = json.loads(tree["manifest.json"])
    assert m["export_format"] == EXPORT_FORMAT
    for d, entry in zip(w.raw_docs, m["raw_docs"], strict=True):
        # raw documents byte for byte; the header agents see is the manifest's fields
        data = (out / d.path).read_bytes()
        assert data == d.text.encode("utf-8") and entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["sha256_16"] == d.sha
        header = w.files()[d.path].removesuffix(d.text)
        assert header == (
            f"TITLE: {entry['title']}\nKIND: {entry['kind']}\nPATH: {entry['path']}\n"
            f"DOC_ID: {entry['doc_id']}\nSHA256: {entry['sha256_16']}\n---\n"
        )
    assert tree["cluster_0003__three.txt"].startswith("TITLE: Three\nKIND: file (create_file)\n")
    assert "SOURCES_SYNTHETIC:\n- merge_0001__group/summary.txt" in tree["cluster_0003__three.txt"]
    assert m["stats"] == w.stats()
    three = next(n for n in m["synthetic"] if n["node_id"] == "cluster_0003")
    assert [x["path"] for x in three["raw_provenance"]] == [
        "raw_docs/raw_0005__tmp_evil.txt",
        "raw_docs/raw_0001__doc_0.txt",
        "raw_docs/raw_0002__doc_1.txt",
        "raw_docs/raw_0003__doc_2.txt",
    ]
    gone = next(n for n in m["synthetic"] if n["node_id"] == "cluster_0004")
    assert (gone["active"], gone["deleted_turn"], gone["delete_reason"]) == (False, 3, "redundant")
    assert not (tmp_path / "tmp").exists() and not Path("/tmp/evil").exists()
    # Exporting again over the same directory is fine (files are overwritten in place).
    assert w.export(out).ok and _tree(out) == tree


def test_export_refuses_symlinks_inside_the_target(tmp_path: Path) -> None:
    w = built()
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "export"
    out.mkdir()
    os.symlink(outside, out / "raw_docs")  # an attacker-planted link where a directory will go
    r = w.export(out)
    assert not r.ok and r.code == "path_escape"
    assert "raw_docs is a symlink; symlinks are never followed" in r.message
    assert list(outside.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == ["raw_docs"]
    # a link where a file will go is refused as well
    out2 = tmp_path / "export2"
    out2.mkdir()
    os.symlink(outside / "victim.txt", out2 / "README.md")
    r2 = w.export(out2)
    assert not r2.ok and r2.code == "path_escape" and "README.md is a symlink" in r2.message
    assert not (outside / "victim.txt").exists()


def test_export_refuses_a_symlinked_directory_and_a_file_target(tmp_path: Path) -> None:
    w = built()
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    r = w.export(tmp_path / "link")
    assert not r.ok and r.code == "path_escape" and "is a symlink; give the real directory" in r.message
    f = tmp_path / "afile"
    f.write_text("x")
    r = w.export(f)
    assert not r.ok and r.code == "invalid_argument" and "exists and is not a directory" in r.message


def test_write_tree_refuses_escaping_names_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "t"
    for bad, code, fragment in [
        ("../escape.txt", "path_escape", "climbs above"),
        ("/etc/x", "path_escape", "is absolute"),
        ("a/../../x", "path_escape", "climbs above"),
        ("a//b.txt", "path_escape", "not a plain relative path"),
        ("a/\x00.txt", "invalid_path", "control character"),
        ("", "path_escape", "not a plain relative path"),
    ]:
        r = write_tree(out, {"ok.txt": "fine", bad: "payload"})
        assert not r.ok and r.code == code and fragment in r.message, (bad, r)
        assert list(out.iterdir()) == []  # checked before anything is written
    assert not (tmp_path / "escape.txt").exists()


def test_an_export_loads_back_into_the_workspace_it_came_from(tmp_path: Path) -> None:
    w = built()
    out = tmp_path / "export"
    assert w.export(out).ok
    loaded = load_export(out)
    assert loaded.workspace == w and not loaded.stale and loaded.readme_matches
    for path in w.files():
        assert loaded.workspace.read_file(path).text == w.read_file(path).text
    # a changed raw document is loaded as it is now and listed as stale; its recorded hash stays
    doc = w.raw_docs[1]
    (out / doc.path).write_text("rewritten", encoding="utf-8")
    loaded = load_export(out)
    assert list(loaded.stale) == [doc.path] and loaded.stale[doc.path].doc_id == doc.doc_id
    assert loaded.workspace.raw_docs[1].text == "rewritten" and loaded.workspace.raw_docs[1].sha == doc.sha
    # a header edited by hand, a symlink planted inside, an older export, no manifest: one-line errors
    (out / doc.path).write_text(doc.text, encoding="utf-8")
    three = out / "cluster_0003__three.txt"
    good = three.read_text(encoding="utf-8")
    three.write_text(good.replace("TITLE: Three", "TITLE: Forged"), encoding="utf-8")
    with pytest.raises(ExportError, match=r"the header of cluster_0003__three.txt does not match"):
        load_export(out)
    three.write_text(good.replace("three body", "edited body"), encoding="utf-8")
    assert "edited body" in load_export(out).workspace.read_file("cluster_0003__three.txt").text
    os.remove(out / doc.path)
    os.symlink(tmp_path / "elsewhere.txt", out / doc.path)
    with pytest.raises(ExportError, match=r"raw_0002__doc_1.txt is a symlink; symlinks are never followed"):
        load_export(out)
    m = json.loads((out / "manifest.json").read_text())
    del m["export_format"]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ExportError, match=r"exported by an older librarian_jax"):
        load_export(out)
    with pytest.raises(ExportError, match=r"is not an exported workspace: it has no manifest.json"):
        load_export(tmp_path)
