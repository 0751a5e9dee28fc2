"""The paper's baselines as eval methods (docs/eval.md): every one answered by the run's own frozen answerer,
under the same turn and token budgets, into the same records as the builder's methods.

    raw             the raw documents, navigated with list/read
    bm25            + the top `bm25.top_k` BM25 passages in the answerer's first prompt
    embedding       + the top-k passages of an embedding model (`roles.embedding`) instead
    rerank          + the first stage's top `rerank.candidates` re-scored by `roles.reranker`, its top k
    agentic         the raw documents with a `search(query, k)` tool beside list/read (`agentic.index`)
    graphrag        a workspace of community summaries from an entity graph (`eval.constructions.graphrag`)
    autocompaction  a workspace of one notes file the executor compacted the corpus into

Retrieval methods cut the corpus into passages of `bm25.passage_words` words (`retrieval.passages`) and give
the answerer `bm25.top_k` of them: the same passage budget for BM25, embedding and reranking. Costs: an index
costs no LLM tokens (construction tokens 0); the embedding model's and the reranker's forward passes are
counted apart as tokens embedded (per corpus: its passages embedded once, plus every query embedded and every
(query, passage) pair scored); passages read per question: those in the first prompt, or returned by search.
GraphRAG and AutoCompaction construct with the executor: their construction tokens are the executor's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from librarian_jax import cluster, distributed
from librarian_jax.agents.runtime import EXECUTOR, AgentContext
from librarian_jax.config_schema import RETRIEVAL_INDEXES, int_list
from librarian_jax.eval import constructions, pipeline, retrieval
from librarian_jax.rollout import jobs as rjobs
from librarian_jax.workspace import Workspace

PREAMBLE_METHODS = ("bm25", "embedding", "rerank")  # retrieved passages in the first prompt
CONSTRUCTED = ("graphrag", "autocompaction")  # workspaces the executor writes
METHODS = ("raw", *PREAMBLE_METHODS, "agentic", *CONSTRUCTED)  # every method without the builder


def needs_embedding(methods: Sequence[str], c: Any) -> bool:
    """Whether these methods with eval config `c` need `roles.embedding`."""
    return ("embedding" in methods or ("rerank" in methods and c.rerank.first_stage == "embedding")
            or ("agentic" in methods and c.agentic.index == "embedding"))


def needs_reranker(methods: Sequence[str]) -> bool:
    return "rerank" in methods


@dataclasses.dataclass
class RetrievalModels:
    """The retrieval roles of an evaluation, loaded once (None: not needed by its methods)."""

    embedder: retrieval.Embedder | None = None
    reranker: retrieval.Reranker | None = None
    described: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_models(methods: Sequence[str], c: Any, mesh: Any, tokenizer: Any) -> RetrievalModels:
    """`roles.embedding` / `roles.reranker` of eval config `c` (`cluster.retrieval_model`), when the methods
    need them."""
    out = RetrievalModels()
    if needs_embedding(methods, c):
        e = c.roles.embedding
        m = cluster.retrieval_model("embedding", e, mesh, tokenizer)
        out.embedder = retrieval.Embedder(m.model, m.tokenizer, pooling=e.pooling, instruction=e.instruction,
                                          batch_size=e.batch_size, max_tokens=e.max_tokens, mesh=mesh)
        out.described["embedding"] = {**m.describe(), "pooling": e.pooling, "instruction": e.instruction}
    if needs_reranker(methods):
        r = c.roles.reranker
        m = cluster.retrieval_model("reranker", r, mesh, tokenizer)
        out.reranker = retrieval.Reranker(m.model, m.tokenizer, m.template, instruction=r.instruction,
                                          batch_size=r.batch_size, max_tokens=r.max_tokens, mesh=mesh)
        out.described["reranker"] = m.describe()
    return out


class _Meter:
    """Tokens embedded for one corpus and method: counted as deltas of the models' counters around its
    calls (the models are shared by every corpus)."""

    def __init__(self) -> None:
        self.tokens = 0

    def run(self, counters: Sequence[Any], fn: Callable[[], Any]) -> Any:
        before = [c.tokens for c in counters]
        out = fn()
        self.tokens += sum(c.tokens - b for c, b in zip(counters, before, strict=True))
        return out


class Searcher:
    """The agentic-RAG search tool of one corpus (`agents.answer_start.Search`): (query, k) -> the k best
    passages of `index`. `tokens`: what its index and queries embedded."""

    def __init__(self, chunks: Sequence[retrieval.Passage], index: Any, meter: _Meter,
                 counters: Sequence[Any]):
        self.chunks, self.index, self.meter, self.counters = list(chunks), index, meter, list(counters)
        self.calls = 0

    def __call__(self, query: str, k: int) -> list[retrieval.Passage]:
        self.calls += 1
        hits = self.meter.run(self.counters, lambda: self.index.search(query, int(k)))
        return [self.chunks[j] for j, _ in hits]


def _index(kind: str, chunks: Sequence[retrieval.Passage], models: RetrievalModels,
           meter: _Meter) -> tuple[Any, list]:
    """(index, the model counters its searches move) of `kind` over `chunks`; building it is metered."""
    if kind == "bm25":
        return retrieval.BM25Index(chunks), []
    if models.embedder is None:
        raise ValueError("an embedding index needs roles.embedding")
    emb = models.embedder
    return meter.run([emb], lambda: retrieval.EmbeddingIndex(chunks, emb)), [emb]


RETRIEVAL_METHODS = ("bm25", "embedding", "rerank", "agentic")  # the methods with a passage budget k


def method_k(method: str, c: Any, ks: Mapping[str, int] | None = None) -> int:
    """A retrieval method's k: `ks[method]` when given (a tuned budget), else the config's (`bm25.top_k`
    for the passages in the first prompt, `agentic.k` for each search)."""
    if ks and method in ks:
        return int(ks[method])
    return int(c.agentic.k if method == "agentic" else c.bm25.top_k)


def retrieval_jobs(methods: Sequence[str], task: Any, questions: Sequence[Any], c: Any, samples: int,
                   models: RetrievalModels, ks: Mapping[str, int] | None = None,
                   indexes: dict[str, tuple[Any, list]] | None = None) -> list[rjobs.Job]:
    """The jobs of the methods without construction (`raw`, `bm25`, `embedding`, `rerank`, `agentic`) for one
    corpus, in `methods` order; retrieval runs here (the passages of each question) except agentic search,
    which runs while the answerer answers. `ks`: a retrieval method's k instead of the config's. `indexes`:
    this corpus's indexes by kind, filled on first use and reused by later calls (`tune_ks` tries several k
    over one index; its embedding is then metered on the first job that built it only)."""
    chunks = retrieval.passages(task, c.bm25.passage_words)
    jobs = []

    def index_of(kind: str, meter: _Meter) -> tuple[Any, list]:
        if indexes is None:
            return _index(kind, chunks, models, meter)
        if kind not in indexes:
            indexes[kind] = _index(kind, chunks, models, meter)
        return indexes[kind]

    def raw_ws() -> Any:
        return Workspace.from_documents(list(task.documents))

    def preambles(name: str, search: Callable[[str], list[tuple[int, float]]], meter: _Meter,
                  counters: Sequence[Any]) -> dict[str, str]:
        out = {}
        for q in questions:
            hits = meter.run(counters, lambda q=q: search(q.question))
            out[q.question_id] = retrieval.render_passages(
                chunks, hits, f"Retrieved passages ({name}, top {len(hits)}) from the raw documents:")
        return out

    for m in methods:
        meter = _Meter()
        if m == "raw":
            jobs.append(rjobs.Job("raw", task, raw_ws(), samples))
        elif m in RETRIEVAL_INDEXES:  # the `bm25` and `embedding` methods: their index's top k
            k = min(method_k(m, c, ks), len(chunks))
            index, counters = index_of(m, meter)
            pre = preambles("BM25" if m == "bm25" else "embedding", lambda q, i=index, k=k: i.search(q, k),
                            meter, counters)
            jobs.append(rjobs.Job(m, task, raw_ws(), samples, preambles=pre, passages=k,
                                     embedded=lambda meter=meter: meter.tokens))
        elif m == "rerank":
            if models.reranker is None:
                raise ValueError("rerank needs roles.reranker")
            index, counters = index_of(c.rerank.first_stage, meter)
            rr = models.reranker
            k = min(method_k(m, c, ks), len(chunks))
            n = max(int(c.rerank.candidates), k)

            def rerank(q: str, index: Any = index, rr: Any = rr, n: int = n, k: int = k
                       ) -> list[tuple[int, float]]:
                return rr.rerank(q, chunks, index.search(q, n), k)

            pre = preambles(f"{c.rerank.first_stage} top {n} reranked", rerank, meter, [*counters, rr])
            jobs.append(rjobs.Job(m, task, raw_ws(), samples, preambles=pre, passages=k,
                                     embedded=lambda meter=meter: meter.tokens))
        elif m == "agentic":
            index, counters = index_of(c.agentic.index, meter)
            searcher = Searcher(chunks, index, meter, counters)
            jobs.append(rjobs.Job(m, task, raw_ws(), samples, search=searcher, search_k=method_k(m, c, ks),
                                     embedded=lambda meter=meter: meter.tokens))
    return jobs


def construct(
    method: str,
    tasks: Sequence[Any],
    engines: Callable[[], dict[str, Any]],
    tokenizer: Any,
    config: Any,
    c: Any,
    *,
    templates: dict[str, Any],
    seed: int = 0,
    batch_tasks: int = rjobs.DEFAULT_BATCH_TASKS,
    reset: Callable[[], None] | None = None,
) -> list[rjobs.Built]:
    """GraphRAG's or AutoCompaction's workspace for each corpus (`eval.constructions`), written by the run's
    executor (`config.builder.executor`: "model" on the executor's engine, batched over the corpora of a
    chunk of `batch_tasks`; "extractive": the model-free stand-in). A corpus that fails is a failed
    construction (its questions count as incorrect)."""
    executor = "model" if config.builder.executor == "model" else "extractive"  # "focused", "statements" too
    s = getattr(c, method).to_dict()

    def gens(chunk: Sequence[Any], by_role: dict[str, Any]) -> list[Any]:
        return [
            constructions.CONSTRUCTIONS[method](
                AgentContext(tokenizer, templates[EXECUTOR], by_role,
                             np.random.default_rng([seed, rjobs.task_seed(t.task_id)]),
                             templates=templates),
                t, executor=executor, **s)
            for t in chunk
        ]

    chunks = [list(tasks[i : i + batch_tasks]) for i in range(0, len(tasks), batch_tasks)]
    results = rjobs.run_jobs(chunks, gens, engines, f"build {method}", reset=reset)
    out = []
    for t, res in zip(tasks, results, strict=True):
        if isinstance(res, Exception):
            out.append(rjobs.Built(method, t, 0, failed=f"{type(res).__name__}: {res}"))
            continue
        logging.info("%s %s: %s, %d executor calls, %d tokens", method, t.task_id, res.info, res.calls,
                     res.construction_tokens)
        out.append(rjobs.Built(method, t, 0, res.workspace, res.construction_tokens, res.calls, True))
    return out


def baseline_sections(
    methods: Sequence[str],
    tasks: Sequence[Any],
    models_: Any,
    tokenizer: Any,
    config: Any,
    c: Any,
    mesh: Any,
    *,
    timing: dict[str, float],
    tune: Callable[[RetrievalModels], dict[str, int]] | None = None,
    batch_tasks: int = rjobs.DEFAULT_BATCH_TASKS,
) -> tuple[list[rjobs.Job], dict[str, list[rjobs.Built]], dict[str, Any]]:
    """Every baseline job of this process's corpora `tasks` (task-major, methods in `methods` order), the
    constructions of GraphRAG / AutoCompaction (for export and failure counts) and the retrieval models'
    description. `models_` is the eval's cluster (`cluster.Cluster`); `timing` gets `build_<method>_s`;
    `tune(models) -> {method: k}` sets the retrieval methods' k (a `matched` budget, `tune_ks`)."""
    t0 = time.perf_counter()
    models = load_models(methods, c, mesh, tokenizer)
    timing["load_retrieval_s"] = time.perf_counter() - t0
    ks: dict[str, int] = {}
    if tune is not None:
        t0 = time.perf_counter()
        ks = tune(models)
        timing["tune_retrieval_s"] = time.perf_counter() - t0
    built_by: dict[str, list[rjobs.Built]] = {}
    for m in CONSTRUCTED:
        if m in methods:
            t0 = time.perf_counter()
            built_by[m] = construct(m, tasks, lambda: models_.engines, tokenizer, config, c,
                                    templates=models_.templates, seed=c.seed, batch_tasks=batch_tasks,
                                    reset=models_.reset)
            timing[f"build_{m}_s"] = time.perf_counter() - t0
    simple = [m for m in methods if m in METHODS and m not in CONSTRUCTED]
    jobs: list[rjobs.Job] = []
    t0 = time.perf_counter()
    for i, t in enumerate(tasks):
        jobs.extend(retrieval_jobs(simple, t, rjobs.questions_of(t, config), c, c.samples, models, ks))
        for m in CONSTRUCTED:
            if m in methods:
                b = built_by[m][i]
                jobs.append(rjobs.Job(m, t, b.workspace, c.samples, b.construction_tokens,
                                         failed=b.failed))
    order = {m: i for i, m in enumerate(methods)}
    pos = {t.task_id: i for i, t in enumerate(tasks)}
    jobs.sort(key=lambda j: (pos[j.task.task_id], order[j.method]))
    timing["retrieve_s"] = time.perf_counter() - t0
    return jobs, built_by, models.described


# ------------------------------------------------------------------------------------------- retrieval budget


def budget_ks(spec: str) -> list[int]:
    """The candidate k values of `retrieval_budget.ks` ("1,2,3,5"), sorted, without repeats."""
    return sorted(int_list(spec))


def choose_k(tried: Sequence[Mapping[str, float]], budget_tokens: float) -> int:
    """The k of `tried` (`{"k", "accuracy", "tokens_read"}` rows, one per candidate) with the best accuracy
    among those whose tokens read per question stay within `budget_tokens`, the smaller k on a tie; when no
    candidate fits, the one that reads least."""
    fits = [t for t in tried if t["tokens_read"] <= budget_tokens]
    if not fits:
        return int(min(tried, key=lambda t: (t["tokens_read"], t["k"]))["k"])
    return int(max(fits, key=lambda t: (t["accuracy"], -t["k"]))["k"])


def tune_ks(
    methods: Sequence[str],
    tasks: Sequence[Any],
    budget_tokens: float,
    models_: Any,
    tokenizer: Any,
    config: Any,
    c: Any,
    models: RetrievalModels,
    *,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Each retrieval method's k for a `matched` budget (`config_schema.RetrievalBudgetSection`): every
    candidate of `c.retrieval_budget.ks` answered by the run's answerer on `tasks` (training corpora), and
    `choose_k` against `budget_tokens`. Multi-process: each process answers its share of `tasks`; the rows
    are gathered, so every process chooses the same k. Returns `{method: {"k", "budget_tokens", "tried"}}`."""
    ks = budget_ks(c.retrieval_budget.ks)
    part = distributed.share(len(tasks))
    jobs: list[rjobs.Job] = []
    tags: list[tuple[str, int]] = []
    for t in tasks[part]:
        qs = rjobs.questions_of(t, config)
        indexes: dict[str, tuple[Any, list]] = {}  # each corpus's index built once for every method and k
        for m in methods:
            for k in ks:
                for j in retrieval_jobs([m], t, qs, c, 1, models, ks={m: k}, indexes=indexes):
                    jobs.append(j)
                    tags.append((m, k))
    answers = rjobs.answer_jobs(jobs, lambda: models_.engines, tokenizer, config, templates=models_.templates,
                                seed=seed, reset=models_.reset, progress=False)
    rows = []
    for (m, k), j, a in zip(tags, jobs, answers, strict=True):
        for r in pipeline.job_records(j, a, config):
            rows.append([m, k, float(r["correct"]), float(r["tokens_read"])])
    gathered = distributed.gather_sections([("rows", rows)], "tune_retrieval_k")["rows"]
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        tried = []
        for k in ks:
            sel = [(c_, t_) for m_, k_, c_, t_ in gathered if m_ == m and k_ == k]
            if sel:
                tried.append({"k": k, "accuracy": float(np.mean([x for x, _ in sel])),
                              "tokens_read": float(np.mean([y for _, y in sel]))})
        k = choose_k(tried, budget_tokens) if tried else method_k(m, c)
        out[m] = {"k": k, "budget_tokens": float(budget_tokens), "corpora": len(tasks), "tried": tried}
        logging.info("retrieval budget: %s k=%d (tokens read <= %.0f per question, %d training corpora: %s)",
                     m, k, budget_tokens, len(tasks),
                     ", ".join(f"k={t['k']} {100 * t['accuracy']:.1f}% {t['tokens_read']:.0f} tok"
                               for t in tried))
    return out
