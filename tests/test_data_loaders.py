"""Loaders: each format on small fixture files, and broken files naming path, line and field."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest

from librarian_jax.data import (
    NOISY_VARIANT,
    DataError,
    iter_tasks,
    load_bright,
    load_bright_domain,
    load_browsecomp_plus,
    load_folder,
    load_tasks,
    save_tasks,
    sniff_format,
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "data"


def _write_rows(path: pathlib.Path, rows: list) -> pathlib.Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _fixture_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


# --- the paper's task JSONL -------------------------------------------------------------------------------


def test_task_jsonl_reads_docs_flags_and_reuse_questions():
    tasks = load_tasks(FIXTURES / "tasks.jsonl")
    assert [t.task_id for t in tasks] == ["q1", "2"]
    t = tasks[0]
    assert [d.doc_id for d in t.documents] == ["d1", "d2", "d3"]
    assert t.documents[0].url == "https://example.org/brevik"
    assert t.documents[0].meta == {"is_evidence": True, "is_gold": True, "is_negative": False}
    assert t.documents[2].meta["is_negative"] is True
    (q,) = t.questions
    assert (q.question_id, q.gold_answer) == ("q1", "Olm")
    assert [r.question_id for r in t.reuse_questions] == ["a1", "a2"]
    assert t.reuse_questions[1].meta["estimated_difficulty"] == 0.4
    assert t.reuse_questions[0].question_type == "fact"
    assert tasks[1].questions[0].aliases == ("O. Vask",)
    assert t.meta["source_line"] == 1 and tasks[1].meta["source_line"] == 2


def _broken_task_file(tmp_path, mutate, line_index=1):
    rows = _fixture_rows("tasks.jsonl")
    rows = [rows[0], rows[1], json.loads(json.dumps(rows[1]))]
    rows[2]["question_id"] = "q3"
    mutate(rows[line_index])
    return _write_rows(tmp_path / "tasks.jsonl", rows)


@pytest.mark.parametrize(
    "mutate, line, field, message",
    [
        (lambda r: r["docs"][0].update(text=None), 2, "docs[0].text", "expected a string, got null"),
        (lambda r: r.pop("gold_answer"), 2, "gold_answer", "missing"),
        (lambda r: r.update(docs=[]), 2, "docs", "empty corpus"),
        (lambda r: r.update(docs="d1"), 2, "docs", "expected a list, got a string"),
        (lambda r: r["docs"].append(dict(r["docs"][0])), 2, "docs[1].doc_id", "duplicate doc_id 'b1'"),
        (lambda r: r["docs"][0].update(is_gold="yes"), 2, "docs[0].is_gold", "expected a boolean"),
        (
            lambda r: r.update(
                amortization_questions=[{"question_id": "x", "question": "?", "gold_answer": 3}]
            ),
            2,
            "amortization_questions[0].gold_answer",
            "expected a string, got a number",
        ),
        (
            lambda r: r.update(
                amortization_questions=[{"question_id": "2", "question": "?", "gold_answer": "a"}]
            ),
            2,
            "amortization_questions[0].question_id",
            "duplicate question_id '2'",
        ),
        (lambda r: r.update(question_id="q1"), 3, "question_id", "duplicate task id 'q1' (first on line 1)"),
    ],
)
def test_task_jsonl_errors_name_path_line_and_field(tmp_path, mutate, line, field, message):
    path = _broken_task_file(tmp_path, mutate, line_index=line - 1)
    with pytest.raises(DataError) as e:
        load_tasks(path, format="tasks")
    assert (e.value.path, e.value.line, e.value.field) == (str(path), line, field)
    assert str(e.value).startswith(f"{path}:{line}: field '{field}': ")
    assert message in str(e.value)


def test_invalid_json_and_non_object_lines(tmp_path):
    good = (FIXTURES / "tasks.jsonl").read_text().splitlines()
    path = tmp_path / "t.jsonl"
    path.write_text(good[0] + "\n\n" + good[1][:-5] + "\n")
    with pytest.raises(DataError, match=r"t\.jsonl:3: invalid JSON"):
        load_tasks(path, format="tasks")
    path.write_text(good[0] + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"t\.jsonl:2: expected a JSON object, got a list"):
        load_tasks(path, format="tasks")
    path.write_bytes(good[0].encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"t\.jsonl:2: not UTF-8"):
        load_tasks(path, format="tasks")
    path.write_text("\n\n")
    with pytest.raises(DataError, match="empty corpus"):
        load_tasks(path, format="tasks")
    with pytest.raises(DataError, match="no such file"):
        load_tasks(tmp_path / "missing.jsonl", format="tasks")


# --- BrowseComp-Plus --------------------------------------------------------------------------------------


def test_browsecomp_plus_dedups_docids_and_keeps_roles():
    tasks = load_tasks(FIXTURES / "browsecomp_plus.jsonl")
    t = tasks[0]
    assert t.task_id == "101" and t.questions[0].gold_answer == "Vask Institute"
    ids = [d.doc_id for d in t.documents]
    assert ids == ["g1", "e1", *[f"n{i}" for i in range(6)]]  # g1 appears in gold and evidence: kept once
    g1 = t.documents[0]
    assert g1.meta == {"is_gold": True, "is_evidence": True, "is_negative": False}
    assert t.documents[1].meta == {"is_gold": False, "is_evidence": True, "is_negative": False}
    assert all(d.meta["is_negative"] for d in t.documents[2:])


def test_browsecomp_plus_negative_caps_keep_support_and_are_seeded():
    path = FIXTURES / "browsecomp_plus.jsonl"
    capped = load_browsecomp_plus(path, max_docs=5, shuffle_docs=True, seed=3)[0]
    ids = {d.doc_id for d in capped.documents}
    assert len(capped.documents) == 5 and {"g1", "e1"} <= ids
    again = load_browsecomp_plus(path, max_docs=5, shuffle_docs=True, seed=3)[0]
    assert [d.doc_id for d in again.documents] == [d.doc_id for d in capped.documents]
    other_seeds = {
        tuple(d.doc_id for d in load_browsecomp_plus(path, max_docs=5, seed=s)[0].documents) for s in range(8)
    }
    assert len(other_seeds) > 1  # the negatives kept depend on the seed
    assert len(load_browsecomp_plus(path, max_negatives=0)[0].documents) == 2
    assert len(load_browsecomp_plus(path, **NOISY_VARIANT)[0].documents) == 8  # under the cap: all kept


def test_browsecomp_plus_errors(tmp_path):
    rows = _fixture_rows("browsecomp_plus.jsonl")
    rows[1]["negative_docs"][0]["text"] = None
    path = _write_rows(tmp_path / "bc.jsonl", rows)
    with pytest.raises(
        DataError, match=r"bc\.jsonl:2: field 'negative_docs\[0\]\.text': expected a string, got null"
    ):
        load_tasks(path, format="browsecomp_plus")
    rows = _fixture_rows("browsecomp_plus.jsonl")
    rows[1].update(gold_docs=[], negative_docs=[])
    with pytest.raises(DataError, match=r":2: field 'gold_docs': empty corpus"):
        load_tasks(_write_rows(tmp_path / "bc.jsonl", rows), format="browsecomp_plus")
    rows = _fixture_rows("browsecomp_plus.jsonl")
    rows[1]["query_id"] = "101"
    with pytest.raises(DataError, match=r":2: field 'query_id': duplicate task id '101'"):
        load_tasks(_write_rows(tmp_path / "bc.jsonl", rows))


# --- BRIGHT -----------------------------------------------------------------------------------------------


def test_bright_one_task_per_domain():
    tasks = load_tasks(FIXTURES / "bright")
    assert [t.task_id for t in tasks] == ["bright/biology", "bright/economics"]
    bio = tasks[0]
    assert [d.doc_id for d in bio.documents] == ["bio-1", "bio-2", "bio-3"]
    assert [q.question_id for q in bio.questions] == ["bq1", "bq2"]
    assert bio.questions[0].meta["gold_ids"] == ["bio-1"] and bio.questions[0].gold_answer == "mitochondria"
    assert bio.questions[1].gold_answer == ""  # no gold_answer in the row
    assert [d.meta["is_gold"] for d in bio.documents] == [True, True, False]
    assert [t.task_id for t in load_bright(FIXTURES / "bright", domains=["economics"])] == [
        "bright/economics"
    ]


def test_bright_errors(tmp_path):
    root = tmp_path / "b"
    shutil.copytree(FIXTURES / "bright", root)
    ex = root / "examples" / "biology.jsonl"
    rows = _fixture_rows("bright/examples/biology.jsonl")
    rows[1]["gold_ids"] = ["bio-2", "bio-9"]
    _write_rows(ex, rows)
    with pytest.raises(
        DataError, match=r"biology\.jsonl:2: field 'gold_ids\[1\]': unknown document id 'bio-9'"
    ):
        load_bright(root)
    docs = root / "documents" / "economics.jsonl"
    _write_rows(docs, [{"id": "eco-1", "content": "a"}, {"id": "eco-1", "content": "b"}])
    with pytest.raises(DataError, match=r"economics\.jsonl:2: field 'id': duplicate document id 'eco-1'"):
        load_bright_domain(docs, root / "examples" / "economics.jsonl")
    _write_rows(docs, [{"id": "eco-1", "content": 5}])
    with pytest.raises(
        DataError, match=r"economics\.jsonl:1: field 'content': expected a string, got a number"
    ):
        load_bright_domain(docs, root / "examples" / "economics.jsonl")
    with pytest.raises(DataError, match="no BRIGHT domain 'law'"):
        load_bright(FIXTURES / "bright", domains=["law"])


# --- folders ----------------------------------------------------------------------------------------------


def test_folder_reads_text_files_skipping_hidden_and_empty():
    t = load_folder(FIXTURES / "folder", task_id="notes")
    assert t.task_id == "notes"
    assert [d.doc_id for d in t.documents] == ["notes/day1.txt", "notes/day2.md", "readme.md"]
    assert t.documents[2].title == "Field notes" and t.documents[0].title == "day1"
    assert not t.questions
    assert sniff_format(FIXTURES / "folder") == "folder"


def test_folder_refuses_escaping_symlinks(tmp_path):
    root = tmp_path / "corpus"
    shutil.copytree(FIXTURES / "folder", root)
    outside = tmp_path / "secret.txt"
    outside.write_text("private\n")
    os.symlink(root / "readme.md", root / "notes" / "inside_link.md")  # stays inside: followed
    t = load_folder(root)
    assert "notes/inside_link.md" in [d.doc_id for d in t.documents]
    os.symlink(outside, root / "notes" / "escape.txt")
    with pytest.raises(DataError, match=r"escape\.txt: symbolic link escapes"):
        load_folder(root)
    (root / "notes" / "escape.txt").unlink()
    os.symlink(tmp_path, root / "up")
    with pytest.raises(DataError, match=r"up: symbolic link escapes"):
        load_folder(root)
    (root / "up").unlink()
    (root / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(DataError, match=r"bad\.txt: not UTF-8"):
        load_folder(root)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        load_folder(empty)


# --- dispatch and round trip ------------------------------------------------------------------------------


def test_sniffing_and_corpus_round_trip(tmp_path):
    assert sniff_format(FIXTURES / "tasks.jsonl") == "tasks"
    assert sniff_format(FIXTURES / "browsecomp_plus.jsonl") == "browsecomp_plus"
    assert sniff_format(FIXTURES / "bright") == "bright"
    tasks = load_tasks(FIXTURES / "tasks.jsonl") + load_tasks(FIXTURES / "browsecomp_plus.jsonl")
    for name in ("all.jsonl", "all.jsonl.gz"):
        assert save_tasks(tasks, tmp_path / name) == 4
        assert sniff_format(tmp_path / name) == "corpus"
        back = load_tasks(tmp_path / name)
        assert back == tasks and [t.to_dict() for t in back] == [t.to_dict() for t in tasks]
    unknown = _write_rows(tmp_path / "x.jsonl", [{"foo": 1}])
    with pytest.raises(DataError, match=r"x\.jsonl:1: cannot tell the format"):
        load_tasks(unknown)
    with pytest.raises(ValueError, match="unknown corpus format"):
        load_tasks(FIXTURES / "tasks.jsonl", format="parquet")
    rows = [t.to_dict() for t in tasks]
    rows[2]["documents"][1]["doc_id"] = rows[2]["documents"][0]["doc_id"]
    with pytest.raises(DataError, match=r":3: field 'documents\[1\]\.doc_id': duplicate doc_id"):
        load_tasks(_write_rows(tmp_path / "c.jsonl", rows), format="corpus")


def test_task_jsonl_caps_and_streaming(tmp_path):
    rows = _fixture_rows("tasks.jsonl")
    rows[0]["docs"] += [{"doc_id": f"n{i}", "text": f"noise {i}", "is_negative": True} for i in range(5)]
    path = _write_rows(tmp_path / "t.jsonl", rows)
    capped = load_tasks(path, max_docs=4, shuffle_docs=True, seed=1)[0]
    ids = {d.doc_id for d in capped.documents}
    assert len(ids) == 4 and {"d1", "d2"} <= ids  # gold / evidence documents always stay
    assert capped.documents == load_tasks(path, max_docs=4, shuffle_docs=True, seed=1)[0].documents
    stream = iter_tasks(path)
    assert next(stream).task_id == "q1"  # one row at a time
    rows.append(
        {"question_id": "q9", "question": "?", "gold_answer": "x", "docs": [{"doc_id": 1, "text": None}]}
    )
    it = iter_tasks(_write_rows(tmp_path / "t2.jsonl", rows))
    assert [next(it).task_id for _ in range(2)] == ["q1", "2"]  # rows before the bad one still stream
    with pytest.raises(DataError, match=r"t2\.jsonl:3: field 'docs\[0\]\.text'"):
        next(it)
