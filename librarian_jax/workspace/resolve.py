"""Resolving what a model names: a path (after the forgiving rules of `paths.py`) to an index entry, a
create source / merge child to a raw handle or node id, a `parent_path` to a directory. Failures are
`ActionResult` errors with suggestions, never exceptions."""

from __future__ import annotations

import dataclasses

from librarian_jax.workspace import paths as P
from librarian_jax.workspace.arguments import as_path_list
from librarian_jax.workspace.index import (
    DIR_ENTRIES,
    E_DIR,
    E_FILE,
    E_HISTORY_DIR,
    E_RAW,
    E_RAW_DIR,
    E_ROOT,
    E_SUMMARY,
    Entry,
)
from librarian_jax.workspace.nodes import HISTORY_DIR, MAX_SOURCES, RAW_DIR, README, SyntheticNode
from librarian_jax.workspace.results import (
    EMPTY_SOURCES,
    INACTIVE_PATH,
    INVALID_ARGUMENT,
    IS_A_DIRECTORY,
    NOT_A_DIRECTORY,
    PARENT_NOT_FOUND,
    PATH_NOT_FOUND,
    RAW_IMMUTABLE,
    UNKNOWN_SOURCE,
    ActionResult,
)
from librarian_jax.workspace.state import WorkspaceState


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A name that resolved: what was `asked`, the `path` found, its index `entry`, the `rule` used."""

    asked: str
    path: str
    entry: Entry
    rule: str


class Resolving(WorkspaceState):
    """Name resolution shared by every action."""

    def _resolve(
        self, arg: object, not_found_code: str = PATH_NOT_FOUND, what: str = "path"
    ) -> Resolved | ActionResult:
        norm = P.normalize(arg)
        if isinstance(norm, P.PathError):
            return ActionResult.error(
                norm.code, norm.message if what == "path" else f"{what}: {norm.message}"
            )
        if norm == "":
            return Resolved(str(arg), "", Entry(E_ROOT), "exact")
        m = self._index.names.resolve(norm)
        if m.path is None:
            if m.ambiguous:
                msg = (
                    f"{what} {arg!r} is ambiguous: {len(m.ambiguous)} entries are named "
                    f"{P.basename(norm)!r}; give the full path"
                )
            else:
                msg = f"{what} {arg!r} does not exist"
            return ActionResult.error(not_found_code, msg, m.suggestions)
        return Resolved(str(arg), m.path, self._index.entry(m.path), m.rule)

    @staticmethod
    def _note(r: Resolved) -> str:
        return "" if r.rule == "exact" else f"[note: {r.asked!r} resolved to {r.path!r} ({r.rule})]\n"

    def _deleted_msg(self, node: SyntheticNode, what: str, asked: str) -> str:
        return (
            f"{what} {asked!r} was deleted at turn {node.deleted_turn}"
            f"{' (' + node.delete_reason + ')' if node.delete_reason else ''}; it is readable at "
            f"{self._index.file_path(node)!r} but is no longer part of the workspace"
        )

    def _directory_sources(self, arg: object) -> list[tuple[str, str]] | None:
        """A create source naming the raw documents' directory (`raw_docs`) stands for every raw document of
        the corpus. None for any other source (`_source` resolves it, or says why not)."""
        r = self._resolve(arg, UNKNOWN_SOURCE, "source")
        if isinstance(r, ActionResult) or r.entry.kind != E_RAW_DIR:
            return None
        return [("raw", d.handle) for d in self._raw]

    def _source(self, arg: object, *, as_child: bool) -> tuple[str, str] | ActionResult:
        """Resolve one create source / merge child to ("raw", handle) or ("node", node id)."""
        what = "child" if as_child else "source"
        r = self._resolve(arg, UNKNOWN_SOURCE, what)
        if isinstance(r, ActionResult):
            return r
        kind = r.entry.kind
        if kind == E_RAW:
            if as_child:
                return ActionResult.error(
                    RAW_IMMUTABLE,
                    f"child {r.asked!r} is a raw document; raw documents never move. Create a "
                    f"synthetic file from it with create_file and merge that instead",
                )
            return ("raw", r.entry.ref)
        if kind in (E_FILE, E_DIR, E_SUMMARY):
            node = self._nodes[r.entry.ref]
            if not node.active:
                return ActionResult.error(INACTIVE_PATH, self._deleted_msg(node, what, r.asked))
            return ("node", node.node_id)
        if kind == E_RAW_DIR and as_child:
            return ActionResult.error(
                RAW_IMMUTABLE, f"child {r.asked!r} is the raw_docs directory; raw documents never move"
            )
        if kind in DIR_ENTRIES:
            return ActionResult.error(
                IS_A_DIRECTORY,
                f"{what} {r.asked!r} is a plain directory; name the files in it",
                (f"list_files({r.path or '.'!r})",),
            )
        return ActionResult.error(
            INVALID_ARGUMENT, f"{what} {r.asked!r} is the generated {README}; name the files it lists instead"
        )

    def _sources(self, args: object, *, as_child: bool) -> list[tuple[str, str]] | ActionResult:
        name = "child_paths" if as_child else "input_paths"
        lst = as_path_list(args, name)
        if isinstance(lst, ActionResult):
            return lst
        if not lst:
            return ActionResult.error(
                EMPTY_SOURCES,
                f"{name} is empty; name at least one {'synthetic file or directory' if as_child else 'file'}",
            )
        if len(lst) > MAX_SOURCES:
            return ActionResult.error(
                INVALID_ARGUMENT, f"{name} has {len(lst)} entries; the limit is {MAX_SOURCES}"
            )
        out: list[tuple[str, str]] = []
        errors: list[ActionResult] = []
        for a in lst:
            expanded = None if as_child else self._directory_sources(a)
            for s in expanded if expanded is not None else [self._source(a, as_child=as_child)]:
                if isinstance(s, ActionResult):
                    errors.append(s)
                elif s not in out:
                    out.append(s)
        if len(out) > MAX_SOURCES:
            return ActionResult.error(
                INVALID_ARGUMENT, f"{name} names {len(out)} files; the limit is {MAX_SOURCES}"
            )
        if errors:
            first = errors[0]
            if len(errors) == 1:
                return first
            msg = "; ".join(e.message for e in errors)
            return ActionResult.error(
                first.code,
                f"{len(errors)} of {len(lst)} {name} are unusable: {msg}",
                tuple(s for e in errors for s in e.suggestions)[: P.MAX_SUGGESTIONS],
            )
        return out

    def _parent(self, arg: object) -> tuple[str | None] | ActionResult:
        """Resolve `parent_path` to (node id,) of an active directory or (None,) for the root."""
        if arg is None:
            return (None,)
        r = self._resolve(arg, PARENT_NOT_FOUND, "parent_path")
        if isinstance(r, ActionResult):
            return r
        kind = r.entry.kind
        if kind == E_ROOT:
            return (None,)
        if kind == E_DIR:
            node = self._nodes[r.entry.ref]
            if not node.active:
                return ActionResult.error(INACTIVE_PATH, self._deleted_msg(node, "parent_path", r.asked))
            return (node.node_id,)
        if kind in (E_RAW_DIR, E_RAW):
            return ActionResult.error(
                RAW_IMMUTABLE,
                f"parent_path {r.asked!r} is inside {RAW_DIR}/, which is "
                f"read-only; use a merge directory or the root",
            )
        if kind == E_HISTORY_DIR:
            return ActionResult.error(
                INACTIVE_PATH, f"parent_path {r.asked!r} is {HISTORY_DIR}/, which only holds deleted nodes"
            )
        sugg = (P.dirname(r.path),) if kind == E_SUMMARY else ()
        return ActionResult.error(
            NOT_A_DIRECTORY, f"parent_path {r.asked!r} is a file, not a directory made by merge_files", sugg
        )

    def _ref_file_path(self, kind: str, ref: str) -> str:
        if kind == "raw":
            return self._raw_by_handle[ref].path
        return self._index.file_path(self._nodes[ref])
