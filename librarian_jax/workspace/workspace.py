"""The workspace: the corpus filesystem a builder edits and an answerer reads, as host-side Python state.

Layout (paths relative to the workspace root; synthetic nodes live AT THE ROOT, next to the raw documents,
so the answerer's first listing shows the builder's top-level files directly and the raw documents stay one
`raw_docs/` away)::

    README.md                              generated index: what is where, counts, how to read
    raw_docs/raw_0001__<slug>.txt          raw documents: immutable, undeletable
    cluster_0001__<slug>.txt               a synthetic file (a CreateFile result)
    merge_0001__<slug>/summary.txt         a synthetic directory (a MergeFiles result) and its summary
    merge_0001__<slug>/cluster_0002__...   ... holding its children (files or further directories)
    history/cluster_0003__<slug>.txt       deleted synthetic nodes, still readable (only once one exists)

Raw documents get a short handle (`raw_0001`, in corpus order) and a file name from a slug of their title (or,
without one, their doc_id). Synthetic node ids count up per kind (`cluster_0001`, `merge_0001`) and never
repeat, so every name is unique and a node keeps its basename when it moves. Names are built only from handles
and slugs (`[a-z0-9_]`), which can never escape a directory.

Every action returns an `ActionResult(ok, code, message, suggestions, text, data)`; bad model input never
raises. Codes (see `results.py`):

- `ok`: success.
- `path_escape`: an absolute path, `~`, a URL, or `..` climbing above the root.
- `invalid_path`: not a string, NUL/control characters, too long (> 512 chars, a segment > 255, > 64 levels).
- `path_not_found`: nothing by that name (after the forgiving rules of `paths.py`); up to 3 suggestions.
- `not_a_directory`: listing a file, or a file given as `parent_path`.
- `is_a_directory`: reading a directory, or a plain directory (`raw_docs/`, `history/`, the root) given as a
  source.
- `inactive_path`: the node was deleted (it stays readable under `history/`, but cannot be a source, a child,
  a parent or deleted again); `history/` itself as a parent.
- `parent_not_found`: `parent_path` names nothing.
- `raw_immutable`: deleting a raw document or `raw_docs/`, moving raw documents into a directory (merge), or
  writing into `raw_docs/`.
- `unknown_source`: a create/merge source or child that names nothing.
- `merge_cycle`: the merge's parent is one of its children or lies inside one of them.
- `empty_sources`: no sources (create), no children (merge).
- `duplicate_title`: an active synthetic node already has this title (case and spacing ignored).
- `invalid_argument`: a wrong type or value (empty title, bad line numbers, non-string content, a target list
  that is empty, a child nested inside another child, README.md as a source or target...).
- `read_too_large`: `num_lines` above `MAX_READ_LINES` (100) in one read.

Text meant for a model (messages, suggestions, README, continuation hints) names the agents' tools:
`list_files(path)` (this class's `list_dir`) and `read_file(path, start_line, num_lines)`.

Reads return at most `MAX_READ_LINES` display lines and `MAX_READ_CHARS` characters (16,000) and say how to
continue. Lines longer than 2,000 characters are shown as several display lines (`render.display_lines`).

Forgiving argument handling (documented, nothing else is guessed): a single string where a list of paths is
expected counts as a one-element list; duplicate paths in a list count once; integers given as decimal
strings of ASCII digits (`"10"`, `" +3 "`) are accepted for line numbers, list starts and turns (any integer
beyond +-MAX_INT is refused); a merge directory and its `summary.txt` name the same node (as a source, a merge
child or a delete target); titles and delete reasons are put on one line (`render.one_line`: control
characters and line breaks become spaces) and a delete reason is cut to 500 characters.

Headers cannot be forged: every header line is built from a structured field that holds no line break or
control character (titles, reasons, raw titles and URLs are put on one line when they enter the workspace;
doc_ids with control characters are refused), and a header ends at its first `---` line, so a body can never
add a header line (`render.parse_header` reads one back). Content refused by create/merge (NUL, lone
surrogates, too long) is exactly what `clean_content` removes. A bad snapshot raises `SnapshotError`.

`merge_files` without `parent_path` puts the new directory in the deepest directory containing all children.
Deleting a directory moves its children up to its parent. Deleting never touches anything that cites the

Where each concern lives (this module only puts them together behind one class, `Workspace`):

| file | holds |
| --- | --- |
| `nodes.py` | layout names, limits, the records `RawDoc` and `SyntheticNode` |
| `arguments.py` | model-written arguments made safe (integers as text, path lists, content), corpus checks |
| `paths.py` | path normalisation (what may not escape) and forgiving name lookup (`NameIndex`) |
| `index.py` | the path index: what each path names, node paths, children, titles; updated per action |
| `state.py` | the state, `from_documents`, `copy()` (a snapshot, O(1)), equality, `path_of` |
| `resolve.py` | a model's path / source / child / parent argument to an index entry, or an error |
| `actions.py` | the builder's actions: `create_file`, `merge_files`, `delete`, `check_create` / `_merge` |
| `provenance.py` | `provenance` (raw documents a file rests on, with hashes), `staleness` |
| `views.py` | `list_dir`, `read_file`, rendering, README and tree, `source_excerpts`, `stats` |
| `invariants.py` | `check_invariants` |
| `serialisation.py` | `to_json` / `from_json` / `to_dict` / `from_dict`, `SnapshotError` |
| `ablations.py` | `flattened`, `shuffled` |
| `export.py` | `files`, `manifest`, `export` (a real directory, never leaving it) |
| `render.py`, `results.py` | text helpers and header parsing; `ActionResult` and the error codes |

A snapshot (`copy()`, taken for every probe) shares the node table and the path index with the workspace it
came from (all its tables are `immutables.Map`s, C hash array mapped tries); a write to either afterwards
copies only the trie nodes it touches, so a snapshot and one write cost O(log files), not a rebuild of the
index.
"""

from __future__ import annotations

from librarian_jax.workspace.ablations import Ablations
from librarian_jax.workspace.actions import BuilderActions
from librarian_jax.workspace.arguments import clean_content
from librarian_jax.workspace.export import Export
from librarian_jax.workspace.index import (
    DIR_ENTRIES,
    E_DIR,
    E_FILE,
    E_HISTORY_DIR,
    E_RAW,
    E_RAW_DIR,
    E_README,
    E_ROOT,
    E_SUMMARY,
)
from librarian_jax.workspace.nodes import (
    DIRECTORY,
    FILE,
    FORMAT,
    HISTORY_DIR,
    MANIFEST,
    MAX_CONTENT_CHARS,
    MAX_INT,
    MAX_LIST_CHARS,
    MAX_READ_CHARS,
    MAX_READ_LINES,
    MAX_REASON_CHARS,
    MAX_SOURCES,
    MAX_TITLE_CHARS,
    RAW_DIR,
    README,
    README_TREE_LINES,
    SUMMARY,
    RawDoc,
    SyntheticNode,
)
from librarian_jax.workspace.nodes import kind_label as _kind_label
from librarian_jax.workspace.serialisation import Serialisation, SnapshotError


class Workspace(BuilderActions, Export, Serialisation, Ablations):
    """The workspace state and its actions (the module docstring has layout, codes, forgiving rules and
    where each concern lives). Every method comes from one concern module; this class adds nothing."""


__all__ = [
    "DIR_ENTRIES",
    "DIRECTORY",
    "E_DIR",
    "E_FILE",
    "E_HISTORY_DIR",
    "E_RAW",
    "E_RAW_DIR",
    "E_README",
    "E_ROOT",
    "E_SUMMARY",
    "FILE",
    "FORMAT",
    "HISTORY_DIR",
    "MANIFEST",
    "MAX_CONTENT_CHARS",
    "MAX_INT",
    "MAX_LIST_CHARS",
    "MAX_READ_CHARS",
    "MAX_READ_LINES",
    "MAX_REASON_CHARS",
    "MAX_SOURCES",
    "MAX_TITLE_CHARS",
    "RAW_DIR",
    "README",
    "README_TREE_LINES",
    "SUMMARY",
    "RawDoc",
    "SnapshotError",
    "SyntheticNode",
    "Workspace",
    "_kind_label",
    "clean_content",
]
