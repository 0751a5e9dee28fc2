"""Evaluation's records and periodic evaluation, on rollout's jobs (`rollout.jobs`: builds and answers on
the scheduler, with the cluster's engines and templates).

`rollout.jobs` runs the work: `build_workspaces` (the builder episodes of a method, final workspaces kept)
and `answer_jobs` (the frozen answerer on every job's workspace), with the one evaluation rollout config
(the cluster's, `cluster.mode_rollout`). What stays here is what evaluation makes of it: each job's
`questions.jsonl` rows (`job_records`), BM25's preambles, and `periodic_eval` (training's held-out
evaluation: build, answer, gather, score). A corpus whose construction or answering failed is recorded
(`failed`) and its questions count as incorrect: nothing is dropped from the denominator.

Multi-process runs (DESIGN.md, "Multi-host"): each process builds and answers a contiguous share of the
corpora (`distributed.share`) on its own process-local engines, and the records are gathered
(`distributed.gather_sections`). No seed depends on the split (`rollout.jobs`), so the gathered records are
those of a single-process run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from librarian_jax import distributed
from librarian_jax.agents.runtime import POLICY
from librarian_jax.eval import retrieval, stats
from librarian_jax.rollout import rewards as R
from librarian_jax.rollout.jobs import (  # the entry points callers (eval.cli, bench.update) name here
    Built,
    Job,
    answer_jobs,
    answer_rng,
    batch_tasks_for,
    build_workspaces,
    questions_of,
    task_seed,
)

__all__ = ["SCALARS", "Built", "Job", "answer_jobs", "answer_rng", "bm25_preambles", "build_workspaces",
           "job_records", "periodic_eval", "questions_of",
           "scalar_metrics", "task_seed"]


def job_records(job: Job, answers: list[dict] | Exception, config: R.RolloutConfig) -> list[dict[str, Any]]:
    """`questions.jsonl` rows of one job: one per (question, sample); a failed construction or answering
    gives `correct 0` rows with the failure as the judgement."""
    questions = questions_of(job.task, config)
    base = {
        "method": job.method,
        "corpus": job.task.task_id,
        "construction_tokens": int(job.construction_tokens),
        "tokens_embedded": int(job.embedded()) if job.embedded is not None else 0,
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
                "files_opened": 0,
                "passages_read": 0,
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
                # distinct files in the answerer's context, preloaded root files included (the paper's
                # "files read per query")
                "files_opened": int(src.get("num_files_opened", len(set(src.get("files_read", []))))),
                "passages_read": int(src.get("passages_read", 0)),
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
    passages per question (each named by its document's path), as the text the answerer reads first. The
    index costs no model tokens. (`eval.baselines` builds every retrieval method's preambles this way.)"""
    chunks = retrieval.passages(task, passage_words)
    index = retrieval.BM25Index(chunks)
    out = {}
    for q in questions:
        hits = index.search(q.question, top_k)
        out[q.question_id] = retrieval.render_passages(
            chunks, hits, f"Retrieved passages (BM25, top {len(hits)}) from the raw documents:")
    return out


# ------------------------------------------------------------------------------------------- periodic eval


def periodic_eval(
    tasks: Sequence[Any],
    engines: dict[str, Any],
    tokenizer: Any,
    config: R.RolloutConfig,
    seed: int,
    repeats: int = 1,
    *,
    templates: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The evaluation `main` runs every `eval.every` steps: the current policy builds a workspace for each
    held-out corpus (greedy), the frozen answerer answers `repeats` times per question; returns (question
    records, metrics) with the metric names of the eval command's TensorBoard scalars for "trained". `config`
    is the cluster's evaluation config (`Cluster.rollout_for(Mode.EVAL)`: greedy builder, probes off).

    Multi-process (every process calls it, with its own process-local `engines`): each process builds and
    answers its share of `tasks` (`share`); every process returns all the records (gathered, in the order
    of a single-process run) and the same metrics, the times the slowest process's."""

    cfg = config
    part = distributed.share(len(tasks))
    t0 = time.perf_counter()
    built = build_workspaces(
        "trained", tasks[part], lambda: engines, tokenizer, cfg, templates=templates, seed=seed,
        batch_tasks=batch_tasks_for(0, getattr(engines.get(POLICY), "num_slots", 0)), progress=False,
        start=part.start,
    )
    t1 = time.perf_counter()
    jobs = [Job.of(b, repeats) for b in built]
    mine = [
        r
        for j, a in zip(
            jobs, answer_jobs(jobs, lambda: engines, tokenizer, cfg, templates=templates, seed=seed,
                                   progress=False), strict=True
        )
        for r in job_records(j, a, cfg)
    ]
    timing = {"eval/build_s": t1 - t0, "eval/answer_s": time.perf_counter() - t1}
    gathered = distributed.gather_sections([("records", mine), ("timing", [timing])], "periodic")
    records = gathered["records"]
    metrics = corpus_metrics(records, [t.task_id for t in tasks])
    metrics.update(distributed.slowest(gathered["timing"]))
    return records, metrics


def corpus_metrics(records: Sequence[Mapping[str, Any]], corpora: Sequence[str]) -> dict[str, float]:
    """`eval/trained/<name>` scalars of the question records of `corpora` (a subset of a `periodic_eval`'s:
    held-out and validation corpora evaluated in one batch are scored apart)."""
    wanted = set(corpora)
    sums = stats.corpus_sums([r for r in records if r["corpus"] in wanted], ["trained"], corpora)
    return scalar_metrics(stats.accuracy_table(sums, np.ones((1, len(corpora))), base=None))


SCALARS = (
    "accuracy",
    "files_per_query",
    "files_opened_per_query",
    "passages_per_query",
    "tokens_embedded_per_corpus",
    "tokens_read_per_query",
    "answer_tokens_per_query",
    "construction_tokens_per_corpus",
    "diff_vs_base",
)


def scalar_metrics(table: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`eval/<method>/<name>` scalars of an accuracy table (the names TensorBoard gets, in both commands)."""
    return {f"eval/{m}/{k}": float(row[k]) for m, row in table.items() for k in SCALARS if k in row}
