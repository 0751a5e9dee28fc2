"""`python -m librarian_jax.serve`: a real server process driven by the official SDK's client, over stdio and
over streamable HTTP on 127.0.0.1, on a small export made here (a synthetic corpus, synthetic files written
through the workspace's own actions). Every tool, the errors, escapes refused, 16 concurrent HTTP clients,
the start-up errors and the stale warning, and a served directory whose bytes do not change."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp.client import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from librarian_jax.data import generate_world
from librarian_jax.serve.__main__ import parse_http
from librarian_jax.workspace import Workspace

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
TIMEOUT_S = 90  # one client session, start-up included


def _world_workspace() -> Workspace:
    task = generate_world(3, 1, docs_per_task=6, min_words=40, max_words=80, questions_per_task=2)[0]
    w = Workspace.from_documents(list(task.documents))
    raw = [d.path for d in w.raw_docs]
    assert w.create_file("People and employers", raw[:2], "Who works where.\nSee the raw documents.").ok
    assert w.create_file("Places", raw[2:4], "Where things are.").ok
    assert w.merge_files("Everything", ["cluster_0001", "cluster_0002"], "People and places.").ok
    assert w.create_file("Scratch", [raw[5]], "to be deleted").ok
    assert w.delete(["cluster_0003"], "redundant", turn=2).ok
    return w


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Workspace, Path]:
    """The workspace and its export, with a symlink planted inside pointing out of it."""
    w = _world_workspace()
    out = tmp_path_factory.mktemp("serve") / "ws"
    assert w.export(out).ok
    outside = out.parent / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET outside the workspace\n")
    os.symlink(outside, out / "planted")  # a link planted inside, pointing out
    os.symlink(outside / "secret.txt", out / "planted.txt")
    return w, out


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root` (links not followed): a file's sha256, a link's target, a directory."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _text(result: Any) -> str:
    assert len(result.content) == 1
    return result.content[0].text


@contextlib.asynccontextmanager
async def stdio_session(directory: Path, errlog: Any = None) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "librarian_jax.serve", str(directory)], cwd=str(ROOT), env=ENV
    )
    async with stdio_client(params, errlog=errlog or sys.stderr) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


async def check_every_tool(s: ClientSession, w: Workspace) -> None:
    """Every tool, resource and prompt, each answer compared with the workspace's own."""
    tools = {t.name: t for t in (await s.list_tools()).tools}
    assert set(tools) == {"list_files", "read_file", "provenance", "search"}
    assert all(t.annotations and t.annotations.read_only_hint for t in tools.values())
    # list_files and read_file: the workspace's own rendering, byte for byte
    r = await s.call_tool("list_files", {})
    assert not r.is_error and _text(r) == w.list_dir(".").render()
    r = await s.call_tool("list_files", {"path": "raw_docs", "start": 2})
    assert _text(r) == w.list_dir("raw_docs", start=2).render()
    for path in w.files():
        r = await s.call_tool("read_file", {"path": path})
        assert not r.is_error and _text(r) == w.read_file(path).render(), path
    doc = w.raw_docs[0]
    r = await s.call_tool("read_file", {"path": doc.path, "offset": 3, "limit": 2})
    assert _text(r) == w.read_file(doc.path, start_line=3, num_lines=2).render()
    assert "SHA256: " + doc.sha in w.read_file(doc.path).text  # the header, rendered as the answerer sees it
    r = await s.call_tool("read_file", {"path": doc.path, "start_line": 2, "num_lines": 1})
    assert _text(r) == w.read_file(doc.path, start_line=2, num_lines=1).render()
    # provenance: transitively, with hashes and stale flags
    r = await s.call_tool("provenance", {"path": "merge_0001__everything"})
    assert not r.is_error and "rests on 4 raw documents" in _text(r) and "stale: false" in _text(r)
    data = r.structured_content
    assert data["stale"] is False and [x["path"] for x in data["raw"]] == [d.path for d in w.raw_docs[:4]]
    for x, d in zip(data["raw"], w.raw_docs[:4], strict=True):
        assert x["sha256_16"] == d.sha and x["stale"] is False
        assert x["sha256"] == hashlib.sha256(d.text.encode()).hexdigest()
    assert sorted(data["synthetic"]) == sorted(
        ["merge_0001__everything/cluster_0001__people_and_employers.txt",
         "merge_0001__everything/cluster_0002__places.txt"]
    )
    # search: BM25 over the synthetic files and raw documents, each hit a path and lines to read
    title_words = w.raw_docs[4].title
    r = await s.call_tool("search", {"query": title_words, "k": 3})
    hits = r.structured_content["hits"]
    assert not r.is_error and 1 <= len(hits) <= 3 and hits[0]["path"] == w.raw_docs[4].path
    assert hits[0]["start_line"] == 1 and f"offset={hits[0]['start_line']}" in _text(r)
    r = await s.call_tool("search", {"query": "Who works where"})
    assert r.structured_content["hits"][0]["path"].endswith("cluster_0001__people_and_employers.txt")
    r = await s.call_tool("search", {"query": "the of and"})  # stopwords only
    assert not r.is_error and r.structured_content["hits"] == [] and "no passage matches" in _text(r)
    # resources and the prompt
    res = {str(x.uri): x for x in (await s.list_resources()).resources}
    assert set(res) == {"workspace://README.md", "workspace://starting-context"}
    readme = (await s.read_resource("workspace://README.md")).contents[0].text
    assert readme == w.readme_text()
    ctx = (await s.read_resource("workspace://starting-context")).contents[0].text
    assert ctx.startswith(readme) and w.list_dir(".").render() in ctx
    prompt = await s.get_prompt("answer_question", {"question": "Where is the lab?"})
    text = prompt.messages[0].content.text
    assert "You answer a question using a workspace" in text and text.rstrip().endswith("Where is the lab?")


async def check_errors_and_escapes(s: ClientSession, w: Workspace) -> None:
    """The answerer's errors, word for word; no path leaves the workspace."""

    async def err(tool: str, args: dict[str, Any]) -> str:
        r = await s.call_tool(tool, args)
        assert r.is_error, (tool, args, _text(r))
        return _text(r)

    assert await err("read_file", {"path": "no_such_file.txt"}) == w.read_file("no_such_file.txt").render()
    assert (await err("read_file", {"path": "no_such_file.txt"})).startswith("ERROR [path_not_found]")
    assert await err("read_file", {"path": "raw_docs"}) == w.read_file("raw_docs").render()
    assert (await err("read_file", {"path": "raw_docs"})).startswith("ERROR [is_a_directory]")
    assert (await err("read_file", {"path": "merge_0001__everything"})).startswith("ERROR [is_a_directory]")
    assert (await err("list_files", {"path": "README.md"})).startswith("ERROR [not_a_directory]")
    # the caps: the protocol's own message for a model asking more than 100 lines
    assert await err("read_file", {"path": "README.md", "limit": 101}) == (
        "ERROR [invalid_argument_type]: read_file: argument 'num_lines' = 101 is above 100; signature: "
        "read_file(path: str, start_line: int = 1, num_lines: int = 100)"
    )
    assert (await err("read_file", {"path": "README.md", "offset": 0})).startswith(
        "ERROR [invalid_argument_type]: read_file: argument 'start_line' = 0 is below 1")
    assert (await err("search", {"query": "x", "k": 21})).startswith("ERROR [invalid_argument_type]")
    assert (await err("provenance", {"path": "raw_docs"})).startswith("ERROR [is_a_directory]")
    # escapes: '..', absolute, home, URLs, planted symlinks (never on disk: the served state is in memory)
    for tool in ("read_file", "list_files", "provenance"):
        for path in ("../ws/README.md", "raw_docs/../../outside/secret.txt", "/etc/passwd", "~/x",
                     "~root", "file:///etc/passwd", "C:/Windows"):
            assert (await err(tool, {"path": path})).startswith("ERROR [path_escape]"), (tool, path)
        for path in ("planted/secret.txt", "planted", "planted.txt"):
            assert (await err(tool, {"path": path})).startswith("ERROR [path_not_found]"), (tool, path)
    for args in ({"query": "SECRET outside"}, {"query": "planted secret"}):
        r = await s.call_tool("search", args)
        hits = r.structured_content["hits"]
        assert "outside the workspace" not in _text(r) and all("planted" not in h["path"] for h in hits)


def test_stdio_every_tool_errors_escapes_and_nothing_written(world: tuple[Workspace, Path]) -> None:
    w, out = world
    before = tree_digest(out)

    async def main() -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with stdio_session(out) as s:
                await check_every_tool(s, w)
                await check_errors_and_escapes(s, w)

    anyio.run(main)
    assert tree_digest(out) == before  # the server wrote nothing, changed nothing, followed no link


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_listening(proc: subprocess.Popen[bytes], port: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise AssertionError(f"the server did not listen on 127.0.0.1:{port} within {deadline_s} s")


def test_http_16_concurrent_clients(world: tuple[Workspace, Path], tmp_path: Path) -> None:
    w, out = world
    before = tree_digest(out)
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "librarian_jax.serve", str(out), f"--http={port}"],
        cwd=ROOT, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    expected = {p: w.read_file(p).render() for p in w.files()}
    finished: list[float] = []

    async def client(i: int) -> None:
        async with streamable_http_client(url) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            paths = list(expected)
            for j in range(4):
                path = paths[(i + j) % len(paths)]
                r = await s.call_tool("read_file", {"path": path})
                assert _text(r) == expected[path]
            r = await s.call_tool("list_files", {"path": "merge_0001__everything"})
            assert _text(r) == w.list_dir("merge_0001__everything").render()
            r = await s.call_tool("search", {"query": w.raw_docs[i % 6].title, "k": 2})
            assert r.structured_content["hits"][0]["path"] == w.raw_docs[i % 6].path
            r = await s.call_tool("read_file", {"path": "../outside/secret.txt"})
            assert r.is_error and _text(r).startswith("ERROR [path_escape]")
        finished.append(time.monotonic())

    async def main() -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with streamable_http_client(url) as (read, write), ClientSession(read, write) as s:
                await s.initialize()
                await check_every_tool(s, w)
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(client, i)

    try:
        _wait_listening(proc, port, 60)
        t0 = time.monotonic()
        anyio.run(main)
        print(f"16 concurrent HTTP clients: {max(finished) - t0:.2f} s")  # noqa: T201
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert len(finished) == 16
    assert f"on http://127.0.0.1:{port}/mcp" in (tmp_path / "server.log").read_text()
    assert tree_digest(out) == before


def _serve_fails(directory: Path) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "librarian_jax.serve", str(directory)], cwd=ROOT, env={**os.environ, **ENV},
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_start_errors_and_stale_documents(world: tuple[Workspace, Path], tmp_path: Path) -> None:
    w, out = world
    # not a workspace, a symlink planted where a raw document was: one line, exit code 2
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("just a folder")
    line = _serve_fails(tmp_path / "notes")
    assert line.startswith("error: ") and "is not an exported workspace: it has no manifest.json" in line
    bad = tmp_path / "linked"
    shutil.copytree(out, bad, symlinks=True)
    doc = w.raw_docs[2]
    os.remove(bad / doc.path)
    os.symlink(out.parent / "outside" / "secret.txt", bad / doc.path)
    line = _serve_fails(bad)
    assert f"{doc.path} is a symlink; symlinks are never followed" in line
    # a changed raw document: a warning naming it, served as it is now, `stale` in provenance
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered, symlinks=True)
    (tampered / doc.path).write_text(doc.text.replace(doc.text.split()[0], "CHANGED", 1))
    errlog = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115 - closed below

    async def main() -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with stdio_session(tampered, errlog) as s:
                r = await s.call_tool("provenance", {"path": "merge_0001__everything"})
                data = r.structured_content
                assert data["stale"] is True and "stale: true" in _text(r)
                assert [x["path"] for x in data["raw"] if x["stale"]] == [doc.path]
                assert "[stale: changed since the workspace was built]" in _text(r)
                r = await s.call_tool("provenance", {"path": w.raw_docs[0].path})
                assert r.structured_content["stale"] is False
                r = await s.call_tool("read_file", {"path": doc.path})
                assert _text(r).startswith(f"[stale: {doc.path} changed since this workspace was built")
                assert "CHANGED" in _text(r) and f"SHA256: {doc.sha}" in _text(r)

    try:
        anyio.run(main)
    finally:
        errlog.close()
    log = (tmp_path / "stderr.txt").read_text()
    assert "1 raw documents changed since the workspace was built" in log and doc.path in log


def test_parse_http_binds_loopback_unless_told() -> None:
    assert parse_http("8123") == ("127.0.0.1", 8123)
    assert parse_http("127.0.0.1:9") == ("127.0.0.1", 9)
    assert parse_http("[::1]:80") == ("::1", 80)
    assert parse_http("0.0.0.0:8000") == ("0.0.0.0", 8000)
    for bad in ("", "x", "127.0.0.1:0", "host:70000"):
        with pytest.raises(ValueError, match="expected \\[HOST:\\]PORT"):
            parse_http(bad)


def test_manifest_describes_every_raw_document(world: tuple[Workspace, Path]) -> None:
    """The header fields agents see are in manifest.json; raw_docs/ holds the documents byte for byte."""
    w, out = world
    m = json.loads((out / "manifest.json").read_text())
    for d, e in zip(w.raw_docs, m["raw_docs"], strict=True):
        assert (out / d.path).read_bytes() == d.text.encode()
        assert (e["title"], e["doc_id"], e["url"], e["sha256_16"]) == (d.title, d.doc_id, d.url, d.sha)


_GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
    st.text(max_size=60),
    st.sampled_from(["..", "../outside/secret.txt", "/etc/passwd", "~", "planted", "planted.txt",
                     "raw_docs/../../outside", "\x00", "README.md", "raw_docs", "."]),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def served(world: tuple[Workspace, Path]) -> Any:
    from librarian_jax.serve.tools import ServedWorkspace
    from librarian_jax.workspace import load_export

    return ServedWorkspace(load_export(world[1]))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(tool=st.sampled_from(["list_files", "read_file", "provenance", "search"]), a=_GARBAGE, b=_GARBAGE)
def test_garbage_tool_arguments_answer_an_error_never_crash_or_escape(served, tool, a, b) -> None:
    """Any JSON-ish arguments an agent sends reach the served tools (in process, the server's own
    `ServedWorkspace`): each call returns a ToolOutput, an error when the arguments are bad, and no answer
    ever shows the file planted outside the workspace."""
    from librarian_jax.serve.tools import ToolOutput

    out = {"list_files": lambda: served.list_files(a, b), "read_file": lambda: served.read_file(a, b),
           "provenance": lambda: served.provenance(a), "search": lambda: served.search(a, b)}[tool]()
    assert isinstance(out, ToolOutput) and isinstance(out.text, str) and out.text
    assert out.ok or out.text.startswith("ERROR [")
    assert "SECRET outside the workspace" not in out.text

