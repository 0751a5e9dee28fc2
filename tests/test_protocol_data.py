"""The paper's data protocol (issue 12, item 8): the split as data, the noisy variant's document cap, the
reuse question set per corpus, and BRIGHT's N sampled questions per domain, from `configs/grpo.py` keys."""

from __future__ import annotations

import json
import pathlib
import types

import pytest

from configs import grpo
from librarian_jax import config_validation, data, inputs
from librarian_jax.config_schema import GRPOConfig
from librarian_jax.config_validation import ConfigError


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task_rows(n: int) -> list[dict]:
    """The paper's task JSONL: one hidden question per corpus."""
    return [
        {"question_id": f"q{i}", "question": f"What is {i}?", "gold_answer": str(i),
         "docs": [{"doc_id": f"d{i}-{j}", "text": f"doc {j} of {i}", "is_gold": j == 0} for j in range(3)]}
        for i in range(n)
    ]


def _build_tasks(config):
    return inputs.build_tasks(GRPOConfig.parse(config))


def _file_config(path: str, **data_keys) -> object:
    c = grpo.get_config("embedded")
    c.warm_start.enabled = False
    c.data.update({"source": "file", "path": path, "format": "auto", "heldout_fraction": 0.25, **data_keys})
    return c


def test_config_declares_the_keys_embedded_off_paper_on():
    base, paper = grpo.get_config("embedded").data, grpo.get_config("qwen3_5_4b").data
    assert (base.split_file, base.max_docs, base.reuse_questions, base.questions_per_domain) == ("", 0, "", 0)
    assert (paper.max_docs, paper.questions_per_domain) == (50, 50)


def test_split_file_decides_the_split_and_write_split_records_it(tmp_path):
    path = _write_jsonl(tmp_path / "tasks.jsonl", _task_rows(8))
    # the paper's shape: train, held-out, and tasks in neither (excluded); the file's order is kept
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["q5", "q0", "q1", "q2"], "heldout": ["q7", "q3"]}))
    train, held = _build_tasks(_file_config(path, split_file=str(split)))
    assert [t.task_id for t in train] == ["q5", "q0", "q1", "q2"]
    assert [t.task_id for t in held] == ["q7", "q3"]
    out = tmp_path / "run"
    out.mkdir()
    with open(inputs.write_split(str(out), train, held)) as f:
        assert json.load(f) == {"train": ["q5", "q0", "q1", "q2"], "heldout": ["q7", "q3"]}
    # held-out ids only, one a line: every other task trains
    ids = tmp_path / "heldout.txt"
    ids.write_text("q6\n\nq1\n")
    train, held = _build_tasks(_file_config(path, split_file=str(ids)))
    assert [t.task_id for t in held] == ["q6", "q1"]
    assert [t.task_id for t in train] == ["q0", "q2", "q3", "q4", "q5", "q7"]


def test_without_a_split_file_a_seeded_draw_holds_out_n_and_excluded_ids_are_in_neither(tmp_path):
    """The paper preset's split without the authors' file: `heldout_count` tasks drawn with `split_seed`
    (the same draw every time, another with another seed), `exclude_file` ids in neither side, and
    split.json records the rule, the seed and the excluded ids."""
    path = _write_jsonl(tmp_path / "tasks.jsonl", _task_rows(20))
    excl = tmp_path / "excluded.txt"
    excl.write_text("q3\nq4\nq99\n")  # an id not in the data is only counted in the log
    cfg = _file_config(path, heldout_fraction=0.0, heldout_count=5, split_seed=7, exclude_file=str(excl))
    train, held = _build_tasks(cfg)
    ids = [t.task_id for t in train + held]
    assert len(held) == 5 and len(train) == 13 and "q3" not in ids and "q4" not in ids
    assert [t.task_id for t in _build_tasks(cfg)[1]] == [t.task_id for t in held]  # recorded seed
    cfg.data.split_seed = 8
    assert [t.task_id for t in _build_tasks(cfg)[1]] != [t.task_id for t in held]
    cfg.data.split_seed = 7
    out = tmp_path / "run"
    out.mkdir()
    with open(inputs.write_split(str(out), train, held, GRPOConfig.parse(cfg))) as f:
        rec = json.load(f)
    assert rec["heldout"] == [t.task_id for t in held]
    assert rec["split"] == {"rule": "seeded_draw", "heldout_count": 5, "split_seed": 7,
                            "exclude_file": str(excl), "excluded": ["q3", "q4", "q99"]}
    with pytest.raises(ConfigError, match=r"config\.data\.heldout_count: 18 leaves no training task"):
        _build_tasks(_file_config(path, heldout_fraction=0.0, heldout_count=18, exclude_file=str(excl)))
    paper = grpo.get_config("qwen3_5_4b").data
    assert (paper.heldout_count, paper.split_seed, paper.exclude_file) == (50, 0, "")


def test_split_file_id_not_in_the_data_names_file_and_id(tmp_path):
    path = _write_jsonl(tmp_path / "tasks.jsonl", _task_rows(4))
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"heldout": ["q1", "q99"]}))
    with pytest.raises(ConfigError, match=rf"config\.data\.split_file: {split}: task id 'q99' is not in"):
        _build_tasks(_file_config(path, split_file=str(split)))
    # the eval side reads task-id files with the same reader
    assert data.read_task_ids(split) == (None, ["q1", "q99"])


def test_max_docs_caps_the_browsecomp_plus_corpora(tmp_path):
    rows = [{"query_id": f"b{i}", "query": "who?", "answer": "x",
             "gold_docs": [{"docid": f"g{i}", "text": "gold"}],
             "evidence_docs": [{"docid": f"e{i}-{k}", "text": "ev"} for k in range(2)],
             "negative_docs": [{"docid": f"n{i}-{k}", "text": f"neg {k}"} for k in range(70)]}
            for i in range(3)]
    path = _write_jsonl(tmp_path / "bcp.jsonl", rows)
    full, _ = _build_tasks(_file_config(path, heldout_fraction=0.0))
    assert [len(t.documents) for t in full] == [73, 73, 73]
    capped, _ = _build_tasks(_file_config(path, heldout_fraction=0.0, max_docs=50))
    assert [len(t.documents) for t in capped] == [50, 50, 50]
    for i, t in enumerate(capped):  # every support document kept
        assert {f"g{i}", f"e{i}-0", f"e{i}-1"} <= {d.doc_id for d in t.documents}
    again, _ = _build_tasks(_file_config(path, heldout_fraction=0.0, max_docs=50))
    assert [[d.doc_id for d in t.documents] for t in again] == [
        [d.doc_id for d in t.documents] for t in capped]


def test_reuse_questions_load_per_corpus(tmp_path):
    path = _write_jsonl(tmp_path / "tasks.jsonl", _task_rows(3))
    reuse = _write_jsonl(tmp_path / "reuse.jsonl", [
        # the paper's reuse-set row (question_id names the corpus, docs ignored) and a bare task_id row
        {"question_id": "q0", "docs": [], "amortization_questions": [
            {"question_id": "q0/r0", "question": "a?", "gold_answer": "A", "estimated_difficulty": 2},
            {"question_id": "q0/r1", "question": "b?", "gold_answer": "B"}]},
        {"task_id": "q2",
         "reuse_questions": [{"question_id": "q2/r0", "question": "c?", "gold_answer": "C"}]},
    ])
    tasks, _ = _build_tasks(_file_config(path, heldout_fraction=0.0, reuse_questions=reuse))
    by_id = {t.task_id: t for t in tasks}
    assert [q.question_id for q in by_id["q0"].reuse_questions] == ["q0/r0", "q0/r1"]
    assert by_id["q0"].reuse_questions[0].meta["estimated_difficulty"] == 2
    assert [q.gold_answer for q in by_id["q2"].reuse_questions] == ["C"]
    assert by_id["q1"].reuse_questions == ()
    assert [q.question_id for q in by_id["q0"].questions] == ["q0"]  # hidden questions untouched
    bad = _write_jsonl(tmp_path / "bad.jsonl", [
        {"task_id": "q7", "reuse_questions": [{"question_id": "r", "question": "?", "gold_answer": "x"}]}])
    with pytest.raises(ConfigError, match=rf"config\.data\.reuse_questions: {bad}:1: task id 'q7' is not"):
        _build_tasks(_file_config(path, heldout_fraction=0.0, reuse_questions=bad))


def _bright(root: pathlib.Path, domains: dict[str, int]) -> str:
    for domain, n in domains.items():
        (root / domain).mkdir(parents=True)
        _write_jsonl(root / domain / "documents.jsonl",
                     [{"id": f"{domain}-d{j}", "content": "t"} for j in range(5)])
        _write_jsonl(root / domain / "examples.jsonl", [
            {"id": f"{domain}-q{k}", "query": f"q {k}", "gold_ids": [f"{domain}-d{k % 5}"],
             "gold_answer": "a"} for k in range(n)])
    return str(root)


def test_bright_samples_n_questions_per_domain_deterministically(tmp_path):
    root = _bright(tmp_path / "bright", {"aops": 80, "biology": 120, "stackoverflow": 30})
    everything, _ = _build_tasks(_file_config(root, heldout_fraction=0.0))
    assert [len(t.questions) for t in everything] == [80, 120, 30]

    def sample(seed: int) -> dict[str, list[str]]:
        tasks, _ = _build_tasks(_file_config(root, heldout_fraction=0.0, questions_per_domain=50,
                                                 sample_seed=seed))
        return {t.task_id: [q.question_id for q in t.questions] for t in tasks}

    first = sample(0)
    assert {k: len(v) for k, v in first.items()} == {"bright/aops": 50, "bright/biology": 50,
                                                     "bright/stackoverflow": 30}  # fewer than N: all kept
    assert sample(0) == first
    other = sample(1)
    assert other["bright/aops"] != first["bright/aops"] and other["bright/stackoverflow"] == first[
        "bright/stackoverflow"]
    order = {q.question_id: i for t in everything for i, q in enumerate(t.questions)}
    for ids in first.values():  # a subset, in the file's order
        assert [order[i] for i in ids] == sorted(order[i] for i in ids)


def test_eval_bright_preset_samples_the_same_questions(tmp_path):
    from configs import eval as eval_config
    from librarian_jax.eval import cli

    root = _bright(tmp_path / "bright", {"aops": 80, "biology": 60})
    c = eval_config.get_config("bright")
    c.tasks = root
    plan = types.SimpleNamespace(config=c, settings=cli.EvalConfig.parse(c), run_dir="", run_cfg=None)
    tasks, _ = cli.heldout_tasks(plan)
    train, _ = _build_tasks(_file_config(root, heldout_fraction=0.0, questions_per_domain=50))
    assert [len(t.questions) for t in tasks] == [50, 50]
    assert [[q.question_id for q in t.questions] for t in tasks] == [
        [q.question_id for q in t.questions] for t in train]


@pytest.mark.parametrize("key,value,message", [
    ("split_file", "/no/such/split.json", "is not a file"),
    ("split_file", "/", "is not a file"),
    ("reuse_questions", "/no/such/reuse.jsonl", "is not a file"),
    ("max_docs", -1, "must be >= 0"),
    ("questions_per_domain", -5, "must be >= 0"),
    ("sample_seed", -1, "must be >= 0"),
])
def test_validation_names_the_bad_key(tmp_path, key, value, message):  # (ConfigDict itself refuses types)
    c = _file_config(_write_jsonl(tmp_path / "tasks.jsonl", _task_rows(2)))
    c.data[key] = value
    with pytest.raises(ConfigError, match=rf"config\.data\.{key}: .*{message}"):
        config_validation.validate_common(c)


def test_validation_reads_the_split_and_reuse_files(tmp_path):
    c = _file_config(_write_jsonl(tmp_path / "tasks.jsonl", _task_rows(2)))
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["q0"], "heldout": ["q0"]}))
    c.data.split_file = str(split)
    with pytest.raises(ConfigError, match=r"config\.data\.split_file: .*'q0' is in both 'train' and"):
        config_validation.validate_common(c)
    c.data.split_file = ""
    c.data.reuse_questions = _write_jsonl(tmp_path / "reuse.jsonl", [{"task_id": "q0"}])
    with pytest.raises(ConfigError, match=r"config\.data\.reuse_questions: .*amortization_questions"):
        config_validation.validate_common(c)
    synthetic = grpo.get_config("embedded")
    synthetic.data.max_docs = 50
    with pytest.raises(ConfigError, match=r"config\.data\.max_docs: applies to data\.source='file'"):
        config_validation.validate_common(synthetic)


def test_validation_corpora_come_from_the_training_split_the_same_for_any_order(tmp_path):
    """`eval.validation_tasks` (the corpora `eval.select="validation"` chooses the step on): that many
    training tasks, none held out, the same ones however the training tasks are ordered and another draw
    with another seed; split.json records them apart from `train`; asking for so many that less than a batch
    is left to train on names the key."""
    path = _write_jsonl(tmp_path / "tasks.jsonl", _task_rows(20))
    cfg = _file_config(path)
    cfg.eval.update(select="validation", validation_tasks=4)
    settings = GRPOConfig.parse(cfg)
    train, held = _build_tasks(cfg)
    rest, val = inputs.validation_split(train, settings)
    ids = {t.task_id for t in val}
    assert len(val) == 4 and len(rest) == len(train) - 4 and not ids & {t.task_id for t in rest + held}
    assert {t.task_id for t in inputs.validation_split(train[::-1], settings)[1]} == ids
    cfg.seed = 1
    assert {t.task_id for t in inputs.validation_split(train, GRPOConfig.parse(cfg))[1]} != ids
    out = tmp_path / "run"
    out.mkdir()
    with open(inputs.write_split(str(out), rest, held, settings, validation=val)) as f:
        rec = json.load(f)
    assert rec["validation"] == [t.task_id for t in val] and not set(rec["validation"]) & set(rec["train"])
    assert inputs.validation_split(train, GRPOConfig.parse(_file_config(path))) == (train, [])  # none asked
    cfg.eval.validation_tasks = len(train) - cfg.data.tasks_per_batch + 1
    with pytest.raises(ConfigError, match=r"config\.eval\.validation_tasks: 12 of the 15 training tasks"):
        inputs.validation_split(train, GRPOConfig.parse(cfg))
