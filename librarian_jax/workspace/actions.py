"""The builder's actions: `create_file`, `merge_files`, `delete`, and `check_create` / `check_merge` (the same
validation without a change, so an executor only runs for valid calls). Each validates everything first and
changes nothing on a refusal; a success updates the node table and the path index in place (`index.py`),
touching only the paths that move."""

from __future__ import annotations

import dataclasses

from absl import logging

from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R
from librarian_jax.workspace.arguments import as_path_list, check_content, check_turn
from librarian_jax.workspace.index import E_DIR, E_FILE, E_HISTORY_DIR, E_RAW, E_RAW_DIR, E_ROOT, E_SUMMARY
from librarian_jax.workspace.nodes import (
    DIRECTORY,
    FILE,
    HISTORY_DIR,
    MAX_REASON_CHARS,
    MAX_TITLE_CHARS,
    README,
    SUMMARY,
    SyntheticNode,
    norm_title,
)
from librarian_jax.workspace.resolve import Resolving
from librarian_jax.workspace.results import (
    DUPLICATE_TITLE,
    INACTIVE_PATH,
    INVALID_ARGUMENT,
    MERGE_CYCLE,
    PATH_NOT_FOUND,
    RAW_IMMUTABLE,
    ActionResult,
)


class BuilderActions(Resolving):
    """create / merge / delete (the module docstring of `workspace.py` has the codes and forgiving rules)."""

    def _check_title(self, title: object) -> str | ActionResult:
        if not isinstance(title, str):
            return ActionResult.error(INVALID_ARGUMENT, f"title must be a string, got {type(title).__name__}")
        t = R.one_line(title)
        if not t:
            return ActionResult.error(INVALID_ARGUMENT, "title is empty")
        if len(t) > MAX_TITLE_CHARS:
            return ActionResult.error(
                INVALID_ARGUMENT, f"title is {len(t)} characters long; the limit is {MAX_TITLE_CHARS}"
            )
        other = self._index.titles.get(norm_title(t))
        if other is not None:
            where = self._index.file_path(self._nodes[other])
            return ActionResult.error(
                DUPLICATE_TITLE,
                f"title {t!r} is already used by {where!r}; pick a distinct title or delete that node first",
                (where,),
            )
        return t

    @staticmethod
    def _check_turn(turn: object) -> int | ActionResult:
        return check_turn(turn)

    @staticmethod
    def _check_content(content: object) -> str | ActionResult:
        return check_content(content)

    # ------------------------------------------------------------------------------------------------ create
    def _check_title_turn_sources(
        self, title: object, turn: object, paths: object, *, as_child: bool
    ) -> tuple[str, int, list[tuple[str, str]]] | ActionResult:
        """The checks create_file and merge_files share: title, turn, then the source / child paths."""
        t = self._check_title(title)
        if isinstance(t, ActionResult):
            return t
        turn_v = self._check_turn(turn)
        if isinstance(turn_v, ActionResult):
            return turn_v
        srcs = self._sources(paths, as_child=as_child)
        if isinstance(srcs, ActionResult):
            return srcs
        return t, turn_v, srcs

    def check_create(
        self, title: object, input_paths: object, parent_path: object = None, turn: object = 0
    ) -> ActionResult:
        """Validate a create_file call without changing anything (so an executor is only run for valid calls).

        On success `data` holds `title`, `raw_sources` (handles), `synthetic_sources` (node ids), `parent`
        (node id or None), `turn` and `source_paths`."""
        common = self._check_title_turn_sources(title, turn, input_paths, as_child=False)
        if isinstance(common, ActionResult):
            return common
        t, turn_v, srcs = common
        par = self._parent(parent_path)
        if isinstance(par, ActionResult):
            return par
        raw = tuple(ref for k, ref in srcs if k == "raw")
        syn = tuple(ref for k, ref in srcs if k == "node")
        return ActionResult.success(
            "create_file arguments are valid",
            title=t,
            raw_sources=raw,
            synthetic_sources=syn,
            parent=par[0],
            turn=turn_v,
            source_paths=[self._ref_file_path(k, r) for k, r in srcs],
        )

    def create_file(
        self,
        title: object,
        input_paths: object,
        content: object,
        parent_path: object = None,
        turn: object = 0,
    ) -> ActionResult:
        """CreateFile: a new synthetic file `cluster_NNNN__<slug>.txt` with `content` as its body, citing
        `input_paths` (raw and/or synthetic), placed in the merge directory `parent_path` (default: root)."""
        chk = self.check_create(title, input_paths, parent_path, turn)
        if not chk.ok:
            return chk
        body = self._check_content(content)
        if isinstance(body, ActionResult):
            return body
        d = chk.data
        nid = self._new_id(FILE)
        node = SyntheticNode(
            nid,
            FILE,
            d["title"],
            P.slugify(d["title"]),
            body,
            d["parent"],
            d["raw_sources"],
            d["synthetic_sources"],
            d["turn"],
        )
        idx = self._index  # built before the node table changes
        self._add_node(node)
        idx.add_file(node)
        path = idx.file_path(node)
        logging.debug("workspace: created %s", path)
        return ActionResult.success(
            f"created {path} ({len(node.raw_sources)} raw + {len(node.synthetic_sources)} synthetic sources, "
            f"{R.fmt_int(len(body))} chars)",
            node_id=nid,
            path=path,
        )

    # ------------------------------------------------------------------------------------------------- merge
    def check_merge(
        self, title: object, child_paths: object, parent_path: object = None, turn: object = 0
    ) -> ActionResult:
        """Validate a merge_files call without changing anything. On success `data` holds `title`,
        `children` (node ids), `parent` (node id or None, the default already applied), `turn`,
        `child_paths`."""
        common = self._check_title_turn_sources(title, turn, child_paths, as_child=True)
        if isinstance(common, ActionResult):
            return common
        t, turn_v, srcs = common
        children = [ref for _, ref in srcs]
        child_set = set(children)
        for c in children:
            for a in self._ancestors(self._nodes[c].parent):
                if a in child_set:
                    return ActionResult.error(
                        INVALID_ARGUMENT,
                        f"child {self._index.dir_path[c]!r} is inside another child "
                        f"{self._index.dir_path[a]!r}; name only the outer one or merge them separately",
                    )
        if parent_path is None:
            chains = [list(reversed(self._ancestors(self._nodes[c].parent))) for c in children]
            common: str | None = None
            for level in zip(*chains, strict=False):
                if all(x == level[0] for x in level):
                    common = level[0]
                else:
                    break
            parent: str | None = common
        else:
            par = self._parent(parent_path)
            if isinstance(par, ActionResult):
                return par
            parent = par[0]
            for a in self._ancestors(parent):
                if a in child_set:
                    where = "is" if a == parent else "lies inside"
                    return ActionResult.error(
                        MERGE_CYCLE,
                        f"parent_path {parent_path!r} {where} child {self._index.dir_path[a]!r}; "
                        f"a directory cannot contain itself",
                    )
        return ActionResult.success(
            "merge_files arguments are valid",
            title=t,
            children=tuple(children),
            parent=parent,
            turn=turn_v,
            child_paths=[self._index.file_path(self._nodes[c]) for c in children],
        )

    def merge_files(
        self,
        title: object,
        child_paths: object,
        content: object,
        parent_path: object = None,
        turn: object = 0,
    ) -> ActionResult:
        """MergeFiles: a new directory `merge_NNNN__<slug>/` whose `summary.txt` body is `content`; the
        children (synthetic files or directories) move into it. Default parent: the deepest directory
        containing every child."""
        chk = self.check_merge(title, child_paths, parent_path, turn)
        if not chk.ok:
            return chk
        body = self._check_content(content)
        if isinstance(body, ActionResult):
            return body
        d = chk.data
        nid = self._new_id(DIRECTORY)
        node = SyntheticNode(
            nid, DIRECTORY, d["title"], P.slugify(d["title"]), body, d["parent"], (), d["children"], d["turn"]
        )
        idx = self._index
        with idx.editing():
            moved = idx.detach(self._nodes, d["children"])
            self._add_node(node)
            nodes = self._nodes.mutate()
            for c in d["children"]:
                nodes[c] = dataclasses.replace(nodes[c], parent=nid)
            self._nodes = nodes.finish()
            idx.on_merge(self._nodes, nid, moved)
        path = idx.dir_path[nid]
        return ActionResult.success(
            f"created directory {path}/ with {len(d['children'])} children and "
            f"{SUMMARY} ({R.fmt_int(len(body))} chars)",
            node_id=nid,
            path=path,
            summary_path=f"{path}/{SUMMARY}",
        )

    # ------------------------------------------------------------------------------------------------ delete
    def delete(self, target_paths: object, reason: object = "", turn: object = 0) -> ActionResult:
        """Delete active synthetic nodes (all or nothing). A deleted directory's children move up to its
        parent; deleted nodes stay readable under `history/`."""
        lst = as_path_list(target_paths, "target_paths")
        if isinstance(lst, ActionResult):
            return lst
        if not lst:
            return ActionResult.error(
                INVALID_ARGUMENT, "target_paths is empty; name the synthetic files or directories to delete"
            )
        if reason is None:
            reason = ""
        if not isinstance(reason, str):
            return ActionResult.error(
                INVALID_ARGUMENT, f"reason must be a string, got {type(reason).__name__}"
            )
        turn_v = self._check_turn(turn)
        if isinstance(turn_v, ActionResult):
            return turn_v
        targets: list[str] = []
        errors: list[ActionResult] = []
        for a in lst:
            r = self._resolve(a, PATH_NOT_FOUND, "target")
            if isinstance(r, ActionResult):
                errors.append(r)
                continue
            k = r.entry.kind
            if k in (E_RAW, E_RAW_DIR):
                errors.append(
                    ActionResult.error(
                        RAW_IMMUTABLE,
                        f"target {r.asked!r} is a raw document"
                        f"{'s directory' if k == E_RAW_DIR else ''}; raw documents "
                        f"can never be deleted",
                    )
                )
            elif k in (E_FILE, E_DIR, E_SUMMARY):
                node = self._nodes[r.entry.ref]
                if not node.active:
                    errors.append(
                        ActionResult.error(INACTIVE_PATH, self._deleted_msg(node, "target", r.asked))
                    )
                elif node.node_id not in targets:
                    targets.append(node.node_id)
            elif k == E_HISTORY_DIR:
                errors.append(
                    ActionResult.error(
                        INACTIVE_PATH, f"target {r.asked!r} is {HISTORY_DIR}/, which only holds deleted nodes"
                    )
                )
            else:
                errors.append(
                    ActionResult.error(
                        INVALID_ARGUMENT,
                        f"target {r.asked!r} is "
                        f"{'the workspace root' if k == E_ROOT else 'the generated ' + README}"
                        f"; only synthetic files and directories can be deleted",
                    )
                )
        if errors:
            if len(errors) == 1:
                return errors[0]
            return ActionResult.error(
                errors[0].code,
                f"nothing deleted; {len(errors)} of {len(lst)} targets are "
                f"unusable: " + "; ".join(e.message for e in errors),
                tuple(s for e in errors for s in e.suggestions)[: P.MAX_SUGGESTIONS],
            )
        why = R.one_line(reason)[:MAX_REASON_CHARS].rstrip()
        idx = self._index
        old_paths = [idx.dir_path[t] for t in targets]
        with idx.editing():
            for t in targets:
                node = self._nodes[t]
                moved = idx.detach(self._nodes, [t])
                nodes = self._nodes.mutate()
                for cid in idx.children.get(t, ()):
                    nodes[cid] = dataclasses.replace(nodes[cid], parent=node.parent)
                nodes[t] = dataclasses.replace(node, active=False, deleted_turn=turn_v, delete_reason=why)
                self._nodes = nodes.finish()
                idx.on_delete(self._nodes, t, moved)
        new_paths = [idx.file_path(self._nodes[t]) for t in targets]
        return ActionResult.success(
            f"deleted {', '.join(old_paths)}; readable under {HISTORY_DIR}/",
            node_ids=targets,
            deleted_paths=old_paths,
            history_paths=new_paths,
        )
