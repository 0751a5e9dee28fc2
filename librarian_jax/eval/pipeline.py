"""Building and answering for evaluation, on top of `rollout` (its scheduler, episodes and agents).

Two phases, each one `Scheduler.run` per batch of corpora (one progress-bar tick):

1. build: `rollout.run_batch` runs the builder episodes of a method over corpora whose questions are
   stripped (the builder never sees them anyway; probes off), greedy unless `builder_temperature` > 0;
   each episode's final workspace snapshot and construction tokens are kept (`Built`).
2. answer: every (method, corpus, sample) workspace — built ones, the raw documents (raw navigation and
   BM25) and the ablation variants — is answered by the same frozen answerer through
   `rollout.evaluate` (BM25 adds its passages as the answerer's preamble), all methods in one batch.

A batch that raises is re-run corpus by corpus on fresh engines; a corpus that still fails is recorded
(`failed`) and its questions count as incorrect: nothing is dropped from the denominator.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging
from tqdm.auto import tqdm

from librarian_jax.agents.runtime import FROZEN, POLICY, AgentContext, AgentGen, Parallel
from librarian_jax.rollout import Scheduler, evaluate, run_batch
from librarian_jax.rollout import rewards as R
from librarian_jax.rollout.episode import answer_and_judge
from librarian_jax.rollout.scheduler import fit_to_engines


@dataclasses.dataclass
class Built:
    """One construction of one corpus by one method."""

    method: str
    task: Any
    episode: int
    workspace: Any = None  # a Workspace, None when the construction failed
    construction_tokens: int = 0
    turns: int = 0
    stopped: bool = False
    failed: str = ""  # the error of a failed construction


@dataclasses.dataclass
class Job:
    """Questions to answer on one workspace: `samples` answers per question."""

    method: str
    task: Any
    workspace: Any
    samples: int
    construction_tokens: int = 0
    episode: int = 0  # which construction (samples of one construction are answer repeats)
    preambles: dict[str, str] | None = None  # question_id -> text put before the question (BM25)
    failed: str = ""


def questions_of(task: Any, config: R.RolloutConfig) -> tuple[Any, ...]:
    """The evaluation questions of a corpus: the rollout's terminal set (reuse questions when present)."""
    return R.terminal_question_set(task, config)


def _strip(task: Any) -> Any:
    return dataclasses.replace(task, questions=(), reuse_questions=())


def _guarded(
    items: Sequence[Any],
    run: Callable[[Sequence[Any]], list[Any]],
    reset: Callable[[], None] | None,
    what: str,
) -> list[Any]:
    """`run(items)` (one result per item); if it raises, each item alone on fresh engines (`reset()`), an
    item that still fails giving its exception as its result."""
    try:
        return run(items)
    except Exception as e:  # noqa: BLE001 - isolate the corpus that fails, keep the others
        logging.warning(
            "%s: a batch of %d failed (%s: %s); retrying one by one", what, len(items), type(e).__name__, e
        )
    out: list[Any] = []
    for item in items:
        if reset is not None:
            reset()
        try:
            out.extend(run([item]))
        except Exception as e:  # noqa: BLE001
            name = getattr(getattr(item, "task", item), "task_id", item)
            logging.warning("%s: %s failed (%s: %s); counted as failed", what, name, type(e).__name__, e)
            out.append(e)
    if reset is not None:
        reset()
    return out


def build_workspaces(
    method: str,
    tasks: Sequence[Any],
    engines: Callable[[], dict[str, Any]],
    tokenizer: Any,
    config: R.RolloutConfig,
    *,
    group_size: int = 1,
    seed: int = 0,
    batch_tasks: int = 8,
    reset: Callable[[], None] | None = None,
    progress: bool = True,
) -> list[Built]:
    """`group_size` builder episodes per corpus (task-major); `engines()` gives the current engines (after a
    `reset()` fresh ones)."""
    from librarian_jax.workspace import Workspace

    out: list[Built] = []
    chunks = [list(tasks[i : i + batch_tasks]) for i in range(0, len(tasks), batch_tasks)]

    def run(chunk: Sequence[Any]) -> list[Any]:
        records = run_batch(
            [_strip(t) for t in chunk], group_size, engines(), tokenizer, config, rng=seed + len(out)
        )
        return [[r for r in records if r.group_id == i] for i in range(len(chunk))]

    for chunk in tqdm(chunks, desc=f"build {method}", disable=not progress, leave=False):
        for task, res in zip(chunk, _guarded(chunk, run, reset, f"build {method}"), strict=True):
            if isinstance(res, Exception):
                out.extend(
                    Built(method, task, g, failed=f"{type(res).__name__}: {res}") for g in range(group_size)
                )
                continue
            for rec in res:
                snap = rec.workspace_snapshots.get("final")
                ws = Workspace.from_dict(snap, docs=task.documents) if snap is not None else None
                out.append(
                    Built(
                        method,
                        task,
                        rec.episode_index,
                        ws,
                        rec.construction_tokens,
                        rec.num_turns,
                        rec.stopped,
                        "" if ws is not None else "no final workspace snapshot",
                    )
                )
    order = {t.task_id: i for i, t in enumerate(tasks)}
    return sorted(out, key=lambda b: (order[b.task.task_id], b.episode))


def _job_gen(ctx: AgentContext, job: Job, config: R.RolloutConfig) -> AgentGen:
    questions = questions_of(job.task, config)
    if job.preambles is None:
        _, answers = yield from evaluate(ctx, job.workspace, questions, job.samples, job.method, config)
        return answers
    gens = [
        answer_and_judge(ctx, job.workspace, q, r, job.method, config,
                         preamble=job.preambles.get(q.question_id, ""))
        for q in questions
        for r in range(job.samples)
    ]
    return (yield Parallel(gens)) if gens else []


def answer_jobs(
    jobs: Sequence[Job],
    engines: Callable[[], dict[str, Any]],
    tokenizer: Any,
    config: R.RolloutConfig,
    *,
    seed: int = 0,
    batch_jobs: int = 32,
    reset: Callable[[], None] | None = None,
    progress: bool = True,
) -> list[list[dict] | Exception]:
    """The answer dicts of every job (in order), or the exception of a job that failed."""
    from librarian_jax.tokenizers import chat_template

    template = chat_template(tokenizer)
    live = [j for j in jobs if j.workspace is not None]

    def run(chunk: Sequence[Job]) -> list[Any]:
        eng = engines()
        by_role = {POLICY: eng[FROZEN], FROZEN: eng[FROZEN]}
        cfg = fit_to_engines(config, by_role)
        gens = [
            _job_gen(
                AgentContext(
                    tokenizer,
                    template,
                    by_role,
                    np.random.default_rng([seed, hash(j.task.task_id) % 2**31, j.episode]),
                ),
                j,
                cfg,
            )
            for j in chunk
        ]
        return Scheduler(by_role).run(gens)

    results: dict[int, Any] = {}
    chunks = [live[i : i + batch_jobs] for i in range(0, len(live), batch_jobs)]
    for chunk in tqdm(chunks, desc="answer", disable=not progress, leave=False):
        for j, res in zip(chunk, _guarded(chunk, run, reset, "answer"), strict=True):
            results[id(j)] = res
    return [results.get(id(j), RuntimeError(j.failed or "no workspace")) for j in jobs]


def job_records(job: Job, answers: list[dict] | Exception, config: R.RolloutConfig) -> list[dict[str, Any]]:
    """`questions.jsonl` rows of one job: one per (question, sample); a failed construction or answering
    gives `correct 0` rows with the failure as the judgement."""
    questions = questions_of(job.task, config)
    base = {
        "method": job.method,
        "corpus": job.task.task_id,
        "construction_tokens": int(job.construction_tokens),
    }
    if isinstance(answers, Exception):
        judgement = "construction_failed" if job.workspace is None else "answer_failed"
        return [
            {
                **base,
                "question_id": q.question_id,
                "question": q.question,
                "gold": q.gold_answer,
                "sample": job.episode * job.samples + r,
                "answer": "",
                "correct": 0.0,
                "judgement": judgement,
                "error": job.failed or f"{type(answers).__name__}: {answers}",
                "files": [],
                "files_read": 0,
                "tokens_read": 0,
                "tokens_written": 0,
                "turns": 0,
                "forced": False,
                "status": judgement,
            }
            for q in questions
            for r in range(job.samples)
        ]
    by_id = {q.question_id: q for q in questions}
    first: dict[str, dict] = {}
    out = []
    for a in answers:
        src = a
        if a.get("copy"):  # a greedy repeat made once and recorded again: it costs what the original did
            src = first[a["question_id"]]
        else:
            first.setdefault(a["question_id"], a)
        q = by_id[a["question_id"]]
        out.append(
            {
                **base,
                "question_id": q.question_id,
                "question": q.question,
                "gold": q.gold_answer,
                "sample": job.episode * job.samples + int(a["repeat"]),
                "answer": a["answer"],
                "correct": float(a["correct"]),
                "judgement": "correct"
                if a["correct"]
                else ("cache_full" if a.get("status") == "cache_full" else "incorrect"),
                "files": list(src.get("files_read", [])),
                "files_read": len(src.get("files_read", [])),
                "tokens_read": int(src["prompt_tokens"]),
                "tokens_written": int(src["generated_tokens"]),
                "turns": int(a["turns"]),
                "forced": bool(a["forced"]),
                "status": a.get("status", "ok"),
            }
        )
    return out


# ------------------------------------------------------------------------------------------- BM25


def bm25_preambles(task: Any, questions: Sequence[Any], top_k: int, passage_words: int) -> dict[str, str]:
    """BM25 (`bm25s`) over passages of `passage_words` words of the corpus's raw documents: the top-k
    passages per question, as the text the answerer reads first. The index costs no model tokens."""
    import logging as py_logging

    import bm25s

    py_logging.getLogger("bm25s").setLevel(py_logging.WARNING)
    passages, names = [], []
    for d in task.documents:
        words = d.text.split()
        for i in range(0, max(len(words), 1), passage_words):
            passages.append(" ".join(words[i : i + passage_words]))
            names.append(f"{d.doc_id} (words {i + 1}-{min(i + passage_words, len(words))})")
    k = min(top_k, len(passages))
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False)
    out = {}
    for q in questions:
        docs, _ = retriever.retrieve(
            bm25s.tokenize([q.question], stopwords="en", show_progress=False), k=k, show_progress=False
        )
        lines = [f"Retrieved passages (BM25, top {k}) from the raw documents:"]
        lines += [f"[{i + 1}] {names[int(j)]}: {passages[int(j)]}" for i, j in enumerate(docs[0])]
        out[q.question_id] = "\n".join(lines)
    return out


# ------------------------------------------------------------------------------------------- periodic eval


def periodic_eval(
    tasks: Sequence[Any],
    engines: dict[str, Any],
    tokenizer: Any,
    config: R.RolloutConfig,
    seed: int,
    repeats: int = 1,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The evaluation `main` runs every `eval.every` steps: the current policy builds a workspace for each
    held-out corpus (greedy), the frozen answerer answers `repeats` times per question; returns (question
    records, metrics) with the metric names of the eval command's TensorBoard scalars for "trained"."""
    from librarian_jax.eval import stats

    cfg = eval_rollout_config(config, builder_temperature=0.0)
    t0 = time.perf_counter()
    built = build_workspaces("trained", tasks, lambda: engines, tokenizer, cfg, seed=seed, progress=False)
    t1 = time.perf_counter()
    jobs = [
        Job("trained", b.task, b.workspace, repeats, b.construction_tokens, b.episode, failed=b.failed)
        for b in built
    ]
    records = [
        r
        for j, a in zip(
            jobs, answer_jobs(jobs, lambda: engines, tokenizer, cfg, seed=seed, progress=False), strict=True
        )
        for r in job_records(j, a, cfg)
    ]
    corpora = [t.task_id for t in tasks]
    sums = stats.corpus_sums(records, ["trained"], corpora)
    table = stats.accuracy_table(sums, np.ones((1, len(corpora))), base=None)
    metrics = scalar_metrics(table)
    metrics.update({"eval/build_s": t1 - t0, "eval/answer_s": time.perf_counter() - t1})
    return records, metrics


SCALARS = (
    "accuracy",
    "files_per_query",
    "tokens_read_per_query",
    "answer_tokens_per_query",
    "construction_tokens_per_corpus",
    "diff_vs_base",
)


def scalar_metrics(table: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`eval/<method>/<name>` scalars of an accuracy table (the names TensorBoard gets, in both commands)."""
    return {f"eval/{m}/{k}": float(row[k]) for m, row in table.items() for k in SCALARS if k in row}


def eval_rollout_config(
    config: R.RolloutConfig, *, builder_temperature: float = 0.0, answerer: dict[str, Any] | None = None
) -> R.RolloutConfig:
    """The rollout config for evaluation: no probes, final snapshots kept, the builder's temperature as
    given, greedy answer repeats made once (and recorded n times, at the original's cost)."""
    a = dataclasses.replace(config.answerer, **(answerer or {}))
    return dataclasses.replace(
        config,
        builder=dataclasses.replace(config.builder, temperature=float(builder_temperature)),
        answerer=a,
        max_probes=0,
        probe_at_start=False,
        record_snapshots=True,
        snapshot_raw_text=False,
        dedupe_greedy_repeats=True,
    )
