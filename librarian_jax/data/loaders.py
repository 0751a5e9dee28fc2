"""Corpus loaders: every supported source format becomes a `list[CorpusTask]`.

Formats (names accepted by `load_tasks(path, format=...)`):

- ``"tasks"``: the paper's task JSONL, one task per row::

      {question_id, question, gold_answer, aliases?,
       docs: [{doc_id, url?, title?, text, is_evidence?, is_gold?, is_negative?}],
       amortization_questions?: [{question_id, question, gold_answer, aliases?, question_type?,
                                  estimated_difficulty?}]}

  The row's question is the task's one hidden question; the amortization questions are its reuse questions.
- ``"browsecomp_plus"``: the official BrowseComp-Plus rows::

      {query_id, query, answer, gold_docs / evidence_docs / negative_docs: [{docid, url?, text}]}

  Documents are deduplicated by ``docid``; their roles are kept as ``meta["is_gold" | "is_evidence" |
  "is_negative"]``. ``max_docs`` / ``max_negatives`` cap the corpus (support documents are always kept,
  negatives are drawn by a seeded shuffle): `NOISY_VARIANT` is the paper's noisy setting.
- ``"bright"``: BRIGHT-style retrieval domains: a documents file of ``{id, content}`` rows and an examples
  file of ``{id, query, gold_ids, gold_answer?}`` rows; one task per domain holding all documents and all
  queries, or (``questions_per_domain=N``) a seeded sample of N of them (the paper: 50 per domain). A
  directory is searched for ``documents/<domain>.jsonl`` + ``examples/<domain>.jsonl`` or
  ``<domain>/documents.jsonl`` + ``<domain>/examples.jsonl``.
- ``"folder"``: a folder of ``.txt`` / ``.md`` files, documents only (for building a user's workspace).
- ``"corpus"``: this package's own JSONL (`CorpusTask.to_dict()` per row, as written by `save_tasks`).

A reuse question set kept in its own file is attached per corpus by `attach_reuse_questions`.

JSONL files (optionally ``.gz``) are read line by line; the ``iter_*`` functions stream tasks one at a time.
Any malformed input raises `DataError` naming the file, the line and the field: invalid JSON (nesting too
deep, a number too long to read included), a lone surrogate escape (``"\\ud800"`` without its pair) anywhere
in a row, a field of the wrong type, an id holding a control character or line break, and in a folder a file
name that is not UTF-8 or holds a control character, or a symbolic link loop. The documented conversions:
an integer id becomes its decimal string, and a null optional field counts as absent.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import pathlib
import random
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from absl import logging

from librarian_jax.data.errors import DataError, json_type_name
from librarian_jax.data.schema import CorpusTask, Document, Question

PathLike = str | os.PathLike[str]

FORMATS = ("tasks", "browsecomp_plus", "bright", "folder", "corpus")

# The paper's noisy BrowseComp-Plus variant: support documents plus shuffled negatives, at most 50 documents.
NOISY_VARIANT: dict[str, Any] = {"max_docs": 50, "shuffle_docs": True}

FOLDER_EXTENSIONS = (".txt", ".md")

# Characters an id may not hold: C0/C1 controls (line breaks included), DEL, line/paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")  # how a lone surrogate gets into JSON text

_KIND_NAMES = {
    "str": "a string",
    "id": "a string or an integer",
    "bool": "a boolean",
    "list": "a list",
    "object": "an object",
    "number": "a number",
}


# ----------------------------------------------------------------------------------------------------
# Reading and validating JSON rows.


def _open_binary(path: pathlib.Path) -> io.BufferedIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")  # noqa: SIM115


def iter_json_rows(path: PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields `(line_number, row)` for every non-blank line of a JSONL file (1-based line numbers).

    Raises `DataError` on a missing file, undecodable bytes, invalid JSON or a line that is not a JSON object.
    Lines are decoded one at a time, so a bad byte is reported on its own line.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise DataError(str(path), "no such file")
    line_no = 0
    try:
        with _open_binary(p) as f:
            for line_no, raw in enumerate(f, 1):  # noqa: B007 (line_no is read after the loop on errors)
                try:
                    text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8").strip()
                except UnicodeDecodeError as e:
                    raise DataError(
                        str(path), f"not UTF-8 text ({e.reason} at byte {e.start})", line=line_no
                    ) from e
                if not text:
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(
                        str(path), f"invalid JSON: {e.msg} (column {e.colno})", line=line_no
                    ) from e
                except ValueError as e:  # e.g. an integer of more than 4300 digits
                    raise DataError(str(path), f"invalid JSON: {str(e)[:120]}", line=line_no) from e
                except RecursionError as e:
                    raise DataError(str(path), "invalid JSON: nested too deeply", line=line_no) from e
                if not isinstance(row, dict):
                    raise DataError(
                        str(path), f"expected a JSON object, got {json_type_name(row)}", line=line_no
                    )
                if _SURROGATE_ESCAPE.search(text):
                    bad = _lone_surrogate_field(row)
                    if bad is not None:
                        raise DataError(
                            str(path),
                            "holds a lone surrogate escape (\\ud800-\\udfff without its pair): not valid "
                            "Unicode text",
                            line=line_no,
                            field=bad,
                        )
                yield line_no, row
    except (OSError, EOFError) as e:  # e.g. a truncated or corrupt .gz
        raise DataError(str(path), f"cannot read: {e}", line=line_no + 1) from e


def _lone_surrogate_field(row: dict[str, Any]) -> str | None:
    """The path (`docs[2].text`) of the first string (key or value) of `row` holding a lone surrogate, or
    None. Iterative: a row nested as deep as JSON allows never exhausts the stack here."""
    stack: list[tuple[str, Any]] = [("", row)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return where or "(row)"
        elif isinstance(value, dict):
            for k, v in reversed(list(value.items())):
                sub = f"{where}.{k}" if where else str(k)
                if _SURROGATE.search(k):
                    return sub
                stack.append((sub, v))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


class _Fields:
    """Typed access to one JSON object of a file, with errors that name path, line and field."""

    def __init__(self, path: str, line: int | None, data: dict[str, Any], prefix: str = ""):
        self.path, self.line, self.data, self.prefix = path, line, data, prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str | None, message: str) -> DataError:
        return DataError(
            self.path,
            message,
            line=self.line,
            field=self.name(key) if key is not None else (self.prefix or None),
        )

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, kind: str, *, required: bool = True, default: Any = None) -> Any:
        if key not in self.data:
            if required:
                raise self.fail(key, "missing")
            return default
        value = self.data[key]
        if value is None and not required:
            return default
        ok = {
            "str": isinstance(value, str),
            "id": (isinstance(value, str) and value != "")
            or (isinstance(value, int) and not isinstance(value, bool)),
            "bool": isinstance(value, bool),
            "list": isinstance(value, list),
            "object": isinstance(value, dict),
            "number": isinstance(value, int | float) and not isinstance(value, bool),
        }[kind]
        if not ok:
            if kind == "id" and value == "":
                raise self.fail(key, "expected a non-empty id, got an empty string")
            raise self.fail(key, f"expected {_KIND_NAMES[kind]}, got {json_type_name(value)}")
        if kind == "id":
            return self._id(key, value)
        return value

    def _id(self, key: str, value: str | int) -> str:
        """An id as a string (an integer id is converted: `7` -> `"7"`); one holding a control character or
        line break is refused (ids appear in file headers and listings)."""
        out = str(value)
        if _CONTROL.search(out):
            raise self.fail(key, f"id {out[:60]!r} holds a control character or line break")
        return out

    def strings(self, key: str, *, required: bool = False) -> tuple[str, ...]:
        values = self.get(key, "list", required=required, default=[])
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise self.fail(f"{key}[{i}]", f"expected a string, got {json_type_name(v)}")
        return tuple(values)

    def ids(self, key: str, *, required: bool = False) -> tuple[str, ...]:
        values = self.get(key, "list", required=required, default=[])
        out = []
        for i, v in enumerate(values):
            if not ((isinstance(v, str) and v) or (isinstance(v, int) and not isinstance(v, bool))):
                raise self.fail(f"{key}[{i}]", f"expected a string or an integer id, got {json_type_name(v)}")
            out.append(self._id(f"{key}[{i}]", v))
        return tuple(out)

    def objects(self, key: str, *, required: bool = True) -> Iterator[_Fields]:
        values = self.get(key, "list", required=required, default=[])
        for i, v in enumerate(values):
            sub = f"{self.name(key)}[{i}]"
            if not isinstance(v, dict):
                raise DataError(
                    self.path, f"expected an object, got {json_type_name(v)}", line=self.line, field=sub
                )
            yield _Fields(self.path, self.line, v, sub)


def _seeded_rng(seed: int, key: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _check_unique_questions(f: _Fields, questions: Iterable[tuple[str, Question]]) -> None:
    seen: dict[str, str] = {}
    for field, q in questions:
        if q.question_id in seen:
            raise f.fail(field, f"duplicate question_id '{q.question_id}' (first at '{seen[q.question_id]}')")
        seen[q.question_id] = field


class _TaskIds:
    """Refuses a task id seen on an earlier line of the same file."""

    def __init__(self, path: str):
        self.path, self.first_line = path, {}

    def add(self, task_id: str, line: int, field: str) -> None:
        if task_id in self.first_line:
            raise DataError(
                self.path,
                f"duplicate task id '{task_id}' (first on line {self.first_line[task_id]})",
                line=line,
                field=field,
            )
        self.first_line[task_id] = line


# ----------------------------------------------------------------------------------------------------
# The paper's task JSONL.


def _reuse_question(a: _Fields) -> Question:
    """One reuse (amortization) question: `{question_id, question, gold_answer, aliases?, question_type?,
    estimated_difficulty?}`."""
    meta = {}
    if a.has("estimated_difficulty"):
        diff = a.data["estimated_difficulty"]
        if not isinstance(diff, str | int | float) or isinstance(diff, bool):
            raise a.fail("estimated_difficulty", f"expected a string or a number, got {json_type_name(diff)}")
        meta["estimated_difficulty"] = diff
    return Question(
        question_id=a.get("question_id", "id"),
        question=a.get("question", "str"),
        gold_answer=a.get("gold_answer", "str"),
        aliases=a.strings("aliases"),
        question_type=a.get("question_type", "str", required=False, default=""),
        meta=meta,
    )


def _parse_task_row(path: str, line: int, row: dict[str, Any]) -> CorpusTask:
    f = _Fields(path, line, row)
    qid = f.get("question_id", "id")
    task_id = f.get("task_id", "id", required=False, default=qid)
    hidden = Question(
        question_id=qid,
        question=f.get("question", "str"),
        gold_answer=f.get("gold_answer", "str"),
        aliases=f.strings("aliases"),
        question_type=f.get("question_type", "str", required=False, default="hidden"),
        meta={"source_line": line},
    )
    docs: list[Document] = []
    seen: dict[str, str] = {}
    for d in f.objects("docs"):
        doc_id = d.get("doc_id", "id")
        if doc_id in seen:
            raise d.fail("doc_id", f"duplicate doc_id '{doc_id}' (first at '{seen[doc_id]}')")
        seen[doc_id] = d.prefix
        meta = {
            k: d.get(k, "bool", required=False, default=False)
            for k in ("is_evidence", "is_gold", "is_negative")
        }
        docs.append(
            Document(
                doc_id=doc_id,
                text=d.get("text", "str"),
                title=d.get("title", "str", required=False, default=""),
                url=d.get("url", "str", required=False, default=""),
                meta=meta,
            )
        )
    if not docs:
        raise f.fail("docs", "empty corpus (no documents)")
    reuse = [
        (a.name("question_id"), _reuse_question(a))
        for a in f.objects("amortization_questions", required=False)
    ]
    _check_unique_questions(f, [("question_id", hidden), *reuse])
    return CorpusTask(
        task_id=task_id,
        documents=tuple(docs),
        questions=(hidden,),
        reuse_questions=tuple(q for _, q in reuse),
        meta={"source": path, "source_line": line, "format": "tasks"},
    )


def iter_task_jsonl(
    path: PathLike,
    *,
    max_docs: int | None = None,
    max_negatives: int | None = None,
    shuffle_docs: bool = False,
    seed: int = 0,
) -> Iterator[CorpusTask]:
    """Streams tasks from the paper's task JSONL (see the module docstring for the row format).

    The caps work as for BrowseComp-Plus: documents flagged `is_gold` or `is_evidence` are always kept, the
    others are sampled with a shuffle seeded by `(seed, task_id)`.
    """
    _check_caps(max_docs, max_negatives)
    ids = _TaskIds(str(path))
    for line, row in iter_json_rows(path):
        task = _parse_task_row(str(path), line, row)
        ids.add(task.task_id, line, "task_id" if "task_id" in row else "question_id")
        if max_docs is not None or max_negatives is not None or shuffle_docs:
            kept = _cap_documents(
                list(task.documents),
                task_id=task.task_id,
                max_docs=max_docs,
                max_negatives=max_negatives,
                shuffle_docs=shuffle_docs,
                seed=seed,
            )
            task = dataclasses.replace(task, documents=tuple(kept))
        yield task


def _check_caps(max_docs: int | None, max_negatives: int | None) -> None:
    for name, value in (("max_docs", max_docs), ("max_negatives", max_negatives)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def load_task_jsonl(path: PathLike, **kwargs: Any) -> list[CorpusTask]:
    """All tasks of a task JSONL file (`iter_task_jsonl` options); raises `DataError` on an empty file."""
    return _non_empty(path, list(iter_task_jsonl(path, **kwargs)))


# ----------------------------------------------------------------------------------------------------
# A reuse question set kept apart from the corpora (the paper's 443-question set over 50 corpora).


def load_reuse_questions(path: PathLike) -> dict[str, tuple[int, tuple[Question, ...]]]:
    """`{task_id: (line, reuse questions)}` from a JSONL file, one corpus per row::

        {task_id | question_id | query_id, amortization_questions | reuse_questions: [{question_id, question,
         gold_answer, aliases?, question_type?, estimated_difficulty?}]}

    The corpus is named as in the formats: `task_id`, else the paper's task row `question_id` (so the
    paper's reuse-set task JSONL is read as is; its `docs` are ignored), else BrowseComp-Plus `query_id`.
    """
    out: dict[str, tuple[int, tuple[Question, ...]]] = {}
    for line, row in iter_json_rows(path):
        f = _Fields(str(path), line, row)
        key = next((k for k in ("task_id", "question_id", "query_id") if k in row), "task_id")
        task_id = f.get(key, "id")
        if task_id in out:
            raise f.fail(key, f"duplicate task id '{task_id}' (first on line {out[task_id][0]})")
        qkey = "reuse_questions" if "reuse_questions" in row else "amortization_questions"
        qs = [(a.name("question_id"), _reuse_question(a)) for a in f.objects(qkey)]
        _check_unique_questions(f, qs)
        out[task_id] = (line, tuple(q for _, q in qs))
    if not out:
        raise DataError(str(path), "no reuse questions (no rows)")
    return out


def attach_reuse_questions(tasks: Iterable[CorpusTask], path: PathLike) -> list[CorpusTask]:
    """`tasks` with the reuse questions of `path` (`load_reuse_questions`) as each named corpus's
    `reuse_questions` (replacing any its own row carried); corpora the file does not name are unchanged.

    Raises `DataError` naming the file, line and id when the file names a task not in `tasks`, or gives a
    corpus a reuse question whose id is one of its hidden questions'.
    """
    tasks = list(tasks)
    sets = load_reuse_questions(path)
    have = {t.task_id for t in tasks}
    for task_id, (line, _) in sets.items():
        if task_id not in have:
            raise DataError(
                str(path), f"task id '{task_id}' is not in the data ({len(have)} tasks)", line=line
            )
    out = []
    for t in tasks:
        if t.task_id not in sets:
            out.append(t)
            continue
        line, reuse = sets[t.task_id]
        hidden = {q.question_id for q in t.questions}
        for q in reuse:
            if q.question_id in hidden:
                raise DataError(
                    str(path),
                    f"reuse question id '{q.question_id}' of task '{t.task_id}' is also one of its hidden "
                    "questions",
                    line=line,
                )
        out.append(dataclasses.replace(t, reuse_questions=reuse, meta={**t.meta, "reuse_source": str(path)}))
    return out


# ----------------------------------------------------------------------------------------------------
# Official BrowseComp-Plus rows.


def _cap_documents(
    docs: list[Document],
    *,
    task_id: str,
    max_docs: int | None,
    max_negatives: int | None,
    shuffle_docs: bool,
    seed: int,
) -> list[Document]:
    """Keeps every support (gold / evidence) document and a seeded sample of negatives within the caps."""
    rng = _seeded_rng(seed, task_id)
    support = [d for d in docs if d.meta.get("is_gold") or d.meta.get("is_evidence")]
    negatives = [d for d in docs if not (d.meta.get("is_gold") or d.meta.get("is_evidence"))]
    keep = len(negatives)
    if max_negatives is not None:
        keep = min(keep, max_negatives)
    if max_docs is not None:
        if len(support) > max_docs:
            logging.warning(
                "task %s: %d support documents exceed max_docs=%d; keeping all of them",
                task_id,
                len(support),
                max_docs,
            )
        keep = min(keep, max(0, max_docs - len(support)))
    if keep < len(negatives):
        order = list(range(len(negatives)))
        rng.shuffle(order)
        chosen = set(order[:keep])
        negatives = [d for i, d in enumerate(negatives) if i in chosen]
    chosen_ids = {d.doc_id for d in support} | {d.doc_id for d in negatives}
    out = [d for d in docs if d.doc_id in chosen_ids]
    if shuffle_docs:
        rng.shuffle(out)
    return out


def _parse_browsecomp_row(
    path: str,
    line: int,
    row: dict[str, Any],
    *,
    max_docs: int | None,
    max_negatives: int | None,
    shuffle_docs: bool,
    seed: int,
) -> CorpusTask:
    f = _Fields(path, line, row)
    qid = f.get("query_id", "id")
    docs: dict[str, Document] = {}
    first_field: dict[str, str] = {}
    for key, flag in (
        ("gold_docs", "is_gold"),
        ("evidence_docs", "is_evidence"),
        ("negative_docs", "is_negative"),
    ):
        for d in f.objects(key, required=False):
            doc_id = d.get("docid", "id")
            text = d.get("text", "str")
            url = d.get("url", "str", required=False, default="")
            prior = docs.get(doc_id)
            if prior is None:
                meta = {"is_gold": False, "is_evidence": False, "is_negative": False, flag: True}
                docs[doc_id] = Document(
                    doc_id=doc_id,
                    text=text,
                    url=url,
                    title=d.get("title", "str", required=False, default=""),
                    meta=meta,
                )
                first_field[doc_id] = d.prefix
            else:
                if prior.text != text:
                    logging.warning(
                        "%s:%d: %s.text differs from the text of the same docid at %s; keeping the first",
                        path,
                        line,
                        d.prefix,
                        first_field[doc_id],
                    )
                prior.meta[flag] = True
    if not docs:
        raise f.fail("gold_docs", "empty corpus (no documents in gold_docs, evidence_docs or negative_docs)")
    raw_count = len(docs)
    kept = _cap_documents(
        list(docs.values()),
        task_id=qid,
        max_docs=max_docs,
        max_negatives=max_negatives,
        shuffle_docs=shuffle_docs,
        seed=seed,
    )
    question = Question(
        question_id=qid,
        question=f.get("query", "str"),
        gold_answer=f.get("answer", "str"),
        aliases=f.strings("aliases"),
        question_type="hidden",
        meta={"source_line": line},
    )
    return CorpusTask(
        task_id=qid,
        documents=tuple(kept),
        questions=(question,),
        meta={"source": path, "source_line": line, "format": "browsecomp_plus", "num_unique_docs": raw_count},
    )


def iter_browsecomp_plus(
    path: PathLike,
    *,
    max_docs: int | None = None,
    max_negatives: int | None = None,
    shuffle_docs: bool = False,
    seed: int = 0,
) -> Iterator[CorpusTask]:
    """Streams BrowseComp-Plus rows as tasks (one hidden question each).

    `max_docs` / `max_negatives` cap the corpus keeping every gold / evidence document; the negatives kept and
    (with `shuffle_docs`) the document order come from a shuffle seeded by `(seed, query_id)`.
    """
    _check_caps(max_docs, max_negatives)
    ids = _TaskIds(str(path))
    for line, row in iter_json_rows(path):
        task = _parse_browsecomp_row(
            str(path),
            line,
            row,
            max_docs=max_docs,
            max_negatives=max_negatives,
            shuffle_docs=shuffle_docs,
            seed=seed,
        )
        ids.add(task.task_id, line, "query_id")
        yield task


def load_browsecomp_plus(path: PathLike, **kwargs: Any) -> list[CorpusTask]:
    """All tasks of a BrowseComp-Plus JSONL file (`iter_browsecomp_plus` options; `**NOISY_VARIANT` for the
    paper's noisy variant)."""
    return _non_empty(path, list(iter_browsecomp_plus(path, **kwargs)))


# ----------------------------------------------------------------------------------------------------
# BRIGHT-style domains.


def load_bright_domain(
    documents_path: PathLike,
    examples_path: PathLike,
    *,
    domain: str | None = None,
    questions_per_domain: int = 0,
    seed: int = 0,
) -> CorpusTask:
    """One task holding a BRIGHT domain: every `{id, content}` document and every `{id, query, gold_ids,
    gold_answer?}` example as a hidden question (`meta["gold_ids"]` keeps the retrieval labels; a missing
    `gold_answer` becomes "").

    `questions_per_domain` > 0 keeps a sample of that many examples (the paper: 50 per domain), drawn by a
    shuffle seeded by `(seed, "bright/<domain>")` and kept in file order; a domain with fewer keeps them all
    (with a warning). 0 keeps every example.
    """
    if questions_per_domain < 0:
        raise ValueError(f"questions_per_domain must be >= 0, got {questions_per_domain}")
    dpath, epath = str(documents_path), str(examples_path)
    domain = domain or pathlib.Path(documents_path).name.split(".")[0]
    docs: list[Document] = []
    first_line: dict[str, int] = {}
    for line, row in iter_json_rows(documents_path):
        f = _Fields(dpath, line, row)
        doc_id = f.get("id", "id")
        if doc_id in first_line:
            raise f.fail("id", f"duplicate document id '{doc_id}' (first on line {first_line[doc_id]})")
        first_line[doc_id] = line
        docs.append(
            Document(
                doc_id=doc_id,
                text=f.get("content", "str"),
                title=f.get("title", "str", required=False, default=""),
                meta={"source_line": line},
            )
        )
    if not docs:
        raise DataError(dpath, "empty corpus (no documents)")
    questions: list[Question] = []
    q_line: dict[str, int] = {}
    missing_answers = 0
    for line, row in iter_json_rows(examples_path):
        f = _Fields(epath, line, row)
        qid = f.get("id", "id")
        if qid in q_line:
            raise f.fail("id", f"duplicate example id '{qid}' (first on line {q_line[qid]})")
        q_line[qid] = line
        gold_ids = f.ids("gold_ids", required=True)
        for i, g in enumerate(gold_ids):
            if g not in first_line:
                raise f.fail(f"gold_ids[{i}]", f"unknown document id '{g}' (not in {dpath})")
        answer = f.get("gold_answer", "str", required=False, default=None)
        if answer is None:
            missing_answers += 1
        meta: dict[str, Any] = {"gold_ids": list(gold_ids), "source_line": line}
        if f.has("excluded_ids"):
            meta["excluded_ids"] = list(f.ids("excluded_ids"))
        questions.append(
            Question(
                question_id=qid,
                question=f.get("query", "str"),
                gold_answer=answer or "",
                aliases=f.strings("aliases"),
                question_type="bright",
                meta=meta,
            )
        )
    if not questions:
        raise DataError(epath, "no examples")
    if missing_answers:
        logging.warning(
            "%s: %d of %d examples have no gold_answer (kept as '')", epath, missing_answers, len(questions)
        )
    total = len(questions)
    if questions_per_domain:
        if questions_per_domain >= total:
            if questions_per_domain > total:
                logging.warning(
                    "%s: %d examples, fewer than questions_per_domain=%d; keeping all of them",
                    epath, total, questions_per_domain,
                )
        else:
            chosen = sorted(_seeded_rng(seed, f"bright/{domain}").sample(range(total), questions_per_domain))
            questions = [questions[i] for i in chosen]
    gold = {g for q in questions for g in q.meta["gold_ids"]}
    for d in docs:
        d.meta["is_gold"] = d.doc_id in gold
    return CorpusTask(
        task_id=f"bright/{domain}",
        documents=tuple(docs),
        questions=tuple(questions),
        meta={"source": dpath, "examples": epath, "format": "bright", "domain": domain,
              "num_examples": total},
    )


def _bright_pairs(root: pathlib.Path) -> list[tuple[str, pathlib.Path, pathlib.Path]]:
    pairs = []
    docs_dir, ex_dir = root / "documents", root / "examples"
    if docs_dir.is_dir() and ex_dir.is_dir():
        for dp in sorted(docs_dir.iterdir()):
            if dp.name.startswith(".") or not dp.is_file():
                continue
            domain = dp.name.split(".")[0]
            matches = sorted(p for p in ex_dir.iterdir() if p.name.split(".")[0] == domain)
            if not matches:
                raise DataError(str(dp), f"no examples file for domain '{domain}' in {ex_dir}")
            pairs.append((domain, dp, matches[0]))
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.name.startswith(".") and sub.name not in ("documents", "examples"):
            dp = next((p for p in sorted(sub.iterdir()) if p.name.split(".")[0] == "documents"), None)
            ep = next((p for p in sorted(sub.iterdir()) if p.name.split(".")[0] == "examples"), None)
            if dp is not None and ep is not None:
                pairs.append((sub.name, dp, ep))
    return pairs


def load_bright(
    root: PathLike,
    *,
    domains: Iterable[str] | None = None,
    questions_per_domain: int = 0,
    seed: int = 0,
) -> list[CorpusTask]:
    """One task per BRIGHT domain found under `root` (see the module docstring for the layouts), each with a
    seeded sample of `questions_per_domain` examples (0 = all; see `load_bright_domain`)."""
    pairs = _bright_pairs(pathlib.Path(root))
    if domains is not None:
        wanted = list(domains)
        have = {d for d, _, _ in pairs}
        for d in wanted:
            if d not in have:
                raise DataError(str(root), f"no BRIGHT domain '{d}' (found: {sorted(have)})")
        pairs = [p for p in pairs if p[0] in wanted]
    if not pairs:
        raise DataError(
            str(root),
            "no BRIGHT domains (expected documents/<domain>.jsonl + examples/<domain>.jsonl "
            "or <domain>/documents.jsonl + <domain>/examples.jsonl)",
        )
    return [
        load_bright_domain(dp, ep, domain=domain, questions_per_domain=questions_per_domain, seed=seed)
        for domain, dp, ep in pairs
    ]


# ----------------------------------------------------------------------------------------------------
# A folder of text files.


def _title_of(text: str, fallback: str) -> str:
    for line in text.splitlines():
        s = line.strip()
        if s:
            return s.lstrip("#").strip() if s.startswith("#") else fallback
    return fallback


def load_folder(
    root: PathLike,
    *,
    extensions: Iterable[str] = FOLDER_EXTENSIONS,
    task_id: str | None = None,
    skip_empty: bool = True,
) -> CorpusTask:
    """A documents-only task from the text files under `root` (recursively, in sorted order).

    `doc_id` is the POSIX path relative to `root`; hidden files and folders are skipped; a symbolic link
    whose target lies outside `root` raises `DataError` (links inside it are followed for files, skipped for
    folders).
    """
    base = pathlib.Path(root)
    if not base.is_dir():
        raise DataError(str(root), "not a folder")
    real_base = _resolve(base)
    exts = tuple(e.lower() for e in extensions)
    docs: list[Document] = []
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        here = pathlib.Path(dirpath)
        kept_dirs = []
        for d in sorted(dirnames):
            if d.startswith("."):
                continue
            p = here / d
            _check_name(p, base)
            if p.is_symlink():
                _check_link(p, real_base, root)
                logging.info("skipping linked folder %s (its target is inside %s)", p, root)
                continue
            kept_dirs.append(d)
        dirnames[:] = kept_dirs
        for name in sorted(filenames):
            if name.startswith(".") or not name.lower().endswith(exts):
                continue
            p = here / name
            rel = _check_name(p, base)
            if p.is_symlink():
                _check_link(p, real_base, root)
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DataError(str(p), f"not UTF-8 text ({e.reason} at byte {e.start})") from e
            except OSError as e:
                raise DataError(str(p), f"cannot read: {e}") from e
            if skip_empty and not text.strip():
                logging.warning("skipping empty file %s", p)
                continue
            docs.append(
                Document(
                    doc_id=rel,
                    text=text,
                    title=_title_of(text, pathlib.Path(rel).stem),
                    url=f"file://{_resolve(p)}",
                    meta={"path": rel},
                )
            )
    if not docs:
        raise DataError(str(root), f"empty corpus (no non-empty {'/'.join(exts)} files)")
    docs.sort(key=lambda d: d.doc_id)
    return CorpusTask(
        task_id=task_id or real_base.name,
        documents=tuple(docs),
        meta={"source": str(root), "format": "folder"},
    )


def _resolve(p: pathlib.Path) -> pathlib.Path:
    """`p.resolve()`, with a symbolic link loop (RuntimeError or OSError) as a DataError naming `p`."""
    try:
        return p.resolve()
    except (RuntimeError, OSError) as e:
        raise DataError(str(p), f"cannot resolve (a symbolic link loop?): {e}") from e


def _check_name(p: pathlib.Path, base: pathlib.Path) -> str:
    """`p` relative to `base` as a POSIX path (the document's doc_id); a name that is not valid UTF-8 or
    holds a control character or line break is refused."""
    rel = p.relative_to(base).as_posix()
    if _SURROGATE.search(rel):
        raise DataError(repr(str(p)), "file name is not valid UTF-8")
    if _CONTROL.search(rel):
        raise DataError(repr(str(p)), "file name holds a control character or line break")
    return rel


def _check_link(p: pathlib.Path, real_base: pathlib.Path, root: PathLike) -> None:
    target = _resolve(p)
    if target != real_base and real_base not in target.parents:
        raise DataError(str(p), f"symbolic link escapes {root} (points to {target})")


# ----------------------------------------------------------------------------------------------------
# This package's own JSONL.


def _corpus_question(q: _Fields) -> Question:
    return Question(
        question_id=q.get("question_id", "id"),
        question=q.get("question", "str"),
        gold_answer=q.get("gold_answer", "str"),
        aliases=q.strings("aliases"),
        question_type=q.get("question_type", "str", required=False, default=""),
        meta=dict(q.get("meta", "object", required=False, default={})),
    )


def iter_corpus_jsonl(path: PathLike) -> Iterator[CorpusTask]:
    """Streams tasks written by `save_tasks` (`CorpusTask.to_dict()` rows), checking each row's fields.

    Every field is checked and the task is built from the checked values: ids may be strings or integers
    (an integer id becomes its decimal string, as in the other formats); titles, URLs, texts and question
    fields must be strings; a `meta` must be an object, and a null `meta` (or a null optional string) counts
    as absent. Anything else is a `DataError` naming the line and the field."""
    ids = _TaskIds(str(path))
    for line, row in iter_json_rows(path):
        f = _Fields(str(path), line, row)
        task_id = f.get("task_id", "id")
        seen: dict[str, str] = {}
        docs = []
        for d in f.objects("documents"):
            doc_id = d.get("doc_id", "id")
            if doc_id in seen:
                raise d.fail("doc_id", f"duplicate doc_id '{doc_id}' (first at '{seen[doc_id]}')")
            seen[doc_id] = d.prefix
            docs.append(
                Document(
                    doc_id=doc_id,
                    text=d.get("text", "str"),
                    title=d.get("title", "str", required=False, default=""),
                    url=d.get("url", "str", required=False, default=""),
                    meta=dict(d.get("meta", "object", required=False, default={})),
                )
            )
        if not docs:
            raise f.fail("documents", "empty corpus (no documents)")
        questions = {
            key: [(q.name("question_id"), _corpus_question(q)) for q in f.objects(key, required=False)]
            for key in ("questions", "reuse_questions")
        }
        _check_unique_questions(f, [*questions["questions"], *questions["reuse_questions"]])
        ids.add(task_id, line, "task_id")
        yield CorpusTask(
            task_id=task_id,
            documents=tuple(docs),
            questions=tuple(q for _, q in questions["questions"]),
            reuse_questions=tuple(q for _, q in questions["reuse_questions"]),
            meta=dict(f.get("meta", "object", required=False, default={})),
        )


def load_corpus_jsonl(path: PathLike) -> list[CorpusTask]:
    return _non_empty(path, list(iter_corpus_jsonl(path)))


def save_tasks(tasks: Iterable[CorpusTask], path: PathLike) -> int:
    """Writes tasks as `corpus` JSONL (gzip when the name ends in .gz); returns how many were written."""
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    opener: Callable[..., Any] = gzip.open if p.suffix == ".gz" else open
    with opener(p, "wt", encoding="utf-8") as f:
        for t in tasks:
            f.write(json.dumps(t.to_dict(), ensure_ascii=False, sort_keys=True) + "\n")
            n += 1
    return n


# ----------------------------------------------------------------------------------------------------
# Dispatch.


def _non_empty(path: PathLike, tasks: list[CorpusTask]) -> list[CorpusTask]:
    if not tasks:
        raise DataError(str(path), "empty corpus (no tasks)")
    return tasks


def sniff_format(path: PathLike) -> str:
    """Guesses a path's format: a folder is `bright` when it holds BRIGHT domains, else `folder`; a file is
    told apart by the keys of its first row."""
    p = pathlib.Path(path)
    if p.is_dir():
        return "bright" if _bright_pairs(p) else "folder"
    for line, row in iter_json_rows(p):
        keys = set(row)
        if "task_id" in keys and "documents" in keys:
            return "corpus"
        if "query_id" in keys or keys & {"gold_docs", "evidence_docs", "negative_docs"}:
            return "browsecomp_plus"
        if "docs" in keys or "question_id" in keys:
            return "tasks"
        raise DataError(
            str(path),
            f"cannot tell the format from the keys {sorted(keys)}; pass format= one of {FORMATS}",
            line=line,
        )
    raise DataError(str(path), "empty corpus (no rows)")


def iter_tasks(path: PathLike, format: str = "auto", **kwargs: Any) -> Iterator[CorpusTask]:  # noqa: A002
    """Streams the tasks of `path` one at a time (JSONL formats are read line by line); see `load_tasks`."""
    fmt = sniff_format(path) if format == "auto" else format
    if fmt not in FORMATS:
        raise ValueError(f"unknown corpus format {format!r}; expected 'auto' or one of {FORMATS}")
    logging.info("loading %s as %s", path, fmt)
    if fmt == "tasks":
        yield from iter_task_jsonl(path, **kwargs)
    elif fmt == "browsecomp_plus":
        yield from iter_browsecomp_plus(path, **kwargs)
    elif fmt == "bright":
        yield from load_bright(path, **kwargs)
    elif fmt == "folder":
        yield load_folder(path, **kwargs)
    else:
        yield from iter_corpus_jsonl(path, **kwargs)


def load_tasks(path: PathLike, format: str = "auto", **kwargs: Any) -> list[CorpusTask]:  # noqa: A002
    """Loads every task of `path` in the named format (`FORMATS`) or, with `"auto"`, the sniffed one.

    Extra keyword arguments go to the format's loader (e.g. `max_docs=50, shuffle_docs=True` for the task
    JSONL and BrowseComp-Plus, `domains=[...]` for BRIGHT, `extensions=...` for a folder). Raises `DataError`
    when the file holds no task.
    """
    return _non_empty(path, list(iter_tasks(path, format, **kwargs)))
