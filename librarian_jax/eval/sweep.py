"""A seed sweep's pooled report: the same command run once per seed, its final evaluations read back and
analysed together (`configs/grpo.py --config.seeds=0,1,2,3,4`, `training.sweep`).

Each seed is its own synthetic world, warm start and GRPO run (`WORKDIR/seed_<s>/`), so its held-out corpora
are its own. The pooled table treats every seed's corpora as one sample, bootstrapped *within* each seed
(stratified: each draw takes as many corpora of every seed as it has, with replacement; the same draw for
every method, so differences are paired); the per-seed rows are each seed's own paired bootstrap. For every
comparison method X the report gives trained - X per seed and pooled, with 95% CIs, and in how many seeds the
trained builder is ahead.

    results = pooled({0: "/runs/s/seed_0", 1: "/runs/s/seed_1"}, name="final")
    print(format_pooled(results))
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from librarian_jax import storage
from librarian_jax.eval import stats

TRAINED = "trained"
COMPARE = ("base", "raw", "bm25", "agentic")  # what the trained builder is compared with, when evaluated
REPORT_DIR = "sweep"


def read_records(run_dir: str, name: str = "final") -> list[dict[str, Any]]:
    """The per-question records of `run_dir/eval/<name>/questions.jsonl`."""
    path = storage.join(run_dir, "eval", name, "questions.jsonl")
    if not storage.isfile(path):
        raise FileNotFoundError(f"{path}: no evaluation '{name}' of this run (did its final evaluation run?)")
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


def stratified_counts(strata: Sequence[int], draws: int, seed: int = 0) -> np.ndarray:
    """`[draws, sum(strata)]` multiplicities of a bootstrap that resamples each stratum's corpora within it
    (stratum i: the next `strata[i]` corpora), the same draws for every method."""
    rng = np.random.default_rng(seed)
    total = int(sum(strata))
    w = np.zeros((draws, total), np.float64)
    start = 0
    for n in strata:
        idx = rng.integers(0, n, size=(draws, n)) + start
        np.add.at(w, (np.arange(draws)[:, None], idx), 1.0)
        start += n
    return w


def _diffs(sums: Mapping[str, Mapping[str, np.ndarray]], w: np.ndarray,
           compare: Sequence[str]) -> dict[str, dict[str, Any]]:
    acc = stats.accuracy_table(sums, w, None)
    out = {}
    t = stats.ratio_of_sums(w, sums[TRAINED]["correct"], sums[TRAINED]["n"])
    for m in compare:
        d = t - stats.ratio_of_sums(w, sums[m]["correct"], sums[m]["n"])
        out[m] = {"diff": acc[TRAINED]["accuracy"] - acc[m]["accuracy"], "ci": stats.percentile_ci(d)}
    return {"accuracy": {m: {"accuracy": r["accuracy"], "ci": r["ci"]} for m, r in acc.items()},
            "vs": out, "corpora": int(w.shape[1])}


def pooled(run_dirs: Mapping[int, str], name: str = "final", *, draws: int = stats.DEFAULT_DRAWS,
           seed: int = 0, compare: Sequence[str] = COMPARE) -> dict[str, Any]:
    """Per-seed and pooled accuracy of every evaluated method, and trained - X (X in `compare`, those
    evaluated) with paired 95% CIs, from each run's `eval/<name>` records."""
    per_seed_records = {s: read_records(d, name) for s, d in run_dirs.items()}
    methods = list(dict.fromkeys(r["method"] for rs in per_seed_records.values() for r in rs))
    if TRAINED not in methods:
        raise ValueError(f"the evaluations '{name}' have no '{TRAINED}' method (methods: {methods})")
    compare = [m for m in compare if m in methods]
    main = [m for m in methods if m not in ("flattened", "shuffled")]
    per_seed: dict[str, Any] = {}
    corpora: list[str] = []
    records: list[dict[str, Any]] = []
    strata = []
    for s, rs in per_seed_records.items():
        ids = list(dict.fromkeys(f"{s}/{r['corpus']}" for r in rs))
        rs = [{**r, "corpus": f"{s}/{r['corpus']}"} for r in rs if r["method"] in main]
        sums = stats.corpus_sums(rs, main, ids)
        w = stats.draw_counts(stats.bootstrap_indices(len(ids), draws, seed), len(ids))
        per_seed[str(s)] = _diffs(sums, w, compare)
        corpora += ids
        records += rs
        strata.append(len(ids))
    sums = stats.corpus_sums(records, main, corpora)
    out = {"seeds": [int(s) for s in run_dirs], "runs": {str(s): d for s, d in run_dirs.items()},
           "evaluation": name, "methods": main, "compare": list(compare),
           "bootstrap": {"draws": draws, "seed": seed, "unit": "corpus", "stratified_by": "seed"},
           "per_seed": per_seed, "pooled": _diffs(sums, stratified_counts(strata, draws, seed), compare)}
    out["wins"] = {m: sum(v["vs"][m]["diff"] > 0 for v in per_seed.values()) for m in compare}
    return out


def format_pooled(results: Mapping[str, Any]) -> str:
    """The sweep's table: one row per seed and a pooled row (accuracy per method, trained - X with CIs), and
    the number of seeds where the trained builder is ahead of each X."""
    methods, compare = results["methods"], results["compare"]
    head = f"{'seed':<7}" + "".join(f"{m[:9]:>10}" for m in methods) + "".join(
        f"{'tr - ' + m[:8]:>24}" for m in compare)
    lines = [head, "-" * len(head)]

    def row(label: str, r: Mapping[str, Any]) -> str:
        accs = "".join(f"{100 * r['accuracy'][m]['accuracy']:10.1f}" for m in methods)
        diffs = "".join(
            f"{100 * r['vs'][m]['diff']:+8.1f} [{100 * r['vs'][m]['ci'][0]:+5.1f},"
            f"{100 * r['vs'][m]['ci'][1]:+5.1f}]" for m in compare)
        return f"{label:<7}{accs}{diffs}"

    for s, r in results["per_seed"].items():
        lines.append(row(s, r))
    lines.append(row("pooled", results["pooled"]))
    n = len(results["per_seed"])
    lines.append(f"{results['pooled']['corpora']} held-out corpora over {n} seeds; trained ahead of "
                 + ", ".join(f"{m} in {results['wins'][m]}/{n}" for m in compare)
                 + f"; CIs: paired corpus bootstrap ({results['bootstrap']['draws']} draws, pooled: within "
                 "each seed)")
    return "\n".join(lines)


def write_pooled(out_dir: str, results: Mapping[str, Any]) -> str:
    """`out_dir/results.json` and `out_dir/report.md` (the table); returns the report's path."""
    storage.makedirs(out_dir)
    storage.write_text(storage.join(out_dir, "results.json"), json.dumps(results, indent=1))
    md = ["# Seed sweep: the final evaluations pooled", "",
          f"Seeds {results['seeds']}; evaluation '{results['evaluation']}' of each run "
          "(`<workdir>/seed_<s>/eval/<name>/`).", "", "```", format_pooled(results), "```", ""]
    path = storage.join(out_dir, "report.md")
    storage.write_text(path, "\n".join(md))
    return path
