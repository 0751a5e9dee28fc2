"""What the served tools do, without the protocol: `ServedWorkspace` answers `list_files`, `read_file`,
`provenance` and `search` on an exported workspace loaded back into a `Workspace` (`load_export`).

One implementation with the answerer's: arguments go through the agents' tool protocol
(`agents.protocol.validate_arguments` with `LIST_FILES_TOOL` / `READ_FILE_TOOL`: the same defaults, bounds
and `invalid_argument_type` messages a model's call gets), then through the workspace's own `list_dir`,
`read_file` and `provenance` (the same path rules, forgiving lookups, caps of 100 lines and 16,000
characters, and errors: `path_not_found`, `is_a_directory`, `path_escape`...), rendered with
`ActionResult.render` as the answerer's observations are. Errors read `ERROR [code]: message` (and
`Did you mean: ...`). Nothing here reads the disk: the export was read once, at load.

Over MCP, `read_file` takes the issue's names `offset` (the first line, 1-based: the answerer's
`start_line`) and `limit` (lines, at most 100: its `num_lines`); the continuation hints the workspace writes
say `start_line=N`, so the server accepts `start_line` / `num_lines` as well.

Served additions: `provenance` returns, besides its text, structured rows with each raw document's full
`sha256` and a `stale` flag (its file changed since the export), and `stale` for the whole answer; `search`
is BM25 over the files (`search.SearchIndex`). Every answer is bounded (`MAX_READ_CHARS`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from librarian_jax.agents import prompt_text
from librarian_jax.agents.answerer import answerer_system, starting_context
from librarian_jax.agents.protocol import (
    LIST_FILES_TOOL,
    READ_FILE_TOOL,
    CallError,
    Param,
    ToolSpec,
    validate_arguments,
)
from librarian_jax.serve.search import SearchIndex
from librarian_jax.workspace import MAX_READ_CHARS, ActionResult, LoadedExport
from librarian_jax.workspace import render as R

MAX_K = 20
MAX_QUERY_CHARS = 1000
# The starting context's budget for preloaded root files, in characters: the answerer's default is half of
# its 32,768-token context (16,384 tokens), about 4 characters a token.
CONTEXT_CHARS = 65_536

PROVENANCE_TOOL = ToolSpec(
    "provenance",
    (Param("path", "str"),),
    "the raw documents a file rests on (through its synthetic sources, transitively), with content hashes "
    "and whether each changed since the workspace was built (stale)",
)
SEARCH_TOOL = ToolSpec(
    "search",
    (
        Param("query", "str", max_chars=MAX_QUERY_CHARS),
        Param("k", "int", False, 5, min_value=1, max_value=MAX_K),
    ),
    f"BM25 over the synthetic files and raw documents: the k best passages (k <= {MAX_K}), each with the "
    f"path and lines to read",
)

MCP_NOTE = (
    "(Served over MCP: call list_files, read_file, provenance and search through your client's tools rather "
    "than writing <tool_call> blocks, and give your answer as your reply.)"
)


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    """A tool's answer: `ok`, the `text` an agent reads, and `data` (structured, JSON-able) when the tool has
    any."""

    ok: bool
    text: str
    data: dict[str, Any] | None = None


def _error(e: CallError) -> ToolOutput:
    return ToolOutput(False, f"ERROR [{e.code}]: {e.message}")


def _result(r: ActionResult) -> ToolOutput:
    return ToolOutput(r.ok, r.render())


class ServedWorkspace:
    """The tools, resources and prompt of one loaded export (read-only; safe to share between clients)."""

    def __init__(self, loaded: LoadedExport, context_chars: int = CONTEXT_CHARS):
        self.loaded = loaded
        self.ws = loaded.workspace
        self.context_chars = context_chars
        self.index = SearchIndex(self.ws)
        self.ws.list_dir(".")  # builds the path index now, not under a first request

    # ----------------------------------------------------------------------------------------- the tools
    def list_files(self, path: object = ".", start: object = 1) -> ToolOutput:
        """The answerer's `list_files(path, start)`."""
        call = validate_arguments(LIST_FILES_TOOL, {"path": path, "start": start})
        if isinstance(call, CallError):
            return _error(call)
        a = call.arguments
        return _result(self.ws.list_dir(a["path"], start=a["start"]))

    def read_file(self, path: object, start_line: object = 1, num_lines: object = 100) -> ToolOutput:
        """The answerer's `read_file(path, start_line, num_lines)`; a raw document whose file changed since
        the export is read as it is now, after a note saying so."""
        call = validate_arguments(
            READ_FILE_TOOL, {"path": path, "start_line": start_line, "num_lines": num_lines}
        )
        if isinstance(call, CallError):
            return _error(call)
        a = call.arguments
        r = self.ws.read_file(a["path"], start_line=a["start_line"], num_lines=a["num_lines"])
        out = _result(r)
        stale = self.loaded.stale.get(r.data.get("path", "")) if r.ok else None
        if stale is not None:
            note = (
                f"[stale: {stale.path} changed since this workspace was built; its file's sha256 is now "
                f"{stale.current_sha256[:16]}, the SHA256 below is the one the synthetic files cite]\n"
            )
            out = ToolOutput(True, note + out.text)
        return out

    def provenance(self, path: object) -> ToolOutput:
        """The raw documents `path` rests on, transitively, with hashes and `stale` flags (see module)."""
        call = validate_arguments(PROVENANCE_TOOL, {"path": path})
        if isinstance(call, CallError):
            return _error(call)
        r = self.ws.provenance(call.arguments["path"])
        if not r.ok:
            return _result(r)
        stale = self.loaded.stale
        rows: list[dict[str, Any]] = []
        lines = [r.message]
        used = len(lines[0])
        for x in r.data["raw"]:
            flag = x["path"] in stale
            line = f"{x['path']} (doc_id={x['doc_id']}, sha256:{x['sha']})" + (
                " [stale: changed since the workspace was built]" if flag else ""
            )
            if used + len(line) + 200 > MAX_READ_CHARS:
                break
            rows.append(
                {"path": x["path"], "doc_id": x["doc_id"], "sha256_16": x["sha"],
                 "sha256": self.loaded.sha256.get(x["path"], ""), "stale": flag}
            )
            lines.append(line)
            used += len(line) + 1
        total = len(r.data["raw"])
        any_stale = any(x["path"] in stale for x in r.data["raw"])
        if len(rows) < total:
            lines.append(f"[showing {len(rows)} of {total} raw documents]")
        lines.append(f"stale: {'true' if any_stale else 'false'}")
        synthetic = [self.ws.file_path_of(n) for n in r.data["synthetic"]]
        data = {"path": r.data["path"], "raw": rows, "total": total, "truncated": len(rows) < total,
                "synthetic": synthetic[:200], "stale": any_stale}
        return ToolOutput(True, "\n".join(lines), data)

    def search(self, query: object, k: object = 5) -> ToolOutput:
        """BM25's `k` best passages for `query` over the synthetic files and raw documents."""
        call = validate_arguments(SEARCH_TOOL, {"query": query, "k": k})
        if isinstance(call, CallError):
            return _error(call)
        q, n = call.arguments["query"], call.arguments["k"]
        hits = self.index.search(q, n)
        head = (
            f"search {R.clip(q, 100)!r}: {len(hits)} passages (BM25 over {self.index.num_files} files: "
            f"synthetic files and raw documents)"
        )
        rows = [
            f"{i}. {h.path} lines {h.start_line}-{h.end_line} (score {h.score:.2f}; "
            f"read_file({h.path!r}, offset={h.start_line})): {h.snippet}"
            for i, h in enumerate(hits, start=1)
        ]
        data = {"query": q, "hits": [dataclasses.asdict(h) for h in hits]}
        return ToolOutput(True, "\n".join([head, *rows]) if rows else head + "\n(no passage matches)", data)

    # ------------------------------------------------------------------------------- resources and prompt
    def readme(self) -> str:
        """The workspace README (`README.md`, as the answerer reads it)."""
        return self.ws.readme_text()

    def starting_context(self) -> str:
        """What the answerer reads before its question: the README, the root listing and the root-level
        files (while they fit in `context_chars` characters; the others are named)."""
        readme, listing, _ = starting_context(self.ws, self.context_chars, len)
        return f"{readme}\n\nRoot listing:\n{listing}"

    def answer_prompt(self, question: str) -> str:
        """The answerer's instructions and first prompt for `question`, as one message for an MCP client."""
        readme, listing, _ = starting_context(self.ws, self.context_chars, len)
        user = prompt_text.render("answerer_user", readme=readme, listing=listing, question=question)
        return f"{answerer_system()}\n{MCP_NOTE}\n\n{user}"
