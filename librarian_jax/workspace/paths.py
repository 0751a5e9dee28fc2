"""Path rules for the workspace: every path a model writes goes through `normalize` first.

A workspace path is relative to the workspace root and uses `/` as its separator. `normalize` is strict about
safety and lenient about spelling:

- Accepted and rewritten: surrounding whitespace, a leading `./`, repeated `/` (`a//b`), a trailing `/`,
  `.` segments, `\\` used as a separator (becomes `/`), and `..` segments that stay inside the root
  (`a/../b` is `b`). `""`, `"."` and `"./"` name the root, returned as `""`.
- Refused with `path_escape`: an absolute path (`/x`, `\\x`, `C:/x`, `~/x`, `file:` / `http:` URLs) and any
  `..` that would climb above the root.
- Refused with `invalid_path`: a non-string, NUL or other control characters, a path longer than
  `MAX_PATH_CHARS` characters, a segment longer than `MAX_SEGMENT_CHARS`, or more than `MAX_DEPTH` segments.

Lookup of a normalised path against the names that exist (`resolve_name`) is forgiving only in these
documented ways, tried in order:
  1. exact match;
  2. case-insensitive match;
  3. the same path with `.txt` or `.md` added (exact, then case-insensitive);
  4. a handle: the last segment (extension dropped) equals a short id (`raw_0001`, `cluster_0003`,
     `merge_0002`) or a raw document's doc_id, case-insensitive;
  5. a basename (with or without extension, case-insensitive) that names exactly one entry anywhere, or
     the name part of one synthetic entry: `Orlen Vask` or `orlen_vask` for `cluster_0003__orlen_vask.txt`
     (`slugify` of the name equals what follows the short id's `__`; a file's title names it so);
  6. a fuzzy match, as the authors' lookup has: the one path whose lowercase full path or basename has a
     normalised similarity of at least `FUZZY_MIN` (0.92; `rapidfuzz.fuzz.ratio`, the Indel distance) to the
     name's, a tie at the best score being no match.
Otherwise the lookup fails, with up to `MAX_SUGGESTIONS` close matches from `difflib`.

Names the workspace itself produces come from `slugify` (lowercase ASCII letters, digits and `_`), so they can
never contain a separator, a dot segment or a control character.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
from collections.abc import Iterable, Iterator, Mapping

import immutables
from rapidfuzz import fuzz

from librarian_jax.workspace import render as R

MAX_PATH_CHARS = 512
MAX_SEGMENT_CHARS = 255
MAX_DEPTH = 64
MAX_SUGGESTIONS = 3
SLUG_MAX_CHARS = 48
FORGIVEN_EXTENSIONS = (".txt", ".md")

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DRIVE = re.compile(r"^[A-Za-z]:")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^file:", re.IGNORECASE)
_NON_ALNUM = re.compile(r"[^a-z0-9]+")
_SHORT_ID_NAME = re.compile(r"^(?:cluster|merge)_\d{4,}__(.+)$")  # synthetic names, lowercase, no extension


@dataclasses.dataclass(frozen=True)
class PathError:
    """Why a path was refused: `code` is `path_escape` or `invalid_path`; `message` names the bad path."""

    code: str
    message: str


def normalize(path: object) -> str | PathError:
    """Normalise a model-written path (see the module docstring); returns the path or a `PathError`."""
    if not isinstance(path, str):
        return PathError(
            "invalid_path", f"path must be a string, got {type(path).__name__}: {R.short_repr(path, 80)}"
        )
    if len(path) > MAX_PATH_CHARS:
        return PathError(
            "invalid_path", f"path is {len(path)} characters long; the limit is {MAX_PATH_CHARS}"
        )
    raw = path.strip()
    if _CONTROL.search(raw):
        return PathError("invalid_path", f"path {raw!r:.120} contains a NUL or control character")
    if raw.startswith("~"):
        return PathError(
            "path_escape",
            f"path {raw!r} refers to a home directory; use a workspace path such as 'raw_docs/'",
        )
    if _URL.match(raw):
        return PathError("path_escape", f"path {raw!r} is a URL; use a workspace path such as 'raw_docs/'")
    text = raw.replace("\\", "/")
    if text.startswith("/") or _DRIVE.match(text):
        return PathError(
            "path_escape",
            f"path {raw!r} is absolute; workspace paths are relative to the root "
            f"(e.g. 'raw_docs/raw_0001__title.txt')",
        )
    parts: list[str] = []
    for seg in text.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not parts:
                return PathError("path_escape", f"path {raw!r} climbs above the workspace root with '..'")
            parts.pop()
            continue
        if len(seg) > MAX_SEGMENT_CHARS:
            return PathError(
                "invalid_path",
                f"path segment {seg[:40]!r}... is {len(seg)} characters long; "
                f"the limit is {MAX_SEGMENT_CHARS}",
            )
        parts.append(seg)
        if len(parts) > MAX_DEPTH:
            return PathError("invalid_path", f"path {raw!r:.120} is deeper than {MAX_DEPTH} levels")
    return "/".join(parts)


def join(*parts: str) -> str:
    """Join normalised workspace paths (empty parts, i.e. the root, are skipped)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def dirname(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def strip_extension(name: str) -> str:
    for ext in FORGIVEN_EXTENSIONS:
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return name


def slugify(text: str, fallback: str = "untitled", max_chars: int = SLUG_MAX_CHARS) -> str:
    """Lowercase `text`, collapse every run of non-alphanumerics to `_`, trim `_`, cap at `max_chars`."""
    slug = _NON_ALNUM.sub("_", text.lower()).strip("_")[:max_chars].strip("_")
    return slug or fallback


def is_safe_name(name: str) -> bool:
    """A single path segment that is safe to write on disk: no separator, no dot segment, no control char."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and not _CONTROL.search(name)
        and len(name) <= MAX_SEGMENT_CHARS
    )


FUZZY_MIN = 0.92  # rule 6's similarity threshold (the authors')


def fuzzy_best(name: str, paths: Iterable[str]) -> str | None:
    """Rule 6: the one path of `paths` most similar to `name` (lowercase full path or basename, the better of
    the two, `rapidfuzz.fuzz.ratio` / 100 >= `FUZZY_MIN`); None when none is that close or two tie."""
    low = name.lower()
    base = basename(low)
    cutoff = 100 * FUZZY_MIN
    best, hits = 0.0, []
    for p in paths:
        pl = p.lower()
        s = max(fuzz.ratio(low, pl, score_cutoff=cutoff), fuzz.ratio(base, basename(pl), score_cutoff=cutoff))
        if s >= cutoff and s >= best:
            hits = [p] if s > best else [*hits, p]
            best = s
    return hits[0] if len(hits) == 1 else None


@dataclasses.dataclass(frozen=True)
class Match:
    """The outcome of `resolve_name`: `path` when found (with `rule` naming the forgiving rule used, `exact`
    otherwise), or `path=None` with `suggestions` (and `ambiguous` listing every candidate of rule 5)."""

    path: str | None
    rule: str = "exact"
    suggestions: tuple[str, ...] = ()
    ambiguous: tuple[str, ...] = ()


@contextlib.contextmanager
def editing(*tables: tuple[object, tuple[str, ...]]) -> Iterator[None]:
    """A batch of in-place edits to persistent tables: for each `(obj, names)`, within the block the
    `immutables.Map` attributes `names` of `obj` are `immutables.MapMutation`s (`m[k] = v`, `del m[k]`,
    `m.pop(k, d)`, `m.get(k)`, `in`, `len`; no iteration), which copy a trie node still shared with a snapshot
    once and then change it in place; on exit they are `Map`s again (`finish()`). Re-entrant: a block over
    tables already being edited does nothing."""
    first, first_names = tables[0]
    if not isinstance(getattr(first, first_names[0]), immutables.Map):  # already a mutation
        yield
        return
    for obj, names in tables:
        for name in names:
            setattr(obj, name, getattr(obj, name).mutate())
    try:
        yield
    finally:
        for obj, names in tables:
            for name in names:
                setattr(obj, name, getattr(obj, name).finish())


class NameIndex:
    """Lookup tables over the paths that exist, for `resolve`.

    `paths` are normalised names (directories without a trailing slash); `handles` maps short ids (`raw_0001`)
    to a path. An index may sit on a `base` index (the workspace keeps the never-changing raw documents in a
    base layer shared by every snapshot, and the synthetic nodes in a layer it changes); lookups see the union
    of both. The tables are persistent maps (`immutables.Map`, a HAMT), so `copy()` is O(1) and a change
    after a copy copies only the trie nodes it touches. `add` and `remove` run inside `editing()`.
    """

    TABLES = ("_paths", "_lower", "_base", "_handles", "_handle_of")

    def __init__(self, paths: Iterable[str], handles: Mapping[str, str], base: NameIndex | None = None):
        self.base = base
        self._paths: immutables.Map[str, None] = immutables.Map()  # a set
        self._lower: immutables.Map[str, tuple[str, ...]] = immutables.Map()  # lowercase -> paths so spelled
        # lowercase basename (and stem) -> paths
        self._base: immutables.Map[str, tuple[str, ...]] = immutables.Map()
        self._handles: immutables.Map[str, str] = immutables.Map()
        self._handle_of: immutables.Map[str, str] = immutables.Map()
        with self.editing():
            for p in paths:
                self.add(p)
            for k, v in handles.items():
                self._handles[k.lower()] = v
                self._handle_of[v] = k.lower()

    def editing(self) -> contextlib.AbstractContextManager[None]:
        """The block in which `add` and `remove` may change the tables (see `editing` above)."""
        return editing((self, self.TABLES))

    def copy(self) -> NameIndex:
        """An independent index in O(1): the tables are immutable, so both share them until either changes."""
        out = NameIndex.__new__(NameIndex)
        out.base = self.base
        out._paths = self._paths
        out._lower = self._lower
        out._base = self._base
        out._handles = self._handles
        out._handle_of = self._handle_of
        return out

    def add(self, path: str, handle: str | None = None) -> None:
        """Add one path (and optionally its short id). Inside `editing()`."""
        self._paths[path] = None
        low = path.lower()
        self._lower[low] = self._lower.get(low, ()) + (path,)
        for key in self._base_keys(low):
            self._base[key] = self._base.get(key, ()) + (path,)
        if handle is not None:
            self._handles[handle.lower()] = path
            self._handle_of[path] = handle.lower()

    def remove(self, path: str) -> None:
        """Forget one path (and the short id pointing at it). Inside `editing()`."""
        del self._paths[path]
        low = path.lower()
        for table, keys in ((self._lower, (low,)), (self._base, self._base_keys(low))):
            for key in keys:
                rest = tuple(p for p in table[key] if p != path)
                if rest:
                    table[key] = rest
                else:
                    del table[key]
        h = self._handle_of.pop(path, None)
        if h is not None and self._handles.get(h) == path:
            del self._handles[h]

    @staticmethod
    def _base_keys(low: str) -> tuple[str, ...]:
        b = low.rsplit("/", 1)[-1]
        keys = (b, b.rsplit(".", 1)[0]) if b.endswith(FORGIVEN_EXTENSIONS) else (b,)
        m = _SHORT_ID_NAME.match(keys[-1])
        return (*keys, "\0" + m.group(1)) if m else keys  # the name part, in its own key space

    @property
    def paths(self) -> list[str]:
        return (self.base.paths if self.base else []) + list(self._paths)

    def _has(self, p: str) -> bool:
        return p in self._paths or (self.base is not None and self.base._has(p))

    def _get_lower(self, low: str) -> str | None:
        hits = self._lower.get(low)
        hit = hits[0] if hits else None
        return hit if hit is not None or self.base is None else self.base._get_lower(low)

    def _get_handle(self, h: str) -> str | None:
        hit = self._handles.get(h)
        return hit if hit is not None or self.base is None else self.base._get_handle(h)

    def _get_base(self, b: str) -> list[str]:
        return list(self._base.get(b, ())) + (self.base._get_base(b) if self.base else [])

    def resolve(self, norm: str) -> Match:
        """Find `norm` (already normalised) by the rules of the module docstring."""
        if self._has(norm):
            return Match(norm)
        low = norm.lower()
        hit = self._get_lower(low)
        if hit is not None:
            return Match(hit, "case_insensitive")
        for ext in FORGIVEN_EXTENSIONS:
            if self._has(norm + ext):
                return Match(norm + ext, "added_extension")
            hit = self._get_lower(low + ext)
            if hit is not None:
                return Match(hit, "added_extension")
        stem = strip_extension(basename(low))
        hit = self._get_handle(stem)
        if hit is not None:
            return Match(hit, "handle")
        cands = sorted(set(self._get_base(basename(low)) or self._get_base(stem)
                           or self._get_base("\0" + slugify(stem, fallback=""))))
        if len(cands) == 1:
            return Match(cands[0], "unique_basename")
        if cands:
            return Match(None, suggestions=tuple(cands[:MAX_SUGGESTIONS]), ambiguous=tuple(cands))
        hit = fuzzy_best(norm, self.paths)
        if hit is not None:
            return Match(hit, "fuzzy")
        return Match(None, suggestions=self.suggest(norm))

    def suggest(self, norm: str) -> tuple[str, ...]:
        """Up to `MAX_SUGGESTIONS` close matches, scoring each path by the better of its full-path and its
        basename similarity to `norm` (difflib ratio >= 0.6)."""
        low = norm.lower()
        base = basename(low)
        scored: list[tuple[float, str]] = []
        sm_full = difflib.SequenceMatcher(b=low, autojunk=False)
        sm_base = difflib.SequenceMatcher(b=base, autojunk=False)
        for p in self.paths:
            pl = p.lower()
            best = 0.0
            for sm, cand in ((sm_full, pl), (sm_base, basename(pl))):
                sm.set_seq1(cand)
                if sm.real_quick_ratio() > best and sm.quick_ratio() > best:
                    best = max(best, sm.ratio())
            if best >= 0.6:
                scored.append((best, p))
        scored.sort(key=lambda t: (-t[0], t[1]))
        return tuple(p for _, p in scored[:MAX_SUGGESTIONS])
