"""grain task pipelines: shuffling, epochs, sharding across processes, resumable iterator state, splits."""

from __future__ import annotations

import collections
import json

import grain
import pytest

from librarian_jax.data import CorpusTask, Document, Question, save_tasks
from librarian_jax.data.pipeline import TaskPipeline, shard_tasks, split_tasks, task_hash_fraction


def _tasks(n: int, prefix: str = "t") -> list[CorpusTask]:
    return [
        CorpusTask(
            task_id=f"{prefix}{i:03d}",
            documents=(Document(doc_id="d", text=f"text {i}"),),
            questions=(Question(question_id="q", question="?", gold_answer=str(i)),),
        )
        for i in range(n)
    ]


def _ids(batch: list[CorpusTask]) -> list[str]:
    return [t.task_id for t in batch]


def test_epochs_are_seeded_permutations_and_batches_stay_in_one_epoch():
    tasks = _tasks(10)
    batches = [
        _ids(b)
        for b in TaskPipeline(
            tasks, tasks_per_batch=3, seed=5, num_epochs=3, shard_index=0, shard_count=1
        ).iterator()
    ]
    assert [len(b) for b in batches] == [3, 3, 3, 1] * 3
    epochs = [sum(batches[4 * e : 4 * e + 4], []) for e in range(3)]
    for e in epochs:
        assert sorted(e) == [t.task_id for t in tasks]
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch
    assert epochs[0] != [t.task_id for t in tasks]
    again = [
        _ids(b)
        for b in TaskPipeline(tasks, tasks_per_batch=3, seed=5, num_epochs=3, shard_count=1, shard_index=0)
    ]
    assert again == batches
    other = [
        _ids(b)
        for b in TaskPipeline(tasks, tasks_per_batch=3, seed=6, num_epochs=1, shard_count=1, shard_index=0)
    ]
    assert sum(other, []) != epochs[0]
    dropped = TaskPipeline(
        tasks, tasks_per_batch=3, seed=5, num_epochs=2, drop_remainder=True, shard_index=0, shard_count=1
    )
    assert [len(b) for b in dropped] == [3] * 6 and dropped.batches_per_epoch == 3
    ordered = TaskPipeline(tasks, tasks_per_batch=4, shuffle=False, shard_index=0, shard_count=1)
    assert sum((_ids(b) for b in ordered), []) == [t.task_id for t in tasks]


def test_restored_iterator_yields_the_same_next_batches():
    pipe = TaskPipeline(_tasks(7), tasks_per_batch=2, seed=1, num_epochs=None, shard_index=0, shard_count=1)
    it = pipe.iterator()
    for _ in range(5):  # past the first epoch boundary (4 batches per epoch)
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what the checkpoint stores
    assert it.epoch == 1 and it.next_batch_index == 5
    expected = [_ids(next(it)) for _ in range(6)]
    fresh = TaskPipeline(
        _tasks(7), tasks_per_batch=2, seed=1, num_epochs=None, shard_index=0, shard_count=1
    ).iterator()
    fresh.set_state(state)
    assert [_ids(next(fresh)) for _ in range(6)] == expected
    it.set_state(state)  # rewinding an iterator works too
    assert _ids(next(it)) == expected[0]


def test_state_refuses_a_different_pipeline():
    it = TaskPipeline(_tasks(6), tasks_per_batch=2, seed=1, shard_index=0, shard_count=1).iterator()
    next(it)
    state = it.get_state()
    with pytest.raises(ValueError, match="'tasks_per_batch' was 2 when saved, is 3 now"):
        TaskPipeline(_tasks(6), tasks_per_batch=3, seed=1, shard_index=0, shard_count=1).iterator().set_state(
            state
        )
    with pytest.raises(ValueError, match="'tasks_digest'"):
        TaskPipeline(
            _tasks(6, "u"), tasks_per_batch=2, seed=1, shard_index=0, shard_count=1
        ).iterator().set_state(state)
    with pytest.raises(ValueError, match="not a TaskIterator state"):
        it.set_state({"next_index": 3})


def test_grain_orbax_handler_round_trips_the_iterator(tmp_path):
    pipe = TaskPipeline(_tasks(9), tasks_per_batch=2, seed=3, num_epochs=None, shard_index=0, shard_count=1)
    it = pipe.iterator()
    next(it), next(it)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(tmp_path, args=grain.checkpoint.CheckpointSave(it))
    saved = json.loads(next(tmp_path.glob("process_*-of-*.json")).read_text())
    assert saved == it.get_state()
    restored = handler.restore(tmp_path, args=grain.checkpoint.CheckpointRestore(pipe.iterator()))
    assert _ids(next(restored)) == _ids(next(it))


def test_two_processes_get_disjoint_shards():
    tasks = _tasks(11)
    shards = [TaskPipeline(tasks, tasks_per_batch=2, seed=0, shard_index=i, shard_count=2) for i in range(2)]
    seen = [collections.Counter(t.task_id for b in p for t in b) for p in shards]
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) == len(seen[1]) == 5  # even shards: one task left out
    assert all(c == 1 for s in seen for c in s.values())
    uneven = [shard_tasks(tasks, i, 2, drop_remainder=False) for i in range(2)]
    assert [len(u) for u in uneven] == [6, 5]
    assert sorted(t.task_id for u in uneven for t in u) == [t.task_id for t in tasks]
    with pytest.raises(ValueError, match="holds no tasks"):
        TaskPipeline(_tasks(1), shard_index=1, shard_count=2)
    # with even shards, the state the primary host saved restores the other process at the same batch
    its = [p.iterator() for p in shards]
    for it in its:
        next(it), next(it)
    its[1].set_state(its[0].get_state())
    assert not {t.task_id for t in next(its[1])} & seen[0].keys()
    uneven_pipes = [
        TaskPipeline(tasks, tasks_per_batch=2, shard_index=i, shard_count=2, even_shards=False)
        for i in range(2)
    ]
    with pytest.raises(ValueError, match="'shard_index' was 0 when saved, is 1 now"):
        uneven_pipes[1].iterator().set_state(uneven_pipes[0].iterator().get_state())
    default = TaskPipeline(tasks)  # jax.process_index() / process_count() in a single process
    assert (default.shard_index, default.shard_count) == (0, 1) and len(default.tasks) == 11


def test_pipeline_reads_a_path_or_a_loader(tmp_path):
    path = tmp_path / "tasks.jsonl"
    save_tasks(_tasks(4), path)
    from_path = TaskPipeline(path, tasks_per_batch=4, shuffle=False, shard_index=0, shard_count=1)
    assert _ids(next(from_path.iterator())) == ["t000", "t001", "t002", "t003"]
    from_loader = TaskPipeline(
        lambda: _tasks(3), tasks_per_batch=3, shuffle=False, shard_index=0, shard_count=1
    )
    assert len(next(iter(from_loader))) == 3
    with pytest.raises(ValueError, match="duplicate task_id 't000'"):
        TaskPipeline(_tasks(2) + _tasks(1), shard_index=0, shard_count=1)
    with pytest.raises(ValueError, match="tasks_per_batch"):
        TaskPipeline(_tasks(2), tasks_per_batch=0, shard_index=0, shard_count=1)


def test_split_by_task_id_hash_is_deterministic_and_order_free():
    tasks = _tasks(200)
    train, held = split_tasks(tasks, 0.25)
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    assert len(train) + len(held) == 200 and 30 <= len(held) <= 70
    assert split_tasks(list(reversed(tasks)), 0.25)[1] == list(reversed(held))
    more_train, more_held = split_tasks(tasks + _tasks(50, "x"), 0.25)  # adding tasks moves none of the old
    assert {t.task_id for t in held} <= {t.task_id for t in more_held}
    assert {t.task_id for t in train} <= {t.task_id for t in more_train}
    exact_train, exact_held = split_tasks(tasks, 50)
    assert len(exact_held) == 50 and len(exact_train) == 150
    assert split_tasks(tasks, 50, salt="other")[1] != exact_held
    assert all(0.0 <= task_hash_fraction(t.task_id) < 1.0 for t in tasks)
    with pytest.raises(ValueError, match="fraction"):
        split_tasks(tasks, 1.5)
