"""eval.stats against hand-computed values and brute force (bootstrap loop, subset enumeration)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from librarian_jax.eval import stats


def _records(method, corpus, n, correct, read, written, construction, files=1):
    return [
        {
            "method": method,
            "corpus": corpus,
            "question": f"{corpus}-q{i}",
            "correct": float(i < correct),
            "tokens_read": read,
            "tokens_written": written,
            "files_read": files,
            "turns": 2,
            "construction_tokens": construction,
        }
        for i in range(n)
    ]


def _random_records(seed=0, corpora=7):
    rng = np.random.default_rng(seed)
    recs = []
    for c in range(corpora):
        n = int(rng.integers(1, 6))  # uneven question counts per corpus
        build = float(rng.integers(100, 999))  # the trained builder's construction tokens of this corpus
        for m, bias in (("base", 0.3), ("trained", 0.6)):
            for i in range(n):
                recs.append(
                    {
                        "method": m,
                        "corpus": f"c{c}",
                        "question": f"q{i}",
                        "correct": float(rng.random() < bias),
                        "tokens_read": float(rng.integers(10, 99)),
                        "tokens_written": 5.0,
                        "files_read": float(rng.integers(0, 4)),
                        "turns": 1,
                        "construction_tokens": build if m == "trained" else 50.0,
                    }
                )
    return recs


def test_bootstrap_accuracy_and_paired_difference_equal_a_plain_loop():
    recs = _random_records()
    corpora = [f"c{c}" for c in range(7)]
    sums = stats.corpus_sums(recs, ["base", "trained"], corpora)
    idx = stats.bootstrap_indices(len(corpora), 300, seed=3)
    table = stats.accuracy_table(sums, stats.draw_counts(idx, len(corpora)), base="base")
    # reference: per draw, the questions of the drawn corpora (a corpus drawn twice counts twice)
    acc = {m: [] for m in ("base", "trained")}
    for row in idx:
        for m in acc:
            vals = [r["correct"] for c in row for r in recs if r["method"] == m and r["corpus"] == corpora[c]]
            acc[m].append(np.mean(vals))
    for m in acc:
        lo, hi = np.percentile(acc[m], [2.5, 97.5])
        assert table[m]["ci"] == pytest.approx((lo, hi), abs=1e-12)
        point = np.mean([r["correct"] for r in recs if r["method"] == m])
        assert table[m]["accuracy"] == pytest.approx(point)
    diff = np.array(acc["trained"]) - np.array(acc["base"])
    assert table["trained"]["diff_ci"] == pytest.approx(tuple(np.percentile(diff, [2.5, 97.5])), abs=1e-12)
    assert table["base"]["diff_vs_base"] == 0.0
    # the same seed gives the same draws; a different seed different ones
    assert (stats.bootstrap_indices(7, 300, seed=3) == idx).all()
    assert not (stats.bootstrap_indices(7, 300, seed=4) == idx).all()


def test_missing_corpus_is_an_error_not_a_gap():
    recs = _records("trained", "a", 2, 1, 10, 1, 100)
    with pytest.raises(ValueError, match="no question record for corpora \\['b'\\]"):
        stats.corpus_sums(recs, ["trained"], ["a", "b"])


def test_cost_curves_ratio_and_crossover_on_a_hand_made_table():
    # trained: B=1000, A=100, p=0.5; base: B=1000, A=10, p=0.1 (two corpora of 10 questions each)
    recs = (
        _records("trained", "a", 10, 5, 90, 10, 1000)
        + _records("trained", "b", 10, 5, 90, 10, 1000)
        + _records("base", "a", 10, 1, 8, 2, 1000)
        + _records("base", "b", 10, 1, 8, 2, 1000)
    )
    sums = stats.corpus_sums(recs, ["base", "trained"], ["a", "b"])
    w = stats.draw_counts(stats.bootstrap_indices(2, 200, seed=0), 2)
    t = stats.cost_table(sums, w, "trained", "base", qs=(1, 10, 80))
    assert (t["B"]["trained"], t["A"]["trained"], t["p"]["trained"]) == pytest.approx((1000, 100, 0.5))
    assert (t["B"]["base"], t["A"]["base"], t["p"]["base"]) == pytest.approx((1000, 10, 0.1))
    # C_trained(10) = (100 + 100) / 0.5 = 400; C_base(10) = (100 + 10) / 0.1 = 1100
    assert t["ratios"]["10"]["ratio"] == pytest.approx(400 / 1100)
    assert t["ratios"]["1"]["ratio"] == pytest.approx(2200 / 10100)
    # q* = (1000 * 0.1 - 1000 * 0.5) / (10 * 0.5 - 100 * 0.1) = 80, where both cost 225 per correct answer
    assert t["crossover_q"] == pytest.approx(80.0)
    assert t["ratios"]["80"]["ratio"] == pytest.approx(1.0)
    assert stats.cost_per_correct(1000, 100, 0.5, 80) == pytest.approx(225.0)
    assert t["cheaper_at_q1"] == "trained" and t["cheaper_beyond_crossover"] == "base"
    # identical corpora: every draw gives the same values, so the CIs collapse to the point
    assert t["ratios"]["10"]["ci"] == pytest.approx((400 / 1100, 400 / 1100))
    assert t["crossover_ci"] == pytest.approx((80.0, 80.0))
    from librarian_jax.eval.report import format_figures

    line = format_figures({"cost": {"trained": t}})
    assert "trained / base at q=10: 0.364" in line and "trained cheaper below it, base beyond" in line
    # a crossover below q = 1: the side below it is the one not cheaper at q = 1
    early = dict(t, B={"trained": 10.0, "base": 0.0}, A={"trained": 10.0, "base": 100.0},
                 p={"trained": 0.5, "base": 0.5}, cheaper_at_q1="trained")  # equal at q = 5 / 45
    early["crossover_q"] = float(stats.crossover(10, 10, 0.5, 0, 100, 0.5))
    assert early["crossover_q"] == pytest.approx(5 / 45)
    assert "base cheaper below it, trained beyond" in format_figures({"cost": {"trained": early}})
    # curves that never cross at q > 0
    assert math.isnan(float(stats.crossover(100, 10, 0.5, 1000, 100, 0.1)))


def test_cost_ratio_ci_equals_a_plain_loop():
    recs = _random_records(seed=5)
    corpora = [f"c{c}" for c in range(7)]
    sums = stats.corpus_sums(recs, ["base", "trained"], corpora)
    idx = stats.bootstrap_indices(7, 200, seed=1)
    t = stats.cost_table(sums, stats.draw_counts(idx, 7), "trained", "base", qs=(10,))
    ref = []
    for row in idx:
        cost = {}
        for m in ("base", "trained"):
            rs = [r for c in row for r in recs if r["method"] == m and r["corpus"] == corpora[c]]
            b = np.mean(
                [
                    next(
                        r["construction_tokens"]
                        for r in recs
                        if r["method"] == m and r["corpus"] == corpora[c]
                    )
                    for c in row
                ]
            )
            a = np.mean([r["tokens_read"] + r["tokens_written"] for r in rs])
            p = np.mean([r["correct"] for r in rs])
            cost[m] = (b / 10 + a) / p if p > 0 else np.inf
        ref.append(cost["trained"] / cost["base"])
    ref = np.array(ref)
    ref = ref[np.isfinite(ref)]
    assert t["ratios"]["10"]["ci"] == pytest.approx(tuple(np.percentile(ref, [2.5, 97.5])), rel=1e-9)


@pytest.mark.parametrize("n", [1, 2, 4, 5])
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert stats.pass_at_k(n, c, k) == pytest.approx(brute)
    with pytest.raises(ValueError):
        stats.pass_at_k(4, 5, 1)


def test_pass_at_k_table_mean_and_standard_error():
    per_q = [(4, 0), (4, 1), (4, 4), (4, 2)]
    table = stats.pass_at_k_table(per_q, ks=(1, 3, 5))
    assert set(table) == {"1", "3"}  # k=5 > n=4 is left out
    v1 = np.array([0, 0.25, 1, 0.5])
    assert table["1"]["mean"] == pytest.approx(v1.mean())
    assert table["1"]["se"] == pytest.approx(v1.std(ddof=1) / 2)
    v3 = np.array([0, 0.75, 1, 1])  # 1 - C(3,3)/C(4,3) = 0.75; n - c < 3 -> 1
    assert table["3"]["mean"] == pytest.approx(v3.mean())
    assert stats.mean_se([1.0, 3.0]) == {"mean": 2.0, "se": pytest.approx(1.0), "n": 2}


def test_a_matched_retrieval_budget_takes_the_best_k_that_reads_no_more():
    from librarian_jax.eval.baselines import budget_ks, choose_k

    tried = [{"k": 1, "accuracy": 0.4, "tokens_read": 900}, {"k": 3, "accuracy": 0.6, "tokens_read": 1200},
             {"k": 5, "accuracy": 0.6, "tokens_read": 1400}, {"k": 8, "accuracy": 0.9, "tokens_read": 2100}]
    assert choose_k(tried, 2100) == 8
    assert choose_k(tried, 2000) == 3  # the tie at 0.6 goes to the smaller k
    assert choose_k(tried, 1000) == 1
    assert choose_k(tried, 500) == 1  # none fits: the one that reads least
    assert budget_ks("8, 1,3,3") == [1, 3, 8]


def test_a_sweep_pools_seeds_with_a_bootstrap_within_each_seed(tmp_path):
    import json

    from librarian_jax.eval import sweep

    w = sweep.stratified_counts([3, 5], draws=400, seed=1)
    assert w.shape == (400, 8)
    assert np.all(w[:, :3].sum(axis=1) == 3) and np.all(w[:, 3:].sum(axis=1) == 5)  # within each seed

    def rows(method: str, corpus: str, right: int) -> list[dict]:
        return [{"method": method, "corpus": corpus, "question_id": f"{corpus}/q{i}",
                 "correct": float(i < right), "tokens_read": 100, "tokens_written": 5, "files_read": 1,
                 "files_opened": 1, "passages_read": 0, "turns": 2, "sample": 0,
                 "construction_tokens": 50 if method == "trained" else 0}
                for i in range(4)]

    runs = {}
    for s, (t, b) in {0: (4, 1), 1: (3, 2), 2: (1, 3)}.items():
        d = tmp_path / f"seed_{s}" / "eval" / "final"
        d.mkdir(parents=True)
        recs = [r for c in ("c0", "c1") for m, k in (("trained", t), ("base", b), ("bm25", 2))
                for r in rows(m, c, k)]
        (d / "questions.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
        runs[s] = str(tmp_path / f"seed_{s}")
    res = sweep.pooled(runs, draws=300)
    assert res["compare"] == ["base", "bm25"] and res["wins"] == {"base": 2, "bm25": 2}
    assert res["per_seed"]["0"]["vs"]["base"]["diff"] == pytest.approx(0.75)
    pooled = res["pooled"]
    assert pooled["corpora"] == 6
    assert pooled["accuracy"]["trained"]["accuracy"] == pytest.approx((8 + 6 + 2) / 24)
    assert pooled["vs"]["base"]["diff"] == pytest.approx((16 - 12) / 24)
    table = sweep.format_pooled(res)
    assert "pooled" in table and "trained ahead of base in 2/3, bm25 in 2/3" in table
    with pytest.raises(FileNotFoundError):
        sweep.pooled({0: str(tmp_path / "nowhere")})


def test_workspace_shapes_tell_nested_flat_and_empty_workspaces_apart():
    """The report's workspace shapes from real workspaces: a builder's files under a directory (nested), the
    same files at the root (flat) and no file (a build that stopped at once), per method."""
    from librarian_jax.data.schema import Document
    from librarian_jax.eval.report import format_figures, workspace_shapes
    from librarian_jax.workspace import Workspace

    docs = [Document("d-a", "Alpha text.", title="Alpha"), Document("d-b", "Beta text.", title="Beta")]

    def built(nested: bool, files: int) -> Workspace:
        ws = Workspace.from_documents(docs)
        made = [ws.create_file(d.title, [p.path], f"{d.title} facts.").data["path"]
                for d, p in zip(docs[:files], ws.raw_docs[:files], strict=True)]
        if nested:
            assert ws.merge_files("People", made, "Who is who.").ok
        return ws

    shapes = workspace_shapes([("trained", built(True, 2).stats()), ("trained", built(False, 2).stats()),
                               ("base", built(False, 1).stats()), ("base", built(False, 0).stats())])
    assert shapes["trained"] == {"corpora": 2, "files": 2.0, "dirs": 0.5, "nested": 0.5, "empty": 0.0}
    assert shapes["base"] == {"corpora": 2, "files": 0.5, "dirs": 0.0, "nested": 0.0, "empty": 0.5}
    line = format_figures({"shapes": shapes})
    assert "trained 2.0 files, 0.5 dirs, 50% nested, 0% empty; base 0.5 files" in line
