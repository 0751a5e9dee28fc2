"""eval end to end on the embedded world: a 2-step training run, then `configs/eval.py` writes a report with
every section and plot, `configs/build.py` exports a browsable tree; bad inputs fail before any model loads;
a corpus whose construction fails stays in the denominator."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from configs import build as build_config
from configs import eval as eval_config
from librarian_jax import cluster, data
from librarian_jax import eval as eval_lib
from librarian_jax.config_validation import ConfigError
from librarian_jax.eval import baselines, cli, pipeline, stats
from librarian_jax.rollout import jobs
from librarian_jax.workspace import load_export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_main import tiny_run_config  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from librarian_jax import training

    workdir = str(tmp_path_factory.mktemp("eval_run") / "run")
    config = tiny_run_config(workdir, num_steps=2)
    if "warm_start" in config:
        config.warm_start.enabled = False  # the SFT warm start has its own tests
    training.run(config)
    return workdir


def _eval_cfg(run_dir, **kw):
    c = eval_config.get_config()
    c.run = run_dir
    c.answerer.kind = "scripted"
    c.bootstrap.draws = 200
    c.update(kw)
    return c


def test_eval_writes_every_section_and_plot(run_dir):
    results = cli.run_eval(_eval_cfg(run_dir, name="e2e"))
    out = os.path.join(run_dir, "eval", "e2e")
    with open(os.path.join(run_dir, "split.json")) as f:
        assert results["corpora"] == json.load(f)["heldout"]  # the run's recorded held-out split
    assert results["methods"] == ["trained", "base", "raw", "bm25", "agentic"]
    report = open(os.path.join(out, "report.md")).read()
    for section in (
        "## Accuracy (Figure 4)",
        "## Reuse cost (Figure 6",
        "## pass@k (Table 3)",
        "## Hierarchy ablation (Table 7)",
        "## Accounting",
        "## Time",
    ):
        assert section in report, section
    for name in ("accuracy.png", "cost_curves.png", "ablation.png"):
        assert os.path.getsize(os.path.join(out, name)) > 1000, name
    assert os.listdir(os.path.join(out, "tb"))
    rows = [json.loads(x) for x in open(os.path.join(out, "questions.jsonl"))]
    n_q = results["accuracy"]["raw"]["questions"]
    assert n_q >= len(results["corpora"])
    for m in ("trained", "base", "raw", "bm25", "agentic", "flattened", "shuffled"):
        assert sum(r["method"] == m for r in rows) == n_q, m
    for key in (
        "method",
        "corpus",
        "question",
        "answer",
        "judgement",
        "files_read",
        "tokens_read",
        "turns",
        "construction_tokens",
    ):
        assert all(key in r for r in rows), key
    assert all(r["construction_tokens"] > 0 for r in rows if r["method"] in ("trained", "base"))
    assert all(r["construction_tokens"] == 0 for r in rows if r["method"] in ("raw", "bm25", "agentic"))
    bm25_read = [r["tokens_read"] for r in rows if r["method"] == "bm25"]
    raw_read = [r["tokens_read"] for r in rows if r["method"] == "raw"]
    assert sum(bm25_read) > 0 and sum(raw_read) > 0
    acc = results["accuracy"]
    assert acc["base"]["diff_vs_base"] == 0.0 and "diff_ci" in acc["trained"]
    assert set(results["ablation"]) == {"trained", "flattened", "shuffled"}
    assert set(results["cost"]) == {"trained"}
    assert results["pass_at_k"]["raw"]["1"]["n"] == 1
    assert results["workspaces"] == {"trained": 2, "base": 2}
    assert os.path.isfile(os.path.join(out, "workspaces", "trained", results["corpora"][0], "README.md"))
    for corpus in results["corpora"]:  # the exported workspaces load back (what `librarian_jax.serve` serves)
        loaded = load_export(os.path.join(out, "workspaces", "trained", corpus))
        assert not loaded.stale and loaded.readme_matches
    t = results["timing"]
    assert t["answer_s"] > 0 and t["build_trained_s"] > 0
    print(json.dumps(t))  # the embedded evaluation's wall-time split (BENCHMARKS.md)
    table = cli.format_table(results)
    assert table.splitlines()[2].startswith("trained") and "95% CI" in table
    # the retrieval methods read what the trained workspaces cost, their k tuned on the training corpora
    rb = results["retrieval_budget"]
    assert rb["mode"] == "matched" and set(rb["tuning"]) == {"bm25", "agentic"}
    trained_read = sum(r["tokens_read"] for r in rows if r["method"] == "trained") / n_q
    for m, t in rb["tuning"].items():
        assert t["budget_tokens"] == pytest.approx(trained_read)
        with open(os.path.join(run_dir, "split.json")) as f:
            assert t["corpora"] == len(json.load(f)["train"])  # every training corpus, no held-out one
        assert [x["k"] for x in t["tried"]] == [1, 2, 3, 5, 8, 12, 16, 20]
        assert rb["ks"][m] == t["k"] == baselines.choose_k(t["tried"], t["budget_tokens"])
    assert {r["passages_read"] for r in rows if r["method"] == "bm25"} <= set(range(1, rb["ks"]["bm25"] + 1))
    assert set(results["cost_vs_raw"]) == {"trained", "base"}
    figures = eval_lib.format_figures(results)
    assert "trained / base at q=10" in figures and "trained / raw at q=10" in figures
    assert "hierarchy ablation" in figures and f"bm25 k={rb['ks']['bm25']}" in figures


def test_step_0_builds_once_for_trained_and_base(run_dir, monkeypatch):
    """Step 0 (a run whose validation kept the warm start): `trained` and `base` are the same weights, so a
    greedy builder's constructions are made once and reused, and both methods' answers are the same."""
    calls = []
    real = jobs.build_workspaces

    def counted(label, *args, **kwargs):
        calls.append(label)
        return real(label, *args, **kwargs)

    monkeypatch.setattr(jobs, "build_workspaces", counted)
    results = cli.run_eval(_eval_cfg(run_dir, name="step0", step=0, methods="trained,base,raw",
                                     ablation=dict(enabled=False)))
    assert calls == ["trained"]
    out = os.path.join(run_dir, "eval", "step0")
    rows = [json.loads(x) for x in open(os.path.join(out, "questions.jsonl"))]

    def of(method):
        return [{k: v for k, v in r.items() if k != "method"} for r in rows if r["method"] == method]

    assert of("trained") == of("base") and of("trained")
    assert results["accuracy"]["trained"]["accuracy"] == results["accuracy"]["base"]["accuracy"]
    assert results["workspaces"] == {"trained": 2, "base": 2}


def test_bad_eval_inputs_fail_before_any_model_loads(run_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"config\.methods: unknown method 'dense'"):
        cli.plan_eval(_eval_cfg(run_dir, methods="trained,dense"))
    with pytest.raises(ConfigError, match=r"config\.run: training workdir '/no/such/run' does not exist"):
        cli.plan_eval(_eval_cfg("/no/such/run"))
    with pytest.raises(ConfigError, match=r"config\.step: '.*checkpoints/7' does not exist"):
        cli.plan_eval(_eval_cfg(run_dir, step=7))
    with pytest.raises(ConfigError, match=r"config\.pass_k: k=3 needs"):
        cli.plan_eval(_eval_cfg(run_dir, pass_k="1,3"))
    # a copy of the run whose config says LoRA rank 4: its full-param checkpoint does not match
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    cfg["model"]["lora_rank"] = 4
    (other / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(run_dir, "checkpoints"), other / "checkpoints")
    with pytest.raises(ConfigError, match=r"config\.run: checkpoint .* holds full params; .* expects LoRA"):
        cli.plan_eval(_eval_cfg(str(other)))
    b = build_config.get_config()
    b.run, b.out = run_dir, str(tmp_path / "out")
    b.data.path = str(tmp_path / "empty")
    os.makedirs(b.data.path)
    with pytest.raises(ConfigError, match=r"config\.data\.path: .*/empty.*(empty corpus|holds no non-empty)"):
        cli.plan_build(b)
    # through main: a one-line error and exit code 2
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "librarian_jax.main",
            "--config=configs/eval.py",
            f"--config.run={run_dir}",
            "--config.methods=trained,nope",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "error: config.methods: unknown method 'nope'" in bad.stderr


def test_build_exports_a_browsable_tree(run_dir, tmp_path):
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    texts = {
        "a.txt": "Orlen Vask works at the Amber Institute.\n",
        "sub/b.md": "# Lab\nThe lab is in Tarn.\n",
    }
    for name, text in texts.items():
        (folder / name).write_text(text)
    b = build_config.get_config()
    b.run, b.out, b.data.path = run_dir, str(tmp_path / "ws"), str(folder)
    summary = cli.run_build(b)
    out = tmp_path / "ws"
    assert summary["documents"] == 2 and not summary["failed"]
    assert (out / "README.md").is_file() and (out / "build.json").is_file()
    manifest = json.load(open(out / "manifest.json"))
    for d in manifest["raw_docs"]:  # raw documents byte for byte, as the manifest's hash says
        blob = (out / d["path"]).read_bytes()
        assert blob == texts[d["doc_id"]].encode() and hashlib.sha256(blob).hexdigest() == d["sha256"]
    _assert_links_resolve(out, manifest)
    assert load_export(out).workspace.stats() == summary["stats"]  # servable as it is
    # it says what it built; the tiny builder wrote nothing, and the user reads that with a real builder named
    if summary["stats"]["active_synthetic"] == 0:
        (warning,) = summary["warnings"]
        assert "the builder wrote no synthetic file" in warning and cli.REAL_BUILDER_HINT in warning
    assert json.load(open(out / "build.json"))["warnings"] == summary["warnings"]
    # the same export contract on a workspace that has synthetic files (a random tiny builder writes none)
    from librarian_jax.workspace import Workspace

    task = data.load_folder(folder)
    ws = Workspace.from_documents(list(task.documents))
    raw = [d.path for d in ws.raw_docs]
    assert ws.create_file("Who works where", raw[:1], "Orlen Vask: Amber Institute").ok
    assert ws.merge_files("People", [ws.manifest()["synthetic"][0]["path"]], "people").ok
    assert ws.export(tmp_path / "ws2").ok
    manifest = json.load(open(tmp_path / "ws2" / "manifest.json"))
    assert len(manifest["synthetic"]) == 2
    _assert_links_resolve(tmp_path / "ws2", manifest)


def test_build_report_says_what_it_built():
    stats = {"active_files": 0, "active_dirs": 0, "active_synthetic": 0, "max_depth": 0, "synthetic_chars": 0}
    summary = {"documents": 6, "stats": stats, "failed": "", "stopped": True, "run": "/runs/tiny", "step": 2,
               "construction_tokens": 41, "turns": 1}
    lines, warnings = cli.build_report(summary, "/tmp/ws")
    assert lines[0].startswith("built /tmp/ws: 6 raw documents, 0 synthetic files in 0 synthetic directories")
    assert "41 tokens over 1 turn, called stop" in lines[0]
    assert lines[1] == "serve it to any MCP client: python -m librarian_jax.serve /tmp/ws"
    assert warnings == [
        "the builder wrote no synthetic file (called stop after 1 turn): the workspace holds the raw "
        "documents only; " + cli.REAL_BUILDER_HINT
    ]
    assert "hf:/" in cli.REAL_BUILDER_HINT and "qwen3_5_4b" in cli.REAL_BUILDER_HINT
    stats.update(active_files=3, active_dirs=1, active_synthetic=4, max_depth=2, synthetic_chars=1234)
    lines, warnings = cli.build_report(summary, "/tmp/ws")
    assert warnings == []
    assert "3 synthetic files in 1 synthetic directories (nesting depth 2, 1,234" in lines[0]
    lines, warnings = cli.build_report({**summary, "failed": "boom"}, "/tmp/ws")
    assert warnings == ["the construction failed (boom); exported the raw documents only"]


def _assert_links_resolve(root, manifest):
    for n in manifest["synthetic"]:
        if not n["active"]:
            continue
        assert (root / n["path"]).is_file() or (root / n["path"]).is_dir(), n["path"]
        assert n["raw_provenance"], n
        for link in n["raw_sources"] + n["synthetic_sources"] + [p["path"] for p in n["raw_provenance"]]:
            assert os.path.exists(root / link), link


def test_a_failed_construction_stays_in_the_denominator(monkeypatch):
    from librarian_jax.workspace import Workspace

    tasks = data.generate_world(1, 2, docs_per_task=2, min_words=20, max_words=30, questions_per_task=2)
    bad = tasks[1].task_id

    def fake_run_batch(batch, group_size, engines, tokenizer, config, rng=0, **kw):
        if any(t.task_id == bad for t in batch):
            raise RuntimeError("builder crashed")
        from librarian_jax.rollout import EpisodeRecord

        return [
            EpisodeRecord(
                t.task_id,
                i,
                0,
                [],
                [],
                0.0,
                0.0,
                workspace_snapshots={
                    "final": Workspace.from_documents(list(t.documents)).to_dict(include_raw_text=False)
                },
                token_counts={"builder_generated": 7},
            )
            for i, t in enumerate(batch)
        ]

    monkeypatch.setattr(jobs, "run_batch", fake_run_batch)
    resets = []
    cfg = cluster.mode_rollout(pipeline.R.RolloutConfig(), cluster.Mode.EVAL)
    built = pipeline.build_workspaces(
        "trained", tasks, dict, None, cfg, templates={"policy": None}, reset=lambda: resets.append(1),
        progress=False,
    )
    assert [b.failed != "" for b in built] == [False, True] and resets
    assert built[0].construction_tokens == 7
    job = pipeline.Job("trained", built[1].task, None, 1, failed=built[1].failed)
    rows = pipeline.job_records(job, RuntimeError("no workspace"), cfg)
    assert len(rows) == len(pipeline.questions_of(tasks[1], cfg)) and all(
        r["judgement"] == "construction_failed" and r["correct"] == 0 for r in rows
    )
    good = [dict(r, method="trained", corpus=tasks[0].task_id, correct=1.0) for r in rows]
    sums = stats.corpus_sums(good + rows, ["trained"], [t.task_id for t in tasks])
    assert stats.accuracy_table(sums, sums["trained"]["n"][None] * 0 + 1, None)["trained"][
        "accuracy"
    ] == pytest.approx(len(good) / (len(good) + len(rows)))


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_update_runs_the_real_engine_into_a_new_dir(run_dir, tmp_path):
    """`configs/build.py --config.update_from=OLD`: the tiny trained builder on its real engine runs the
    update episode; the old export is untouched, its synthetic files resting on unchanged documents are
    carried byte for byte, and every file cites current hashes or is marked stale.
    Bad update inputs fail before any model loads."""
    from librarian_jax.workspace import Workspace, carry_over

    folder = tmp_path / "notes"
    folder.mkdir()
    texts = {"a.txt": "Orlen Vask works at the Amber Institute.\n", "b.txt": "The lab is in Tarn.\n",
             "c.txt": "Mira Holt studies tides.\n"}
    for name, text in texts.items():
        (folder / name).write_text(text)
    # the old export: written by hand, so that it has synthetic files to carry (the tiny builder writes none)
    ws = Workspace.from_documents(list(data.load_folder(folder).documents))
    raw = [d.path for d in ws.raw_docs]
    assert ws.create_file("Orlen Vask", raw[:1], "Orlen Vask: Amber Institute.").ok
    assert ws.create_file("Labs", raw[1:2], "The lab: Tarn.").ok
    old = tmp_path / "old"
    assert ws.export(old).ok
    before = _tree(old)
    (folder / "b.txt").write_text("The lab moved to Vell.\n")  # modified
    (folder / "c.txt").unlink()  # removed
    (folder / "d.txt").write_text("Ada Lind paints harbours.\n")  # added
    b = build_config.get_config()
    b.run, b.out, b.data.path = run_dir, str(tmp_path / "new"), str(folder)
    b.update_from, b.update_max_turns = str(old), 2
    summary = cli.run_build(b)
    new = tmp_path / "new"
    assert _tree(old) == before  # the old directory, byte for byte
    up = summary["update"]
    assert up["changes"] == {"added": 1, "removed": 1, "modified": 1, "renamed": 0, "unchanged": 1}
    assert up["stale_before"] == 1 and summary["turns"] <= 2
    assert (new / "cluster_0001__orlen_vask.txt").read_bytes() == before["cluster_0001__orlen_vask.txt"]
    manifest = json.load(open(new / "manifest.json"))
    current = {d["path"]: d["sha256_16"] for d in manifest["raw_docs"]}
    stale = {s["path"] for s in manifest.get("stale", [])}
    for n in manifest["synthetic"]:  # history/ too
        fresh = all(current.get(p["path"]) == p["sha256_16"] for p in n["raw_provenance"])
        assert fresh != (n["path"] in stale), n["path"]
    assert sorted(s["path"] for s in manifest.get("stale", []) if s["active"]) == sorted(up["stale_after"])
    assert {d["doc_id"] for d in manifest["raw_docs"]} == {"a.txt", "b.txt", "d.txt"}
    # an update of the update with the same folder changes nothing: no episode, the same tree
    assert carry_over(load_export(new).workspace, list(data.load_folder(folder).documents)).changes.empty
    b.update_from, b.out = str(new), str(tmp_path / "new2")
    again = cli.run_build(b)
    assert again["construction_tokens"] == 0 and again["update"]["stale_before"] == len(up["stale_after"])
    same = {k: v for k, v in _tree(new).items() if k != "build.json"}
    assert {k: v for k, v in _tree(tmp_path / "new2").items() if k != "build.json"} == same
    lines, _ = cli.build_report(summary, str(new))
    assert lines[1].startswith(f"updated from {old} (left as it was): 1 added, 1 removed, 1 modified")
    # bad update inputs fail before any model loads
    b.out = str(tmp_path / "other")
    b.update_from = str(tmp_path / "notes")
    with pytest.raises(ConfigError, match=r"config\.update_from: .* no manifest\.json"):
        cli.plan_build(b)
    b.update_from, b.out = str(old), str(old / "inside")
    with pytest.raises(ConfigError, match=r"config\.out: .* lies inside the workspace to update"):
        cli.plan_build(b)


def test_bench_update_with_the_runs_builder(run_dir):
    """`python -m librarian_jax.bench.update --run=DIR`: the run's builder on its real engine builds, updates
    and rebuilds a mutated held-out corpus, and the run's answerer answers the three workspaces."""
    from librarian_jax.bench import update as bench_update

    setup = bench_update.run_setup(run_dir)
    res = bench_update.measure(setup, corpora=1, fraction=0.5, questions=2, max_turns=1, seed=0)
    assert res["builder"].startswith(run_dir) and set(res["methods"]) == {"stale", "rebuild", "updated"}
    assert res["methods"]["rebuild"]["tokens_mean"] > 0 and res["methods"]["updated"]["tokens_mean"] > 0
    assert "| updated |" in bench_update.table(res)
