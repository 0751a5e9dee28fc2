"""The paper's evaluation statistics (docs/eval.md; `shared/reference/eval-statistics.md`), in plain NumPy.

Units: the sampling unit is a corpus; questions (and samples of a question) are nested in corpora. Every
statistic is computed from per-corpus sums, so a bootstrap draw is one matrix product:

    idx = bootstrap_indices(C, draws, seed)        # int  [draws, C]   corpora drawn with replacement
    W = draw_counts(idx, C)                        # f64  [draws, C]   how often each corpus was drawn
    p_draws = ratio_of_sums(W, correct_c, n_c)     # f64  [draws]      sum_c W correct_c / sum_c W n_c

The same `idx` serves every method (paired), so a difference or a ratio is taken inside each draw.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_DRAWS = 2000
CI_LEVEL = 0.95
COST_QS = (1, 10, 20, 50)


# ------------------------------------------------------------------------------------------- bootstrap


def bootstrap_indices(num_corpora: int, draws: int = DEFAULT_DRAWS, seed: int = 0) -> np.ndarray:
    """Corpus indices drawn with replacement: int64 `[draws, num_corpora]` (row d = the corpora of draw d)."""
    if num_corpora < 1:
        raise ValueError(f"bootstrap needs at least one corpus, got {num_corpora}")
    return np.random.default_rng(seed).integers(0, num_corpora, size=(draws, num_corpora))


def draw_counts(idx: np.ndarray, num_corpora: int) -> np.ndarray:
    """`[draws, C]` multiplicities of each corpus in each draw (a corpus drawn twice counts twice)."""
    w = np.zeros((idx.shape[0], num_corpora), np.float64)
    np.add.at(w, (np.arange(idx.shape[0])[:, None], idx), 1.0)
    return w


def ratio_of_sums(w: np.ndarray, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """`(w @ num) / (w @ den)` per draw: `w` `[draws, C]`, `num`/`den` `[C]` -> `[draws]` (nan: den 0)."""
    n, d = w @ np.asarray(num, np.float64), w @ np.asarray(den, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1.0), np.nan)


def percentile_ci(values: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    """The (2.5th, 97.5th) percentiles of the finite draws (nan, nan when none is finite)."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return (math.nan, math.nan)
    lo, hi = np.percentile(v, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return (float(lo), float(hi))


# ------------------------------------------------------------------------------------------- per-corpus sums

SUM_FIELDS = ("n", "correct", "answer_tokens", "tokens_read", "files_read", "files_opened", "passages_read",
              "turns")


def corpus_sums(
    records: Sequence[Mapping[str, Any]], methods: Sequence[str], corpora: Sequence[str]
) -> dict[str, dict[str, np.ndarray]]:
    """Per method, per corpus (in `corpora` order) sums over question records: `n` (records), `correct`,
    `answer_tokens` (read + written), `tokens_read`, `files_read`, `files_opened`, `passages_read`, `turns`,
    `construction`
    (the corpus's construction tokens, the mean over its samples) and `embedded` (the corpus's tokens
    embedded by retrieval models). Each array is float64 `[C]`.

    A method without any record of a corpus raises: failures are records (correct 0), never gaps.
    """
    pos = {c: i for i, c in enumerate(corpora)}
    out = {m: {f: np.zeros(len(corpora)) for f in (*SUM_FIELDS, "construction", "embedded")} for m in methods}
    builds: dict[tuple[str, int], dict[int, float]] = {}
    embedded: dict[tuple[str, int], float] = {}
    for r in records:
        m = r["method"]
        if m not in out:
            continue
        i = pos[r["corpus"]]
        s = out[m]
        s["n"][i] += 1
        s["correct"][i] += float(r["correct"])
        s["answer_tokens"][i] += float(r["tokens_read"]) + float(r.get("tokens_written", 0))
        s["tokens_read"][i] += float(r["tokens_read"])
        s["files_read"][i] += float(r["files_read"])
        s["passages_read"][i] += float(r.get("passages_read", 0))
        s["files_opened"][i] += float(r.get("files_opened", r["files_read"]))
        embedded[(m, i)] = max(embedded.get((m, i), 0.0), float(r.get("tokens_embedded", 0)))
        s["turns"][i] += float(r.get("turns", 0))
        builds.setdefault((m, i), {})[int(r.get("sample", 0))] = float(r.get("construction_tokens", 0))
    for (m, i), per_sample in builds.items():
        out[m]["construction"][i] = float(np.mean(list(per_sample.values())))
    for (m, i), n in embedded.items():
        out[m]["embedded"][i] = n
    for m in methods:
        missing = [c for c, k in zip(corpora, out[m]["n"], strict=True) if k == 0]
        if missing:
            raise ValueError(
                f"method {m!r} has no question record for corpora {missing[:3]}: every corpus "
                f"counts (a failed construction is recorded as incorrect answers)"
            )
    return out


# ------------------------------------------------------------------------------------------- accuracy


def accuracy_table(
    sums: Mapping[str, Mapping[str, np.ndarray]], w: np.ndarray, base: str | None
) -> dict[str, dict[str, Any]]:
    """Per method: accuracy (full denominator), its paired-bootstrap 95% CI, files / tokens read per query,
    construction tokens per corpus, and (when `base` is given) the paired difference to `base` with its CI."""
    out: dict[str, dict[str, Any]] = {}
    base_draws = ratio_of_sums(w, sums[base]["correct"], sums[base]["n"]) if base in sums else None
    for m, s in sums.items():
        n = float(s["n"].sum())
        acc = float(s["correct"].sum() / n)
        draws = ratio_of_sums(w, s["correct"], s["n"])
        row: dict[str, Any] = {
            "accuracy": acc,
            "ci": percentile_ci(draws),
            "questions": int(n),
            "corpora": int(len(s["n"])),
            "files_per_query": float(s["files_read"].sum() / n),
            "passages_per_query": float(s["passages_read"].sum() / n),
            "files_opened_per_query": float(s["files_opened"].sum() / n),  # the paper's "files read/query"
            "tokens_read_per_query": float(s["tokens_read"].sum() / n),
            "answer_tokens_per_query": float(s["answer_tokens"].sum() / n),
            "turns_per_query": float(s["turns"].sum() / n),
            "construction_tokens_per_corpus": float(s["construction"].mean()),
            "tokens_embedded_per_corpus": float(s["embedded"].mean()),
        }
        if base_draws is not None:
            b = sums[base]
            row["diff_vs_base"] = acc - float(b["correct"].sum() / b["n"].sum())
            row["diff_ci"] = percentile_ci(draws - base_draws)
        out[m] = row
    return out


# ------------------------------------------------------------------------------------------- cost curves


def cost_per_question(b: Any, a: Any, q: Any) -> Any:
    """`T(q) = B / q + A`: tokens per question when q questions share one construction."""
    return np.asarray(b, np.float64) / np.asarray(q, np.float64) + np.asarray(a, np.float64)


def cost_per_correct(b: Any, a: Any, p: Any, q: Any) -> Any:
    """`C(q) = T(q) / p`: tokens per expected correct answer (inf where p = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.asarray(p) > 0, cost_per_question(b, a, q) / np.asarray(p, np.float64), np.inf)


def crossover(b1: Any, a1: Any, p1: Any, b0: Any, a0: Any, p0: Any) -> Any:
    """The q where `C_1(q) = C_0(q)`: `(B1 p0 - B0 p1) / (A0 p1 - A1 p0)`; nan where it is not positive and
    finite (the curves never cross at q > 0)."""
    num = np.asarray(b1, np.float64) * p0 - np.asarray(b0, np.float64) * p1
    den = np.asarray(a0, np.float64) * p1 - np.asarray(a1, np.float64) * p0
    with np.errstate(divide="ignore", invalid="ignore"):
        q = num / den
    return np.where(np.isfinite(q) & (q > 0), q, np.nan)


def method_bap(s: Mapping[str, np.ndarray], w: np.ndarray | None = None) -> tuple[Any, Any, Any]:
    """(B, A, p) of one method: construction tokens per corpus, answer tokens per question, accuracy; with
    `w` `[draws, C]`, one value per draw (`[draws]` each)."""
    if w is None:
        n = s["n"].sum()
        return (
            float(s["construction"].mean()),
            float(s["answer_tokens"].sum() / n),
            float(s["correct"].sum() / n),
        )
    ones = np.ones_like(s["construction"])
    return (
        ratio_of_sums(w, s["construction"], ones),
        ratio_of_sums(w, s["answer_tokens"], s["n"]),
        ratio_of_sums(w, s["correct"], s["n"]),
    )


def cost_table(
    sums: Mapping[str, Mapping[str, np.ndarray]],
    w: np.ndarray,
    method: str,
    base: str,
    qs: Sequence[int] = COST_QS,
) -> dict[str, Any]:
    """`method` against `base` (Figure 6): per q the ratio `C_method(q) / C_base(q)` with its paired-bootstrap
    CI, and the crossover q* with its CI (over the draws where the curves cross) and which method is cheaper
    below / above it."""
    bm, am, pm = method_bap(sums[method])
    bb, ab, pb = method_bap(sums[base])
    dm, db = method_bap(sums[method], w), method_bap(sums[base], w)
    ratios = {}
    for q in qs:
        with np.errstate(invalid="ignore", divide="ignore"):
            point = float(cost_per_correct(bm, am, pm, q) / cost_per_correct(bb, ab, pb, q))
            draws = cost_per_correct(*dm, q) / cost_per_correct(*db, q)
        ratios[str(q)] = {"ratio": point, "ci": percentile_ci(draws)}
    q_star = float(crossover(bm, am, pm, bb, ab, pb))
    q_draws = crossover(*dm, *db)
    below = method if cost_per_correct(bm, am, pm, 1) < cost_per_correct(bb, ab, pb, 1) else base
    return {
        "method": method,
        "base": base,
        "ratios": ratios,
        "crossover_q": q_star,
        "crossover_ci": percentile_ci(q_draws),
        "crossover_defined_frac": float(np.isfinite(q_draws).mean()),
        "cheaper_at_q1": below,
        "cheaper_beyond_crossover": (base if below == method else method) if np.isfinite(q_star) else below,
        "B": {method: bm, base: bb},
        "A": {method: am, base: ab},
        "p": {method: pm, base: pb},
    }


# ------------------------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: `1 - C(n-c, k) / C(n, k)` (1 when n - c < k)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_table(
    per_question: Sequence[tuple[int, int]], ks: Sequence[int]
) -> dict[str, dict[str, float]]:
    """Mean pass@k over questions and its standard error (std of the per-question values / sqrt(Q)), for each
    k <= the smallest n. `per_question`: (n samples, c correct) per question."""
    out: dict[str, dict[str, float]] = {}
    if not per_question:
        return out
    n_min = min(n for n, _ in per_question)
    for k in ks:
        if k > n_min:
            continue
        v = np.array([pass_at_k(n, c, k) for n, c in per_question])
        out[str(k)] = {"mean": float(v.mean()), "se": standard_error(v), "questions": int(v.size), "n": n_min}
    return out


# ------------------------------------------------------------------------------------------- mean +- SE


def standard_error(values: Any) -> float:
    """Sample standard deviation (ddof 1) / sqrt(n); 0 for fewer than two values."""
    v = np.asarray(values, np.float64)
    return float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0


def mean_se(values: Any) -> dict[str, float]:
    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()) if v.size else math.nan, "se": standard_error(v), "n": int(v.size)}
