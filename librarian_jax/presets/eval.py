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
The keys are declared in `librarian_jax.config_schema.EvalConfig`; this file sets values.
"""

from __future__ import annotations

import ml_collections

from librarian_jax import config_schema

PRESETS = ("embedded", "browsecomp_plus", "bright")


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    preset = preset or "embedded"
    if preset not in PRESETS:
        raise ValueError(f"configs/eval.py: unknown preset {preset!r}; known: {list(PRESETS)}")
    c = config_schema.EvalConfig().to_config_dict()
    c.lock()  # only the schema's keys: setting another is a KeyError here
    c.preset = preset
    c.run = ""  # the training workdir (config.json, split.json, checkpoints/, tokenizer/)
    c.step = -1  # checkpoint step; -1 = the newest committed one
    c.builder = ""  # the "trained" method's weights: "" = the run's checkpoint, or "hf:/path"
    c.train_preset = "embedded"  # configs/grpo.py preset for rollout settings when there is no run
    # comma-separated: trained, base, raw, bm25, embedding, rerank, agentic, graphrag, autocompaction,
    # run:/other/workdir (extra Orbax runs); docs/eval.md says what each does and costs
    c.methods = "trained,base,raw,bm25,agentic"
    c.name = "default"  # report folder name under <run>/eval/
    c.out = ""  # report folder; "" = <run>/eval/<name>
    c.tasks = ""  # a task file (data.load_tasks); "" = the run's data, held-out ids from split.json
    c.task_ids = ""  # a file of task ids to evaluate (one per line, or JSON list / {"heldout": [...]})
    c.num_tasks = 0  # evaluate the first N held-out corpora (0 = all)
    c.questions_per_domain = 0  # a BRIGHT `tasks` folder: a sample of N questions per domain (0 = all)
    c.sample_seed = 0  # the seed of that sample (as configs/grpo.py data.sample_seed)
    c.seed = 0
    c.samples = 1  # n samples per question (pass@k); a sample = one construction + one answer
    c.pass_k = "1"  # comma-separated k <= samples
    c.builder_temperature = 0.0  # 0 = greedy builder (the default for evaluation)
    c.answer_temperature = 0.0  # > 0: samples = sampled answers on one construction per corpus
    c.answerer.update(kind="", temperature=-1.0)  # "" / -1 = the run's
    c.bm25.update(top_k=3, passage_words=120)  # every retrieval method's passages and top-k budget
    c.rerank.update(candidates=20, first_stage="bm25")
    c.agentic.update(index="bm25", k=3)  # k: the scripted navigator's searches (an LLM picks its own)
    # every retrieval method reads what the trained builder's workspaces cost the answerer, its k tuned on the
    # run's training corpora (docs/eval.md, "Retrieval budget"); "fixed": bm25.top_k and agentic.k
    c.retrieval_budget.update(mode="matched", ks="1,2,3,5,8,12,16,20", corpora=16, against="trained")
    c.graphrag.update(seed=0, resolution=1.0, extract_max_tokens=2048, extract_max_new_tokens=512,
                      summary_words=200, summary_max_new_tokens=512)
    # an embedded corpus (6 documents of 40-80 words) fits 2,000 tokens whole (96.0% on the embedded world's
    # held-out corpora, no compaction at all); 128 keeps the notes lossy, as a real corpus is against the
    # paper's budget (7.3%; 256: 17.7%)
    c.autocompaction.update(budget_tokens=128, chunk_tokens=128)
    # the retrieval models (HF folders of our families); "" = not loaded (embedding / rerank need them)
    c.roles.embedding.update(path="", dtype="", pooling="last", max_tokens=512, batch_size=16)
    c.roles.reranker.update(path="", dtype="", max_tokens=1024, batch_size=8)
    c.ablation.update(enabled=True, shuffle_seed=0)
    c.bootstrap.update(draws=2000, seed=0)
    c.cost_qs = "1,10,20,50"
    c.batch_tasks = 0  # corpora per scheduler batch (one progress-bar tick); 0 = as many as the builder's
    # engine slots hold (its idle slots decode anyway: 16 corpora at once built the 31 held-out ones of a
    # noisy run in 13.2 s instead of 18.0 with 8)
    c.export_workspaces = True
    c.engine.update(policy_slots=0, frozen_slots=0, max_seq_len=0, round_steps=0)  # 0 = the run's
    c.mesh.shape.update(data=1, fsdp=1, tensor=1)
    paper_methods = "trained,base,raw,bm25,embedding,rerank,agentic,graphrag,autocompaction"
    if preset in ("browsecomp_plus", "bright"):
        # the paper's baselines: dense retrieval (Qwen3-Embedding, last-token pooling), reranking of the
        # embedding top 20 (Qwen3-Reranker), agentic search over the embedding index. AutoCompaction's step
        # (notes + piece + its reply, 2 * budget + chunk + ~150 tokens) fits the executor's 8,192 context
        c.methods = paper_methods
        c.retrieval_budget.mode = "fixed"  # the paper's k (tuning would answer 16 corpora x 8 k per method)
        c.rerank.update(candidates=20, first_stage="embedding")
        c.agentic.index = "embedding"
        c.roles.embedding.update(dtype="bfloat16", batch_size=64)
        c.roles.reranker.update(dtype="bfloat16", batch_size=32)
        c.autocompaction.update(budget_tokens=2000, chunk_tokens=4000)
    if preset == "browsecomp_plus":
        # 680 train / 50 held-out tasks: the held-out ids come from task_ids when given, else the run's split
        c.train_preset = "qwen3_5_4b"
        c.bm25.update(top_k=5, passage_words=200)
        c.engine.update(policy_slots=64, frozen_slots=256)
        c.mesh.shape.update(data=1, fsdp=-1, tensor=1)
        c.bootstrap.draws = 10000
    elif preset == "bright":
        c.train_preset = "qwen3_5_4b"
        # the paper's pass@k: one workspace per domain (greedy), 4 sampled answerer responses per question,
        # every baseline sampled the same way (the temperature is ours: the paper does not give one)
        c.samples, c.pass_k, c.builder_temperature, c.answer_temperature = 4, "1,3", 0.0, 1.0
        c.questions_per_domain = 50  # paper Table 3: 50 questions each from AOPS, Biology, Stack Overflow
        c.ablation.enabled = False
        c.engine.update(policy_slots=64, frozen_slots=256)
        c.mesh.shape.update(data=1, fsdp=-1, tensor=1)
        c.bootstrap.draws = 10000
    c.unlock()
    return c
