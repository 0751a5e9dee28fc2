"""What readers see: `list_dir` and `read_file` (the answerer's tools), the rendered files (raw documents and
synthetic nodes with their headers), the generated README and tree, `source_excerpts` (what an executor is
given) and `stats`."""

from __future__ import annotations

import hashlib

from librarian_jax.workspace import paths as P
from librarian_jax.workspace import render as R
from librarian_jax.workspace.arguments import as_int, short_repr
from librarian_jax.workspace.index import (
    DIR_ENTRIES,
    E_DIR,
    E_HISTORY_DIR,
    E_RAW,
    E_RAW_DIR,
    E_README,
    E_ROOT,
    E_SUMMARY,
    Entry,
)
from librarian_jax.workspace.nodes import (
    DIRECTORY,
    FILE,
    HISTORY_DIR,
    MAX_LIST_CHARS,
    MAX_READ_CHARS,
    MAX_READ_LINES,
    RAW_DIR,
    RAW_KIND,
    README,
    README_TREE_LINES,
    SUMMARY,
    RawDoc,
    SyntheticNode,
    kind_label,
)
from librarian_jax.workspace.provenance import Provenance
from librarian_jax.workspace.results import (
    INVALID_ARGUMENT,
    IS_A_DIRECTORY,
    NOT_A_DIRECTORY,
    READ_TOO_LARGE,
    ActionResult,
)


class Views(Provenance):
    """Reading and rendering."""

    def render_raw(self, doc: RawDoc) -> str:
        lines = [
            f"TITLE: {doc.title or doc.doc_id}",
            f"KIND: {RAW_KIND}",
            f"PATH: {doc.path}",
            f"DOC_ID: {doc.doc_id}",
        ]
        if doc.url:
            lines.append(f"URL: {doc.url}")
        lines += [f"SHA256: {doc.sha}", "---"]
        return "\n".join(lines) + "\n" + doc.text

    def render_node(self, node: SyntheticNode) -> str:
        """A synthetic node's file exactly as agents read it: a header, `---`, then the body."""
        idx = self._index
        lines = [
            f"TITLE: {node.title}",
            f"KIND: {kind_label(node)}",
            f"PATH: {idx.file_path(node)}",
        ]
        if not node.active:
            lines.append(
                f"STATUS: deleted at turn {node.deleted_turn}"
                + (f": {node.delete_reason}" if node.delete_reason else "")
            )
        if len(node.raw_sources) > 2 and set(node.raw_sources) == {d.handle for d in self._raw}:
            # written from the whole corpus (create_file from raw_docs): one line, with a digest of every
            # document's hash, so the header still changes when any of them does
            digest = hashlib.sha256(" ".join(sorted(d.sha for d in self._raw)).encode()).hexdigest()[:16]
            lines.append(f"SOURCES_RAW: all {len(self._raw)} raw documents under {RAW_DIR}/ "
                         f"(their sha256s: sha256:{digest})")
        elif node.raw_sources:
            lines.append("SOURCES_RAW:")
            for h in node.raw_sources:
                d = self._raw_by_handle[h]
                lines.append(f"- {d.path} (sha256:{d.sha})")
        else:
            lines.append("SOURCES_RAW: (none)")
        if node.synthetic_sources:
            lines.append("SOURCES_SYNTHETIC:")
            for s in node.synthetic_sources:
                sn = self._nodes[s]
                status = "" if sn.active else ", deleted"
                lines.append(f'- {idx.file_path(sn)} ("{R.clip(sn.title, 80)}"{status})')
            prov = self._raw_provenance(node.node_id)
            lines.append(
                f"RAW_PROVENANCE: {len(prov)} raw documents in total, reached through the synthetic sources' "
                f"headers"
            )
        else:
            lines.append("SOURCES_SYNTHETIC: (none)")
        if node.kind == DIRECTORY and node.active:
            kids = idx.children.get(node.node_id, [])
            lines.append(f"CHILDREN: {len(kids)} (list_files {idx.dir_path[node.node_id]!r} to see them)")
        lines.append("---")
        return "\n".join(lines) + "\n" + node.body

    def _text_of(self, entry: Entry) -> str:
        if entry.kind == E_RAW:
            return self.render_raw(self._raw_by_handle[entry.ref])
        if entry.kind == E_README:
            return self.readme_text()
        return self.render_node(self._nodes[entry.ref])

    def _entry_line(self, path: str, entry: Entry) -> str:
        idx = self._index
        name = P.basename(path)
        k = entry.kind
        if k == E_README:
            return f"{README}  [index] how this workspace is organised and how to read it"
        if k == E_RAW_DIR:
            return f"{RAW_DIR}/  [directory] {len(self._raw)} raw documents (read-only originals)"
        if k == E_HISTORY_DIR:
            n = sum(1 for x in self._nodes.values() if not x.active)
            return f"{HISTORY_DIR}/  [directory] {n} deleted synthetic nodes (read-only)"
        if k == E_RAW:
            d = self._raw_by_handle[entry.ref]
            return (
                f'{name}  [raw] "{R.clip(d.title or d.doc_id, 100)}" (doc_id={d.doc_id}, '
                f"{R.fmt_int(len(d.text))} chars)"
            )
        node = self._nodes[entry.ref]
        title = R.clip(node.title, 100)
        if k == E_SUMMARY:
            return f'{name}  [summary] "{title}" ({R.fmt_int(len(node.body))} chars)'
        if not node.active:
            what = "deleted directory" if node.kind == DIRECTORY else "deleted file"
            why = f": {R.clip(node.delete_reason, 80)}" if node.delete_reason else ""
            return f'{name}{"/" if k == E_DIR else ""}  [{what}] "{title}" (turn {node.deleted_turn}{why})'
        if k == E_DIR:
            kids = [self._nodes[c] for c in idx.children.get(node.node_id, [])]
            nd = sum(1 for c in kids if c.kind == DIRECTORY)
            return f'{name}/  [directory] "{title}" ({len(kids) - nd} files, {nd} directories, {SUMMARY})'
        return (
            f'{name}  [file] "{title}" ({len(node.raw_sources)} raw + {len(node.synthetic_sources)} '
            f"synthetic sources, {R.fmt_int(len(node.body))} chars)"
        )

    def _dir_children(self, path: str, entry: Entry) -> list[str]:
        """Paths directly inside a directory entry, in listing order."""
        idx = self._index

        def node_sort(nids: list[str]) -> list[str]:
            nodes = [self._nodes[n] for n in nids]
            dirs = sorted((n for n in nodes if n.kind == DIRECTORY), key=lambda n: n.name)
            files = sorted((n for n in nodes if n.kind != DIRECTORY), key=lambda n: n.name)
            return [idx.dir_path[n.node_id] for n in dirs + files]

        k = entry.kind
        if k == E_ROOT:
            head = [README, RAW_DIR] + ([HISTORY_DIR] if idx.has_history else [])
            return head + node_sort(idx.children.get(None, []))
        if k == E_RAW_DIR:
            return [d.path for d in self._raw]
        if k == E_HISTORY_DIR:
            return node_sort([n for n, x in self._nodes.items() if not x.active])
        node = self._nodes[entry.ref]
        kids = idx.children.get(node.node_id, []) if node.active else []
        return [f"{path}/{SUMMARY}"] + node_sort(kids)

    # ---------------------------------------------------------------------------------------------- reading
    def list_dir(
        self, path: object = ".", start: object = 1, max_chars: int = MAX_LIST_CHARS
    ) -> ActionResult:
        """One line per entry (kind, title, counts). Long listings stop at `max_chars` and say how to go on
        (`start` is the 1-based entry to begin with)."""
        r = self._resolve(path)
        if isinstance(r, ActionResult):
            return r
        if r.entry.kind not in DIR_ENTRIES:
            return ActionResult.error(
                NOT_A_DIRECTORY, f"{r.asked!r} is a file; read it with read_file", (f"read_file({r.path!r})",)
            )
        start_v = as_int(start, "start")
        if isinstance(start_v, ActionResult):
            return start_v
        cap = as_int(max_chars, "max_chars")
        if isinstance(cap, ActionResult):
            return cap
        max_chars = cap
        kids = self._dir_children(r.path, r.entry)
        if start_v < 1 or (start_v > len(kids) and kids):
            return ActionResult.error(INVALID_ARGUMENT, f"start={start_v} is outside 1..{len(kids)}")
        shown = r.path + "/" if r.path else ". (workspace root)"
        head = f"{self._note(r)}Directory {shown}: {len(kids)} entries"
        rows: list[str] = []
        used = len(head)
        last = start_v - 1
        for i in range(start_v - 1, len(kids)):
            row = self._entry_line(kids[i], self._index.entry(kids[i]))
            if rows and used + len(row) + 1 > max_chars - 200:
                break
            rows.append(row)
            used += len(row) + 1
            last = i + 1
        text = head + "\n" + "\n".join(rows)
        truncated = last < len(kids)
        if truncated:
            text += (
                f"\n[showing entries {start_v}-{last} of {len(kids)}; continue with "
                f"list_files({r.path or '.'!r}, start={last + 1})]"
            )
        return ActionResult.success(
            f"listed {r.path or '.'} ({len(kids)} entries)",
            text,
            path=r.path,
            entries=kids[start_v - 1 : last],
            total=len(kids),
            truncated=truncated,
        )

    def read_file(
        self, path: object, start_line: object = 1, num_lines: object = MAX_READ_LINES
    ) -> ActionResult:
        """Numbered display lines `start_line..` of a file: at most 100 lines and 16,000 characters, with a
        footer saying whether the file ends here or how to read on."""
        s = as_int(start_line, "start_line")
        if isinstance(s, ActionResult):
            return s
        n = as_int(num_lines, "num_lines")
        if isinstance(n, ActionResult):
            return n
        if n > MAX_READ_LINES:
            return ActionResult.error(
                READ_TOO_LARGE,
                f"num_lines={n} is above the limit of {MAX_READ_LINES} "
                f"lines per read; read in windows of at most "
                f"{MAX_READ_LINES} lines",
                (f"read_file({short_repr(path, 200)}, start_line={s}, num_lines={MAX_READ_LINES})",),
            )
        if n < 1:
            return ActionResult.error(INVALID_ARGUMENT, f"num_lines must be >= 1, got {n}")
        if s < 1:
            return ActionResult.error(INVALID_ARGUMENT, f"start_line must be >= 1, got {s}")
        r = self._resolve(path)
        if isinstance(r, ActionResult):
            return r
        k = r.entry.kind
        if k in DIR_ENTRIES:
            sugg = [f"{r.path}/{SUMMARY}"] if k == E_DIR else [README] if k == E_ROOT else []
            sugg.append(f"list_files({r.path or '.'!r})")
            return ActionResult.error(
                IS_A_DIRECTORY,
                f"{r.asked!r} is a directory; list it with list_files"
                + (f" or read its {SUMMARY}" if k == E_DIR else ""),
                sugg,
            )
        lines = R.display_lines(self._text_of(r.entry))
        if s > len(lines):
            return ActionResult.error(
                INVALID_ARGUMENT,
                f"start_line={s} is past the end of {r.path!r} ({len(lines)} lines)",
                (f"read_file({r.path!r}, start_line=1)",),
            )
        rows, last = R.window(lines, s, n, MAX_READ_CHARS)
        head = f"{self._note(r)}[{r.path} | lines {s}-{last} of {len(lines)}]"
        if last >= len(lines):
            foot, nxt = "[end of file]", None
        else:
            cut = "16,000-character limit reached" if last < min(len(lines), s + n - 1) else "more lines"
            foot = (
                f"[{cut}: lines {last + 1}-{len(lines)} not shown; continue with "
                f"read_file({r.path!r}, start_line={last + 1})]"
            )
            nxt = last + 1
        text = head + "\n" + "\n".join(rows) + "\n" + foot
        return ActionResult.success(
            f"read {r.path} lines {s}-{last} of {len(lines)}",
            text,
            path=r.path,
            start_line=s,
            end_line=last,
            total_lines=len(lines),
            truncated=nxt is not None,
            next_start_line=nxt,
        )

    def source_excerpts(
        self, paths: object, max_lines: int = MAX_READ_LINES, max_chars: int = MAX_READ_CHARS
    ) -> ActionResult:
        """What an executor is given: the title and first `max_lines` body lines of each source, all together
        at most `max_chars` characters (the budget is shared fairly: short sources leave room for long ones).
        Accepts the same paths as create_file sources and merge_files children (raw, files, directories).

        `data["sources"]` lists, per source in order, `path`, `title` (one line), `excerpt` (the body text
        given, with the cut marker when cut), `chars` and `truncated`: the structured form of `text`, for
        callers that need each source apart (never re-parse `text`: a document may hold lines that look like
        its `=== SOURCE n: ... ===` headers)."""
        lim = as_int(max_lines, "max_lines")
        if isinstance(lim, ActionResult):
            return lim
        cap = as_int(max_chars, "max_chars")
        if isinstance(cap, ActionResult):
            return cap
        max_lines, max_chars = max(0, lim), max(0, cap)
        srcs = self._sources(paths, as_child=False)
        if isinstance(srcs, ActionResult):
            return srcs
        items: list[tuple[str, str, str, bool, str]] = []  # header, body excerpt, path, lines cut, title
        for kind, ref in srcs:
            if kind == "raw":
                d = self._raw_by_handle[ref]
                title, body, path = d.title or d.doc_id, d.text, d.path
            else:
                node = self._nodes[ref]
                title, body, path = node.title, node.body, self._index.file_path(node)
            all_lines = R.display_lines(body)
            excerpt = "\n".join(all_lines[:max_lines])
            title = R.one_line(title)
            header = f"=== SOURCE {len(items) + 1}: {path} ===\nTITLE: {title}\n"
            items.append((header, excerpt, path, len(all_lines) > max_lines, title))
        marker = "\n[... excerpt cut]"
        fixed = sum(len(h) + len(marker) + 2 for h, _, _, _, _ in items)
        budget = max(0, max_chars - fixed)
        alloc = [0] * len(items)
        order = sorted(range(len(items)), key=lambda i: len(items[i][1]))
        remaining = budget
        for pos, i in enumerate(order):
            share = remaining // (len(items) - pos)
            alloc[i] = min(len(items[i][1]), share)
            remaining -= alloc[i]
        parts: list[str] = []
        info = []
        for (h, body, path, lines_cut, title), a in zip(items, alloc, strict=True):
            cut = lines_cut or len(body) > a
            excerpt = body[:a] + (marker if cut else "")
            parts.append(h + excerpt)
            info.append({"path": path, "title": title, "excerpt": excerpt, "chars": a, "truncated": cut})
        text = "\n\n".join(parts)
        if len(text) > max_chars:  # only when the headers alone exceed the budget
            text = text[:max_chars]
        return ActionResult.success(
            f"excerpts of {len(items)} sources ({R.fmt_int(len(text))} chars)", text, sources=info
        )

    def tree(self, max_lines: int = README_TREE_LINES, max_depth: int = 0) -> str:
        """The active synthetic hierarchy, one indented line per node (directories with a trailing `/` and,
        where their children are not shown, how many they hold); `max_depth` > 0 shows only that many levels
        (1: the root's entries)."""
        idx = self._index
        out: list[str] = []
        table = dict(self._nodes.items())  # one pass over the node map
        total = sum(1 for n in table.values() if n.active)

        collapsed = 0  # active nodes inside directories shown without their children

        def descendants(nid: str) -> int:
            kids = [table[c] for c in idx.children.get(nid, [])]
            return len(kids) + sum(descendants(k.node_id) for k in kids if k.kind == DIRECTORY)

        def walk(parent: str | None, depth: int) -> None:
            nonlocal collapsed
            nodes = sorted(
                (table[c] for c in idx.children.get(parent, [])),
                key=lambda n: (n.kind != DIRECTORY, n.name),
            )
            for n in nodes:
                if len(out) >= max_lines:
                    return
                slash = "/" if n.kind == DIRECTORY else ""
                deeper = n.kind == DIRECTORY and (not max_depth or depth + 1 < max_depth)
                count = ""
                if n.kind == DIRECTORY and not deeper:
                    count = f" ({len(idx.children.get(n.node_id, []))} entries)"
                    collapsed += descendants(n.node_id)
                out.append(f'{"  " * depth}{n.name}{slash}  "{R.clip(n.title, 90)}"{count}')
                if deeper:
                    walk(n.node_id, depth + 1)

        walk(None, 0)
        if len(out) + collapsed < total:
            out.append(f"... ({total - len(out) - collapsed} more synthetic nodes; use list_files)")
        return "\n".join(out) if out else "(no synthetic files yet)"

    def readme_text(self) -> str:
        st = self.stats()
        if st["active_synthetic"]:
            intro = (
                f"This workspace holds {st['raw_docs']} raw documents (under {RAW_DIR}/) and "
                f"{st['active_files']} synthetic files in {st['active_dirs']} synthetic directories (nesting "
                f"depth {st['max_depth']}), written from those documents to make them easier to navigate."
            )
        else:
            intro = (
                f"This workspace holds {st['raw_docs']} raw documents under {RAW_DIR}/. No synthetic files "
                f"have been written yet: list {RAW_DIR}/ to see the documents."
            )
        lines = [
            "# Workspace index",
            "",
            intro,
            "",
            "## How to read",
            f"- list_files(path) lists a directory; read_file(path, start_line, num_lines) reads at most "
            f"{MAX_READ_LINES} lines and {R.fmt_int(MAX_READ_CHARS)} characters at a time and says how to "
            f"continue.",
            "- Every synthetic file starts with a header: TITLE, KIND, PATH, SOURCES_RAW (the original "
            "documents it was written from, with content hashes; one line when it is every document) and "
            "SOURCES_SYNTHETIC (other synthetic files it builds on), then `---` and its text.",
            "- Synthetic files summarise; when a detail is missing, follow SOURCES_RAW to the original "
            f"document under {RAW_DIR}/.",
            "",
            "## Layout",
            "- cluster_NNNN__<name>.txt: a synthetic file written from the sources in its header.",
            f"- merge_NNNN__<name>/: a synthetic directory; its {SUMMARY} describes what it holds.",
            f"- {RAW_DIR}/: the {st['raw_docs']} original documents, unchanged (raw_NNNN__<name>.txt).",
        ]
        if st["deleted"]:
            lines.append(
                f"- {HISTORY_DIR}/: {st['deleted']} synthetic nodes the builder deleted (kept for "
                f"reference; may be outdated)."
            )
        lines += ["", "## Synthetic files (the top level; list_files shows what a directory holds)",
                  self.tree(max_depth=1)]
        return "\n".join(lines) + "\n"

    def readme(self) -> ActionResult:
        """The root README (also readable as `README.md`)."""
        text = self.readme_text()
        return ActionResult.success(f"{README} ({R.fmt_int(len(text))} chars)", text, path=README)

    # -------------------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, int]:
        """Counts for rewards and logging: raw docs, active files / directories, deleted nodes, deepest
        nesting of active nodes (root level = 1), characters of active synthetic bodies and raw texts,
        entries at the root."""
        table = dict(self._nodes.items())  # one pass over the node map; counts need no order
        active = [n for n in table.values() if n.active]
        depth_memo: dict[str, int] = {}

        def depth(nid: str) -> int:
            if nid not in depth_memo:
                p = table[nid].parent
                depth_memo[nid] = 1 if p is None else 1 + depth(p)
            return depth_memo[nid]

        return {
            "raw_docs": len(self._raw),
            "active_files": sum(1 for n in active if n.kind == FILE),
            "active_dirs": sum(1 for n in active if n.kind == DIRECTORY),
            "active_synthetic": len(active),
            "deleted": len(table) - len(active),
            "max_depth": max((depth(n.node_id) for n in active), default=0),
            "synthetic_chars": sum(len(n.body) for n in active),
            "raw_chars": sum(len(d.text) for d in self._raw),
            "root_entries": len(self._index.children.get(None, [])),
        }
