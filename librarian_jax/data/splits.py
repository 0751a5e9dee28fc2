"""Task-id files: a train / held-out split given as data (the paper's 680/50 BrowseComp-Plus split).

A task-id file is one of:

- plain text, one task id per line (blank lines ignored): the held-out ids;
- a JSON list of ids: the held-out ids;
- a JSON object ``{"heldout" | "test": [...], "train"?: [...]}`` (as `inputs.write_split` records a run's).

With only held-out ids, every other task trains. With both lists, tasks in neither are left out (the paper's
100 excluded BrowseComp-Plus tasks). Used by training (`config.data.split_file`) and evaluation
(`configs/eval.py` `task_ids`); standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from librarian_jax.data.errors import DataError, json_type_name
from librarian_jax.data.schema import CorpusTask


def _ids(path: str, value: Any, field: str) -> list[str]:
    if not isinstance(value, list):
        raise DataError(path, f"expected a list of task ids, got {json_type_name(value)}", field=field)
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, str | int) or x == "":
            raise DataError(
                path, f"expected a task id (a string or an integer), got {x!r}", field=f"{field}[{i}]"
            )
        out.append(str(x))
    seen: set[str] = set()
    for i, x in enumerate(out):
        if x in seen:
            raise DataError(path, f"task id '{x}' is listed twice", field=f"{field}[{i}]")
        seen.add(x)
    return out


def read_task_ids(path: str | os.PathLike[str]) -> tuple[list[str] | None, list[str]]:
    """`(train ids or None, held-out ids)` of a task-id file (see the module doc); `DataError` names the file
    (and the field) on anything else, an id listed twice or in both lists included."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise DataError(path, "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(path, f"cannot read: {e}") from e
    try:
        data = json.loads(text)
    except ValueError:
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        return None, _ids(path, lines, "(line)")
    train = None
    if isinstance(data, dict):
        key = next((k for k in ("heldout", "test") if k in data), None)
        if key is None:
            raise DataError(path, "expected a JSON list of ids or an object with 'heldout' (or 'test') ids")
        held = _ids(path, data[key], key)
        if data.get("train") is not None:
            train = _ids(path, data["train"], "train")
            both = set(train) & set(held)
            if both:
                raise DataError(path, f"task id '{sorted(both)[0]}' is in both 'train' and '{key}'")
        return train, held
    return None, _ids(path, data, "(list)")


def split_by_ids(
    tasks: Sequence[CorpusTask], path: str | os.PathLike[str]
) -> tuple[list[CorpusTask], list[CorpusTask]]:
    """`(train, held_out)` as the task-id file `path` says: the listed ids in the file's order; with only
    held-out ids, train is every other task in input order. An id that is not a task of `tasks` is a
    `DataError` naming the file and the id."""
    train_ids, held_ids = read_task_ids(path)
    by_id = {t.task_id: t for t in tasks}
    listed = [*(train_ids or []), *held_ids]
    missing = [i for i in listed if i not in by_id]
    if missing:
        raise DataError(
            str(path),
            f"task id '{missing[0]}' is not in the data ({len(missing)} of {len(listed)} listed ids are not "
            f"among the {len(by_id)} tasks)",
        )
    held = [by_id[i] for i in held_ids]
    if train_ids is None:
        held_set = set(held_ids)
        train = [t for t in tasks if t.task_id not in held_set]
    else:
        train = [by_id[i] for i in train_ids]
    return train, held
