"""librarian_jax.data: corpus tasks from files or a synthetic world, and grain pipelines over them.

`schema` (the shared dataclasses), `loaders` and `synthetic` need only the standard library and absl;
the grain pipeline names (`TaskPipeline`, `TaskIterator`, `split_tasks`, ...) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from librarian_jax.data.errors import DataError
from librarian_jax.data.loaders import (
    FORMATS,
    NOISY_VARIANT,
    attach_reuse_questions,
    iter_browsecomp_plus,
    iter_corpus_jsonl,
    iter_task_jsonl,
    iter_tasks,
    load_bright,
    load_bright_domain,
    load_browsecomp_plus,
    load_corpus_jsonl,
    load_folder,
    load_reuse_questions,
    load_task_jsonl,
    load_tasks,
    save_tasks,
    sniff_format,
)
from librarian_jax.data.schema import CorpusTask, Document, Question, content_hash
from librarian_jax.data.splits import read_task_ids, split_by_ids
from librarian_jax.data.synthetic import WORLDS, WorldConfig, generate_task, generate_world, world_texts

_LAZY = {
    "TaskPipeline": "librarian_jax.data.pipeline",
    "TaskIterator": "librarian_jax.data.pipeline",
    "split_tasks": "librarian_jax.data.pipeline",
    "shard_tasks": "librarian_jax.data.pipeline",
    "task_hash_fraction": "librarian_jax.data.pipeline",
    "tasks_digest": "librarian_jax.data.pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'librarian_jax.data' has no attribute {name!r}")


__all__ = [
    "FORMATS", "NOISY_VARIANT", "WORLDS", "CorpusTask", "DataError", "Document", "Question", "WorldConfig",
    "attach_reuse_questions", "content_hash", "generate_task", "generate_world", "iter_browsecomp_plus",
    "iter_corpus_jsonl", "iter_task_jsonl", "iter_tasks", "load_bright", "load_bright_domain",
    "load_browsecomp_plus", "load_corpus_jsonl", "load_folder", "load_reuse_questions", "load_task_jsonl",
    "load_tasks", "read_task_ids", "save_tasks", "sniff_format", "split_by_ids", "world_texts", *_LAZY,
]
