"""Evaluation split across processes (issue 14): `python -m librarian_jax.main --config=configs/eval.py` as 2
JAX processes x 4 simulated CPU devices, each building and answering its own contiguous share of the held-out
corpora, gives the records and table of the same evaluation as 1 process x 8 devices; and, in one process,
the pieces that make that hold: shares, episode seeds that do not depend on the split, answer seeds that do
not depend on Python's per-process string hash.

The real runs evaluate a run directory made from the committed warm-start fixture (tests/fixtures/warm_start,
a builder that writes valid calls) with a sampling builder (2 constructions per corpus, one turn that the
builder ends itself), so an episode's seed shows in its records (the construction's length): a process that
drew other seeds than the 1-process run would write other records. The 1-process launch reads the
programs the 2-process one compiled (one compilation cache: the suite's, else a tmp one), and the build test's
launches read the engine programs of the eval test's: ~50 s on 2 cores at load 4-5.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from multiproc import free_port, launch_env, wait_all

from librarian_jax import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "warm_start_classic")  # the classic world's warm start
NUM_CORPORA = 5  # uneven over 2 processes: [0, 3) and [3, 5)
BATCH_TASKS = 2  # process 1's share starts inside a chunk (corpus 3 of chunk [2, 4))
SAMPLES = 2  # sampled constructions per corpus


# ------------------------------------------------------------------------------ the pieces, in one process


def test_shares_are_contiguous_uneven_and_may_be_empty():
    from librarian_jax import distributed

    for n in range(0, 9):
        for count in (1, 2, 3, 5):
            parts = [distributed.share(n, p, count) for p in range(count)]
            want = np.array_split(np.arange(n), count)
            assert [list(range(n))[s] for s in parts] == [list(w) for w in want], (n, count)
    assert distributed.share(1, 1, 2) == slice(1, 1)  # more processes than corpora: an empty share
    assert distributed.share(7) == slice(0, 7)  # this (single) process: everything


def test_answer_seeds_do_not_depend_on_the_process_hash_seed(monkeypatch):
    """The answerer's stream of a job is a function of (seed, corpus id, construction) alone: pinned values
    (red on `hash(task_id)`, which PYTHONHASHSEED salts per process), and `answer_jobs` uses it."""
    from librarian_jax.eval import pipeline
    from librarian_jax.rollout import jobs

    assert pipeline.task_seed("task_0003") == 3860922803
    assert int(pipeline.answer_rng(0, "task_0003", 1).integers(2**62)) == 1197510428464194297
    seen = []

    def context(tokenizer, template, by_role, rng, **kw):
        seen.append(int(rng.integers(2**62)))

    class Scheduler:
        def __init__(self, by_role):
            pass

        def run(self, gens):
            return [[] for _ in gens]

    monkeypatch.setattr(jobs, "AgentContext", context)
    monkeypatch.setattr(jobs, "Scheduler", Scheduler)

    class Task:
        def __init__(self, task_id):
            self.task_id = task_id

    jobs = [pipeline.Job("trained", Task(t), object(), 1, episode=e)
            for t in ("task_0003", "x") for e in (0, 1)]
    pipeline.answer_jobs(jobs, lambda: {"frozen": None}, None, pipeline.R.RolloutConfig(),
                         templates={"answerer": None}, seed=0, progress=False)
    assert seen[1] == 1197510428464194297
    assert seen == [int(pipeline.answer_rng(0, j.task.task_id, j.episode).integers(2**62)) for j in jobs]


def _fake_run_batch(seeds: dict[tuple[str, int], int], bad: str = ""):
    """A `rollout.run_batch` that draws each episode's seed as the real one does (task-major), records it in
    `seeds`, and builds a workspace of the raw documents whose construction tokens come from the seed. A
    batch holding `bad` with other corpora raises."""
    from librarian_jax.rollout import EpisodeRecord
    from librarian_jax.workspace import Workspace

    def run_batch(batch, group_size, engines, tokenizer, config, rng=0, **kw):
        if len(batch) > 1 and any(t.task_id == bad for t in batch):
            raise RuntimeError("a batch with the bad corpus crashed")
        rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(int(rng))
        out = []
        for i, t in enumerate(batch):
            for g in range(group_size):
                s = int(rng.integers(2**62))
                seeds[(t.task_id, g)] = s
                out.append(EpisodeRecord(
                    t.task_id, i, g, [], [], 0.0, 0.0,
                    workspace_snapshots={"final": Workspace.from_documents(list(t.documents)).to_dict(
                        include_raw_text=False)},
                    token_counts={"builder_generated": s % 100003}))
        return out

    return run_batch


def test_a_share_builds_with_the_episode_seeds_of_the_whole_build(monkeypatch):
    """`build_workspaces` on each process's share (with its `start`) draws exactly the episode seeds a build
    over all corpora draws (chunks at global multiples of batch_tasks; the 1-process seeds are the ones it
    always drew: chunk k from default_rng(seed + k * batch_tasks * group)), a corpus re-run alone after its
    batch failed included; so the Built lists, concatenated, are the whole build's."""
    from librarian_jax import data, distributed
    from librarian_jax.eval import pipeline
    from librarian_jax.rollout import jobs

    tasks = data.generate_world(3, 7, docs_per_task=2, min_words=20, max_words=30, questions_per_task=1)
    seeds: dict[tuple[str, int], int] = {}
    # corpus 4's batch fails: each corpus of that chunk is re-run alone
    monkeypatch.setattr(jobs, "run_batch", _fake_run_batch(seeds, bad=tasks[4].task_id))
    cfg = cluster.mode_rollout(pipeline.R.RolloutConfig(), cluster.Mode.EVAL)
    kw = dict(group_size=2, seed=11, batch_tasks=3, progress=False)

    def build(part):
        return [(b.task.task_id, b.episode, b.construction_tokens, b.failed)
                for b in pipeline.build_workspaces("m", tasks[part], dict, None, cfg, start=part.start,
                                                    templates={"policy": None}, **kw)]

    whole = build(slice(0, len(tasks)))
    whole_seeds = dict(seeds)
    expected = {}
    for k in range(0, len(tasks), 3):
        rng = np.random.default_rng(11 + k * 2)
        for t in tasks[k:k + 3]:
            for g in range(2):
                expected[(t.task_id, g)] = int(rng.integers(2**62))
    assert whole_seeds == expected
    assert all(not f for *_, f in whole)
    for count in (2, 3, 4, 8):
        seeds.clear()
        split = [b for p in range(count) for b in build(distributed.share(len(tasks), p, count))]
        assert split == whole, count
        assert seeds == whole_seeds, count


@pytest.mark.parametrize("num_corpora", [5, 1])
def test_periodic_eval_on_two_processes_returns_the_one_process_records_and_metrics(monkeypatch, num_corpora):
    """Training's periodic eval split over 2 processes, emulated in one: process 0 builds and answers its
    share and hands its records to the gather; process 1 does its share (none of 1 corpus) and gets both
    (process order), as the collective gives them; what process 1 returns is the 1-process records and
    metrics (times aside)."""
    from librarian_jax import data, distributed
    from librarian_jax.eval import pipeline
    from librarian_jax.rollout import jobs

    tasks = data.generate_world(5, num_corpora, docs_per_task=2, min_words=20, max_words=30,
                                questions_per_task=2)
    monkeypatch.setattr(jobs, "run_batch", _fake_run_batch({}))

    def answer_jobs(jobs, engines, tokenizer, config, *, seed=0, progress=True, **kw):
        t = [j.construction_tokens for j in jobs]
        return [[{"question_id": q.question_id, "repeat": r, "answer": "", "correct": n % 2,
                  "prompt_tokens": n % 997, "generated_tokens": 1, "turns": 1, "forced": False}
                 for q in pipeline.questions_of(j.task, config) for r in range(j.samples)]
                for j, n in zip(jobs, t, strict=True)]

    monkeypatch.setattr(pipeline, "answer_jobs", answer_jobs)
    cfg = pipeline.R.RolloutConfig()

    def run():
        return pipeline.periodic_eval(tasks, {}, None, cfg, seed=7, repeats=2, templates={"policy": None})

    def times_aside(metrics):
        return {k: v for k, v in metrics.items() if not k.endswith("_s")}

    one_records, one_metrics = run()

    class Handed(Exception):
        """Process 0 waits at the gather (here: stops there)."""

    sent = []

    def gather(obj, what):
        sent.append(obj)
        if len(sent) < 2:
            raise Handed
        return list(sent)

    monkeypatch.setattr(distributed, "gather", gather)
    real_share = distributed.share
    for p in range(2):
        monkeypatch.setattr(distributed, "share", lambda n, p=p: real_share(n, p, 2))
        try:
            records, metrics = run()
        except Handed:
            assert p == 0
    mine = sum(2 * len(pipeline.questions_of(t, cfg)) for t in tasks[real_share(len(tasks), 0, 2)])
    assert len(sent) == 2 and len(sent[0][0][1]) == mine
    assert records == one_records and times_aside(metrics) == times_aside(one_metrics)
    assert {"eval/build_s", "eval/answer_s"} <= set(metrics)
    if num_corpora > 1:
        assert len({r["tokens_read"] for r in one_records}) > 1  # the seeds show in the records


def test_builds_fill_the_builder_engines_slots(monkeypatch):
    """`batch_tasks` 0 (configs/eval.py's default) builds as many corpora at once as the builder's engine has
    slots for (it decodes every slot each round); training's periodic evaluation does the same."""
    from types import SimpleNamespace

    from librarian_jax import data
    from librarian_jax.eval import pipeline
    from librarian_jax.rollout import jobs

    assert [jobs.batch_tasks_for(*a) for a in [(0, 16, 1), (0, 16, 3), (0, 2, 4), (5, 16, 1), (0, 0, 1)]] == [
        16, 5, 1, 5, jobs.DEFAULT_BATCH_TASKS]
    from configs import eval as eval_config
    assert eval_config.get_config().batch_tasks == 0

    tasks = data.generate_world(6, 14, docs_per_task=2, min_words=20, max_words=30, questions_per_task=1)
    sizes: list[int] = []
    fake = _fake_run_batch({})
    monkeypatch.setattr(jobs, "run_batch", lambda batch, *a, **kw: sizes.append(len(batch)) or fake(batch, *a,
                                                                                                         **kw))

    def answer_jobs(jobs_, engines, tokenizer, config, **kw):
        return [[{"question_id": q.question_id, "repeat": 0, "answer": "", "correct": 1, "prompt_tokens": 1,
                  "generated_tokens": 1, "turns": 1, "forced": False}
                 for q in pipeline.questions_of(j.task, config)] for j in jobs_]

    monkeypatch.setattr(pipeline, "answer_jobs", answer_jobs)
    for slots, want in ((16, [14]), (4, [4, 4, 4, 2]), (None, [8, 6])):
        sizes.clear()
        engines = {} if slots is None else {"policy": SimpleNamespace(num_slots=slots)}
        pipeline.periodic_eval(tasks, engines, None, pipeline.R.RolloutConfig(), seed=1,
                               templates={"policy": None})
        assert sizes == want, (slots, sizes)


# ------------------------------------------------------------------------------ 2 processes vs 1



def _run_dir(path: str) -> str:
    """A training workdir whose step 1 is the warm-start fixture (config.json of the embedded preset on
    it, checkpoints/1/params linked to the fixture, split.json holding every corpus of a small world)."""
    from configs import grpo
    from librarian_jax import inputs
    from librarian_jax.config_schema import GRPOConfig

    cfg = grpo.get_config("embedded")
    cfg.workdir = path
    cfg.warm_start.enabled = False
    cfg.model.update(init="orbax", path=FIXTURE, tokenizer=os.path.join(FIXTURE, "tokenizer.model"))
    cfg.data.update(num_tasks=NUM_CORPORA, docs_per_task=3, min_words=20, max_words=30, questions_per_task=1)
    cfg.rollout.update(max_seq_len=1024, round_steps=16)
    # one turn, long enough that the builder ends its call itself: its sampled length (construction tokens)
    # differs from one construction to the next, so a wrong episode seed shows in the records
    cfg.rollout.builder.update(max_turns=1, max_new_tokens=160, compaction_budget=800)
    step = os.path.join(path, "checkpoints", "1")
    os.makedirs(step)
    os.symlink(os.path.join(FIXTURE, "params"), os.path.join(step, "params"))
    open(os.path.join(step, "commit_success.txt"), "w").close()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(cfg.to_json_best_effort(indent=2))
    train, held = inputs.build_tasks(GRPOConfig.parse(cfg))
    with open(os.path.join(path, "split.json"), "w") as f:
        json.dump({"train": [], "heldout": [t.task_id for t in train + held]}, f)
    return path


def _flags(run: str, out: str) -> list[str]:
    return [
        "--config=configs/eval.py", f"--config.run={run}", f"--config.out={out}",
        "--config.methods=trained,raw",
        f"--config.samples={SAMPLES}", "--config.pass_k=1,2", "--config.builder_temperature=1.0",
        f"--config.batch_tasks={BATCH_TASKS}", "--config.bootstrap.draws=100", "--config.cost_qs=1",
        "--config.engine.policy_slots=4", "--config.engine.frozen_slots=4",
    ]


def _start(run: str, out: str, log: str, process_id: int | None, port: int, cache: str,
           flags: list[str] | None = None) -> subprocess.Popen:
    env = launch_env()
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", LIBRARIAN_JAX_COMPILATION_CACHE=cache,
               LIBRARIAN_HEARTBEAT_TIMEOUT_S="30",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={8 if process_id is None else 4} "
                         "--xla_cpu_collective_timeout_seconds=300")
    if process_id is not None:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(process_id))
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "librarian_jax.main", *(flags or _flags(run, out))],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)



def _cache(tmp_path) -> str:
    """The launches' persistent compilation cache: the suite's (tests/run.sh), so both tests' launches read
    what an earlier one compiled, or this test's own."""
    return os.environ.get("LIBRARIAN_JAX_COMPILATION_CACHE") or str(tmp_path / "jax_cache")


def _table(log: str) -> str:
    """The held-out table `run_eval` prints (between the tqdm/absl lines and the `report:` line)."""
    text = open(log).read()
    m = re.search(r"^method .*?(?=^report: )", text, re.M | re.S)
    assert m, text[-3000:]
    return m.group(0)


def _built_episodes(log: str) -> int:
    """Builder episodes this process ran (`rollout.run_batch` logs each batch)."""
    return sum(int(n) for n in re.findall(r"rollout batch: (\d+) episodes", open(log).read()))


@pytest.mark.slow
def test_two_processes_evaluate_their_shares_and_report_what_one_process_does(tmp_path):
    run = _run_dir(str(tmp_path / "run"))
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    logs = [str(tmp_path / f"two.p{i}.log") for i in range(2)]
    port = free_port()
    t0 = time.time()
    cache = _cache(tmp_path)
    wait_all([_start(run, two, logs[i], i, port, cache) for i in range(2)], logs, 300)
    t1 = time.time()
    slog = str(tmp_path / "one.log")
    wait_all([_start(run, one, slog, None, 0, cache)], [slog], 300)
    print(f"2 processes {t1 - t0:.1f}s, 1 process {time.time() - t1:.1f}s")  # noqa: T201

    # each process built and answered its own share: [0, 3) and [3, 5), 2 constructions per corpus
    for i, (a, b) in enumerate([(0, 3), (3, NUM_CORPORA)]):
        text = open(logs[i]).read()
        line = f"eval: process {i} of 2 builds and answers corpora [{a}, {b}) of {NUM_CORPORA}"
        assert line in text, text[-3000:]
        assert _built_episodes(logs[i]) == (b - a) * SAMPLES, text[-3000:]
    assert _built_episodes(slog) == NUM_CORPORA * SAMPLES
    # one report (process 0's), with every process's records: the 1-process run's records and table
    rows = {d: [json.loads(x) for x in open(os.path.join(d, "questions.jsonl"))] for d in (two, one)}
    assert rows[two] == rows[one]
    corpora = json.load(open(os.path.join(run, "split.json")))["heldout"]
    for m in ("trained", "raw", "flattened", "shuffled"):
        assert sorted({r["corpus"] for r in rows[two] if r["method"] == m}) == sorted(corpora), m
    assert _table(logs[0]) == _table(slog)
    res = {d: json.load(open(os.path.join(d, "results.json"))) for d in (two, one)}
    for key in ("accuracy", "cost", "pass_at_k", "ablation", "failed_constructions", "workspaces"):
        assert res[two].get(key) == res[one].get(key), key
    assert res[two]["setup"]["processes"] == 2 and res[one]["setup"]["processes"] == 1
    assert res[two]["workspaces"] == {"trained": NUM_CORPORA}  # process 0 exported every corpus's
    for c in corpora:
        a, b = (os.path.join(d, "workspaces", "trained", c, "manifest.json") for d in (two, one))
        assert open(a).read() == open(b).read(), c
    # the seeds show in the records: the two sampled constructions of a corpus differ in length (a split
    # that drew other seeds would not give the 1-process records above)
    tokens: dict[str, set[int]] = {}
    for r in rows[one]:
        if r["method"] == "trained":
            tokens.setdefault(r["corpus"], set()).add(r["construction_tokens"])
    assert sum(len(v) > 1 for v in tokens.values()) >= 2, tokens


@pytest.mark.slow
def test_build_on_two_processes_exports_what_one_process_does(tmp_path):
    """`configs/build.py` launched as 2 processes x 4 devices (one construction: every process builds it,
    process 0 exports) writes the workspace a 1-process run writes, and only process 0 writes it."""
    run = _run_dir(str(tmp_path / "run"))
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("Orlen Vask works at the Amber Institute in Tarn.\n")
    (folder / "b.md").write_text("# Lab\nThe Tarn lab studies glass and is run by Orlen Vask.\n")
    outs = {n: str(tmp_path / n) for n in ("two", "one")}

    def flags(out: str) -> list[str]:
        return ["--config=configs/build.py", f"--config.run={run}", f"--config.out={out}",
                f"--config.data.path={folder}",
                # the eval test's engines: their programs are in the cache already
                "--config.engine.policy_slots=4", "--config.engine.frozen_slots=4"]

    cache = _cache(tmp_path)
    logs = [str(tmp_path / f"build.p{i}.log") for i in range(2)]
    port = free_port()
    two = [_start(run, outs["two"], logs[i], i, port, cache, flags(outs["two"])) for i in range(2)]
    wait_all(two, logs, 300)
    slog = str(tmp_path / "build1.log")
    wait_all([_start(run, outs["one"], slog, None, 0, cache, flags(outs["one"]))], [slog], 300)
    assert "workspace: " in open(logs[0]).read() and "workspace: " not in open(logs[1]).read()
    assert open(os.path.join(outs["two"], "manifest.json")).read() == \
        open(os.path.join(outs["one"], "manifest.json")).read()
    built = {n: json.load(open(os.path.join(d, "build.json"))) for n, d in outs.items()}
    for key in ("documents", "step", "failed", "construction_tokens", "turns", "stopped", "stats"):
        assert built["two"][key] == built["one"][key], key
