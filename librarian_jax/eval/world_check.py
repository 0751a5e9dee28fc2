"""The synthetic world's design check (`python -m librarian_jax.bench.world`, docs/world.md): which structure
helps the run's answerer, against retrieval.

Model-free and deterministic: every warm-start demonstration style (`warm_start.demos.STYLES`, one scripted
builder per style, run through the real protocol, executor and workspace by `testing.ScriptedEngine`) builds a
workspace for each held-out corpus of the config's world, and the run's answerer (the embedded default: the
scripted navigator) answers their questions; beside them the retrieval baselines (`raw`, `bm25` and
`agentic`, at each k), under the same answerer budgets. `measure` returns accuracy per method and per question
type, files and tokens read per question and the tokens one construction cost; `render` prints them.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from librarian_jax import cluster, config_validation, inputs
from librarian_jax.agents.runtime import FROZEN, POLICY
from librarian_jax.config_schema import EvalConfig, GRPOConfig
from librarian_jax.eval import baselines, pipeline, stats
from librarian_jax.testing import ScriptedEngine
from librarian_jax.warm_start import sft
from librarian_jax.warm_start.demos import scripted_builder


def measure(cfg: Any, styles: Sequence[str], corpora: int, ks: Sequence[int], calls_per_turn: int = 0,
            passage_words: int = 0) -> dict[str, Any]:
    """Builds with each style and answers with the run's answerer, next to raw / bm25@k / agentic@k."""
    t0 = time.perf_counter()
    settings = cfg if isinstance(cfg, GRPOConfig) else config_validation.validate(cfg)
    train, held = inputs.build_tasks(settings)
    tasks = held[:corpora] if corpora else held
    sft_cfg = sft.warm_start_config(settings)
    # the warm start's tokenizer (never trained on the run's tasks)
    tok = sft.demo_tokenizer(sft_cfg, sft.demo_tasks(sft_cfg))
    templates = cluster.role_templates(settings, tok)  # every role's template, as the run encodes it
    template = templates[POLICY]
    rollout = dataclasses.replace(cluster.mode_rollout(settings.rollout.config, cluster.Mode.EVAL),
                                  terminal_questions="hidden")
    jobs: list[pipeline.Job] = []
    for style in styles:
        policy = scripted_builder(style, calls_per_turn, rollout.builder.max_turns,
                                  rollout.builder.max_new_tokens, rollout.builder.doc_id_titles)
        engine = ScriptedEngine(tok, policy, end_id=template.stop_ids[0])
        engines = {POLICY: engine, FROZEN: engine}
        built = pipeline.build_workspaces(style, tasks, lambda engines=engines: engines, tok, rollout,
                                          templates=templates, seed=0, progress=False)
        jobs += [pipeline.Job.of(b, 1) for b in built]
    c = EvalConfig()  # BM25 passages of `bm25.passage_words`; agentic search over a BM25 index
    if passage_words:
        c = dataclasses.replace(c, bm25=dataclasses.replace(c.bm25, passage_words=passage_words))
    for t in tasks:
        qs = pipeline.questions_of(t, rollout)
        jobs += baselines.retrieval_jobs(["raw"], t, qs, c, 1, baselines.RetrievalModels())
        indexes: dict = {}  # the corpus's BM25 index, built once for every k
        for k in ks:
            for j in baselines.retrieval_jobs(["bm25", "agentic"], t, qs, c, 1, baselines.RetrievalModels(),
                                              ks={"bm25": k, "agentic": k}, indexes=indexes):
                jobs.append(dataclasses.replace(j, method=f"{j.method}@{k}"))
    none = ScriptedEngine(tok, lambda s: "", end_id=template.stop_ids[0])
    answers = pipeline.answer_jobs(jobs, lambda: {POLICY: none, FROZEN: none}, tok, rollout,
                                   templates=templates, seed=0, progress=False)
    records = [r for j, a in zip(jobs, answers, strict=True) for r in pipeline.job_records(j, a, rollout)]
    qtype = {q.question_id: q.question_type for t in tasks for q in t.questions}
    methods = list(dict.fromkeys(j.method for j in jobs))
    corpus_ids = [t.task_id for t in tasks]
    sums = stats.corpus_sums(records, methods, corpus_ids)
    w = stats.draw_counts(stats.bootstrap_indices(len(corpus_ids), seed=0), len(corpus_ids))
    table = stats.accuracy_table(sums, w, base=methods[0])
    by_type: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_type[r["method"]][qtype[r["question_id"]]].append(r["correct"])
    out = {"corpora": len(tasks), "docs_per_corpus": float(np.mean([len(t.documents) for t in tasks])),
           "words_per_corpus": float(np.mean([sum(len(d.text.split()) for d in t.documents) for t in tasks])),
           "question_types": {k: sum(v == k for v in qtype.values()) for k in sorted(set(qtype.values()))},
           "methods": {}, "wall_s": 0.0}
    for m in methods:
        row = table[m]
        out["methods"][m] = {
            "accuracy": row["accuracy"], "ci95": row["ci"],
            "by_type": {k: float(np.mean(v)) for k, v in sorted(by_type[m].items())},
            "tokens_read": row["tokens_read_per_query"], "files": row["files_opened_per_query"],
            "construction": row["construction_tokens_per_corpus"]}
    out["wall_s"] = time.perf_counter() - t0
    return out


def render(res: dict[str, Any]) -> str:
    types = sorted(res["question_types"])
    head = f"{'method':<14} {'acc %':>6} {'95% CI':>14} " + " ".join(f"{t[:10]:>10}" for t in types)
    head += f" {'files/q':>8} {'tok read/q':>10} {'build tok':>9}"
    lines = [f"{res['corpora']} corpora, {res['docs_per_corpus']:.1f} documents and "
             f"{res['words_per_corpus']:.0f} words each; questions by type {res['question_types']}", head,
             "-" * len(head)]
    for m, r in res["methods"].items():
        lo, hi = r["ci95"]
        by = " ".join(f"{100 * r['by_type'].get(t, float('nan')):>10.1f}" for t in types)
        lines.append(f"{m:<14} {100 * r['accuracy']:>6.1f} [{100 * lo:5.1f}, {100 * hi:5.1f}] {by} "
                     f"{r['files']:>8.2f} {r['tokens_read']:>10.0f} {r['construction']:>9.0f}")
    return "\n".join(lines)
