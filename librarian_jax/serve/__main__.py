"""`python -m librarian_jax.serve WORKSPACE_DIR [--http=[HOST:]PORT] [--context_chars=N]`.

Serves an exported workspace over MCP: stdio by default (for a client that starts the server itself),
streamable HTTP at `http://HOST:PORT/mcp` with `--http` (HOST defaults to 127.0.0.1; any other address is
served only when named, with a warning). A directory that is not an exported workspace, or whose files
cannot be read safely, ends the command with one line on stderr and exit code 2; raw documents changed
since the export are named in a warning and served as they are now, flagged `stale` by `provenance`.
Logs go to stderr (stdout is the protocol's channel under stdio)."""

from __future__ import annotations

import ipaddress
import sys

from absl import app, flags, logging

from librarian_jax.serve import server
from librarian_jax.serve.tools import CONTEXT_CHARS, ServedWorkspace
from librarian_jax.workspace import ExportError, load_export

_HTTP = flags.DEFINE_string(
    "http", None, "serve streamable HTTP on [HOST:]PORT (HOST 127.0.0.1 unless given) instead of stdio"
)
_CONTEXT_CHARS = flags.DEFINE_integer(
    "context_chars", CONTEXT_CHARS, "characters of root-level files in the starting context", lower_bound=0
)


def parse_http(text: str) -> tuple[str, int]:
    """`[HOST:]PORT` (IPv6 hosts in brackets) as (host, port); ValueError with a one-line message."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--http={text!r}: expected [HOST:]PORT with PORT in 1..65535")
    return host or "127.0.0.1", int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        print("usage: python -m librarian_jax.serve WORKSPACE_DIR [--http=[HOST:]PORT]",  # noqa: T201
              file=sys.stderr)
        sys.exit(2)
    try:
        http = parse_http(_HTTP.value) if _HTTP.value else None
        loaded = load_export(argv[1])
    except (ValueError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)  # noqa: T201 - the CLI's answer
        sys.exit(2)
    if loaded.stale:
        logging.warning(
            "%d raw documents changed since the workspace was built (served as they are now, flagged stale "
            "by provenance): %s", len(loaded.stale), ", ".join(sorted(loaded.stale))
        )
    if not loaded.readme_matches:
        logging.warning("README.md differs from the index the workspace generates; serving the generated one")
    served = ServedWorkspace(loaded, _CONTEXT_CHARS.value)
    st = loaded.workspace.stats()
    where = "stdio" if http is None else f"http://{http[0]}:{http[1]}{server.HTTP_PATH}"
    if http is not None and not _is_loopback(http[0]):
        logging.warning("serving on %s, which is not a loopback address: anyone who reaches it can read "
                        "the workspace", http[0])
    logging.info("serving %s (%d raw documents, %d synthetic files, %d synthetic directories) on %s",
                 loaded.root, st["raw_docs"], st["active_files"], st["active_dirs"], where)
    server.run(served, http)


if __name__ == "__main__":
    app.run(main)
