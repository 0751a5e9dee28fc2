"""grain pipelines over corpus tasks: seeded shuffle, repeat, per-process sharding, batching, resumable state.

The pipeline is a `grain.MapDataset` over task *indices*; the tasks stay host Python objects and are looked up
at the end, so nothing is serialised per element::

    range(len(shard)) -> shuffle(seed) -> map(index -> CorpusTask) -> batch(tasks_per_batch, list) -> repeat

Shuffling before batching and repeating after keeps every batch inside one epoch (no task twice in a batch);
`repeat` reseeds the shuffle each epoch, so epochs differ but are reproducible.

Checkpointing: `TaskIterator` is a `grain.DatasetIterator`. `it.get_state()` is a JSON-serialisable dict (the
inner grain iterator state plus a fingerprint of the pipeline, checked by `set_state` so a state is never
applied to a different task list, shard or batch size). This project's `librarian_jax.checkpoint` stores that
dict as JSON in each step's `meta`. Because the iterator is a grain `DatasetIterator`, grain's own Orbax
integration also works unchanged: `grain.checkpoint.CheckpointSave(it)` / `CheckpointRestore(it)` with the
legacy `ocp.args` API (handler `grain.checkpoint.CheckpointHandler`, one `process_<i>-of-<n>.json` per
process) and the Orbax v1 `save` / `load` methods `DatasetIterator` defines.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import grain
from absl import logging
from grain._src.core import sharding as grain_sharding

from librarian_jax.data.loaders import load_tasks
from librarian_jax.data.schema import CorpusTask

_STATE_VERSION = 1


def tasks_digest(tasks: Sequence[CorpusTask]) -> str:
    """A short hash of the task ids, in order: what a saved iterator state is tied to."""
    h = hashlib.sha256()
    for t in tasks:
        h.update(t.task_id.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def process_shard() -> tuple[int, int]:
    """`(jax.process_index(), jax.process_count())`, or `(0, 1)` without JAX."""
    return grain_sharding.get_process_index_and_count()


def shard_tasks(
    tasks: Sequence[CorpusTask], shard_index: int, shard_count: int, *, drop_remainder: bool = True
) -> list[CorpusTask]:
    """This shard's contiguous block of `tasks` (grain's `even_split`).

    With `drop_remainder` every shard gets exactly `len(tasks) // shard_count` tasks (so multi-host steps stay
    in lockstep); otherwise the first `len(tasks) % shard_count` shards get one more.
    """
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(
            f"shard_index must be in [0, shard_count), got shard_index={shard_index}, "
            f"shard_count={shard_count}"
        )
    opts = grain.sharding.ShardOptions(
        shard_index=shard_index, shard_count=shard_count, drop_remainder=drop_remainder
    )
    start, end = grain_sharding.even_split(len(tasks), opts)
    return list(tasks[start:end])


class TaskPipeline:
    """Batches of `CorpusTask` for this process.

    Args:
      tasks: the tasks, a path any `load_tasks` format reads, or a zero-argument loader returning tasks.
      tasks_per_batch: tasks in each batch (a list).
      seed: shuffle seed (each epoch is reshuffled from it deterministically).
      shuffle: shuffle at all (False keeps this shard's order).
      num_epochs: passes over the tasks; None repeats forever.
      shard_index, shard_count: this process's shard; default `jax.process_index()` / `jax.process_count()`.
      drop_remainder: drop each epoch's last, short batch.
      even_shards: give every shard the same number of tasks (dropping up to `shard_count - 1`).
      loader_kwargs: keyword arguments for `load_tasks` when `tasks` is a path.
    """

    def __init__(
        self,
        tasks: Sequence[CorpusTask] | str | os.PathLike[str] | Callable[[], Sequence[CorpusTask]],
        *,
        tasks_per_batch: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = 1,
        shard_index: int | None = None,
        shard_count: int | None = None,
        drop_remainder: bool = False,
        even_shards: bool = True,
        loader_kwargs: dict[str, Any] | None = None,
    ):
        if isinstance(tasks, str | os.PathLike):
            tasks = load_tasks(tasks, **(loader_kwargs or {}))
        elif callable(tasks):
            tasks = tasks()
        all_tasks = list(tasks)
        for i, t in enumerate(all_tasks):
            if not isinstance(t, CorpusTask):
                raise TypeError(f"tasks[{i}] is a {type(t).__name__}, expected a CorpusTask")
        seen: dict[str, int] = {}
        for i, t in enumerate(all_tasks):
            if t.task_id in seen:
                raise ValueError(
                    f"duplicate task_id '{t.task_id}' at tasks[{i}] and tasks[{seen[t.task_id]}]"
                )
            seen[t.task_id] = i
        if tasks_per_batch < 1:
            raise ValueError(f"tasks_per_batch must be >= 1, got {tasks_per_batch}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        if shard_index is None or shard_count is None:
            p_index, p_count = process_shard()
            shard_index = p_index if shard_index is None else shard_index
            shard_count = p_count if shard_count is None else shard_count
        self.shard_index, self.shard_count = shard_index, shard_count
        self.tasks = shard_tasks(all_tasks, shard_index, shard_count, drop_remainder=even_shards)
        if not self.tasks:
            raise ValueError(f"shard {shard_index} of {shard_count} holds no tasks ({len(all_tasks)} in all)")
        if drop_remainder and len(self.tasks) < tasks_per_batch:
            raise ValueError(
                f"tasks_per_batch={tasks_per_batch} exceeds this shard's {len(self.tasks)} tasks "
                "with drop_remainder=True: no batch would be produced"
            )
        self.num_total_tasks = len(all_tasks)
        self.all_tasks_digest = tasks_digest(all_tasks)
        self.tasks_per_batch, self.seed, self.shuffle = tasks_per_batch, seed, shuffle
        self.num_epochs, self.drop_remainder, self.even_shards = num_epochs, drop_remainder, even_shards
        logging.info(
            "TaskPipeline: shard %d/%d holds %d of %d tasks, %d batches per epoch",
            shard_index,
            shard_count,
            len(self.tasks),
            len(all_tasks),
            self.batches_per_epoch,
        )

    @property
    def batches_per_epoch(self) -> int:
        n, b = len(self.tasks), self.tasks_per_batch
        return n // b if self.drop_remainder else -(-n // b)

    def fingerprint(self) -> dict[str, Any]:
        """What a saved state must match to be restored into this pipeline.

        With `even_shards` every process yields the same number of batches per epoch, so all processes are at
        the same batch index and a state saved by one (the primary host writes the checkpoint's JSON) restores
        every other: the shard index is then left out of the check.
        """
        return {
            "version": _STATE_VERSION,
            "tasks_digest": self.all_tasks_digest,
            "num_tasks": self.num_total_tasks,
            "shard_index": "any" if self.even_shards else self.shard_index,
            "even_shards": self.even_shards,
            "shard_count": self.shard_count,
            "tasks_per_batch": self.tasks_per_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_epochs": self.num_epochs,
            "drop_remainder": self.drop_remainder,
        }

    def dataset(self) -> grain.MapDataset:
        """The `grain.MapDataset` of batches (`list[CorpusTask]`); random access, `len` = batches in all."""
        tasks = self.tasks
        ds = grain.MapDataset.range(len(tasks))
        if self.shuffle:
            ds = ds.shuffle(seed=self.seed)
        ds = ds.map(tasks.__getitem__)
        ds = ds.batch(self.tasks_per_batch, drop_remainder=self.drop_remainder, batch_fn=list)
        return ds.repeat(self.num_epochs)

    def iterator(self) -> TaskIterator:
        """A fresh iterator at the first batch."""
        return TaskIterator(self)

    def __iter__(self) -> TaskIterator:
        return self.iterator()


class TaskIterator(grain.DatasetIterator):
    """Yields `list[CorpusTask]` batches; `get_state()` / `set_state()` resume exactly (see module doc)."""

    def __init__(self, pipeline: TaskPipeline):
        # Elements are looked up in the calling thread: no worker threads, no prefetch buffer to checkpoint.
        inner = pipeline.dataset().to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        self._inner = iter(inner)
        super().__init__(self._inner)
        self.pipeline = pipeline

    def __next__(self) -> list[CorpusTask]:
        return next(self._inner)

    @property
    def next_batch_index(self) -> int:
        """How many batches this iterator has yielded (since the start of the run)."""
        return int(self._inner.get_state()["next_index"])

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (0-based)."""
        return self.next_batch_index // max(1, self.pipeline.batches_per_epoch)

    def get_state(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline.fingerprint(), "grain": self._inner.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "grain" not in state or "pipeline" not in state:
            raise ValueError(f"not a TaskIterator state (expected keys 'pipeline' and 'grain'): {state!r}")
        mine = self.pipeline.fingerprint()
        for key, value in mine.items():
            saved = state["pipeline"].get(key)
            if saved != value:
                raise ValueError(
                    f"iterator state does not fit this pipeline: '{key}' was {saved!r} when saved, "
                    f"is {value!r} now"
                )
        self._inner.set_state(state["grain"])

    def __str__(self) -> str:
        return (
            f"TaskIterator(shard={self.pipeline.shard_index}/{self.pipeline.shard_count}, "
            f"tasks={len(self.pipeline.tasks)}, next_batch={self.next_batch_index})"
        )


def task_hash_fraction(task_id: str, salt: str = "") -> float:
    """A stable number in [0, 1) from a task id (sha256): the basis of `split_tasks`."""
    digest = hashlib.sha256(f"{salt}\0{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_tasks(
    tasks: Sequence[CorpusTask], held_out: float | int = 0.1, *, salt: str = "librarian"
) -> tuple[list[CorpusTask], list[CorpusTask]]:
    """Deterministic `(train, held_out)` split by task-id hash, independent of task order.

    A float in [0, 1) holds out each task whose hash fraction is below it (a task keeps its side whatever
    other tasks exist); an int holds out exactly that many tasks, those with the smallest hashes. Both sides
    keep the input order.
    """
    if isinstance(held_out, bool) or not isinstance(held_out, int | float):
        raise TypeError(f"held_out must be a float fraction or an int count, got {held_out!r}")
    scores = [task_hash_fraction(t.task_id, salt) for t in tasks]
    if isinstance(held_out, int):
        if not 0 <= held_out <= len(tasks):
            raise ValueError(f"held_out count must be in [0, {len(tasks)}], got {held_out}")
        chosen = set(sorted(range(len(tasks)), key=lambda i: (scores[i], tasks[i].task_id))[:held_out])
    else:
        if not 0.0 <= held_out < 1.0:
            raise ValueError(f"held_out fraction must be in [0, 1), got {held_out}")
        chosen = {i for i, s in enumerate(scores) if s < held_out}
    train = [t for i, t in enumerate(tasks) if i not in chosen]
    test = [t for i, t in enumerate(tasks) if i in chosen]
    return train, test
