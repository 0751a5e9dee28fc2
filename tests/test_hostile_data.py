"""Hostile data files (issue 17): every loader turns a bad file into a `DataError` naming file, line and
field, or into a documented conversion; a loaded task always makes a workspace."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from librarian_jax.data.errors import DataError
from librarian_jax.data.loaders import load_folder, load_tasks
from librarian_jax.data.schema import CorpusTask, Document
from librarian_jax.workspace import Workspace


def _corpus_row(**doc: Any) -> dict[str, Any]:
    d = {"doc_id": "d1", "text": "some text", "title": "T", "url": "", "meta": {}}
    d.update(doc)
    return {"task_id": "t1", "documents": [d], "questions": [], "reuse_questions": [], "meta": {}}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------- regressions
def test_deep_nesting_is_a_data_error(tmp_path: Path) -> None:
    p = _write(
        tmp_path / "deep.jsonl", ['{"task_id": "t", "documents": ' + "[" * 100_000 + "]" * 100_000 + "}"]
    )
    with pytest.raises(DataError, match="nested too deeply") as info:
        load_tasks(p, format="corpus")
    assert info.value.line == 1


def test_a_number_too_long_to_read_is_a_data_error(tmp_path: Path) -> None:
    p = _write(tmp_path / "big.jsonl", [json.dumps(_corpus_row())[:-1] + ', "n": ' + "9" * 5000 + "}"])
    with pytest.raises(DataError) as info:
        load_tasks(p, format="corpus")
    assert info.value.line == 1


def test_corpus_rows_are_converted_or_refused_field_by_field(tmp_path: Path) -> None:
    row = _corpus_row(doc_id=7, meta=None)
    row["task_id"] = 3
    row["meta"] = None
    row["questions"] = [{"question_id": 5, "question": "q", "gold_answer": "a", "meta": None}]
    (task,) = load_tasks(_write(tmp_path / "ok.jsonl", [json.dumps(row)]), format="corpus")
    assert task.task_id == "3" and task.meta == {}
    assert task.documents[0].doc_id == "7" and task.documents[0].meta == {}
    assert task.questions[0].question_id == "5" and task.questions[0].meta == {}
    Workspace.from_documents(task.documents)  # an integer doc_id used to crash here
    for doc, field in [
        ({"title": 7}, "documents[0].title"),
        ({"url": ["http://a"]}, "documents[0].url"),
        ({"meta": "m"}, "documents[0].meta"),
        ({"doc_id": "a\nb"}, "documents[0].doc_id"),
    ]:
        p = _write(tmp_path / "bad.jsonl", ["", json.dumps(_corpus_row(**doc))])
        with pytest.raises(DataError) as info:
            load_tasks(p, format="corpus")
        assert (info.value.line, info.value.field) == (2, field), doc


def test_a_lone_surrogate_escape_is_a_data_error(tmp_path: Path) -> None:
    line = json.dumps(_corpus_row(text="x\ud800y"))
    assert "\\ud800" in line
    with pytest.raises(DataError) as info:
        load_tasks(_write(tmp_path / "s.jsonl", [line]), format="corpus")
    assert (info.value.line, info.value.field) == (1, "documents[0].text")
    pair = json.dumps(_corpus_row(text="smile \U0001f600"))  # a proper pair is fine
    (task,) = load_tasks(_write(tmp_path / "p.jsonl", [pair]), format="corpus")
    assert task.documents[0].text == "smile \U0001f600"
    assert Document("a", "x\ud800").sha  # hashing never raises


def test_a_symlink_loop_in_a_folder_is_a_data_error(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text("hello", encoding="utf-8")
    os.symlink(root / "loop1.txt", root / "loop2.txt")
    os.symlink(root / "loop2.txt", root / "loop1.txt")
    with pytest.raises(DataError, match="loop"):
        load_folder(root)


def test_a_folder_file_name_with_a_newline_is_a_data_error(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a\nTITLE: x.txt").write_text("hello", encoding="utf-8")
    with pytest.raises(DataError, match="control character"):
        load_folder(root)


# ---------------------------------------------------------------------------------------- property tests
scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6),
    st.sampled_from(["a\nb", "\x00", "x\u2028y"]),
)
value = st.recursive(
    scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
KEYS = {
    "corpus": ("task_id", "documents", "questions", "meta"),
    "tasks": ("question_id", "question", "gold_answer", "docs", "amortization_questions"),
    "browsecomp_plus": ("query_id", "query", "answer", "gold_docs", "negative_docs"),
}
DOC_KEYS = ("doc_id", "docid", "text", "title", "url", "meta", "is_gold")
SPECIAL_LINES = ["[" * 5000, "9" * 5000, '{"a": "\\ud800"}', '{"a": 1', "null", '"x"', ""]


VALID: dict[str, Any] = {"meta": {}, "is_gold": True, "url": "http://a", "title": "A title", "text": "Body."}


@st.composite
def rows(draw: st.DrawFn, fmt: str) -> list[str]:
    """Rows of `fmt` whose every field is valid except, each with probability 1/25, a hostile value."""

    def field(key: str, n: int) -> Any:
        return draw(value) if draw(st.integers(0, 24)) == 24 else VALID.get(key, f"{key}-{n}")

    out = []
    for n in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 9)) == 9:
            out.append(draw(st.sampled_from(SPECIAL_LINES)))
            continue
        row: dict[str, Any] = {}
        for k in KEYS[fmt]:
            if k in ("documents", "docs", "gold_docs", "negative_docs"):
                docs = [
                    {dk: field(dk, n * 10 + i) for dk in DOC_KEYS} for i in range(draw(st.integers(1, 2)))
                ]
                row[k] = docs if draw(st.integers(0, 9)) < 9 else draw(value)
            elif k == "amortization_questions":
                row[k] = [{"question_id": field("qid", n), "question": field("q", n), "gold_answer": "a"}]
            elif k != "questions":
                row[k] = field(k, n)
        out.append(json.dumps(row))
    return out


def _check_task(task: CorpusTask) -> None:
    assert isinstance(task.task_id, str)
    for d in task.documents:
        assert all(isinstance(x, str) for x in (d.doc_id, d.text, d.title, d.url)) and isinstance(
            d.meta, dict
        )
        d.sha  # noqa: B018
    for q in (*task.questions, *task.reuse_questions):
        assert (
            isinstance(q.question_id, str) and isinstance(q.question, str) and isinstance(q.gold_answer, str)
        )
    Workspace.from_documents(task.documents).to_json()


_ID = st.text(alphabet=st.characters(categories=("L", "N", "P", "S", "Zs")), min_size=1, max_size=8)
_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
_DOCS = st.lists(st.tuples(_ID, _TEXT, _TEXT, _TEXT), min_size=1, max_size=3, unique_by=lambda d: d[0])


@st.composite
def well_formed(draw: st.DrawFn, fmt: str) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
    """Rows of `fmt` with every field well-formed (any text but lone surrogates, ids of printable
    characters), and what each must load as: (task id, [(doc id, text, title, url)], question, answer)."""
    rows_, want = [], []
    for n in range(draw(st.integers(1, 3))):
        docs, qid, question, answer = draw(_DOCS), f"{draw(_ID)}-{n}", draw(_TEXT), draw(_TEXT)
        if fmt == "corpus":
            row: dict[str, Any] = {"task_id": qid, "documents": [
                {"doc_id": i, "text": t, "title": ti, "url": u, "meta": {}} for i, t, ti, u in docs],
                "questions": [{"question_id": "q", "question": question, "gold_answer": answer}]}
        elif fmt == "tasks":
            row = {"question_id": qid, "question": question, "gold_answer": answer,
                   "docs": [{"doc_id": i, "text": t, "title": ti, "url": u} for i, t, ti, u in docs]}
        else:
            row = {"query_id": qid, "query": question, "answer": answer,
                   "gold_docs": [{"docid": i, "text": t, "title": ti, "url": u} for i, t, ti, u in docs]}
        rows_.append(row)
        want.append((qid, docs, question, answer))
    return rows_, want


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(KEYS)).flatmap(lambda f: st.tuples(st.just(f), well_formed(f))))
def test_well_formed_data_files_always_load_as_written(tmp_path_factory: pytest.TempPathFactory,
                                                       case: Any) -> None:
    """The other half of the property below (which a loader refusing everything would pass): a file of
    well-formed rows of each format always loads, every task, document and question as written, and makes a
    workspace."""
    fmt, (lines, want) = case
    p = tmp_path_factory.mktemp("data") / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    tasks = load_tasks(p, format=fmt)
    assert len(tasks) == len(want)
    for t, (tid, docs, question, answer) in zip(tasks, want, strict=True):
        assert t.task_id == tid
        assert [(d.doc_id, d.text, d.title, d.url) for d in t.documents] == [tuple(d) for d in docs]
        (q,) = t.questions
        assert (q.question, q.gold_answer) == (question, answer)
        _check_task(t)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(KEYS)).flatmap(lambda f: st.tuples(st.just(f), rows(f))))
def test_hostile_data_files_load_or_raise_data_error(
    tmp_path_factory: pytest.TempPathFactory, case: Any
) -> None:
    fmt, lines = case
    p = tmp_path_factory.mktemp("data") / "rows.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        tasks = load_tasks(p, format=fmt)
    except DataError as e:
        assert e.path == str(p) and str(e)
        if any(line.strip() for line in lines):
            assert e.line is not None
        return
    for t in tasks:
        _check_task(t)
