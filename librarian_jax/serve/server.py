"""The MCP server (official `mcp` SDK, `MCPServer`) over a `ServedWorkspace`: four read-only tools, two
resources and one prompt; stdio or streamable HTTP.

- Tools: `list_files(path=".", start=1)`, `read_file(path, offset=1, limit=100)` (`start_line` /
  `num_lines` accepted too), `provenance(path)`, `search(query, k=5)`. A tool's error is a result with
  `isError` and the workspace's error text (`ERROR [code]: ...`), never a protocol error.
- Resources: `workspace://README.md` (the README) and `workspace://starting-context` (README, root
  listing and root-level files: what the answerer reads before its question).
- Prompt: `answer_question(question)`, the answerer's instructions and first prompt.

Tools are `async` functions that do their short, in-memory work on the event loop without awaiting: the
requests of concurrent HTTP clients interleave between calls, and no two threads share the workspace. HTTP
binds to the
address given (`127.0.0.1` by default; the SDK then refuses requests whose Host or Origin is not a
loopback name, against DNS rebinding)."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent, ToolAnnotations

from librarian_jax.serve.tools import ServedWorkspace, ToolOutput

README_URI = "workspace://README.md"
CONTEXT_URI = "workspace://starting-context"
HTTP_PATH = "/mcp"

_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                             open_world_hint=False)


def _result(out: ToolOutput) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=out.text)],
        structured_content=out.data if out.ok else None,
        is_error=not out.ok,
    )


def _instructions(served: ServedWorkspace) -> str:
    st = served.ws.stats()
    stale = f" {len(served.loaded.stale)} raw documents changed since it was built (stale)." if (
        served.loaded.stale) else ""
    return (
        f"A Librarian workspace (read-only): {st['raw_docs']} raw documents under raw_docs/ and "
        f"{st['active_files']} synthetic files in {st['active_dirs']} synthetic directories "
        f"written from them, each naming its sources.{stale} "
        f"Start with the resource {CONTEXT_URI} (or list_files('.')), read with read_file (at most 100 lines "
        f"and 16,000 characters a call), find passages with search, and trace any file to the raw documents "
        f"it rests on with provenance."
    )


def make_server(served: ServedWorkspace, name: str = "librarian-workspace") -> MCPServer[Any]:
    """An `MCPServer` serving `served` (see the module docstring)."""
    mcp: MCPServer[Any] = MCPServer(name, instructions=_instructions(served), log_level="WARNING")

    @mcp.tool(annotations=_READ_ONLY)
    async def list_files(path: str = ".", start: int = 1) -> CallToolResult:
        """List a directory of the workspace ('.' is the root): one line per entry with its kind, title and
        size. A long listing says which `start` entry to continue from."""
        return _result(served.list_files(path, start))

    @mcp.tool(annotations=_READ_ONLY)
    async def read_file(
        path: str,
        offset: int = 1,
        limit: int = 100,
        start_line: int | None = None,
        num_lines: int | None = None,
    ) -> CallToolResult:
        """Read numbered lines of a file: from line `offset` (1-based), at most `limit` lines (<= 100) and
        16,000 characters. The footer says whether the file ends or which line to continue from
        (`start_line` / `num_lines` are the same as `offset` / `limit`, the names the footer uses)."""
        return _result(
            served.read_file(
                path,
                start_line if start_line is not None else offset,
                num_lines if num_lines is not None else limit,
            )
        )

    @mcp.tool(annotations=_READ_ONLY)
    async def provenance(path: str) -> CallToolResult:
        """The raw documents a file rests on (followed through its synthetic sources), with content hashes,
        and whether each changed since the workspace was built (`stale`)."""
        return _result(served.provenance(path))

    @mcp.tool(annotations=_READ_ONLY)
    async def search(query: str, k: int = 5) -> CallToolResult:
        """BM25 over the synthetic files and raw documents: the `k` best passages (k <= 20), each with its
        path, line range and a snippet; read on with read_file(path, offset)."""
        return _result(served.search(query, k))

    @mcp.resource(README_URI, name="README", mime_type="text/markdown",
                  description="The workspace's generated index: what is where and how to read it.")
    def readme() -> str:
        return served.readme()

    @mcp.resource(CONTEXT_URI, name="starting-context", mime_type="text/plain",
                  description="What the answerer reads before its question: the README, the root listing "
                  "and the root-level files.")
    def context() -> str:
        return served.starting_context()

    @mcp.prompt(name="answer_question", description="The answerer's instructions and starting context for "
                "a question about this workspace.")
    def answer_question(question: str) -> str:
        return served.answer_prompt(question)

    return mcp


def run(served: ServedWorkspace, http: tuple[str, int] | None = None) -> None:
    """Serve until the client closes stdin (stdio) or the process is stopped (HTTP on `http`)."""
    mcp = make_server(served)
    if http is None:
        mcp.run()
    else:
        mcp.run("streamable-http", host=http[0], port=http[1], streamable_http_path=HTTP_PATH)
