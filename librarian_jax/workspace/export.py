"""Export: every readable file of a workspace rendered as agents read it (`files`), the files as written to
disk (`disk_files`: raw documents byte for byte, synthetic files with their headers), a manifest of the raw
documents and synthetic nodes with their provenance, and writing both to disk (`export`, `write_tree`)
without ever leaving the target directory or touching a symlink. `exported.load_export` reads such a
directory back.

Export format `EXPORT_FORMAT` (manifest key `export_format`):

- `raw_docs/<name>.txt` holds the document's text exactly (UTF-8), so a user, the MCP server and an update
  can compare it with the original by hash. The header agents see when they read it (TITLE, KIND, PATH,
  DOC_ID, URL, SHA256) is not in the file: its fields are the manifest's `raw_docs` entries (`title`, `kind`,
  `path`, `doc_id`, `url`, `sha256_16`), with `sha256` (all 64 hex digits of the file's bytes) and `bytes`.
- Synthetic files (and directory summaries, and `history/`) are written as agents read them: header, `---`,
  body. The manifest's `synthetic` entries hold each node's structure (`node_id`, `kind`, `title`, `slug`,
  `parent`, sources by path, turns, status) and its transitive raw provenance with hashes.
- `README.md` is the generated index; `next_ids` the id counters.
- After an incremental update (`workspace.update`, `build --config.update_from=OLD`): `retired_raw_docs` lists
  the documents the update took out (removed, or an old version: `retired` "removed" / "modified") that
  synthetic files still cite (they have no file), and `stale` the synthetic files resting on one (path,
  node_id, `active` false for a deleted one under history/, doc_ids changed / removed). Every other synthetic
  file's `raw_provenance` names files of `raw_docs/` with their current hash."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from absl import logging

from librarian_jax.workspace import paths as P
from librarian_jax.workspace.index import E_FILE, E_RAW, E_README, E_SUMMARY
from librarian_jax.workspace.nodes import DIRECTORY, FILE, FORMAT, MANIFEST, RAW_KIND
from librarian_jax.workspace.results import INVALID_ARGUMENT, INVALID_PATH, PATH_ESCAPE, ActionResult
from librarian_jax.workspace.views import Views

EXPORT_FORMAT = "librarian_jax.export/2"  # 1 (no key): raw_docs/ files carried the 7-line header

_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)


def _check(root: Path, rel: str) -> ActionResult | None:
    """None when `rel` is a safe relative file path under `root` whose existing components are no symlinks."""
    norm = P.normalize(rel)
    if isinstance(norm, P.PathError):
        return ActionResult.error(norm.code, f"export refused file {rel!r}: {norm.message}")
    parts = norm.split("/") if norm else []
    if not parts or norm != rel or not all(P.is_safe_name(p) for p in parts):
        return ActionResult.error(
            PATH_ESCAPE, f"export refused file {rel!r}: not a plain relative path inside the export directory"
        )
    cur = root
    for i, part in enumerate(parts):
        cur = cur / part
        if cur.is_symlink():
            return ActionResult.error(
                PATH_ESCAPE, f"export refused file {rel!r}: {cur} is a symlink; symlinks are never followed"
            )
        if cur.exists() and (cur.is_dir() != (i < len(parts) - 1)):
            kind = "a directory" if cur.is_dir() else "a file"
            return ActionResult.error(
                INVALID_PATH, f"export refused file {rel!r}: {cur} already exists as {kind}"
            )
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(cur)]) != real_root:
        return ActionResult.error(PATH_ESCAPE, f"export refused file {rel!r}: it resolves outside {root}")
    return None


def write_tree(root: Path, files: Mapping[str, str]) -> ActionResult:
    """Write `files` (relative path -> text, as UTF-8 bytes exactly: no newline translation) under `root`,
    creating directories as needed.

    Every path is checked before anything is written; on any refusal nothing is written. Existing files of the
    same names are overwritten; other files in `root` are left alone."""
    if root.is_symlink():
        return ActionResult.error(
            PATH_ESCAPE, f"export directory {root} is a symlink; give the real directory"
        )
    if root.exists() and not root.is_dir():
        return ActionResult.error(INVALID_ARGUMENT, f"export directory {root} exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    for rel in files:
        err = _check(root, rel)
        if err is not None:
            return err
    n_chars = 0
    for rel, text in files.items():
        target = root
        parts = rel.split("/")
        for part in parts[:-1]:
            target = target / part
            if not target.exists():
                target.mkdir()
            elif target.is_symlink() or not target.is_dir():  # appeared after the check
                return ActionResult.error(PATH_ESCAPE, f"export stopped at {target}: not a plain directory")
        fd = os.open(target / parts[-1], _OPEN_FLAGS, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        n_chars += len(text)
    logging.info("workspace: exported %d files (%d chars) to %s", len(files), n_chars, root)
    return ActionResult.success(
        f"exported {len(files)} files to {root}", directory=str(root), files=len(files), chars=n_chars
    )


class Export(Views):
    """`files()`, `disk_files()`, `manifest()`, `export(directory)`."""

    def files(self) -> dict[str, str]:
        """Every readable file of the workspace (README, raw documents, synthetic files and summaries,
        history) by path, rendered exactly as read_file shows it (without line numbers): the fixed files in
        corpus order, then the synthetic ones by path."""
        idx = self._index
        out = {p: self._text_of(e) for p, e in idx.raw.entries.items() if e.kind in (E_README, E_RAW)}
        for p, e in sorted(idx.entries.items(), key=lambda pe: pe[0]):
            if e.kind in (E_FILE, E_SUMMARY):
                out[p] = self._text_of(e)
        return out

    def disk_files(self) -> dict[str, str]:
        """The files `export` writes (without manifest.json): `files()`, except that each raw document holds
        its text exactly, without the header agents see when they read it (its fields are in the manifest)."""
        out = self.files()
        for d in self._raw:
            out[d.path] = d.text
        return out

    def manifest(self) -> dict[str, Any]:
        """manifest.json: the export format, stats, id counters, every raw document (the header fields
        agents see, with the full sha256 and size of the file on disk) and every synthetic node (structure,
        sources and transitive raw provenance). See the module docstring."""
        idx = self._index
        return {
            "format": FORMAT,
            "export_format": EXPORT_FORMAT,
            "stats": self.stats(),
            "next_ids": {"cluster": self._next[FILE], "merge": self._next[DIRECTORY]},
            "raw_docs": [
                {
                    "path": d.path,
                    "handle": d.handle,
                    "doc_id": d.doc_id,
                    "title": d.title,
                    "kind": RAW_KIND,
                    "url": d.url,
                    "sha256_16": d.sha,
                    "sha256": hashlib.sha256(d.text.encode("utf-8")).hexdigest(),
                    "bytes": len(d.text.encode("utf-8")),
                }
                for d in self._raw
            ],
            "synthetic": [
                {
                    "node_id": n.node_id,
                    "kind": n.kind,
                    "title": n.title,
                    "slug": n.slug,
                    "path": idx.file_path(n),
                    "parent": n.parent,
                    "active": n.active,
                    "created_turn": n.created_turn,
                    "deleted_turn": n.deleted_turn,
                    "delete_reason": n.delete_reason,
                    "raw_sources": [self._raw_by_handle[h].path for h in n.raw_sources],
                    "synthetic_sources": [idx.file_path(self._nodes[s]) for s in n.synthetic_sources],
                    "raw_provenance": [
                        {"path": self._raw_by_handle[h].path, "sha256_16": self._raw_by_handle[h].sha}
                        for h in self._raw_provenance(n.node_id)
                    ],
                }
                for _, n in self._node_items()
            ],
            **self._update_sections(),
        }

    def _update_sections(self) -> dict[str, Any]:
        """After an update (`workspace.update`): `retired_raw_docs`, the documents it took out that synthetic
        nodes still cite (no file: their path is not in raw_docs/), and `stale`, the active nodes resting on
        one (`stale_nodes`). Absent for a workspace built from scratch."""
        if not self._retired:
            return {}
        return {
            "retired_raw_docs": [
                {
                    "path": d.path,
                    "handle": d.handle,
                    "doc_id": d.doc_id,
                    "title": d.title,
                    "url": d.url,
                    "sha256_16": d.sha,
                    "retired": d.meta.get("retired", "removed"),
                }
                for d in self._retired
            ],
            "stale": self.stale_nodes(include_deleted=True),
        }

    def export(self, directory: str | os.PathLike[str]) -> ActionResult:
        """Write the workspace as a real directory tree: README.md, raw_docs/ (each document byte for byte),
        the synthetic files (with headers) and directories, history/, and manifest.json. Refuses (writing
        nothing) if `directory` is a symlink, or if any file would land outside it or pass through a symlink;
        never follows or writes symlinks."""
        files = self.disk_files()
        files[MANIFEST] = json.dumps(self.manifest(), ensure_ascii=False, indent=1) + "\n"
        return write_tree(Path(directory), files)
