"""The evaluation report: results.json, questions.jsonl, report.md, PNG plots, TensorBoard scalars.

`analyse(records, methods, corpora, ...)` turns per-question records into the results dict (every table);
`write_report(out_dir, results, records)` writes the files; `format_table(results)` is the plain-text
held-out table the console prints.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from librarian_jax import storage
from librarian_jax.eval import stats
from librarian_jax.eval.pipeline import scalar_metrics

BASE = "base"
TRAINED = "trained"
RAW = "raw"


def _ci(ci: Sequence[float], pct: bool = True) -> str:
    if any(not math.isfinite(x) for x in ci):
        return "n/a"
    return f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if pct else f"[{ci[0]:.3g}, {ci[1]:.3g}]"


def analyse(
    records: Sequence[dict[str, Any]],
    methods: Sequence[str],
    corpora: Sequence[str],
    *,
    draws: int = stats.DEFAULT_DRAWS,
    seed: int = 0,
    cost_qs: Sequence[int] = stats.COST_QS,
    pass_k: Sequence[int] = (1,),
    ablation: Sequence[str] = (),
) -> dict[str, Any]:
    """Every table of the report from the question records (see docs/eval.md)."""
    main = [m for m in methods if m not in ablation]
    sums = stats.corpus_sums(records, main, corpora)
    idx = stats.bootstrap_indices(len(corpora), draws, seed)
    w = stats.draw_counts(idx, len(corpora))
    base = BASE if BASE in main else None
    out: dict[str, Any] = {
        "methods": list(main),
        "corpora": list(corpora),
        "base_method": base,
        "bootstrap": {
            "draws": draws,
            "seed": seed,
            "unit": "corpus",
            "paired": True,
            "level": stats.CI_LEVEL,
        },
        "accuracy": stats.accuracy_table(sums, w, base),
    }
    if base is not None:
        out["cost"] = {
            m: stats.cost_table(sums, w, m, base, cost_qs)
            for m in main
            if m != base and sums[m]["construction"].any()
        }
    if RAW in main:  # a workspace against no construction at all (the paper's Figure 6 has both)
        out["cost_vs_raw"] = {
            m: stats.cost_table(sums, w, m, RAW, cost_qs)
            for m in main
            if m != RAW and sums[m]["construction"].any()
        }
    per_q: dict[str, list[tuple[int, int]]] = {}
    for m in main:
        groups: dict[tuple[str, str], list[float]] = {}
        for r in records:
            if r["method"] == m:
                groups.setdefault((r["corpus"], r["question_id"]), []).append(float(r["correct"]))
        per_q[m] = [(len(v), int(sum(v))) for v in groups.values()]
    out["pass_at_k"] = {m: stats.pass_at_k_table(per_q[m], pass_k) for m in main}
    if ablation:
        table = {}
        for variant in (TRAINED, *ablation):
            rs = [r for r in records if r["method"] == variant and int(r.get("sample", 0)) == 0]
            if rs:
                table[variant] = {
                    "accuracy": stats.mean_se([r["correct"] for r in rs]),
                    "nav_tokens": stats.mean_se([r["tokens_read"] + r["tokens_written"] for r in rs]),
                }
        out["ablation"] = table
    return out


def format_table(results: dict[str, Any]) -> str:
    """The held-out table as plain text: per method accuracy with its paired-bootstrap 95% CI, the paired
    difference to the base builder, files and tokens read per query, construction tokens per corpus."""
    acc = results["accuracy"]
    head = (
        f"{'method':<22} {'acc %':>6} {'95% CI':>14} {'vs base':>8} {'95% CI':>14} {'files/q':>8} "
        f"{'tok read/q':>10} {'build tok/corpus':>16}"
    )
    lines = [head, "-" * len(head)]
    for m, row in acc.items():
        diff = f"{100 * row['diff_vs_base']:+.1f}" if "diff_vs_base" in row else ""
        lines.append(
            f"{m:<22} {100 * row['accuracy']:6.1f} {_ci(row['ci']):>14} {diff:>8} "
            f"{_ci(row['diff_ci']) if 'diff_ci' in row else '':>14} {row['files_per_query']:8.2f} "
            f"{row['tokens_read_per_query']:10.0f} {row['construction_tokens_per_corpus']:16.0f}"
        )
    n = next(iter(acc.values()))
    lines.append(
        f"{n['corpora']} corpora, {n['questions']} question records per method; CIs: paired corpus "
        f"bootstrap, {results['bootstrap']['draws']} draws"
    )
    return "\n".join(lines)


def workspace_shapes(shapes: Sequence[tuple[str, dict[str, int]]]) -> dict[str, dict[str, float]]:
    """Per method, the shape of its workspaces (`(method, Workspace.stats())` of each corpus's first
    construction): corpora, mean synthetic files and directories, the share with a file below the root
    (`nested`: more than one level) and the share with no synthetic file (`empty`). A builder that drifts
    from a hierarchy to flat files, or to stopping at once, shows here before it shows in accuracy."""
    by: dict[str, list[dict[str, int]]] = {}
    for m, st in shapes:
        by.setdefault(m, []).append(st)
    return {m: {"corpora": len(sts),
                "files": float(np.mean([s["active_files"] for s in sts])),
                "dirs": float(np.mean([s["active_dirs"] for s in sts])),
                "nested": float(np.mean([s["max_depth"] >= 2 for s in sts])),
                "empty": float(np.mean([s["active_synthetic"] == 0 for s in sts]))}
            for m, sts in by.items()}


def format_figures(results: dict[str, Any], q: int = 10) -> str:
    """The paper's figures from an evaluation, as lines for the console: the reuse cost ratio of the
    trained builder against the base builder and raw navigation at `q` questions per construction (with its
    paired-bootstrap CI) and the crossover q*; the hierarchy ablation (accuracy and navigation tokens of the
    trained workspaces, flattened and shuffled); the retrieval methods' k and budget. "" when none apply."""
    lines = []
    for key in ("cost", "cost_vs_raw"):
        c = results.get(key, {}).get(TRAINED)
        if c is None or str(q) not in c["ratios"]:
            continue
        r = c["ratios"][str(q)]
        if math.isfinite(c["crossover_q"]):
            half = c["crossover_q"] / 2  # which side is cheaper below q* (q = 1 may lie beyond it)

            def cost(m: str, q: float, c: dict[str, Any] = c) -> float:
                return (float(c["B"][m]) / q + float(c["A"][m])) / max(float(c["p"][m]), 1e-12)

            below = TRAINED if cost(TRAINED, half) < cost(c["base"], half) else c["base"]
            beyond = c["base"] if below == TRAINED else TRAINED
            cross = (f"crossover q* = {c['crossover_q']:.1f} {_ci(c['crossover_ci'], pct=False)}: "
                     f"{below} cheaper below it, {beyond} beyond")
        else:
            cross = f"no crossover: {c['cheaper_at_q1']} cheaper at every q"
        lines.append(f"tokens per expected correct answer, {TRAINED} / {c['base']} at q={q}: "
                     f"{r['ratio']:.3f} {_ci(r['ci'], pct=False)}; {cross}")
    ab = results.get("ablation", {})
    if ab:
        lines.append("hierarchy ablation (the trained workspaces): " + "; ".join(
            f"{v} {100 * x['accuracy']['mean']:.1f}% +- {100 * x['accuracy']['se']:.1f}, "
            f"{x['nav_tokens']['mean']:.0f} +- {x['nav_tokens']['se']:.0f} nav tokens"
            for v, x in ab.items()))
    shapes = results.get("shapes", {})
    if shapes:
        lines.append("workspaces (first construction of each corpus): " + "; ".join(
            f"{m} {s['files']:.1f} files, {s['dirs']:.1f} dirs, {100 * s['nested']:.0f}% nested, "
            f"{100 * s['empty']:.0f}% empty" for m, s in shapes.items()))
    rb = results.get("retrieval_budget", {})
    if rb.get("ks"):
        tuned = rb.get("tuning", {})
        first = next(iter(tuned.values()), None)
        how = (f"k tuned on {first['corpora']} training corpora within {first['budget_tokens']:.0f} tokens "
               f"read per question (the trained workspaces')" if first else "k fixed")
        lines.append("retrieval: " + ", ".join(f"{m} k={k}" for m, k in rb["ks"].items()) + f" ({how})")
    return "\n".join(lines)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def report_markdown(results: dict[str, Any]) -> str:
    """report.md: setup, protocol, accuracy, the paper's reading counts, cost curves, pass@k, ablation,
    workspace shapes, the accounting rule, the timing (a function per section)."""
    parts = _md_setup(results)
    for section in (_md_protocol, _md_accuracy, _md_paper_reading, _md_cost, _md_pass_at_k, _md_ablation,
                    _md_shapes, _md_tail):
        parts += section(results)
    return "\n".join(parts)


def _md_setup(results: dict[str, Any]) -> list[str]:
    """The title and one paragraph: run, step, corpora, methods, answerer, sampling."""
    s = results.get("setup", {})
    return [
        f"# Evaluation: {s.get('name', '')}",
        "",
        f"Run `{s.get('run', '')}` step {s.get('step', '')}; {len(results['corpora'])} held-out corpora "
        f"({s.get('split', '')}); methods {', '.join(results['methods'])}; answerer "
        f"{s.get('answerer', '')}; builder temperature {s.get('builder_temperature', 0.0)}; "
        f"{s.get('samples', 1)} sample(s) per question.",
        "",
    ]


def _md_protocol(results: dict[str, Any]) -> list[str]:
    """Every role of the evaluation against the training run's (`protocol.json`): overrides, differences."""
    parts: list[str] = []
    proto = results.get("protocol")
    if proto:
        diffs = proto.get("differences", [])
        parts += [
            "## Protocol vs training",
            "",
            "Every role of this evaluation (`protocol.json` beside this report) against the training run's "
            "(`RUN/protocol.json`); a field that differs reads `value (trained: other) !`. Explicit "
            "overrides: "
            f"{', '.join(proto.get('overrides', [])) or 'none'}; differences: "
            + ("; ".join(f"{d['role']}.{d['field']} {d['eval']!r} (trained {d['trained']!r})" for d in diffs)
               or "none") + ".",
            "",
            "```",
            proto.get("table", ""),
            "```",
            "",
        ]
    return parts


def _md_accuracy(results: dict[str, Any]) -> list[str]:
    """Figure 4: each method's accuracy with its CI and difference to the base builder, and its costs."""
    parts: list[str] = []
    parts += [
        "## Accuracy (Figure 4)",
        "",
        "Full denominator: failed constructions, crashes, empty or forced answers count as incorrect. "
        "95% CIs: paired corpus bootstrap (the same corpora drawn for every method); the difference "
        "to the base builder is taken inside each draw.",
        "",
    ]
    rows = []
    for m, r in results["accuracy"].items():
        rows.append(
            [
                m,
                f"{100 * r['accuracy']:.1f}",
                _ci(r["ci"]),
                f"{100 * r['diff_vs_base']:+.1f} {_ci(r['diff_ci'])}" if "diff_vs_base" in r else "",
                f"{r['files_per_query']:.2f}",
                f"{r.get('passages_per_query', 0.0):.2f}",
                f"{r['tokens_read_per_query']:.0f}",
                f"{r['answer_tokens_per_query']:.0f}",
                f"{r['construction_tokens_per_corpus']:.0f}",
                f"{r.get('tokens_embedded_per_corpus', 0.0):.0f}",
                str(results.get("failed_constructions", {}).get(m, 0)),
            ]
        )
    parts += [
        _md_table(
            [
                "method",
                "acc %",
                "95% CI",
                "vs base (pp, CI)",
                "files/query",
                "passages/query",
                "tokens read/query",
                "answer tokens/query (A)",
                "construction tokens/corpus (B)",
                "tokens embedded/corpus",
                "failed constructions",
            ],
            rows,
        ),
        "",
        "![accuracy](accuracy.png)",
        "",
    ]
    return parts


def _md_paper_reading(results: dict[str, Any]) -> list[str]:
    """Table 2: files and tokens per question counted as the paper counts them."""
    parts: list[str] = []
    parts += [
        "## Reading per question as the paper counts it (Table 2)",
        "",
        "The paper's \"files read per query\" is the distinct files in the answerer's context (root-level "
        "files preloaded in its first prompt + files it read), its \"tokens per query\" the answer tokens A "
        "(read + written); the paper's trained builder: 26.9 files and 9,346 tokens, its base builder 2.72 "
        "and 1,238 (reuse set, Qwen3.5-4B answerer). Our columns above count read_file'd files only and "
        "tokens read.",
        "",
        _md_table(["method", "files read/query (paper: opened)", "tokens/query (paper: A)"],
                  [[m, f"{r.get('files_opened_per_query', r['files_per_query']):.2f}",
                    f"{r['answer_tokens_per_query']:.0f}"] for m, r in results["accuracy"].items()]),
        "",
    ]
    return parts


def _md_cost(results: dict[str, Any]) -> list[str]:
    """Figure 6 / Appendix A.4: the reuse cost ratios and crossover of each method against its base."""
    parts: list[str] = []
    parts += [
        "## Reuse cost (Figure 6, Appendix A.4)",
        "",
        "`T(q) = B/q + A` tokens per question when q questions share one construction; "
        "`C(q) = T(q)/p` tokens per expected correct answer. Ratios and the crossover q* are computed "
        "inside each bootstrap draw from that draw's B, A and p.",
        "",
    ]
    for m, c in [*results.get("cost", {}).items(), *results.get("cost_vs_raw", {}).items()]:
        rows = [[q, f"{v['ratio']:.3f}", _ci(v["ci"], pct=False)] for q, v in c["ratios"].items()]
        parts += [
            f"**{m} / {c['base']}**",
            "",
            _md_table(["q", "C ratio", "95% CI"], rows),
            "",
            f"Crossover q* = {c['crossover_q']:.3g} (95% CI {_ci(c['crossover_ci'], pct=False)}, curves "
            f"cross in {100 * c['crossover_defined_frac']:.0f}% of draws); cheaper at q = 1: "
            f"{c['cheaper_at_q1']}; cheaper beyond q*: {c['cheaper_beyond_crossover']}.",
            "",
        ]
    if not results.get("cost"):
        parts += ["(no method with construction tokens to compare with the base builder)", ""]
    parts += ["![cost curves](cost_curves.png)", ""]
    return parts


def _md_pass_at_k(results: dict[str, Any]) -> list[str]:
    """Table 3: pass@k per method."""
    parts: list[str] = []
    parts += [
        "## pass@k (Table 3)",
        "",
        "Unbiased estimator `1 - C(n-c, k)/C(n, k)` per question from n samples, mean over questions "
        "+- standard error.",
        "",
    ]
    rows = [
        [m, k, f"{100 * v['mean']:.1f} +- {100 * v['se']:.1f}", v["n"]]
        for m, t in results["pass_at_k"].items()
        for k, v in t.items()
    ]
    parts += [_md_table(["method", "k", "pass@k %", "n"], rows), ""]
    return parts


def _md_ablation(results: dict[str, Any]) -> list[str]:
    """Table 7: the trained builder's workspaces as built, flattened and shuffled (when run)."""
    parts: list[str] = []
    if results.get("ablation"):
        parts += [
            "## Hierarchy ablation (Table 7)",
            "",
            "The trained builder's workspaces (first sample) as built, flattened (every synthetic file at "
            "the root) and shuffled (same directories, files placed at random); same questions and "
            "answerer. Mean +- standard error over questions; navigation tokens = answerer tokens read "
            "+ written.",
            "",
        ]
        rows = [
            [
                v,
                f"{100 * r['accuracy']['mean']:.1f} +- {100 * r['accuracy']['se']:.1f}",
                f"{r['nav_tokens']['mean']:.0f} +- {r['nav_tokens']['se']:.0f}",
                r["accuracy"]["n"],
            ]
            for v, r in results["ablation"].items()
        ]
        parts += [
            _md_table(["workspace", "acc %", "navigation tokens", "questions"], rows),
            "",
            "![ablation](ablation.png)",
            "",
        ]
    return parts


def _md_shapes(results: dict[str, Any]) -> list[str]:
    """Each method's workspaces: files, directories, nested and empty shares (when recorded)."""
    parts: list[str] = []
    if results.get("shapes"):
        parts += [
            "## Workspace shapes",
            "",
            "Each method's first construction of each corpus: synthetic files and directories (means), the "
            "share of workspaces with a file below the root (nested) and with no synthetic file (empty).",
            "",
            _md_table(["method", "corpora", "files", "dirs", "nested %", "empty %"], [
                [m, s["corpora"], f"{s['files']:.1f}", f"{s['dirs']:.1f}", f"{100 * s['nested']:.0f}",
                 f"{100 * s['empty']:.0f}"] for m, s in results["shapes"].items()]),
            "",
        ]
    return parts


def _md_tail(results: dict[str, Any]) -> list[str]:
    """The accounting rule and the time each phase took."""
    parts: list[str] = []
    parts += ["## Accounting", "", results.get("accounting", ""), ""]
    t = results.get("timing", {})
    if t:
        parts += ["## Time", "", _md_table(["phase", "seconds"], [[k, f"{v:.1f}"] for k, v in t.items()]), ""]
    return parts


def plot(out_dir: str, results: dict[str, Any]) -> list[str]:
    """accuracy.png (accuracy with CIs per method), cost_curves.png (T(q) and C(q) panels), ablation.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    acc = results["accuracy"]
    names = list(acc)
    vals = np.array([acc[m]["accuracy"] for m in names])
    ci = np.array([acc[m]["ci"] for m in names], np.float64)
    err = np.nan_to_num(np.abs(np.stack([vals - ci[:, 0], ci[:, 1] - vals])))
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 3.5))
    ax.bar(names, 100 * vals, yerr=100 * err, capsize=4, color="tab:blue")
    ax.set_ylabel("accuracy % (95% CI)")
    ax.set_title("Held-out accuracy")
    fig.tight_layout()
    with storage.writing(storage.join(out_dir, "accuracy.png")) as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    written.append("accuracy.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    qs = np.unique(np.round(np.logspace(0, 2, 40)))
    for m in names:
        row = acc[m]
        b, a, p = row["construction_tokens_per_corpus"], row["answer_tokens_per_query"], row["accuracy"]
        a1.plot(qs, stats.cost_per_question(b, a, qs), label=m)
        if p > 0:
            a2.plot(qs, stats.cost_per_correct(b, a, p, qs), label=m)
    for c in results.get("cost", {}).values():
        if math.isfinite(c["crossover_q"]):
            a2.axvline(c["crossover_q"], ls=":", c="gray")
    for ax, title in ((a1, "tokens per question T(q) = B/q + A"), (a2, "tokens per expected correct C(q)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("questions per corpus q")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    with storage.writing(storage.join(out_dir, "cost_curves.png")) as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    written.append("cost_curves.png")

    if results.get("ablation"):
        ab = results["ablation"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2))
        v = list(ab)
        a1.bar(
            v,
            [100 * ab[x]["accuracy"]["mean"] for x in v],
            yerr=[100 * ab[x]["accuracy"]["se"] for x in v],
            capsize=4,
        )
        a1.set_title("accuracy % (+- SE)")
        a2.bar(
            v,
            [ab[x]["nav_tokens"]["mean"] for x in v],
            yerr=[ab[x]["nav_tokens"]["se"] for x in v],
            capsize=4,
            color="tab:orange",
        )
        a2.set_title("navigation tokens (+- SE)")
        fig.tight_layout()
        with storage.writing(storage.join(out_dir, "ablation.png")) as f:
            fig.savefig(f, dpi=100, format="png")
        plt.close(fig)
        written.append("ablation.png")
    return written


def reward_curve(steps: Sequence[int], rewards: Sequence[float], title: str, png: str) -> str:
    """A training run's mean episode reward by GRPO step (`training.reward_curve`: `title` is its summary
    line) as `png`; returns `png`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker="o", ms=3)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean episode reward")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, png)


def accuracy_curve(curve: list[tuple[int, float]], png: str, what: str,
                   validation: list[tuple[int, float]] | None = None) -> str:
    """A training run's periodic held-out accuracy by GRPO step (`what` names the evaluation), and of the
    validation corpora's when given, as `png`; returns `png`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if curve:
        ax.plot([s for s, _ in curve], [100 * a for _, a in curve], marker="o", ms=4, color="tab:green",
                label="held-out")
    if validation:
        ax.plot([s for s, _ in validation], [100 * a for _, a in validation], marker="s", ms=4,
                color="tab:purple", label="validation (training split)")
        ax.legend(fontsize=7)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out accuracy %")
    ax.set_title(f"held-out accuracy ({what})", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, png)


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), imported where a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, png: str) -> str:
    """`fig` laid out and written to `png` (a local path or gs://), then closed."""
    plt = _pyplot()
    fig.tight_layout()
    with storage.writing(png) as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)
    return png


def write_report(
    out_dir: str, results: dict[str, Any], records: Sequence[dict[str, Any]], step: int = 0
) -> dict[str, str]:
    """Writes results.json, questions.jsonl, report.md, the plots and TensorBoard scalars under `out_dir`."""
    from tensorboardX import SummaryWriter


    storage.makedirs(out_dir)  # a local directory or a URL (gs://...)
    storage.write_text(storage.join(out_dir, "questions.jsonl"),
                       "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    results["plots"] = plot(out_dir, results)
    storage.write_text(storage.join(out_dir, "results.json"), json.dumps(results, indent=1, default=float))
    storage.write_text(storage.join(out_dir, "report.md"), report_markdown(results))
    writer = SummaryWriter(storage.join(out_dir, "tb"))
    for k, v in scalar_metrics(results["accuracy"]).items():
        if math.isfinite(v):
            writer.add_scalar(k, v, step)
    writer.close()
    return {k: storage.join(out_dir, k) for k in ("report.md", "results.json", "questions.jsonl")}
