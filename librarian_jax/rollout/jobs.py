"""Evaluation's whole jobs on the scheduler: builds (a builder episode per corpus, its final workspace) and
answers (the frozen answerer on a workspace), each batch of them one `Scheduler.run`.

`eval/` hands its work here and keeps only statistics and reporting (DESIGN.md, "eval"):

1. build: `build_workspaces` runs the builder episodes of a method (`run_batch`) over corpora whose questions
   are stripped (the builder never sees them anyway; probes off); each episode's final workspace snapshot
   and construction tokens are kept (`Built`).
2. answer: every `Job` (a workspace to answer: built, raw, a retrieval baseline's, an ablation variant) is
   answered by the same frozen answerer through `episode.evaluate` (a retrieval baseline's passages as the
   answerer's preamble), every job of a batch in one `Scheduler.run` (`answer_jobs`).
3. anything else made of agent generators over corpora (GraphRAG's and AutoCompaction's constructions):
   `run_jobs`, the same batching and failure isolation.

The rollout config of every evaluation comes from one place, its cluster (`cluster.mode_rollout`: no probes,
final snapshots kept, the builder's and the answerer's sampling as asked). A batch that raises is re-run item
by item on fresh engines (`guarded`); an item that still fails is its exception, which the caller records
(nothing is dropped from a denominator).

Seeds never depend on how corpora are split over processes: a build's episode seeds come from its corpus's
global index (`build_workspaces`'s `start`, `episode_rng`), an answer's from its corpus id and construction
(`answer_rng`), so a split evaluation's records are those of a single-process run.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging
from tqdm.auto import tqdm

from librarian_jax.agents.runtime import ANSWERER, FROZEN, FROZEN_ROLES, POLICY, AgentContext, AgentGen
from librarian_jax.rollout import rewards as R
from librarian_jax.rollout.episode import evaluate
from librarian_jax.rollout.scheduler import Scheduler, episode_rng, fit_to_engines, run_batch
from librarian_jax.workspace import Workspace

Engines = Callable[[], Mapping[str, Any]]  # the current engines by role (after a `reset()`, fresh ones)


def questions_of(task: Any, config: R.RolloutConfig) -> tuple[Any, ...]:
    """The evaluation questions of a corpus: the rollout's terminal set (reuse questions when present)."""
    return R.terminal_question_set(task, config)


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

    @classmethod
    def of(cls, built: Built, samples: int, method: str | None = None, workspace: Any = None) -> Job:
        """The answer job of a construction (`method` / `workspace`: an ablation variant of it)."""
        return cls(method or built.method, built.task, built.workspace if workspace is None else workspace,
                   samples, built.construction_tokens, built.episode if method is None else 0,
                   failed=built.failed)


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


def answer_engines(engines: Mapping[str, Any]) -> dict[str, Any]:
    """The engines of an answer (or executor) batch: every frozen role's own, the answerer's standing in for
    the policy and "frozen" (no builder turn is sampled there)."""
    answerer = engines[ANSWERER] if ANSWERER in engines else engines[FROZEN]
    return {POLICY: answerer, FROZEN: answerer, **{r: engines[r] for r in FROZEN_ROLES if r in engines}}


def run_jobs(
    chunks: Sequence[Sequence[Any]],
    gens: Callable[[Sequence[Any], dict[str, Any]], list[AgentGen]],
    engines: Engines,
    what: str,
    *,
    reset: Callable[[], None] | None = None,
    progress: bool = False,
) -> list[Any]:
    """Each chunk of items as one `Scheduler.run` over `gens(chunk, engines)` (one generator per item) on
    the frozen roles' engines (`answer_engines`), `guarded`; returns every item's result (or exception)."""

    def run(chunk: Sequence[Any]) -> list[Any]:
        by_role = answer_engines(engines())
        return Scheduler(by_role).run(gens(chunk, by_role))

    out: list[Any] = []
    for chunk in tqdm(chunks, desc=what, disable=not progress, leave=False):
        out.extend(guarded(chunk, run, reset, what))
    return out


# ------------------------------------------------------------------------------------------- build


@dataclasses.dataclass(frozen=True)
class _Slot:
    """A corpus of a build and its index in the global list of corpora (which fixes its episode seeds)."""

    index: int
    task: Any


def _strip(task: Any) -> Any:
    return dataclasses.replace(task, questions=(), reuse_questions=())


DEFAULT_BATCH_TASKS = 8  # `build_workspaces`' corpora per scheduler batch when nothing says otherwise


def batch_tasks_for(requested: int, slots: int, group_size: int = 1) -> int:
    """Corpora per scheduler batch of `build_workspaces`: `requested`, or with 0 as many as `slots` builder
    slots hold at `group_size` episodes a corpus (at least 1; DEFAULT_BATCH_TASKS when `slots` is 0,
    unknown). The builder's engine decodes all its slots every round, busy or idle, so a full batch costs
    little more than a half-full one; a greedy build gave the same workspaces either way (31 noisy corpora,
    16 or 8 at once). Sampled builds draw their episode seeds per batch (`build_workspaces`), so theirs
    change with it."""
    if requested > 0:
        return requested
    return max(1, slots // max(1, group_size)) if slots > 0 else DEFAULT_BATCH_TASKS


def build_workspaces(
    method: str,
    tasks: Sequence[Any],
    engines: Engines,
    tokenizer: Any,
    config: R.RolloutConfig,
    *,
    templates: Mapping[str, Any],
    group_size: int = 1,
    seed: int = 0,
    batch_tasks: int = DEFAULT_BATCH_TASKS,
    reset: Callable[[], None] | None = None,
    progress: bool = True,
    start: int = 0,
) -> list[Built]:
    """`group_size` builder episodes per corpus (task-major); `engines()` gives the current engines (after a
    `reset()` fresh ones), every role's (`cluster.Cluster.engines`), and `templates` every role's chat
    template (`cluster.Cluster.templates`). `config` is an evaluation's (`cluster.mode_rollout`).

    `start`: the global index of `tasks[0]` when `tasks` is one process's share of a longer list
    (`distributed.share`). The episode seeds are those of a build over the whole list: it runs in chunks of
    `batch_tasks` corpora at global multiples of `batch_tasks`, chunk `k` drawing its episodes' seeds
    task-major from `default_rng(seed + k * batch_tasks * group_size)` (`run_batch`); a share that begins or
    ends inside a chunk runs that chunk's part with the stream advanced past the corpora before it
    (`episode_rng`), and a corpus re-run alone after its batch failed gets its seeds too."""

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
        rng = episode_rng(seed + first * group_size, (chunk[0].index - first) * group_size)
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


# ------------------------------------------------------------------------------------------- answer


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
    engines: Engines,
    tokenizer: Any,
    config: R.RolloutConfig,
    *,
    templates: Mapping[str, Any],
    seed: int = 0,
    batch_jobs: int = 32,
    reset: Callable[[], None] | None = None,
    progress: bool = True,
) -> list[list[dict] | Exception]:
    """The answer dicts of every job (in order), or the exception of a job that failed (a job without a
    workspace: a `RuntimeError` naming its failure). The frozen roles answer and judge on their own engines
    with their own templates (`engines()` and `templates`: the cluster's), as in training's probes."""
    live = [j for j in jobs if j.workspace is not None]

    def gens(chunk: Sequence[Job], by_role: dict[str, Any]) -> list[AgentGen]:
        cfg = fit_to_engines(config, by_role)
        return [_job_gen(AgentContext(tokenizer, templates[ANSWERER], by_role,
                                      answer_rng(seed, j.task.task_id, j.episode), templates=dict(templates)),
                         j, cfg)
                for j in chunk]

    chunks = [live[i : i + batch_jobs] for i in range(0, len(live), batch_jobs)]
    answers = run_jobs(chunks, gens, engines, "answer", reset=reset, progress=progress)
    results = {id(j): a for j, a in zip(live, answers, strict=True)}
    return [results.get(id(j), RuntimeError(j.failed or "no workspace")) for j in jobs]
