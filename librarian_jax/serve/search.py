"""BM25 (`bm25s`) over a workspace's readable files: its synthetic files (history included) and its raw
documents, cut into passages of `PASSAGE_LINES` display lines of the text `read_file` shows, so that every
hit names a path and the line range to read (its snippet leaves the file's header out). The generated README
is left out (it only lists the others)."""

from __future__ import annotations

import dataclasses
import logging as py_logging

import numpy as np

from librarian_jax.workspace import README, Workspace
from librarian_jax.workspace import render as R

PASSAGE_LINES = 20
SNIPPET_CHARS = 300


@dataclasses.dataclass(frozen=True)
class Hit:
    """One passage found: `path`, display lines `start_line..end_line` (as `read_file` numbers them),
    its BM25 `score` and a one-line `snippet` (at most `SNIPPET_CHARS` characters)."""

    path: str
    start_line: int
    end_line: int
    score: float
    snippet: str


class SearchIndex:
    """The index over one workspace, built once (the workspace is served read-only)."""

    def __init__(self, workspace: Workspace, passage_lines: int = PASSAGE_LINES):
        import bm25s  # here, not with this module: importing it starts the JAX backend (a jitted top_k)

        py_logging.getLogger("bm25s").setLevel(py_logging.WARNING)
        self._tokenize = bm25s.tokenize
        self.passages: list[tuple[str, int, int, str]] = []  # path, first line, last line, text
        files = {p: t for p, t in workspace.files().items() if p != README}
        self._snippets: list[str] = []  # each passage's text without header lines (for the snippet)
        for path, text in files.items():
            lines = R.display_lines(text)
            body_from = lines.index(R.HEADER_END) + 1 if R.HEADER_END in lines else 0
            for i in range(0, max(len(lines), 1), passage_lines):
                chunk = lines[i : i + passage_lines]
                self.passages.append((path, i + 1, i + len(chunk), "\n".join(chunk)))
                self._snippets.append("\n".join(lines[max(i, body_from) : i + passage_lines]))
        self.num_files = len(files)
        self._retriever = bm25s.BM25()
        corpus = [f"{p}\n{t}" for p, _, _, t in self.passages]  # a path's words find its file too
        tokens = self._tokenize(corpus, stopwords="en", show_progress=False)
        self._retriever.index(tokens, show_progress=False)

    def search(self, query: str, k: int) -> list[Hit]:
        """Up to `k` passages with a positive score for `query`, best first (ties in corpus order)."""
        words = self._tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        if not self.passages or not words:
            return []
        scores = np.asarray(self._retriever.get_scores(words), dtype=np.float64)
        order = np.argsort(-scores, kind="stable")[:k]
        out = []
        for j in order:
            if scores[j] <= 0:
                break
            path, a, b, _ = self.passages[int(j)]
            out.append(Hit(path, a, b, float(scores[j]), R.clip(self._snippets[int(j)], SNIPPET_CHARS)))
        return out
