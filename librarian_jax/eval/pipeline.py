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

Multi-process runs (DESIGN.md, "Multi-host"): each process builds and answers a contiguous share of the
corpora (`share`) on its own process-local engines, and the records are gathered (`gather_sections`). No seed
depends on the split: a construction's episode seeds come from its corpus's global index (`build_workspaces`'s
`start`), an answer's from its corpus id and construction (`answer_rng`), so the gathered records are those of
a single-process run.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging
from tqdm.auto import tqdm

from librarian_jax import distributed
from librarian_jax.agents.runtime import (
    ANSWERER,
    FROZEN,
    FROZEN_ROLES,
    POLICY,
    AgentContext,
    AgentGen,
)
from librarian_jax.eval import retrieval, stats
from librarian_jax.rollout import Scheduler, evaluate, run_batch
from librarian_jax.rollout import rewards as R
from librarian_jax.rollout.scheduler import fit_to_engines
from librarian_jax.workspace import Workspace


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
    preambles: dict[str, str] | None = None  # question_id -> text put before the question (retrieval)
    failed: str = ""
    passages: int = 0  # passages in each preamble (retrieval baselines: passages read per question)
    search: Any = None  # agentic RAG: the answerer's search tool (`agents.answer_start.Search`)
    search_k: int = 3  # the scripted navigator's k for its searches
    embedded: Callable[[], int] | None = None  # tokens embedded for this corpus so far (read at record time)


def questions_of(task: Any, config: R.RolloutConfig) -> tuple[Any, ...]:
    """The evaluation questions of a corpus: the rollout's terminal set (reuse questions when present)."""
    return R.terminal_question_set(task, config)


def _strip(task: Any) -> Any:
    return dataclasses.replace(task, questions=(), reuse_questions=())


def guarded(
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


@dataclasses.dataclass(frozen=True)
class _Slot:
    """A corpus of a build and its index in the global list of corpora (which fixes its episode seeds)."""

    index: int
    task: Any


def build_workspaces(
    method: str,
    tasks: Sequence[Any],
    engines: Callable[[], dict[str, Any]],
    tokenizer: Any,
    config: R.RolloutConfig,
    *,
    templates: dict[str, Any],
    group_size: int = 1,
    seed: int = 0,
    batch_tasks: int = 8,
    reset: Callable[[], None] | None = None,
    progress: bool = True,
    start: int = 0,
) -> list[Built]:
    """`group_size` builder episodes per corpus (task-major); `engines()` gives the current engines (after a
    `reset()` fresh ones), every role's (`cluster.Cluster.engines`), and `templates` every role's chat
    template (`cluster.Cluster.templates`).

    `start`: the global index of `tasks[0]` when `tasks` is one process's share of a longer list (`share`).
    The episode seeds are those of a build over the whole list: it runs in chunks of `batch_tasks` corpora
    at global multiples of `batch_tasks`, chunk `k` drawing its episodes' seeds task-major from
    `default_rng(seed + k * batch_tasks * group_size)` (`rollout.run_batch`); a share that begins or ends
    inside a chunk runs that chunk's part with the stream advanced past the corpora before it
    (`distributed.episode_rng`), and a corpus re-run alone after its batch failed gets its seeds too."""

    out: list[Built] = []
    slots = [_Slot(start + i, t) for i, t in enumerate(tasks)]
    chunks: list[list[_Slot]] = []
    for s in slots:
        if chunks and chunks[-1][-1].index // batch_tasks == s.index // batch_tasks:
            chunks[-1].append(s)
        else:
            chunks.append([s])

    def run(chunk: Sequence[_Slot]) -> list[Any]:
        first = chunk[0].index - chunk[0].index % batch_tasks  # global index of its chunk's first corpus
        rng = distributed.episode_rng(seed + first * group_size, (chunk[0].index - first) * group_size)
        batch = [_strip(s.task) for s in chunk]
        records = run_batch(batch, group_size, engines(), tokenizer, config, rng=rng,
                            template=templates[POLICY], templates=templates)
        return [[r for r in records if r.group_id == i] for i in range(len(chunk))]

    for chunk in tqdm(chunks, desc=f"build {method}", disable=not progress, leave=False):
        for slot, res in zip(chunk, guarded(chunk, run, reset, f"build {method}"), strict=True):
            task = slot.task
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
    """Every answer of one job; its `samples` repeats follow `config.repeat_mode` for every method alike
    (greedy: one run recorded `samples` times; "sample": `samples` runs at `repeat_temperature`)."""
    questions = questions_of(job.task, config)
    if job.search is not None and config.answerer.kind == "scripted":
        search: Any = lambda query, k: job.search(query, job.search_k)  # the navigator's k  # noqa: E731
    else:
        search = job.search
    _, answers = yield from evaluate(ctx, job.workspace, questions, job.samples, job.method, config,
                                     preambles=job.preambles, preamble_passages=job.passages, search=search)
    return answers


def task_seed(task_id: str) -> int:
    """A corpus id as a seed: CRC-32 of its UTF-8 bytes, the same in every process and launch (Python's
    `hash` of a str is salted per process, PYTHONHASHSEED)."""
    return zlib.crc32(str(task_id).encode("utf-8"))


def answer_rng(seed: int, task_id: str, episode: int) -> np.random.Generator:
    """The answerer's random stream for the questions of construction `episode` of corpus `task_id`: it
    depends on nothing else (not the batch, not which process answers), so a split evaluation answers as a
    single process does."""
    return np.random.default_rng([int(seed), task_seed(task_id), int(episode)])


def answer_jobs(
    jobs: Sequence[Job],
    engines: Callable[[], dict[str, Any]],
    tokenizer: Any,
    config: R.RolloutConfig,
    *,
    templates: dict[str, Any],
    seed: int = 0,
    batch_jobs: int = 32,
    reset: Callable[[], None] | None = None,
    progress: bool = True,
) -> list[list[dict] | Exception]:
    """The answer dicts of every job (in order), or the exception of a job that failed. The frozen roles
    answer and judge on their own engines with their own templates (`engines()` and `templates`: the
    cluster's), as in training's probes."""
    live = [j for j in jobs if j.workspace is not None]

    def run(chunk: Sequence[Job]) -> list[Any]:
        eng = engines()
        answerer = eng.get(ANSWERER, eng[FROZEN])
        by_role = {POLICY: answerer, FROZEN: answerer, **{r: eng[r] for r in FROZEN_ROLES if r in eng}}
        cfg = fit_to_engines(config, by_role)
        gens = [
            _job_gen(
                AgentContext(
                    tokenizer,
                    templates[ANSWERER],
                    by_role,
                    answer_rng(seed, j.task.task_id, j.episode),
                    templates=templates,
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
        for j, res in zip(chunk, guarded(chunk, run, reset, "answer"), strict=True):
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


# ------------------------------------------------------------------------------------------- processes


def share(n: int, process: int | None = None, count: int | None = None) -> slice:
    """Process `process`'s (default: this one's) contiguous share of `n` corpora over `count` processes
    (default: all): `numpy.array_split`'s, the first `n % count` processes one corpus more; empty when there
    are fewer corpora than processes. One process: everything."""
    return distributed.process_slice(n, process, count, even=False)


_MEETINGS = itertools.count()  # every process meets in the same order, so the n-th meeting has one name


def meet(what: str) -> None:
    """All processes wait for each other here (a coordination-service barrier, timeout
    `LIBRARIAN_SYNC_TIMEOUT_S`): before a collective that processes reach at different times, since their
    shares take different times and a device collective's own timeout is not meant for that wait."""
    if distributed.is_multi():
        distributed.wait_for_all(f"eval/{what}/{next(_MEETINGS)}")


def gather(obj: Any, what: str) -> list[Any]:
    """Every process's JSON-serialisable `obj`, in process order (`distributed.allgather_json` after
    `meet`); one process: `[obj]`."""
    if not distributed.is_multi():
        return [obj]
    meet(what)
    return distributed.allgather_json(obj)


def gather_sections(sections: Sequence[tuple[str, list[Any]]], what: str) -> dict[str, list[Any]]:
    """Every process's items of each named section, in process order: each process's items of a section
    come from its contiguous share of the corpora in corpus order, so the concatenation is the section of a
    single-process run. Every process must pass the same section names in the same order."""
    gathered = gather([[name, items] for name, items in sections], what)
    out: dict[str, list[Any]] = {name: [] for name, _ in sections}
    for per_process in gathered:
        for name, items in per_process:
            out[name].extend(items)
    return out


def slowest(timings: Sequence[dict[str, float]]) -> dict[str, float]:
    """Processes' timing entries as the job's: each the slowest process's (the job waits for it)."""
    keys = list(dict.fromkeys(k for t in timings for k in t))
    return {k: max(float(t[k]) for t in timings if k in t) for k in keys}


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
    records, metrics) with the metric names of the eval command's TensorBoard scalars for "trained".

    Multi-process (every process calls it, with its own process-local `engines`): each process builds and
    answers its share of `tasks` (`share`); every process returns all the records (gathered, in the order
    of a single-process run) and the same metrics, the times the slowest process's."""

    cfg = eval_rollout_config(config, builder_temperature=0.0)
    part = share(len(tasks))
    t0 = time.perf_counter()
    built = build_workspaces(
        "trained", tasks[part], lambda: engines, tokenizer, cfg, templates=templates, seed=seed,
        progress=False, start=part.start,
    )
    t1 = time.perf_counter()
    jobs = [
        Job("trained", b.task, b.workspace, repeats, b.construction_tokens, b.episode, failed=b.failed)
        for b in built
    ]
    mine = [
        r
        for j, a in zip(
            jobs, answer_jobs(jobs, lambda: engines, tokenizer, cfg, templates=templates, seed=seed,
                                   progress=False), strict=True
        )
        for r in job_records(j, a, cfg)
    ]
    timing = {"eval/build_s": t1 - t0, "eval/answer_s": time.perf_counter() - t1}
    gathered = gather_sections([("records", mine), ("timing", [timing])], "periodic")
    records = gathered["records"]
    corpora = [t.task_id for t in tasks]
    sums = stats.corpus_sums(records, ["trained"], corpora)
    table = stats.accuracy_table(sums, np.ones((1, len(corpora))), base=None)
    metrics = scalar_metrics(table)
    metrics.update(slowest(gathered["timing"]))
    return records, metrics


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


def eval_rollout_config(
    config: R.RolloutConfig, *, builder_temperature: float = 0.0, answerer: dict[str, Any] | None = None,
    answer_temperature: float = 0.0,
) -> R.RolloutConfig:
    """The rollout config for evaluation: no probes, final snapshots kept, the builder's temperature as
    given, greedy answer repeats made once (and recorded n times, at the original's cost); with
    `answer_temperature` > 0 every repeat is its own answer sampled at that temperature."""
    a = dataclasses.replace(config.answerer, **(answerer or {}))
    sampled = float(answer_temperature) > 0
    return dataclasses.replace(
        config,
        builder=dataclasses.replace(config.builder, temperature=float(builder_temperature)),
        answerer=a,
        max_probes=0,
        probe_at_start=False,
        record_snapshots=True,
        snapshot_raw_text=False,
        dedupe_greedy_repeats=not sampled,
        repeat_mode="sample" if sampled else "greedy_once",
        repeat_temperature=float(answer_temperature) if sampled else config.repeat_temperature,
    )
