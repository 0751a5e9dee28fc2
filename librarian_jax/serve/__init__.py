"""librarian_jax.serve: an exported workspace served to any agent over the Model Context Protocol.

`python -m librarian_jax.serve WORKSPACE_DIR` (stdio) or `... --http=127.0.0.1:PORT` (streamable HTTP at
`/mcp`) serves a directory that `build` exported (or an eval report's `workspaces/<method>/<corpus>/`),
read-only, with the answerer's own tools: `list_files`, `read_file`, plus `provenance` and `search`; the
README and the answerer's starting context as resources, its instructions as the prompt `answer_question`.

Layers: beside `eval/`, above `workspace/` and `agents/`. `tools` holds what the tools do (through the
workspace's and the agents' protocol's one implementation), `search` the BM25 index, `server` the MCP
wiring, `__main__` the command. The directory is read once at start (`workspace.load_export`): a directory
that is not an export gets a one-line error, raw documents that changed since the export a warning naming
them (and `stale` in `provenance`); nothing is written, and no path a client gives reaches the disk."""

from librarian_jax.serve.server import CONTEXT_URI, HTTP_PATH, README_URI, make_server, run
from librarian_jax.serve.tools import ServedWorkspace, ToolOutput

__all__ = ["CONTEXT_URI", "HTTP_PATH", "README_URI", "ServedWorkspace", "ToolOutput", "make_server", "run"]
