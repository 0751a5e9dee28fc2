"""The invariants a sound workspace keeps, checked in one place (`check_invariants`): every snapshot that is
restored goes through it, and the tests run it after every random action."""

from __future__ import annotations

from librarian_jax.data.schema import content_hash
from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R
from librarian_jax.workspace.arguments import check_content, short_repr
from librarian_jax.workspace.index import Index, RawLayer
from librarian_jax.workspace.nodes import (
    DIRECTORY,
    FILE,
    MAX_INT,
    MAX_REASON_CHARS,
    MAX_TITLE_CHARS,
    NODE_ID,
    RAW_HANDLE,
    norm_title,
)
from librarian_jax.workspace.results import ActionResult
from librarian_jax.workspace.state import WorkspaceState


class Invariants(WorkspaceState):
    """`check_invariants()`."""

    def check_invariants(self) -> list[str]:
        """Every broken invariant as a sentence (empty when the state is sound): raw texts match hashes;
        ids, handles and names are well formed and unique (raw handles increase in corpus order, with gaps
        where an update retired documents); every source resolves (a retired document included); active
        nodes sit in active directories; the parent relation has no cycle; every path is unique."""
        errs: list[str] = []
        handles = set()
        last = 0
        for i, d in enumerate(self._raw, start=1):
            if not R.encodable(d.text):
                errs.append(f"raw {d.handle}: text holds a lone surrogate (not valid Unicode)")
            elif content_hash(d.text) != d.sha:
                errs.append(f"raw {d.handle}: text does not match sha {d.sha}")
            if not d.doc_id or R.has_control(d.doc_id):
                errs.append(f"raw {d.handle}: doc_id must be one non-empty line without control characters")
            if not (R.is_one_line(d.title) and R.is_one_line(d.url)):
                errs.append(f"raw {d.handle}: title and url must be single lines without control characters")
            m = RAW_HANDLE.fullmatch(d.handle) if isinstance(d.handle, str) else None
            number = int(m.group(1)) if m else -1
            if m is None or number <= last or d.handle in handles:
                errs.append(f"raw #{i}: bad, repeated or out-of-order handle {short_repr(d.handle)}")
            last = max(last, number)
            handles.add(d.handle)
            if not P.is_safe_name(d.filename) or not d.filename.startswith(d.handle + "__"):
                errs.append(f"raw {d.handle}: unsafe file name {d.filename!r}")
        if len({d.doc_id for d in self._raw}) != len(self._raw):
            errs.append("repeated doc_id among raw documents")
        for d in self._retired:  # an update's retired documents: cited, never listed (text not kept)
            if RAW_HANDLE.fullmatch(d.handle) is None or d.handle in handles:
                errs.append(f"retired raw {short_repr(d.handle)}: bad handle, or also a live document's")
            handles.add(d.handle)
            if not P.is_safe_name(d.filename) or not d.filename.startswith(d.handle + "__"):
                errs.append(f"retired raw {d.handle}: unsafe file name {d.filename!r}")
        titles: dict[str, str] = {}
        for nid, n in self._node_items():
            m = NODE_ID.fullmatch(nid) if isinstance(nid, str) else None
            if (
                n.node_id != nid
                or m is None
                or int(m.group(2)) >= self._next[FILE if m.group(1) == "cluster" else DIRECTORY]
            ):
                errs.append(f"node {short_repr(nid)}: bad id")
                continue
            if n.kind not in (FILE, DIRECTORY):
                errs.append(f"node {nid}: bad kind {n.kind!r}")
            if not (
                isinstance(n.title, str) and isinstance(n.body, str) and isinstance(n.delete_reason, str)
            ):
                errs.append(f"node {nid}: title, body and delete_reason must be strings")
                continue
            if not n.title or not R.is_one_line(n.title) or len(n.title) > MAX_TITLE_CHARS:
                errs.append(
                    f"node {nid}: title must be one non-empty line of at most {MAX_TITLE_CHARS} characters"
                )
            elif n.active:
                other = titles.setdefault(norm_title(n.title), nid)
                if other != nid:
                    errs.append(
                        f"node {nid}: title {n.title[:80]!r} is also the title of active node {other}"
                    )
            if not R.is_one_line(n.delete_reason) or len(n.delete_reason) > MAX_REASON_CHARS:
                errs.append(
                    f"node {nid}: delete_reason must be one line of at most {MAX_REASON_CHARS} characters"
                )
            if isinstance(check_content(n.body), ActionResult):
                errs.append(f"node {nid}: body is not valid content (NUL, lone surrogate or too long)")
            turns = (n.created_turn,) if n.deleted_turn is None else (n.created_turn, n.deleted_turn)
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_INT for x in turns):
                errs.append(f"node {nid}: turns must be integers between 0 and {MAX_INT}")
            if not isinstance(n.active, bool) or not (n.parent is None or isinstance(n.parent, str)):
                errs.append(f"node {nid}: active must be a boolean and parent a node id or None")
                continue
            if not all(isinstance(x, str) for x in (*n.raw_sources, *n.synthetic_sources, n.slug)):
                errs.append(f"node {nid}: slug and sources must be strings")
                continue
            if not P.is_safe_name(n.name) or P.slugify(n.slug) != n.slug:
                errs.append(f"node {nid}: unsafe name {n.name!r}")
            for h in n.raw_sources:
                if h not in self._raw_by_handle:
                    errs.append(f"node {nid}: raw source {h!r} does not exist")
            for s in n.synthetic_sources:
                if s not in self._nodes:
                    errs.append(f"node {nid}: synthetic source {s!r} does not exist")
            if n.active:
                if n.parent is not None:
                    p = self._nodes.get(n.parent)
                    if p is None or not p.active or p.kind != DIRECTORY:
                        errs.append(f"node {nid}: parent {n.parent!r} is not an active directory")
                if n.deleted_turn is not None:
                    errs.append(f"node {nid}: active but has a deleted turn")
            elif n.deleted_turn is None:
                errs.append(f"node {nid}: deleted without a deleted turn")
            seen = {nid}
            p = n.parent if n.active else None
            while isinstance(p, str) and p in self._nodes:
                if p in seen:
                    errs.append(f"node {nid}: parent cycle")
                    break
                seen.add(p)
                p = self._nodes[p].parent
        if not errs:
            try:
                idx = Index.build(self.nodes, RawLayer(self._raw))
                n_expected = (
                    3 + len(self._raw) + sum(2 if n.kind == DIRECTORY else 1 for n in self._nodes.values())
                )
                n_expected += 1 if any(not n.active for n in self._nodes.values()) else 0
                n_paths = len({p for p, _ in idx.all_entries()})
                if n_paths != n_expected:
                    errs.append(f"paths are not unique: {n_paths} distinct paths, {n_expected} expected")
                if self._index_cache is not None and self._index_cache.signature() != idx.signature():
                    errs.append("the incrementally updated path index differs from a fresh build")
            except RuntimeError as e:
                errs.append(str(e))
        return errs
