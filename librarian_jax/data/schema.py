"""The corpus-task schema: plain dataclasses with no dependencies, shared by every layer.

A `CorpusTask` is one builder environment: raw documents to organise, hidden training questions whose answers
the probes score (the builder never sees them), and optional reuse questions for evaluation.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any


def content_hash(text: str) -> str:
    """Short, stable content hash of a document's text (sha256 of its UTF-8, first 16 hex digits). Total: a
    lone surrogate (which UTF-8 cannot encode) is hashed as its surrogate escape bytes instead of raising."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Document:
    """One raw document. `doc_id` is unique within its task; `title` and `url` are optional."""

    doc_id: str
    text: str
    title: str = ""
    url: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def sha(self) -> str:
        return content_hash(self.text)

    def to_dict(self) -> dict[str, Any]:
        return {"doc_id": self.doc_id, "text": self.text, "title": self.title, "url": self.url,
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Document:
        return cls(doc_id=d["doc_id"], text=d["text"], title=d.get("title", ""), url=d.get("url", ""),
                   meta=dict(d.get("meta", {})))


@dataclasses.dataclass(frozen=True)
class Question:
    """A question with its gold answer; `aliases` are other accepted surface forms of the answer."""

    question_id: str
    question: str
    gold_answer: str
    aliases: tuple[str, ...] = ()
    question_type: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def answers(self) -> tuple[str, ...]:
        return (self.gold_answer, *self.aliases)

    def to_dict(self) -> dict[str, Any]:
        return {"question_id": self.question_id, "question": self.question, "gold_answer": self.gold_answer,
                "aliases": list(self.aliases), "question_type": self.question_type, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Question:
        return cls(question_id=d["question_id"], question=d["question"], gold_answer=d["gold_answer"],
                   aliases=tuple(d.get("aliases", ())), question_type=d.get("question_type", ""),
                   meta=dict(d.get("meta", {})))


@dataclasses.dataclass(frozen=True)
class CorpusTask:
    """One corpus: documents, hidden training questions, and optional reuse (evaluation) questions."""

    task_id: str
    documents: tuple[Document, ...]
    questions: tuple[Question, ...] = ()
    reuse_questions: tuple[Question, ...] = ()
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "documents": [d.to_dict() for d in self.documents],
                "questions": [q.to_dict() for q in self.questions],
                "reuse_questions": [q.to_dict() for q in self.reuse_questions], "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorpusTask:
        return cls(task_id=d["task_id"], documents=tuple(Document.from_dict(x) for x in d["documents"]),
                   questions=tuple(Question.from_dict(x) for x in d.get("questions", ())),
                   reuse_questions=tuple(Question.from_dict(x) for x in d.get("reuse_questions", ())),
                   meta=dict(d.get("meta", {})))
