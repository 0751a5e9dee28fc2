"""Evaluation of a trained builder against baselines on held-out corpora (librarian_jax.eval; docs/eval.md).

    python -m librarian_jax.main --config=configs/eval.py --config.run=/runs/q4b
    python -m librarian_jax.main --config=configs/eval.py:browsecomp_plus --config.run=/runs/q4b \\
        --config.task_ids=/data/bcp_heldout_ids.txt
    python -m librarian_jax.main --config=configs/eval.py --config.builder=hf:/ckpt/Qwen3.5-4B \\
        --config.tasks=/data/heldout.jsonl --config.train_preset=qwen3_5_4b

The report goes to `<run>/eval/<name>/` (or `out` when set): report.md, results.json, questions.jsonl,
PNG plots, TensorBoard scalars (`tb/`) and the built workspaces (`workspaces/`).
Presets: `embedded` (default: trained, base, raw, bm25, agentic), `browsecomp_plus` (the paper's 680/50
protocol, one sample per question), `bright` (50 sampled questions per domain; pass@1 and pass@3 from 4
answers sampled per question on one workspace per domain, every method alike). The paper presets run every
baseline of the paper's central table (docs/eval.md, "Baselines"): give them
`--config.roles.embedding.path=/ckpt/Qwen3-Embedding-0.6B` and
`--config.roles.reranker.path=/ckpt/Qwen3-Reranker-0.6B` (or drop `embedding,rerank` from `methods`).
The keys and their defaults (the `embedded` preset's) are declared in
`librarian_jax.config_schema.EvalConfig`; a preset states only what it changes.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from librarian_jax import config_schema


def _paper(preset: str) -> dict[str, Any]:
    """The paper's baselines: dense retrieval (Qwen3-Embedding, last-token pooling), reranking of the
    embedding top 20 (Qwen3-Reranker), agentic search over the embedding index, with the paper's k (a matched
    budget would answer 16 corpora x 8 k per method). AutoCompaction's step (notes + piece + its reply,
    2 * budget + chunk + ~150 tokens) fits the executor's 8,192 context."""
    c: dict[str, Any] = {
        "train_preset": "qwen3_5_4b",
        "methods": "trained,base,raw,bm25,embedding,rerank,agentic,graphrag,autocompaction",
        "retrieval_budget": {"mode": "fixed"},
        "rerank": {"first_stage": "embedding"},
        "agentic": {"index": "embedding"},
        "roles": {"embedding": {"dtype": "bfloat16", "batch_size": 64},
                  "reranker": {"dtype": "bfloat16", "batch_size": 32}},
        "autocompaction": {"budget_tokens": 2000, "chunk_tokens": 4000},
        "engine": {"policy_slots": 64, "frozen_slots": 256},
        "mesh": {"shape": {"data": 1, "fsdp": -1, "tensor": 1}},
        "bootstrap": {"draws": 10000},
    }
    if preset == "browsecomp_plus":
        # 680 train / 50 held-out tasks: the held-out ids come from task_ids when given, else the run's split
        c["bm25"] = {"top_k": 5, "passage_words": 200}
    else:
        # the paper's pass@k: one workspace per domain (greedy), 4 sampled answerer responses per question,
        # every baseline sampled the same way (the temperature is ours: the paper does not give one); 50
        # questions each from AOPS, Biology, Stack Overflow (paper Table 3)
        c.update(samples=4, pass_k="1,3", answer_temperature=1.0, questions_per_domain=50,
                 ablation={"enabled": False})
    return c


# preset name -> the keys it sets on the schema's defaults (nested like the config)
PRESETS: dict[str, dict[str, Any]] = {
    "embedded": {},
    "browsecomp_plus": _paper("browsecomp_plus"),
    "bright": _paper("bright"),
}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    preset = preset or "embedded"
    if preset not in PRESETS:
        raise ValueError(f"configs/eval.py: unknown preset {preset!r}; known: {list(PRESETS)}")
    return config_schema.EvalConfig.preset_config({**PRESETS[preset], "preset": preset})
