"""A run's inputs, built from its validated, typed config (`config_schema.RunConfig`, never the raw
ConfigDict: each function raises TypeError on one): the tasks and their train / held-out split, and the
tokenizer. Every command (GRPO, the warm start, eval, build) takes them from here.

    train, heldout = build_tasks(config)            # the synthetic world or a tasks file, split
    write_split(workdir, train, heldout)            # workdir/split.json: what eval will hold out
    tokenizer = build_tokenizer(config, tasks)      # model.tokenizer, the HF folder's, or a trained one
    train, validation = validation_split(train, config)  # GRPO: eval.validation_tasks kept out of training
    train = update_tasks(train, config)             # data.update_fraction of them as incremental updates
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from absl import logging

from librarian_jax import data, storage, tokenizers
from librarian_jax.agents import vocabulary
from librarian_jax.agents.executor import extractive_text
from librarian_jax.config_schema import RUN_SCHEMAS, ConfigError, DataSection, RunConfig, require_typed
from librarian_jax.data.mutate import mutate_task
from librarian_jax.workspace import UPDATE_META, Workspace, carry_over

SPLIT_FILE = "split.json"

# The loaders' options each data key sets, and the formats that have them (docs/paper-settings.md, Data).
_DATA_LOADER_KEYS = {"max_docs": ("tasks", "browsecomp_plus"), "questions_per_domain": ("bright",)}


def _loader_kwargs(d: DataSection, fmt: str) -> dict[str, Any]:
    """`data.load_tasks` options from the data config: the noisy variant's document cap (`max_docs`: support
    documents plus shuffled negatives, at most that many) and the BRIGHT question sample
    (`questions_per_domain`), both drawn with `sample_seed`. A key set for a format without it is logged."""
    kwargs: dict[str, Any] = {}
    for key, formats in _DATA_LOADER_KEYS.items():
        value = int(getattr(d, key))
        if not value:
            continue
        if fmt not in formats:
            logging.warning("config.data.%s=%d does not apply to the %r format of %s (only %s)",
                            key, value, fmt, d.path, "/".join(formats))
            continue
        kwargs.update({key: value, "seed": d.sample_seed})
        if key == "max_docs":
            kwargs["shuffle_docs"] = True
    return kwargs


def build_tasks(config: RunConfig) -> tuple[list[Any], list[Any]]:
    """(train tasks, held-out tasks) from the synthetic world or a tasks file.

    `data.reuse_questions` (a file) sets the named corpora's reuse questions; `data.split_file` (a task-id
    file, `data.read_task_ids`) decides train / held-out, else `data.heldout_fraction` by task-id hash."""
    require_typed(config, RUN_SCHEMAS, "inputs.build_tasks")
    d = config.data
    if d.source == "synthetic":
        tasks = data.generate_world(config.seed, d.num_tasks, data.WORLDS[d.world],
                                    docs_per_task=d.docs_per_task,
                                    min_words=d.min_words, max_words=d.max_words,
                                    questions_per_task=d.questions_per_task,
                                    reuse_questions_per_task=d.reuse_questions_per_task)
    else:
        fmt = data.sniff_format(d.path) if d.format == "auto" else d.format
        tasks = data.load_tasks(d.path, format=fmt, **_loader_kwargs(d, fmt))
    if d.reuse_questions:
        try:
            tasks = data.attach_reuse_questions(tasks, d.reuse_questions)
        except data.DataError as e:
            raise ConfigError(f"config.data.reuse_questions: {e}") from e
    if d.exclude_file:
        try:
            out = set(data.read_task_ids(d.exclude_file)[1])
        except data.DataError as e:
            raise ConfigError(f"config.data.exclude_file: {e}") from e
        kept = [t for t in tasks if t.task_id not in out]
        logging.info("data.exclude_file: %d of its %d ids excluded from %d tasks", len(tasks) - len(kept),
                     len(out), len(tasks))
        tasks = kept
    if d.split_file:
        try:
            train, heldout = data.split_by_ids(tasks, d.split_file)
        except data.DataError as e:
            raise ConfigError(f"config.data.split_file: {e}") from e
        if not train:
            raise ConfigError(
                f"config.data.split_file: {d.split_file} leaves no training task of {len(tasks)}")
        return train, heldout
    if d.heldout_count:
        n = d.heldout_count
        if n >= len(tasks):
            raise ConfigError(f"config.data.heldout_count: {n} leaves no training task of {len(tasks)}")
        drawn = set(np.random.default_rng(d.split_seed).choice(len(tasks), n, replace=False)
                    .tolist())
        return ([t for i, t in enumerate(tasks) if i not in drawn],
                [t for i, t in enumerate(tasks) if i in drawn])
    train, heldout = data.split_tasks(tasks, float(d.heldout_fraction)) if d.heldout_fraction else (tasks, [])
    if not train:
        raise ConfigError(
            f"config.data.heldout_fraction: {d.heldout_fraction} leaves no training task of {len(tasks)}")
    return list(train), list(heldout)


def validation_split(train: list[Any], config: Any) -> tuple[list[Any], list[Any]]:
    """(GRPO's training tasks, validation tasks): `eval.validation_tasks` of the training tasks, those with
    the smallest task-id hash salted with the seed (any task order gives the same ones), kept out of GRPO's
    batches; the step the final evaluation reports is chosen on them (`eval.select="validation"`), never on
    the held-out corpora. None asked: `(train, [])`."""
    n = config.eval.validation_tasks
    if not n:
        return list(train), []
    if n > len(train) - config.data.tasks_per_batch:
        raise ConfigError(f"config.eval.validation_tasks: {n} of the {len(train)} training tasks leaves "
                          f"fewer than a batch (data.tasks_per_batch={config.data.tasks_per_batch}) to "
                          "train on")
    salt = f"validation:{config.seed}"
    chosen = {t.task_id for t in sorted(train, key=lambda t: (data.task_hash_fraction(t.task_id, salt=salt),
                                                                t.task_id))[:n]}
    return [t for t in train if t.task_id not in chosen], [t for t in train if t.task_id in chosen]


def starting_workspace(task: Any) -> Workspace:
    """The OLD workspace of an update task: one extractive file per document (titled by the document), as a
    warm-start `own_doc` builder with the extractive executor writes it; deterministic, no model."""
    ws = Workspace.from_documents(list(task.documents))
    for d in ws.raw_docs:
        title = d.title or d.doc_id
        ws.create_file(title, [d.path], extractive_text(title, "", [(d.path, d.text)]), turn=0)
    return ws


def update_tasks(tasks: list[Any], config: RunConfig) -> list[Any]:
    """`data.update_fraction` of `tasks` (chosen by task-id hash, salted with the seed) replaced by update
    tasks (issue 42): the task's corpus mutated (`data.mutate.mutate_task`, `data.update_changes`), its
    questions asked again from the new corpus, and in its meta (`workspace.UPDATE_META`) the old workspace
    (`starting_workspace`) carried over to it, with the builder's turn budget. The episode then starts from
    that workspace and the update prompt; probes and the terminal reward score the new questions."""
    require_typed(config, RUN_SCHEMAS, "inputs.update_tasks")
    d = config.data
    frac = d.update_fraction
    if frac <= 0:
        return list(tasks)
    out = []
    for t in tasks:
        if data.task_hash_fraction(t.task_id, salt=f"update:{config.seed}") >= frac:
            out.append(t)
            continue
        m = mutate_task(t, config.seed, d.update_changes, len(t.questions))
        start = carry_over(starting_workspace(t), m.task.documents, config.rollout.config.builder.max_turns)
        out.append(dataclasses.replace(m.task, meta={**m.task.meta, UPDATE_META: start}))
    logging.info("data: %d of %d training tasks are update tasks (data.update_fraction %.2f)",
                 sum(UPDATE_META in t.meta for t in out), len(out), frac)
    return out


def split_rule(config: RunConfig) -> dict[str, Any]:
    """How `build_tasks` split the tasks, for split.json: `split_file`, a seeded draw of `heldout_count`
    (`split_seed`), the task-id hash (`heldout_fraction`) or none; and the ids `exclude_file` lists."""
    require_typed(config, RUN_SCHEMAS, "inputs.split_rule")
    d = config.data
    if d.split_file:
        rule: dict[str, Any] = {"rule": "split_file", "split_file": d.split_file}
    elif d.heldout_count:
        rule = {"rule": "seeded_draw", "heldout_count": d.heldout_count, "split_seed": d.split_seed}
    elif d.heldout_fraction:
        rule = {"rule": "task_id_hash", "heldout_fraction": d.heldout_fraction}
    else:
        rule = {"rule": "none"}
    if d.exclude_file:
        rule.update(exclude_file=d.exclude_file, excluded=data.read_task_ids(d.exclude_file)[1])
    return rule


def write_split(workdir: str, train: list[Any], heldout: list[Any], config: RunConfig | None = None,
                validation: list[Any] | None = None) -> str:
    """Records the run's train / held-out task ids in `workdir/split.json` (and, given the run's `config`,
    how they were split: `split_rule`; the `validation` ids carved from the training split, when any), so
    evaluation uses exactly the held-out tasks this run never trained on (never a re-derived split)."""
    path = storage.join(workdir, SPLIT_FILE)
    out: dict[str, Any] = {"train": [t.task_id for t in train], "heldout": [t.task_id for t in heldout]}
    if validation:
        out["validation"] = [t.task_id for t in validation]
    if config is not None:
        out["split"] = split_rule(config)
    storage.write_text(path, json.dumps(out, indent=1))
    return path


def local_file(path: str, purpose: str) -> str:
    """`path` itself when local; a remote file (`gs://...`) copied once into a local cache directory (for
    readers that need a local file, e.g. SentencePiece)."""
    if not storage.is_remote(path):
        return path
    local = os.path.join(storage.local_cache_dir(storage.dirname(path), purpose), storage.basename(path))
    if not os.path.exists(local):
        storage.copy_file(path, local)
    return local


def build_tokenizer(config: RunConfig, tasks: list[Any], extra_texts: list[str] | None = None) -> Any:
    """The tokenizer: `model.tokenizer`, the HF folder's, or a SentencePiece trained (and cached in
    `workdir/tokenizer`) on the tasks plus the agents' own prompts and tool descriptions (and `extra_texts`,
    e.g. the tool calls of the warm start's demonstrations), so those encode compactly too."""
    require_typed(config, RUN_SCHEMAS, "inputs.build_tokenizer")
    if config.model.tokenizer:
        return tokenizers.load_tokenizer(local_file(config.model.tokenizer, "tokenizer"))
    if config.model.init == "hf":
        return tokenizers.load_tokenizer(config.model.path)
    cache = storage.join(config.workdir, "tokenizer")
    texts = data.world_texts(tasks) + vocabulary.all_texts() + list(extra_texts or [])
    # SentencePiece reads and writes local files: a remote workdir's cache is mirrored in a local directory
    # (models there first copied down, so a restart on another host does not train again; a new one up)
    local = storage.local_cache_dir(cache, "tokenizer")
    remote = local != cache
    if remote:
        for name in storage.listdir(cache):
            if name.endswith(".model") and not os.path.exists(os.path.join(local, name)):
                storage.copy_file(storage.join(cache, name), os.path.join(local, name))
    tokenizer = tokenizers.cached_tokenizer(texts, local, config.model.tokenizer_vocab_size)
    if remote and jax.process_index() == 0:
        for name in sorted(os.listdir(local)):
            if name.endswith(".model") and not storage.exists(storage.join(cache, name)):
                storage.copy_file(os.path.join(local, name), storage.join(cache, name))
    return tokenizer
