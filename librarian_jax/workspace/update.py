"""Incremental update: an old workspace and a changed corpus -> the workspace an update episode starts from.

    changes = diff_corpus(old.raw_docs, new_docs)       # by content hash: added, removed, modified, renamed
    start = carry_over(old, new_docs)                   # a NEW workspace; `old` is not changed

What the new workspace holds (the design, and why):

- A raw document's handle names one content. An unchanged document keeps its handle, file name and path, so
  every synthetic file that cites only unchanged documents renders byte for byte as before (its header names
  the same paths and hashes; the node records are carried over as they are).
- Modified (same doc_id, other text): the new text is a new raw document under a new handle (appended after
  the highest handle so far; its file name is the new handle and its title's slug). The old version is
  *retired*: it leaves `raw_docs/`, but synthetic files that were written from it keep citing its old path
  and hash, so they are recognisably stale (`Workspace.stale_nodes`, the manifest's `stale`) and their bytes
  do not change until the builder rewrites or deletes them. Raw documents stay immutable inside one workspace.
- Removed (doc_id gone, and no new document has its text): retired the same way.
- Added (a new doc_id whose text no old document had): a new raw document under a new handle.
- Renamed (an old doc_id gone and a new doc_id with the same text, paired by content hash in corpus order):
  the same document. It keeps its handle and file name (so every file citing it stays byte-identical and is
  not stale); its doc_id, title and URL become the new ones (manifest, raw header). The file name still
  carries the old title's slug: a path is an identity, not a description.
- Retired documents no node cites are dropped. Handles are never reused while a node cites one.

`UpdateStart` bundles the new workspace, the changes, the stale files and the update episode's turn budget;
`prompt_fields` gives the builder's first message (`agents/prompts/builder_update.txt`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from librarian_jax.data.schema import Document, content_hash
from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R
from librarian_jax.workspace.arguments import check_document
from librarian_jax.workspace.nodes import FILE, RAW_HANDLE, RawDoc
from librarian_jax.workspace.workspace import Workspace

UPDATE_META = "update_start"  # the key of a CorpusTask's meta holding its `UpdateStart` (an update task)


@dataclasses.dataclass(frozen=True)
class CorpusChanges:
    """How a new corpus differs from a workspace's raw documents, by doc_id and content hash."""

    added: tuple[str, ...] = ()  # new doc_ids
    removed: tuple[str, ...] = ()  # old doc_ids
    modified: tuple[str, ...] = ()  # doc_ids whose text changed
    renamed: tuple[tuple[str, str], ...] = ()  # (old doc_id, new doc_id), same text
    unchanged: int = 0

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.modified or self.renamed)

    def counts(self) -> dict[str, int]:
        return {"added": len(self.added), "removed": len(self.removed), "modified": len(self.modified),
                "renamed": len(self.renamed), "unchanged": self.unchanged}


def diff_corpus(old: Sequence[RawDoc], new: Sequence[Document]) -> CorpusChanges:
    """Compare by content hash (`content_hash`, as the workspace records it): a doc_id in both with another
    hash is modified; an old doc_id gone and a new one with the same hash is a rename (paired in corpus
    order); other new doc_ids are added, other old ones removed."""
    new_sha = {d.doc_id: content_hash(d.text) for d in new}
    old_ids = {d.doc_id for d in old}
    modified = tuple(d.doc_id for d in old if d.doc_id in new_sha and new_sha[d.doc_id] != d.sha)
    unchanged = sum(1 for d in old if new_sha.get(d.doc_id) == d.sha)
    gone = [d for d in old if d.doc_id not in new_sha]
    fresh = [d.doc_id for d in new if d.doc_id not in old_ids]
    by_sha: dict[str, list[str]] = {}
    for doc_id in fresh:
        by_sha.setdefault(new_sha[doc_id], []).append(doc_id)
    renamed, removed = [], []
    for d in gone:
        match = by_sha.get(d.sha)
        if match:
            renamed.append((d.doc_id, match.pop(0)))
        else:
            removed.append(d.doc_id)
    paired = {b for _, b in renamed}
    added = tuple(x for x in fresh if x not in paired)
    return CorpusChanges(added, tuple(removed), modified, tuple(renamed), unchanged)


@dataclasses.dataclass(frozen=True)
class UpdateStart:
    """Where an update episode starts: `workspace` (the old one carried over to the new corpus; copy it
    before acting), the `changes`, the `stale` synthetic files (`Workspace.stale_nodes` at the start), and
    the episode's own turn budget `max_turns`."""

    workspace: Workspace
    changes: CorpusChanges
    stale: tuple[dict[str, Any], ...]  # stale_nodes() entries + title, kind, sources (current paths)
    max_turns: int
    paths: dict[str, str]  # doc_id -> its path in the new workspace (added, modified, renamed)
    old_paths: dict[str, str]  # doc_id -> its path in the old workspace (removed, modified, renamed)

    def prompt_fields(self) -> dict[str, str]:
        """The builder's update prompt's fields (`agents/prompts/builder_update.txt`): the changes, the stale
        files (each with its title and its direct sources as they are now: a changed document's new path, a
        removed one left out, so it can be rewritten without reading it first) and the new and changed
        documents as the raw listing shows them. Its size grows with the
        change, not with the corpus: the rest of the workspace is one list_files away."""
        c = self.changes
        lines = [f"- added: {self.paths[x]} (doc_id {x})" for x in c.added]
        lines += [f"- modified: {self.old_paths[x]} is now {self.paths[x]} (doc_id {x})" for x in c.modified]
        lines += [f"- removed: {self.old_paths[x]} (doc_id {x})" for x in c.removed]
        lines += [f"- renamed: doc_id {a} is now {b} (same text, still {self.paths[b]})"
                  for a, b in c.renamed]
        stale = [
            f'- {s["path"]} "{s["title"]}" '
            + (f"from {', '.join(s['sources']) or '(nothing left)'}" if s["kind"] == FILE
               else "(a directory: deleting it keeps its children)")
            + (f" (changed: {', '.join(s['changed'])})" if s["changed"] else "")
            + (f" (removed: {', '.join(s['removed'])})" if s["removed"] else "")
            for s in self.stale
        ]
        fresh = set(c.added) | set(c.modified)
        listing = [f'{d.path}  [raw] "{d.title or d.doc_id}" (doc_id={d.doc_id}, {len(d.text)} chars)'
                   for d in self.workspace.raw_docs if d.doc_id in fresh]
        num_active = len(self.workspace.active_nodes())
        return {"changes": "\n".join(lines) or "(none)", "stale": "\n".join(stale) or "(none)",
                "new_listing": "\n".join(listing) or "(none)", "num_stale": str(len(self.stale)),
                "num_kept": str(num_active - len(self.stale)), "max_turns": str(self.max_turns)}


def _handle_number(handle: str) -> int:
    m = RAW_HANDLE.fullmatch(handle)
    if m is None:
        raise ValueError(f"raw handle {handle!r} is not raw_NNNN")
    return int(m.group(1))


def carry_over(old: Workspace, new_docs: Sequence[Document], max_turns: int = 8) -> UpdateStart:
    """The workspace an update episode starts from (the module docstring has the rules); `old` is read only.
    Raises ValueError on a bad corpus (as `Workspace.from_documents`: repeated doc_id, bad text)."""
    new_docs = list(new_docs)
    seen: set[str] = set()
    for i, d in enumerate(new_docs, start=1):
        check_document(d, i)
        if d.doc_id in seen:
            raise ValueError(f"duplicate doc_id {d.doc_id!r} (document #{i})")
        seen.add(d.doc_id)
    changes = diff_corpus(old.raw_docs, new_docs)
    by_id = {d.doc_id: d for d in new_docs}
    rename_of = dict(changes.renamed)
    modified = set(changes.modified)
    next_n = 1 + max((_handle_number(d.handle) for d in (*old.raw_docs, *old.retired_docs)), default=0)
    raw: list[RawDoc] = []
    retired: list[RawDoc] = list(old.retired_docs)
    old_paths: dict[str, str] = {}
    for d in old.raw_docs:
        new_id = rename_of.get(d.doc_id, d.doc_id)
        if new_id in by_id and d.doc_id not in modified:
            nd = by_id[new_id]
            raw.append(dataclasses.replace(d, doc_id=new_id, title=R.one_line(nd.title),
                                           url=R.one_line(nd.url), text=nd.text, meta=dict(nd.meta)))
            if new_id != d.doc_id:
                old_paths[new_id] = d.path
        else:
            why = "modified" if d.doc_id in modified else "removed"
            retired.append(dataclasses.replace(d, text="", meta={"retired": why}))
            old_paths[d.doc_id] = d.path
    kept = {d.doc_id for d in raw}
    for nd in new_docs:  # added and modified documents, in the new corpus's order, under new handles
        if nd.doc_id in kept:
            continue
        handle = f"raw_{next_n:04d}"
        next_n += 1
        title = R.one_line(nd.title)
        slug = P.slugify(title or nd.doc_id, fallback="doc")
        raw.append(RawDoc(handle, nd.doc_id, title, R.one_line(nd.url), nd.text, content_hash(nd.text),
                          f"{handle}__{slug}.txt", dict(nd.meta)))
    cited = {h for n in old.nodes.values() for h in n.raw_sources}
    retired = [d for d in retired if d.handle in cited]
    ws = Workspace(raw, old.nodes, {**old._next}, retired)  # noqa: SLF001 - the id counters carry over
    errs = ws.check_invariants()
    if errs:  # a bug here, not a user error: the old workspace was sound
        raise RuntimeError("update: the carried-over workspace breaks invariants: " + "; ".join(errs[:3]))
    paths = {d.doc_id: d.path for d in raw}
    live = {d.handle: d.path for d in raw}
    nodes = ws.nodes

    def now(handle: str) -> str | None:  # where a source's content is now (None: removed)
        if handle in live:
            return live[handle]
        d = next(x for x in retired if x.handle == handle)
        return paths.get(d.doc_id) if d.meta.get("retired") == "modified" else None

    stale = []
    for s in ws.stale_nodes():
        n = nodes[s["node_id"]]
        sources = [p for h in n.raw_sources if (p := now(h)) is not None]
        sources += [ws.file_path_of(x) for x in n.synthetic_sources if nodes[x].active]
        stale.append({**s, "title": n.title, "kind": n.kind, "sources": list(dict.fromkeys(sources))})
    return UpdateStart(ws, changes, tuple(stale), max_turns, paths, old_paths)
