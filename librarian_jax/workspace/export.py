"""Writing a workspace to disk without ever leaving the target directory or touching a symlink."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from absl import logging

from librarian_jax.workspace import paths as P
from librarian_jax.workspace.results import INVALID_ARGUMENT, INVALID_PATH, PATH_ESCAPE, ActionResult

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
    """Write `files` (relative path -> text, UTF-8) under `root`, creating directories as needed.

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
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        n_chars += len(text)
    logging.info("workspace: exported %d files (%d chars) to %s", len(files), n_chars, root)
    return ActionResult.success(
        f"exported {len(files)} files to {root}", directory=str(root), files=len(files), chars=n_chars
    )
