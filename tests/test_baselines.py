"""The paper's baselines as eval methods (eval.baselines, eval.retrieval, eval.constructions; issue 38).

Embedding retrieval and reranking run real forward passes of small random-weight checkpoints saved with
`models.save_hf` and loaded back through `load_hf`; their pooling and yes/no scores are checked against a
full forward pass, their token counts against a hand count. Agentic RAG's search tool runs in the scripted
navigator and the LLM answerer's protocol; GraphRAG and AutoCompaction write real workspaces with provenance,
and with a model executor their construction tokens equal the hand count of every executor prompt and reply.
Every method then runs end to end through `configs/eval.py` (`cli.evaluate_run`) on a tiny training run.
"""

from __future__ import annotations

import os
import sys

import forward
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from librarian_jax import models
from librarian_jax.agents.answerer import AnswererConfig, answer_question
from librarian_jax.agents.runtime import EXECUTOR, FROZEN, POLICY, AgentContext
from librarian_jax.data import synthetic
from librarian_jax.eval import baselines, constructions, retrieval
from librarian_jax.rollout import Scheduler
from librarian_jax.testing import ByteTokenizer, ScriptedEngine, chat_template, returned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_main import tiny_run_config  # noqa: E402

TOK = ByteTokenizer()
TPL = chat_template(TOK)
TASK = synthetic.generate_task(0, 0, synthetic.WorldConfig(docs_per_task=4, min_words=30, max_words=50,
                                                            questions_per_task=3))


@pytest.fixture(scope="module")
def tiny_model():
    """A 1-layer random-weight Qwen3-family checkpoint, saved and loaded back through our HF I/O."""
    path = os.path.join(os.environ.get("PYTEST_TMPDIR", "/tmp"), f"baselines_tiny_{os.getpid()}")
    model = models.Transformer(models.get_preset("tiny", num_layers=1, dtype="float32",
                                                 param_dtype="float32"), rngs=nnx.Rngs(0))
    models.save_hf(model, path)
    return path, models.load_hf(path, dtype="float32")


def test_passages_and_bm25_find_the_document_that_names_the_subject():
    chunks = retrieval.passages(TASK, passage_words=10)
    words = sum(max(len(d.text.split()), 1) for d in TASK.documents)
    assert sum(c.last_word - c.first_word + 1 for c in chunks) == words  # every word in exactly one passage
    assert all(c.path.startswith("raw_docs/") for c in chunks)
    doc = TASK.documents[0]
    name = doc.meta["subject"]
    hits = retrieval.BM25Index(chunks).search(f"{name}", 3)
    assert chunks[hits[0][0]].doc_id in {d.doc_id for d in TASK.documents if name in d.text}
    assert len(hits) == 3 and hits[0][1] >= hits[-1][1]


def test_retrieval_jobs_build_a_corpus_index_once_for_every_k(monkeypatch):
    """`tune_ks` and the world check try several k on each corpus: given one `indexes` dict, BM25 and agentic
    search share one index of the corpus (built once, not once per k and method), and every job is what a job
    with an index of its own would be."""
    from librarian_jax.config_schema import EvalConfig

    built = []

    class Counted(retrieval.BM25Index):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(retrieval, "BM25Index", Counted)
    c, qs, ks = EvalConfig(), list(TASK.questions), (1, 2, 3)

    def jobs(indexes):
        out = []
        for k in ks:
            out += baselines.retrieval_jobs(["bm25", "agentic"], TASK, qs, c, 1, baselines.RetrievalModels(),
                                            ks={"bm25": k, "agentic": k}, indexes=indexes)
        return out

    shared = jobs({})
    assert len(built) == 1
    own = jobs(None)
    assert len(built) == 1 + 2 * len(ks)
    for a, b in zip(shared, own, strict=True):
        fields = ("method", "preambles", "passages", "search_k")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        if a.search is not None:
            for q in qs:
                assert [p.path for p in a.search(q.question, a.search_k)] == \
                    [p.path for p in b.search(q.question, b.search_k)]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedder_pools_like_a_full_forward_and_counts_its_tokens(tiny_model, pooling):
    _, model = tiny_model
    texts = ["short one", "a much longer passage of text than the first one, padded in its batch", "x"]
    emb = retrieval.Embedder(model, TOK, pooling=pooling, instruction="Find it", batch_size=2, max_tokens=64)
    vecs = emb.embed(texts, query=True)  # [3, hidden]
    assert vecs.shape == (3, model.config.hidden_size)
    ids = [TOK.encode(f"Instruct: Find it\nQuery:{t}")[:63] + [TOK.eos_id] for t in texts]  # cut to 64
    assert emb.tokens == sum(len(i) for i in ids)  # hand count: real tokens only, no padding
    for v, i in zip(vecs, ids, strict=True):  # each text alone, unpadded, through the model's own forward
        h = np.asarray(forward.hidden(model, jnp.asarray([i], jnp.int32))[0], np.float32)
        want = h[-1] if pooling == "last" else h.mean(0)
        np.testing.assert_allclose(v, want / np.linalg.norm(want), atol=2e-5)
    assert np.allclose(np.linalg.norm(vecs, axis=-1), 1.0, atol=1e-5)


def test_embedding_index_ranks_by_dot_product_and_meters_queries(tiny_model):
    _, model = tiny_model
    chunks = retrieval.passages(TASK, passage_words=12)
    emb = retrieval.Embedder(model, TOK, batch_size=4, max_tokens=128)
    index = retrieval.EmbeddingIndex(chunks, emb)
    assert index.index_tokens == sum(len(TOK.encode(c.text)[:127]) + 1 for c in chunks)
    q = "Who employs the botanist?"
    hits = index.search(q, 4)
    scores = index.vectors @ emb.embed([q], query=True)[0]
    assert [j for j, _ in hits] == list(np.argsort(-scores, kind="stable")[:4])
    assert index.tokens == index.index_tokens + len(emb.ids(q, query=True))


def test_reranker_scores_yes_against_no_at_the_last_position(tiny_model):
    _, model = tiny_model
    rr = retrieval.Reranker(model, TOK, TPL, instruction="Judge", batch_size=2, max_tokens=512)
    docs = ["first passage", "second passage, a bit longer than the first", "third"]
    s = rr.scores("the query", docs)
    yes, no = rr.label_ids
    for score, d in zip(s, docs, strict=True):
        ids = rr.prompt("the query", d, 10_000)
        logits = forward.logits(model, jnp.asarray([ids], jnp.int32))
        pair = np.asarray(logits[0, -1, [yes, no]], np.float32)
        np.testing.assert_allclose(score, np.exp(pair[0]) / np.exp(pair).sum(), atol=1e-5)
    assert rr.tokens == sum(len(rr.prompt("the query", d, 10_000)) for d in docs)
    short = retrieval.Reranker(model, TOK, TPL, instruction="Judge", max_tokens=240)
    short.scores("the query", docs)  # a prompt longer than max_tokens has its document cut to fit
    assert short.tokens == sum(min(len(rr.prompt("the query", d, 10_000)), 240) for d in docs)
    chunks = retrieval.passages(TASK, passage_words=12)
    top = rr.rerank("the query", chunks, [(0, 1.0), (1, 0.5), (2, 0.1)], 2)
    full = rr.scores("the query", [chunks[j].text for j in range(3)])
    assert [j for j, _ in top] == list(np.argsort(-full, kind="stable")[:2])


def test_scripted_navigator_searches_first_and_counts_passages():
    """With a search tool the navigator searches once per hop, reads the hit's document first, and counts the
    passages; its answers are at least as good as raw navigation's under the same turn budget."""
    from librarian_jax.workspace import Workspace

    chunks = retrieval.passages(TASK, passage_words=40)
    index = retrieval.BM25Index(chunks)
    calls = []

    def search(query, k):
        calls.append((query, k))
        return [chunks[j] for j, _ in index.search(query, k)]

    cfg = AnswererConfig(kind="scripted", max_turns=3, context_budget=100_000, preload_root_files=False)
    right = {"agentic": 0, "raw": 0}
    for q in TASK.questions:
        ws = Workspace.from_documents(list(TASK.documents))
        with_search = returned(answer_question(AgentContext(TOK, TPL, {}), ws, q.question, cfg,
                                               search=search))
        raw = returned(answer_question(AgentContext(TOK, TPL, {}), ws, q.question, cfg))
        assert with_search.actions[0].startswith("search ")
        assert with_search.passages_read == 5 * sum(a.startswith("search") for a in with_search.actions)
        assert raw.passages_read == 0
        right["agentic"] += with_search.answer in q.answers
        right["raw"] += raw.answer in q.answers
    assert calls and right["agentic"] >= right["raw"]


def test_llm_answerer_runs_search_calls_and_reads_their_passages():
    from librarian_jax.workspace import Workspace

    chunks = retrieval.passages(TASK, passage_words=40)
    index = retrieval.BM25Index(chunks)
    replies = iter(['<tool_call>{"name": "search", "arguments": {"query": "botanist", "k": 2}}</tool_call>',
                    '<tool_call>{"name": "answer", "arguments": {"text": "x"}}</tool_call>'])
    eng = ScriptedEngine(TOK, lambda s: next(replies))
    ctx = AgentContext(TOK, TPL, {"answerer": eng, FROZEN: eng})
    cfg = AnswererConfig(kind="model", max_turns=4, context_budget=100_000, preload_root_files=False)
    search = lambda q, k: [chunks[j] for j, _ in index.search(q, k)]  # noqa: E731
    out = Scheduler({"answerer": eng, POLICY: eng, FROZEN: eng}).run(
        [answer_question(ctx, Workspace.from_documents(list(TASK.documents)), "Who?", cfg, search=search)])[0]
    assert out.passages_read == 2 and out.answer == "x"
    text = eng.sessions[0].text()
    assert "search(query: str, k: int = 5)" in text  # the tool is in the system prompt
    hit = chunks[index.search("botanist", 1)[0][0]]
    assert f"[1] {hit.label}: {hit.text}" in text  # its passages were the observation


def test_cooccurrence_graph_and_louvain_communities_are_seeded():
    rels = constructions.cooccurrence_relations("This profile describes Jezai Fund. Jezai Fund is on the "
                                                "staff of Cionufax Society. By profession, Jezai Fund is a "
                                                "botanist.")
    assert rels == [("Jezai Fund", "Jezai Fund is on the staff of Cionufax Society.", "Cionufax Society")]
    assert constructions.parse_relations("A | knows | B\nnoise\n | x | \nC|likes|D") == [
        ("A", "knows", "B"), ("C", "likes", "D")]
    edges = [(f"a{i}", "r", f"a{i + 1}", "p") for i in range(5)] + [(f"b{i}", "r", f"b{i + 1}", "p")
                                                                   for i in range(5)]
    first = constructions.communities(edges, seed=0, resolution=1.0)
    assert first == constructions.communities(edges, seed=0, resolution=1.0)
    assert sorted(e for c in first for e in c) == sorted({e for a, _, b, _ in edges for e in (a, b)})
    assert not any({e[0] for e in c} == {"a", "b"} for c in first)  # the two chains never share a community


def _executor_ctx(reply):
    eng = ScriptedEngine(TOK, reply)
    by_role = {POLICY: eng, FROZEN: eng, EXECUTOR: eng}
    return AgentContext(TOK, TPL, by_role, templates={EXECUTOR: TPL}), eng, by_role


@pytest.mark.parametrize("method", ["graphrag", "autocompaction"])
def test_model_executor_construction_tokens_are_the_hand_count(method):
    """Every executor prompt and reply of the construction, counted by hand from the engine's sessions."""
    reply = (lambda s: "Jezai Fund | works at | Cionufax Society") if method == "graphrag" else (
        lambda s: "Jezai Fund is a botanist.")
    ctx, eng, by_role = _executor_ctx(reply)
    kw = ({"summary_words": 50} if method == "graphrag" else {"budget_tokens": 200, "chunk_tokens": 150})
    out = Scheduler(by_role).run([constructions.CONSTRUCTIONS[method](ctx, TASK, executor="model", **kw)])[0]
    hand = sum(len(s.tokens) for s in eng.sessions)  # prompt + generated ids of every executor session
    assert out.construction_tokens == hand and out.calls == len(eng.sessions) > 0
    files = [n for n in out.workspace.active_nodes()]
    if method == "graphrag":  # one extraction per document, one summary per community
        assert out.calls == len(TASK.documents) + len(files) and out.info["communities"] == len(files) == 1
        assert files[0].title.startswith("Community 1: ")
    else:
        assert len(files) == 1 and files[0].body == "Jezai Fund is a botanist."
        assert out.calls == out.info["steps"] > len(TASK.documents)  # chunked: more pieces than documents


def test_extractive_constructions_have_provenance_and_fit_their_budget():
    ctx = AgentContext(TOK, TPL, {})
    g = Scheduler({}).run([constructions.graphrag(ctx, TASK, executor="extractive", summary_words=80)])[0]
    assert g.construction_tokens == 0 and g.info["communities"] >= 1
    nodes = g.workspace.active_nodes()
    assert len(nodes) == g.info["communities"]
    raw = {d.handle for d in g.workspace.raw_docs}
    assert all(n.raw_sources and set(n.raw_sources) <= raw for n in nodes)  # provenance: real raw documents
    a = returned(constructions.autocompaction(ctx, TASK, executor="extractive", budget_tokens=120,
                                            chunk_tokens=64))
    (notes,) = a.workspace.active_nodes()
    assert len(TOK.encode(notes.body)) <= 120 and a.construction_tokens == 0
    assert set(notes.raw_sources) == raw


# ------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from librarian_jax import training

    workdir = str(tmp_path_factory.mktemp("baselines_run") / "run")
    training.run(tiny_run_config(workdir, num_steps=1))
    return workdir


def test_every_baseline_end_to_end_through_configs_eval(run_dir, tiny_model):
    from configs import eval as eval_config
    from librarian_jax.eval import cli

    path, model = tiny_model
    c = eval_config.get_config()
    c.answerer.kind = "scripted"
    c.bootstrap.draws = 50
    c.roles.embedding.update(path=path, dtype="float32", max_tokens=64, batch_size=4)
    c.roles.reranker.update(path=path, dtype="float32", max_tokens=256, batch_size=4)
    c.rerank.candidates = 4
    c.bm25.update(top_k=2, passage_words=15)
    methods = list(baselines.METHODS)
    results = cli.evaluate_run(run_dir, methods=methods, name="baselines", config=c, progress=False)
    assert results["methods"] == methods
    import json

    out = os.path.join(run_dir, "eval", "baselines")
    records = [json.loads(x) for x in open(os.path.join(out, "questions.jsonl"))]
    by = {m: [r for r in records if r["method"] == m] for m in methods}
    assert all(by[m] for m in methods)
    assert all(r["judgement"] not in ("answer_failed", "construction_failed") for r in records)
    # hand count of tokens embedded on this tiny corpus: every passage once + every query (embedding);
    # every (question, candidate) judging prompt (rerank over BM25)
    tasks, _ = cli.heldout_tasks(cli.plan_eval(_with_run(c, run_dir)))
    tok = cli.restore.run_tokenizer(cli.restore.load_run_config(run_dir), run_dir, tasks)
    emb = retrieval.Embedder(model, tok, instruction=c.roles.embedding.instruction, max_tokens=64)
    rr_tpl = None
    for t in tasks:
        chunks = retrieval.passages(t, 15)
        qs = [r["question"] for r in by["embedding"] if r["corpus"] == t.task_id]
        want = sum(len(emb.ids(x.text)) for x in chunks) + sum(len(emb.ids(q, query=True)) for q in qs)
        got = {r["tokens_embedded"] for r in by["embedding"] if r["corpus"] == t.task_id}
        assert got == {want}
        if rr_tpl is None:
            from librarian_jax import cluster
            from librarian_jax.config_schema import RerankerRoleSection

            section = RerankerRoleSection.parse(c.roles.reranker, "roles.reranker")
            rr_tpl = cluster.retrieval_model("reranker", section, None, tok).template
        rr = retrieval.Reranker(model, tok, rr_tpl, instruction=c.roles.reranker.instruction, max_tokens=256)
        bm = retrieval.BM25Index(chunks)
        want = sum(min(len(rr.prompt(q, chunks[j].text, 256 - len(rr.prompt(q, "", 0)))), 256)
                   for q in qs for j, _ in bm.search(q, 4))
        assert {r["tokens_embedded"] for r in by["rerank"] if r["corpus"] == t.task_id} == {want}
    for m in ("bm25", "embedding", "rerank"):
        assert {r["passages_read"] for r in by[m]} == {2}  # top_k passages in every first prompt
        assert all(r["construction_tokens"] == 0 for r in by[m])
    assert all(r["tokens_embedded"] == 0 for m in ("raw", "bm25", "agentic", "graphrag") for r in by[m])
    assert all(r["passages_read"] % c.agentic.k == 0 for r in by["agentic"])
    assert any(r["passages_read"] > 0 for r in by["agentic"])
    acc = results["accuracy"]
    assert acc["embedding"]["tokens_embedded_per_corpus"] > 0 and acc["bm25"]["passages_per_query"] == 2
    # GraphRAG and AutoCompaction: real workspaces (exported), the run's extractive executor costs 0 tokens
    assert results["workspaces"]["graphrag"] == results["workspaces"]["autocompaction"] == len(tasks)
    report = open(os.path.join(out, "report.md")).read()
    assert "tokens embedded/corpus" in report and "passages/query" in report
    # the paper's "files read per query": distinct files in context, the preloaded community files included
    assert "## Reading per question as the paper counts it" in report
    assert all(r["files_opened"] >= len(set(r["files"])) for r in records)
    assert acc["graphrag"]["files_opened_per_query"] > acc["graphrag"]["files_per_query"]


def _with_run(c, run_dir):
    import ml_collections

    c = ml_collections.ConfigDict(c.to_dict())
    c.run = run_dir
    c.methods = ",".join(baselines.METHODS)
    return c


def test_embedding_methods_need_their_model_before_anything_loads(run_dir):
    from configs import eval as eval_config
    from librarian_jax.config_schema import ConfigError
    from librarian_jax.eval import cli

    c = eval_config.get_config()
    c.run = run_dir
    for methods, key in (("embedding", "roles.embedding.path"), ("rerank", "roles.reranker.path"),
                         ("agentic", None)):
        c.methods = methods
        if key is None:
            cli.plan_eval(c)  # agentic over BM25 needs no model
            c.agentic.index = "embedding"
            key = "roles.embedding.path"
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            cli.plan_eval(c)


@pytest.mark.parametrize("preset", ["browsecomp_plus", "bright"])
def test_paper_presets_dry_run_with_every_method(run_dir, tiny_model, preset, capsys):
    from configs import eval as eval_config
    from librarian_jax.config_schema import ConfigError
    from librarian_jax.eval import cli

    c = eval_config.get_config(preset)
    assert set(cli._csv(c.methods)) == {"trained", "base", *baselines.METHODS}
    c.run = run_dir
    with pytest.raises(ConfigError, match=r"config\.roles\.embedding\.path: required"):
        cli.run_eval(c, dry_run=True)  # named before any model loads
    c.roles.embedding.path = c.roles.reranker.path = tiny_model[0]
    assert cli.run_eval(c, dry_run=True) is None
    assert "'agentic', 'graphrag', 'autocompaction'" in capsys.readouterr().out


def test_bright_pass_at_k_samples_answers_on_one_construction_for_every_method(run_dir):
    """`answer_temperature` > 0 (the bright preset): one construction per corpus, `samples` answers sampled
    per question for the builder's methods and the baselines alike; greedy answers: one run recorded n
    times."""
    import json

    from configs import eval as eval_config
    from librarian_jax.eval import cli

    c = eval_config.get_config()
    c.update(samples=3, pass_k="1,3", builder_temperature=1.0, answer_temperature=1.0)
    c.answerer.kind = "model"  # the tiny run's random-weight answerer: sampling shows in its replies
    c.bootstrap.draws = 20
    c.ablation.enabled = False
    methods = ["trained", "raw", "bm25", "agentic"]
    results = cli.evaluate_run(run_dir, methods=methods, name="bright_like", config=c, progress=False,
                               export_workspaces=False)
    assert "sampled at temperature 1.0" in results["setup"]["sample_unit"]
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "eval", "bright_like", "questions.jsonl"))]
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        by_q: dict = {}
        for r in mine:
            by_q.setdefault((r["corpus"], r["question_id"]), []).append(r)
        assert all(sorted(r["sample"] for r in rs) == [0, 1, 2] for rs in by_q.values()), m
        assert all(r["tokens_read"] > 0 for r in mine), m  # every sample its own run, none a free copy
        assert any(len({r["answer"] for r in rs}) > 1 for rs in by_q.values()), m  # sampled, not copies
        if m == "trained":  # one construction per corpus: every sample of a corpus has its build cost
            assert len({(r["corpus"], r["construction_tokens"]) for r in mine}) == len(results["corpora"])
    assert set(results["pass_at_k"]["bm25"]) == {"1", "3"}
    c.answer_temperature = 0.0  # greedy answers: one run per question recorded 3 times, at its cost
    cli.evaluate_run(run_dir, methods=["bm25"], name="greedy", config=c, progress=False,
                     export_workspaces=False)
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "eval", "greedy", "questions.jsonl"))]
    assert {r["sample"] for r in rows} == {0, 1, 2}
    for q in {r["question_id"] for r in rows}:
        assert len({(r["answer"], r["tokens_read"]) for r in rows if r["question_id"] == q}) == 1
