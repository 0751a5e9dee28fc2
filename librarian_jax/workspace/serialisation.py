"""Serialisation: the whole state as JSON (`to_json` / `to_dict`) and back (`from_json` / `from_dict`), with
the raw section cached and optionally left out; a snapshot that `to_json` could not have written raises
`SnapshotError` naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Self

from librarian_jax.data.schema import Document
from librarian_jax.workspace.arguments import short_repr
from librarian_jax.workspace.invariants import Invariants
from librarian_jax.workspace.nodes import DIRECTORY, FILE, FORMAT, MAX_INT, RawDoc, SyntheticNode


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class SnapshotError(ValueError):
    """A workspace snapshot (`from_json` / `from_dict`) that `to_json` could not have written; `field` names
    the offending field (`nodes[3].created_turn`), or is empty when the problem is not one field's."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


_TYPE_NAMES = {str: "a string", bool: "a boolean", list: "a list", dict: "an object", int: "an integer"}


def _field(x: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """`x[key]`, checked to be of `kind` (a bool is never an int here); SnapshotError naming the field."""
    path = f"{where}.{key}" if where else key
    if key not in x:
        raise SnapshotError(
            f"malformed workspace snapshot: missing or bad field {key!r} (at {path!r}: missing)", path
        )
    value = x[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(_TYPE_NAMES.get(k, "null") for k in kinds)
        raise SnapshotError(
            f"malformed workspace snapshot: missing or bad field {key!r} (at {path!r}: expected {want}, "
            f"got {type(value).__name__})",
            path,
        )
    return value


def _int_field(x: dict[str, Any], key: str, where: str, low: int = 0) -> int:
    value = _field(x, key, int, where)
    if not low <= value <= MAX_INT:
        path = f"{where}.{key}" if where else key
        raise SnapshotError(
            f"malformed workspace snapshot: field {path!r} must be between {low} and {MAX_INT}, got "
            f"{short_repr(value)}",
            path,
        )
    return value


def _strings(x: dict[str, Any], key: str, where: str) -> list[str]:
    values = _field(x, key, list, where)
    for j, v in enumerate(values):
        if not isinstance(v, str):
            path = f"{where}.{key}[{j}]"
            raise SnapshotError(
                f"malformed workspace snapshot: field {path!r} must be a string, got {type(v).__name__}", path
            )
    return values


class Serialisation(Invariants):
    """to_json / to_dict / from_json / from_dict."""

    @staticmethod
    def _raw_dict(d: RawDoc, with_text: bool) -> dict[str, Any]:
        out = {
            "handle": d.handle,
            "doc_id": d.doc_id,
            "title": d.title,
            "url": d.url,
            "sha": d.sha,
            "filename": d.filename,
            "meta": d.meta,
        }
        if with_text:
            out["text"] = d.text
        return out

    def _nodes_list(self) -> list[dict[str, Any]]:
        return [
            {
                "node_id": n.node_id,
                "kind": n.kind,
                "title": n.title,
                "slug": n.slug,
                "parent": n.parent,
                "raw_sources": list(n.raw_sources),
                "synthetic_sources": list(n.synthetic_sources),
                "created_turn": n.created_turn,
                "active": n.active,
                "deleted_turn": n.deleted_turn,
                "delete_reason": n.delete_reason,
                "body": n.body,
            }
            for _, n in self._node_items()
        ]

    def to_dict(self, include_raw_text: bool = True) -> dict[str, Any]:
        """The state as plain JSON-able data (see `to_json`)."""
        return {
            "format": FORMAT,
            "next_ids": {"cluster": self._next[FILE], "merge": self._next[DIRECTORY]},
            "raw": [self._raw_dict(d, include_raw_text) for d in self._raw],
            "nodes": self._nodes_list(),
            **self._retired_section(),
        }

    def _retired_section(self) -> dict[str, Any]:
        """`{"retired": [...]}` when an update retired documents (their text is not kept), else `{}`."""
        return {"retired": [self._raw_dict(d, True) for d in self._retired]} if self._retired else {}

    def to_json(self, include_raw_text: bool = True) -> str:
        """The whole state as JSON; `Workspace.from_json(ws.to_json())` restores it exactly.

        With `include_raw_text=False` raw documents are recorded by doc_id, hash and name only (a snapshot of
        a few kilobytes instead of the whole corpus, e.g. for episode records); `from_json(text, docs=...)`
        then needs the documents back and checks their hashes. The serialised raw section is cached (raw
        documents never change), so repeated snapshots cost only the synthetic part."""
        key = "raw_json" if include_raw_text else "raw_json_notext"
        layer = self._raw_layer
        cached = layer.cache.get(key)
        if cached is None:
            cached = _dumps([self._raw_dict(d, include_raw_text) for d in self._raw])
            layer.cache[key] = cached
        head = _dumps(
            {"format": FORMAT, "next_ids": {"cluster": self._next[FILE], "merge": self._next[DIRECTORY]}}
        )
        retired = self._retired_section()
        tail = f',"retired":{_dumps(retired["retired"])}' if retired else ""
        return f'{head[:-1]},"raw":{cached},"nodes":{_dumps(self._nodes_list())}{tail}}}'

    @classmethod
    def from_dict(cls, d: dict[str, Any], docs: Iterable[Document] | None = None) -> Self:
        """Restore `to_dict` data (`docs` supplies raw texts a snapshot left out; see `to_json`).

        Raises `SnapshotError` (a ValueError) naming the field on anything `to_dict` would not have
        written: a wrong type (a float or bool turn, a non-string title, a list handle...), a missing key, an
        out-of-range id counter, or a state that breaks `check_invariants` (texts that do not match their
        hashes, titles or reasons spread over several lines, unsafe names, dangling sources, cycles)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise SnapshotError(
                f"not a workspace snapshot: format {short_repr(got)}, expected {FORMAT!r}", "format"
            )
        texts: dict[str, str] = {}
        for i, x in enumerate(docs if docs is not None else ()):
            if not isinstance(x, Document) or not isinstance(x.doc_id, str) or not isinstance(x.text, str):
                raise SnapshotError(
                    f"docs[{i}] is not a Document with a string doc_id and text", f"docs[{i}]"
                )
            texts[x.doc_id] = x.text
        raw: list[RawDoc] = []
        retired: list[RawDoc] = []
        sections = [("raw", raw, x) for x in _field(d, "raw", list, "")]
        if "retired" in d:  # an update's retired documents (`workspace.update`)
            sections += [("retired", retired, x) for x in _field(d, "retired", list, "")]
        counts = {"raw": 0, "retired": 0}
        for section, out, x in sections:
            i = counts[section]
            counts[section] += 1
            where = f"{section}[{i}]"
            if not isinstance(x, dict):
                raise SnapshotError(f"malformed workspace snapshot: field {where!r} must be an object", where)
            doc_id = _field(x, "doc_id", str, where)
            if "text" in x:
                text = _field(x, "text", str, where)
            elif doc_id in texts:
                text = texts[doc_id]
            else:
                raise SnapshotError(
                    f"snapshot has no text for raw document {doc_id!r}; pass docs=", f"{where}.text"
                )
            meta = x.get("meta", {})
            if not isinstance(meta, dict):
                raise SnapshotError(
                    f"malformed workspace snapshot: field '{where}.meta' must be an object", where
                )
            out.append(
                RawDoc(
                    _field(x, "handle", str, where),
                    doc_id,
                    _field(x, "title", str, where),
                    _field(x, "url", str, where),
                    text,
                    _field(x, "sha", str, where),
                    _field(x, "filename", str, where),
                    dict(meta),
                )
            )
        nodes: dict[str, SyntheticNode] = {}
        for i, x in enumerate(_field(d, "nodes", list, "")):
            where = f"nodes[{i}]"
            if not isinstance(x, dict):
                raise SnapshotError(f"malformed workspace snapshot: field {where!r} must be an object", where)
            nid = _field(x, "node_id", str, where)
            if nid in nodes:
                raise SnapshotError(
                    f"malformed workspace snapshot: node id {nid!r} appears twice", f"{where}.node_id"
                )
            texts_ok = all(isinstance(x.get(k), str) for k in ("title", "body", "delete_reason") if k in x)
            if not texts_ok:
                raise SnapshotError(
                    f"node {nid}: title, body and delete_reason must be strings "
                    f"(malformed workspace snapshot at {where})",
                    where,
                )
            deleted = x.get("deleted_turn")
            nodes[nid] = SyntheticNode(
                nid,
                _field(x, "kind", str, where),
                _field(x, "title", str, where),
                _field(x, "slug", str, where),
                _field(x, "body", str, where),
                _field(x, "parent", (str, type(None)), where),
                tuple(_strings(x, "raw_sources", where)),
                tuple(_strings(x, "synthetic_sources", where)),
                _int_field(x, "created_turn", where),
                _field(x, "active", bool, where),
                None if deleted is None and "deleted_turn" in x else _int_field(x, "deleted_turn", where),
                _field(x, "delete_reason", str, where),
            )
        counters = _field(d, "next_ids", dict, "")
        next_ids = {
            FILE: _int_field(counters, "cluster", "next_ids", low=1),
            DIRECTORY: _int_field(counters, "merge", "next_ids", low=1),
        }
        ws = cls(raw, nodes, next_ids, retired)
        errs = ws.check_invariants()
        if errs:
            raise SnapshotError("workspace snapshot breaks invariants: " + "; ".join(errs[:5]), "")
        return ws

    @classmethod
    def from_json(cls, text: str, docs: Iterable[Document] | None = None) -> Self:
        """Restore a `to_json` snapshot; raises `SnapshotError` (a ValueError) naming the problem if it is
        malformed or unsound (a raw text that does not match its recorded hash included)."""
        if not isinstance(text, str | bytes | bytearray):
            raise SnapshotError(f"workspace snapshot must be JSON text, got {type(text).__name__}", "")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits, too deep
            raise SnapshotError(f"workspace snapshot is not valid JSON: {str(e)[:200]}", "") from e
        return cls.from_dict(d, docs)
