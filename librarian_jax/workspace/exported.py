"""Reading an exported workspace directory back (`load_export`): the `Workspace` it was exported from, so that
every reader of it (the MCP server, `librarian_jax.serve`) answers with the workspace's own `list_dir`,
`read_file` and `provenance`, and which raw documents changed since the export (stale).

What is read, and what is refused (`ExportError`, one line naming the file):

- `manifest.json` (export format `export.EXPORT_FORMAT`): missing, not JSON, another format, an export of the
  older format (raw documents with a header), or fields of the wrong type.
- Each raw document `raw_docs/<name>`: its bytes, compared with the manifest's `sha256`. Missing: refused.
  Changed: loaded as it is now (UTF-8, undecodable bytes as U+FFFD), listed in `LoadedExport.stale`; the
  workspace keeps the recorded hash (`sha256_16`), which is what the synthetic files' headers cite.
- Each synthetic file: its body is the text after the header's `---` line (a body edited by hand is
  served as edited); the header must be exactly what the manifest's structure renders, else refused.
- `retired_raw_docs` (an update's): documents that synthetic files cite but that have no file (see
  `export`); the stale files resting on them are recomputed (`Workspace.stale_nodes`).
- Every path is checked before it is opened: a plain relative path inside the directory, no component a
  symlink (`lstat`), a regular file, opened with `O_NOFOLLOW`, at most `MAX_FILE_BYTES`. Nothing is written.

The loaded state passes `check_invariants` (except, for a stale document, that its text matches its hash).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R
from librarian_jax.workspace.export import EXPORT_FORMAT
from librarian_jax.workspace.nodes import (
    DIRECTORY,
    FILE,
    FORMAT,
    MANIFEST,
    RAW_DIR,
    README,
    RawDoc,
    SyntheticNode,
)
from librarian_jax.workspace.serialisation import SnapshotError, _field, _int_field, _strings
from librarian_jax.workspace.workspace import Workspace

MAX_FILE_BYTES = 64 << 20  # one file of an export read at start; a bigger one is refused


class ExportError(ValueError):
    """A directory that is not a loadable exported workspace; the message is one line naming the file."""


@dataclasses.dataclass(frozen=True)
class StaleDoc:
    """A raw document whose file no longer matches the hash recorded at export."""

    path: str
    doc_id: str
    recorded_sha256: str
    current_sha256: str


@dataclasses.dataclass(frozen=True)
class LoadedExport:
    """An exported directory read back: `workspace` (read it with its own tools), the `manifest`, the
    full `sha256` recorded per raw document path, and the `stale` raw documents by path."""

    root: Path
    workspace: Workspace
    manifest: dict[str, Any]
    sha256: dict[str, str]
    stale: dict[str, StaleDoc]
    readme_matches: bool


def read_inside(root: Path, rel: object, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file `rel` (a plain relative path) under `root`; `ExportError` if `rel` is
    not a plain path inside `root`, if any component is a symlink, if it is not a regular file, or if it is
    larger than `max_bytes`. Never follows a symlink (components checked with `lstat`, opened O_NOFOLLOW)."""
    norm = P.normalize(rel)
    if isinstance(norm, P.PathError):
        raise ExportError(f"{root}: refused path {R.short_repr(rel, 120)}: {norm.message}")
    parts = norm.split("/") if norm else []
    if not parts or norm != rel or not all(P.is_safe_name(p) for p in parts):
        raise ExportError(f"{root}: refused path {R.short_repr(rel, 120)}: not a plain relative path")
    cur = root
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise ExportError(f"{root}: {norm} is missing") from None
        if stat.S_ISLNK(st.st_mode):
            raise ExportError(f"{root}: {P.join(*parts[: i + 1])} is a symlink; symlinks are never followed")
        want_dir = i < len(parts) - 1
        if want_dir and not stat.S_ISDIR(st.st_mode):
            raise ExportError(f"{root}: {P.join(*parts[: i + 1])} is not a directory")
        if not want_dir and not stat.S_ISREG(st.st_mode):
            raise ExportError(f"{root}: {norm} is not a regular file")
        if not want_dir and st.st_size > max_bytes:
            raise ExportError(f"{root}: {norm} is {st.st_size} bytes; the limit is {max_bytes}")
    fd = os.open(cur, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ExportError(f"{root}: {norm} grew beyond {max_bytes} bytes while being read")
    return data


def _decode(root: Path, rel: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExportError(f"{root}: {rel} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _manifest(root: Path) -> dict[str, Any]:
    if not os.path.lexists(root / MANIFEST):
        raise ExportError(
            f"{root} is not an exported workspace: it has no {MANIFEST} (export one with the build command, "
            f"or use an eval report's workspaces/<method>/<corpus>/)"
        )
    text = _decode(root, MANIFEST, read_inside(root, MANIFEST))
    try:
        m = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ExportError(f"{root}: {MANIFEST} is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ExportError(f"{root}: {MANIFEST} is not a workspace manifest (format {FORMAT!r} expected)")
    if m.get("export_format") != EXPORT_FORMAT:
        if "export_format" not in m:
            raise ExportError(
                f"{root} was exported by an older librarian_jax whose {RAW_DIR}/ files carry a header; "
                f"export it again (build, or eval with export_workspaces)"
            )
        raise ExportError(
            f"{root}: {MANIFEST} has export format {R.short_repr(m['export_format'])}, this version reads "
            f"{EXPORT_FORMAT!r}"
        )
    return m


def load_export(directory: str | os.PathLike[str]) -> LoadedExport:
    """Read an exported workspace directory back (see the module docstring); `ExportError` (one line) when
    it is not one. A directory given as a symlink is followed (the user named it); nothing inside is."""
    root = Path(os.path.realpath(directory))
    if not root.is_dir():
        raise ExportError(f"{directory} is not a directory")
    m = _manifest(root)
    try:
        return _load(root, m)
    except SnapshotError as e:
        raise ExportError(f"{root}: {MANIFEST}: {str(e).splitlines()[0]}") from None


def _refs(x: dict[str, Any], key: str, table: dict[str, str], where: str) -> tuple[str, ...]:
    """The ids (raw handles, node ids) of the paths `x[key]` lists, through `table` (path -> id)."""
    out = []
    for p in _strings(x, key, where):
        if p not in table:
            raise SnapshotError(f"field '{where}.{key}' names {R.short_repr(p)}, a path it lists nowhere",
                                f"{where}.{key}")
        out.append(table[p])
    return tuple(out)


def _raw_entry_path(x: Any, where: str) -> tuple[str, str]:
    """(path, file name) of a manifest's raw-document entry `x` (current or retired): an object whose `path`
    is `raw_docs/<safe name>`; anything else a SnapshotError naming `where`."""
    if not isinstance(x, dict):
        raise SnapshotError(f"field {where!r} must be an object", where)
    path = _field(x, "path", str, where)
    filename = path.removeprefix(RAW_DIR + "/")
    if path != f"{RAW_DIR}/{filename}" or not P.is_safe_name(filename):
        raise SnapshotError(f"field '{where}.path' must be {RAW_DIR}/<name>, got {R.short_repr(path)}", where)
    return path, filename


def _load(root: Path, m: dict[str, Any]) -> LoadedExport:
    raw: list[RawDoc] = []
    sha256: dict[str, str] = {}
    stale: dict[str, StaleDoc] = {}
    for i, x in enumerate(_field(m, "raw_docs", list, "")):
        where = f"raw_docs[{i}]"
        path, filename = _raw_entry_path(x, where)
        want = _field(x, "sha256", str, where)
        data = read_inside(root, path)
        got = hashlib.sha256(data).hexdigest()
        doc_id = _field(x, "doc_id", str, where)
        if got == want:
            text = _decode(root, path, data)
        else:
            text = data.decode("utf-8", errors="replace")
            stale[path] = StaleDoc(path, doc_id, want, got)
        sha256[path] = want
        raw.append(
            RawDoc(
                _field(x, "handle", str, where),
                doc_id,
                _field(x, "title", str, where),
                _field(x, "url", str, where),
                text,
                _field(x, "sha256_16", str, where),
                filename,
            )
        )
    retired: list[RawDoc] = []
    for i, x in enumerate(_field(m, "retired_raw_docs", list, "") if "retired_raw_docs" in m else []):
        where = f"retired_raw_docs[{i}]"
        _, filename = _raw_entry_path(x, where)
        retired.append(RawDoc(
            _field(x, "handle", str, where), _field(x, "doc_id", str, where), _field(x, "title", str, where),
            _field(x, "url", str, where), "", _field(x, "sha256_16", str, where), filename,
            {"retired": _field(x, "retired", str, where)},
        ))
    handle_of = {d.path: d.handle for d in (*retired, *raw)}
    entries = _field(m, "synthetic", list, "")
    id_of: dict[str, str] = {}
    for i, x in enumerate(entries):
        if not isinstance(x, dict):
            raise SnapshotError(f"field 'synthetic[{i}]' must be an object", f"synthetic[{i}]")
        id_of[_field(x, "path", str, f"synthetic[{i}]")] = _field(x, "node_id", str, f"synthetic[{i}]")
    nodes: dict[str, SyntheticNode] = {}
    texts: dict[str, str] = {}
    for i, x in enumerate(entries):
        where = f"synthetic[{i}]"
        path = x["path"]
        text = texts[path] = _decode(root, path, read_inside(root, path))
        _, sep, body = text.partition("\n" + R.HEADER_END + "\n")
        if not sep:
            raise ExportError(f"{root}: {path} has no header (no '{R.HEADER_END}' line)")
        deleted = x.get("deleted_turn")
        node = SyntheticNode(
            _field(x, "node_id", str, where),
            _field(x, "kind", str, where),
            _field(x, "title", str, where),
            _field(x, "slug", str, where),
            body,
            _field(x, "parent", (str, type(None)), where),
            _refs(x, "raw_sources", handle_of, where),
            _refs(x, "synthetic_sources", id_of, where),
            _int_field(x, "created_turn", where),
            _field(x, "active", bool, where),
            None if deleted is None else _int_field(x, "deleted_turn", where),
            _field(x, "delete_reason", str, where),
        )
        if node.node_id in nodes:
            raise SnapshotError(f"node id {node.node_id!r} appears twice", f"{where}.node_id")
        nodes[node.node_id] = node
    counters = _field(m, "next_ids", dict, "")
    next_ids = {
        FILE: _int_field(counters, "cluster", "next_ids", low=1),
        DIRECTORY: _int_field(counters, "merge", "next_ids", low=1),
    }
    ws = Workspace(raw, nodes, next_ids, retired)
    expected = {f"raw {d.handle}: text does not match sha {d.sha}" for d in raw if d.path in stale}
    errs = [e for e in ws.check_invariants() if e not in expected]
    if errs:
        raise ExportError(f"{root}: {MANIFEST} describes an unsound workspace: {'; '.join(errs[:3])}")
    for x in entries:  # a header must say exactly what the manifest's structure renders
        node = nodes[x["node_id"]]
        if ws.file_path_of(node.node_id) != x["path"]:
            raise ExportError(f"{root}: {x['path']} is not where {node.node_id} belongs ({MANIFEST})")
        if texts[x["path"]] != ws.render_node(node):
            raise ExportError(f"{root}: the header of {x['path']} does not match {MANIFEST}")
    readme = _decode(root, README, read_inside(root, README))
    return LoadedExport(root, ws, m, sha256, stale, readme == ws.readme_text())
