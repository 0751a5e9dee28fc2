"""Provenance: every raw document a synthetic file rests on (followed through synthetic sources, deleted ones
included, with content hashes), and staleness: which active nodes rest on documents a new corpus changes or
drops."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from librarian_jax.data.schema import Document
from librarian_jax.workspace.index import DIR_ENTRIES, E_DIR, E_FILE, E_RAW, E_SUMMARY
from librarian_jax.workspace.resolve import Resolving
from librarian_jax.workspace.results import INVALID_ARGUMENT, IS_A_DIRECTORY, ActionResult


class Provenance(Resolving):
    """`provenance(path)`, `staleness(new_docs)` and the closure both rest on."""

    def _raw_provenance(self, node_id: str) -> list[str]:
        """Raw handles reached from a node through synthetic sources (deleted ones included), in order."""
        seen_nodes: set[str] = set()
        out: list[str] = []
        stack = [node_id]
        while stack:
            nid = stack.pop()
            if nid in seen_nodes:
                continue
            seen_nodes.add(nid)
            node = self._nodes[nid]
            for h in node.raw_sources:
                if h not in out:
                    out.append(h)
            stack.extend(reversed(node.synthetic_sources))
        return out

    def provenance(self, path: object) -> ActionResult:
        """Every raw document a file rests on, followed through synthetic sources (deleted ones too), with its
        content hash. `data["raw"]` is a list of {handle, doc_id, path, sha}; `data["synthetic"]` the node
        ids passed through."""
        r = self._resolve(path)
        if isinstance(r, ActionResult):
            return r
        k = r.entry.kind
        if k == E_RAW:
            handles, through = [r.entry.ref], []
        elif k in (E_FILE, E_DIR, E_SUMMARY):
            handles = self._raw_provenance(r.entry.ref)
            through = self._synthetic_closure(r.entry.ref)
        else:
            return ActionResult.error(
                IS_A_DIRECTORY if k in DIR_ENTRIES else INVALID_ARGUMENT,
                f"{r.asked!r} is not a raw document or synthetic node",
            )
        raws = [self._raw_by_handle[h] for h in handles]
        rows = [{"handle": d.handle, "doc_id": d.doc_id, "path": d.path, "sha": d.sha} for d in raws]
        text = "\n".join(f"{d.path} (doc_id={d.doc_id}, sha256:{d.sha})" for d in raws)
        return ActionResult.success(
            f"{r.path} rests on {len(rows)} raw documents", text, path=r.path, raw=rows, synthetic=through
        )

    def _synthetic_closure(self, node_id: str) -> list[str]:
        out: list[str] = []
        stack = list(reversed(self._nodes[node_id].synthetic_sources))
        while stack:
            nid = stack.pop()
            if nid in out or nid == node_id:
                continue
            out.append(nid)
            stack.extend(reversed(self._nodes[nid].synthetic_sources))
        return out

    def stale_nodes(self, include_deleted: bool = False) -> list[dict[str, Any]]:
        """The active synthetic nodes (with `include_deleted`, the deleted ones under history/ too) that rest
        (transitively) on a document an update retired (`state.WorkspaceState._retired`): what they cite is no
        longer in `raw_docs/` with that hash. Each is {node_id, path, active, changed, removed}: the retired
        documents' doc_ids by why they were retired (`meta` `"retired"`: "modified", a new version is in
        raw_docs/ under a new handle, or "removed")."""
        if not self._retired:
            return []
        why = {d.handle: d.meta.get("retired", "removed") for d in self._retired}
        out = []
        for _, n in self._node_items():
            if not (n.active or include_deleted):
                continue
            prov = [h for h in self._raw_provenance(n.node_id) if h in why]
            if prov:
                out.append({
                    "node_id": n.node_id,
                    "path": self._index.file_path(n),
                    "active": n.active,
                    "changed": [self._raw_by_handle[h].doc_id for h in prov if why[h] == "modified"],
                    "removed": [self._raw_by_handle[h].doc_id for h in prov if why[h] != "modified"],
                })
        return out

    def staleness(self, new_docs: Iterable[Document]) -> ActionResult:
        """Which active synthetic nodes rest (transitively) on a raw document that `new_docs` changes (same
        doc_id, other text) or drops (doc_id absent). `data["stale"]` lists {node_id, path, changed, removed}
        (doc_ids); `data` also has `changed_docs`, `removed_docs`, `added_docs`."""
        new = {d.doc_id: d.sha for d in new_docs}
        changed = {d.handle for d in self._raw if d.doc_id in new and new[d.doc_id] != d.sha}
        removed = {d.handle for d in self._raw if d.doc_id not in new}
        known = {d.doc_id for d in self._raw}
        stale = []
        for n in self.active_nodes():
            prov = self._raw_provenance(n.node_id)
            c = [self._raw_by_handle[h].doc_id for h in prov if h in changed]
            rm = [self._raw_by_handle[h].doc_id for h in prov if h in removed]
            if c or rm:
                stale.append(
                    {"node_id": n.node_id, "path": self._index.file_path(n), "changed": c, "removed": rm}
                )
        text = "\n".join(f"{s['path']}: changed {s['changed']}, removed {s['removed']}" for s in stale)
        by_h = self._raw_by_handle
        return ActionResult.success(
            f"{len(stale)} active synthetic nodes rest on changed or removed documents",
            text or "(none stale)",
            stale=stale,
            changed_docs=sorted(by_h[h].doc_id for h in changed),
            removed_docs=sorted(by_h[h].doc_id for h in removed),
            added_docs=sorted(set(new) - known),
        )
