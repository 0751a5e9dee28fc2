"""One protocol for every command (issue 37): the role cluster's roles, templates and contexts are the same
in training, the warm start, evaluation and `--dry_run`, and `protocol.json` records them.

- A tiny run whose answerer, executor and judge are three different small models (saved HF directories,
  different chat templates and context lengths) is trained and evaluated; the evaluation's protocol.json
  equals the run's for every role but the builder's weights, and its engines serve those very models.
- A warm-start conversation of a Qwen3.5 preset encodes to the same ids through the SFT path as through the
  GRPO prompt path.
- The paper presets dry-run from README's own command lines and print the roles docs/paper-settings.md shows.
- An evaluation's explicit override is reported as a difference, and nothing else is.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from configs import grpo
from librarian_jax import cluster, models, testing
from librarian_jax.config_schema import EvalConfig, GRPOConfig, SFTConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _save_model(path: pathlib.Path, layers: int, seed: int) -> str:
    model = testing.tiny_model(models.get_preset("tiny", num_layers=layers), seed=seed)
    models.save_hf(model, str(path))
    return str(path)


def _three_role_config(tmp_path: pathlib.Path):
    from tests.test_main import tiny_run_config

    c = tiny_run_config(str(tmp_path / "run"), num_steps=1)
    c.data.update(heldout_fraction=0.5)
    c.rollout.update(use_model_judge=True, judge_max_new_tokens=4, max_probes=0, terminal_repeats=1)
    c.rollout.builder.update(executor="model", executor_max_new_tokens=8, excerpt_max_chars=600)
    c.rollout.answerer.update(kind="model", context_budget=1024, preload_max_tokens=128)
    c.roles.answerer.update(init="hf", path=_save_model(tmp_path / "answerer", 1, 11), slots=3,
                            max_seq_len=1024, template="chatml")
    c.roles.executor.update(init="hf", path=_save_model(tmp_path / "executor", 2, 12), slots=2,
                            max_seq_len=1536, template="qwen3_5", thinking=False)
    c.roles.judge.update(init="hf", path=_save_model(tmp_path / "judge", 3, 13), slots=2, max_seq_len=512,
                         template="qwen3_5", thinking=True)
    return c


def test_eval_runs_the_training_runs_protocol_with_three_frozen_models(tmp_path):
    from librarian_jax import training
    from librarian_jax.eval import cli

    c = _three_role_config(tmp_path)
    training.run(c)
    run_dir = c.workdir
    trained = json.loads((pathlib.Path(run_dir) / "protocol.json").read_text())
    assert trained["answerer"]["architecture"] == "qwen3:1x128"
    assert trained["executor"]["architecture"] == "qwen3:2x128"
    assert trained["judge"]["architecture"] == "qwen3:3x128"
    roles = ("answerer", "executor", "judge")
    assert [trained[r]["template"] for r in roles] == ["chatml", "qwen3_5", "qwen3_5"]
    assert [trained[r]["max_seq_len"] for r in ("answerer", "executor", "judge")] == [1024, 1536, 512]
    assert trained["judge"]["thinking"] and not trained["executor"]["thinking"]
    assert trained["compaction"]["weights"] == "scripted:deterministic"

    # the eval of that run, its builder sampled as in training: every role as trained but the builder's
    e = _eval_config(run_dir)
    e.update(name="proto", builder_temperature=float(c.rollout.builder.temperature))
    e.ablation.enabled = False
    results = cli.evaluate_run(run_dir, config=e, name="proto", progress=False)
    used = json.loads((pathlib.Path(run_dir) / "eval" / "proto" / "protocol.json").read_text())
    assert used["builder"]["weights"].startswith("run:") and used["builder"]["weights"].endswith("@1")
    diffs = cluster.protocol_diff(trained, used)
    assert diffs == [], diffs
    assert results["protocol"]["differences"] == []
    report = (pathlib.Path(run_dir) / "eval" / "proto" / "report.md").read_text()
    assert "## Protocol vs training" in report and "differences: none" in report

    # and the evaluation's engines serve those very models (not the answerer's engine for every role)
    plan = cli.plan_eval(e)
    tok = cli.restore.run_tokenizer(plan.run_cfg, run_dir, [])
    m = cli.eval_cluster(plan, cluster.Mode.EVAL, cluster.local_mesh(plan.settings.mesh), tok)
    engines = m.engines
    assert len({id(engines[r]) for r in ("answerer", "executor", "judge")}) == 3
    for role, layers, seq in (("answerer", 1, 1024), ("executor", 2, 1536), ("judge", 3, 512)):
        eng = engines[role]
        assert eng.max_seq_len == seq and eng.config.num_layers == layers, role
        want = nnx.state(models.load_hf(c.roles[role].path, dtype="bfloat16"), nnx.Param).to_pure_dict()
        got = nnx.state(eng.params).to_pure_dict() if not hasattr(eng.params, "to_pure_dict") else \
            eng.params.to_pure_dict()
        np.testing.assert_array_equal(np.asarray(want["embed_tokens"]["embedding"]),
                                      np.asarray(got["embed_tokens"]["embedding"]), err_msg=role)
    assert m.templates["answerer"].style == "chatml" and m.templates["judge"].thinking
    assert m.templates["executor"].style == "qwen3_5" and not m.templates["executor"].thinking


def _eval_config(run_dir: str):
    import importlib

    e = importlib.import_module("configs.eval").get_config()
    e.run, e.methods, e.num_tasks = run_dir, "trained", 1
    return e


def test_a_qwen3_5_warm_start_conversation_encodes_as_grpo_samples_it(qwen_tok, tmp_path):
    """The SFT path's template (`warm_start.sft.builder_template`) is the one GRPO's policy engine samples
    with (`cluster.role_templates`, which `build_cluster` uses): a demonstration made through the real
    protocol with GRPO's template (its builder session's ids) encodes to exactly those ids for SFT. Red when
    SFT detects the template from the vocabulary (ChatML) instead of taking the protocol's (Qwen3.5)."""
    from configs import sft as sft_configs
    from librarian_jax.agents import AnswererConfig, BuilderConfig
    from librarian_jax.data import synthetic
    from librarian_jax.rl import sft
    from librarian_jax.rollout import RolloutConfig
    from librarian_jax.warm_start import demos
    from librarian_jax.warm_start import sft as warm_start_sft

    grpo_cfg = grpo.get_config("qwen3_5_4b")
    sft_cfg = sft_configs.get_config("qwen3_5_4b")
    (tmp_path / "convs.jsonl").touch()
    grpo_cfg.model.path = sft_cfg.model.path = grpo_cfg.data.path = str(tmp_path)  # the user's folders
    sft_cfg.data.path = str(tmp_path / "convs.jsonl")  # and conversations
    grpo_cfg, sft_cfg = GRPOConfig.parse(grpo_cfg), SFTConfig.parse(sft_cfg)
    grpo_tpl = cluster.role_templates(grpo_cfg, qwen_tok)["policy"]
    sft_tpl = warm_start_sft.builder_template(sft_cfg, qwen_tok)
    assert (grpo_tpl.style, grpo_tpl.thinking) == ("qwen3_5", True) == (sft_tpl.style, sft_tpl.thinking)
    tasks = synthetic.generate_world(3, 1, docs_per_task=3, min_words=20, max_words=30, questions_per_task=1)
    cfg = RolloutConfig(builder=BuilderConfig(max_turns=2, max_new_tokens=4000, executor="extractive",
                                              compaction="none"),
                        answerer=AnswererConfig(kind="scripted", max_turns=2, context_budget=100_000),
                        max_probes=0, terminal_repeats=1, use_model_judge=False)
    out = demos.make_demonstrations(tasks, qwen_tok, cfg, mix={"entities": 1.0}, per_task=1,
                                    template=grpo_tpl)
    assert out
    for d in out:
        ex = sft.encode_conversation(d["messages"], sft_tpl, qwen_tok)
        np.testing.assert_array_equal(ex.tokens, d["_segment"].tokens)
        np.testing.assert_array_equal(ex.loss_mask, d["_segment"].loss_mask)


def _readme_training_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Train for real", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [" ".join(cmd.split()) for cmd in block.replace("\\\n", " ").strip().splitlines()]


def _paper_settings_roles() -> dict[str, list[str]]:
    doc = (ROOT / "docs" / "paper-settings.md").read_text()
    lines = doc.split("## Roles", 1)[1].splitlines()[1:]
    table = [ln for ln in lines[: lines.index("")] if ln.startswith("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    return {r[0]: r for r in rows}


@pytest.mark.parametrize("preset", ["qwen3_5_4b", "gemma3_4b"])
def test_paper_presets_dry_run_from_readmes_command_lines(tmp_path, preset):
    """README's "Train for real" lines, with only their model and data paths made real, validate and print
    the role table that docs/paper-settings.md shows (weights, slots, context, thinking)."""
    line = next(x for x in _readme_training_lines() if f"configs/grpo.py:{preset}" in x)
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "librarian_jax.main"]
    for i, a in enumerate(argv):
        key, _, value = a.partition("=")
        if key.endswith(".path") or key.endswith(".workdir"):  # the user's own folders
            local = tmp_path / value.strip("/").replace("/", "_")
            local.mkdir(exist_ok=True)
            argv[i] = f"{key}={local}"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, *argv[1:], "--dry_run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout.split("roles (which model serves which role):", 1)[1]
    rows = {ln.split()[0]: ln for ln in table.strip().splitlines()[1:]}
    docs = _paper_settings_roles()
    for role in ("answerer", "executor", "compaction", "judge"):
        cells = re.split(r"\s{2,}", rows[role])
        slots, seq, thinking = cells[4], cells[5], cells[7]
        engine = docs[role][2]
        if "slots" in engine:
            assert f"{slots} slots" in engine, (role, engine, rows[role])
        if "max_seq_len" in engine:
            assert f"max_seq_len {seq}" in engine, (role, engine, rows[role])
        assert (thinking == "True") == docs[role][3].startswith("on"), (role, thinking, docs[role][3])
    # compaction and the judge share the executor's engine, as the doc says
    engines = {r: re.split(r"\s{2,}", rows[r])[2] for r in ("executor", "compaction", "judge")}
    assert len(set(engines.values())) == 1, engines
    if preset == "qwen3_5_4b":
        assert "Qwen3.5-35B-A3B" in rows["executor"] and "Qwen3.5-35B-A3B" in docs["executor"][1]


def test_an_evals_override_is_reported_as_the_only_difference(tmp_path):
    """`Overrides.of_eval` names an explicit `roles.<role>` override and the evaluation's cluster applies it;
    `protocol_diff` then finds exactly that field (and a greedy builder's temperature), nothing else."""
    import importlib

    def used(e):  # the protocol of an evaluation of `run` (its cluster's, no model loaded)
        over = cluster.Overrides.of_eval(EvalConfig.parse(e))
        specs = cluster.role_specs(run, over)
        rollout = cluster.mode_rollout(run.rollout.config, cluster.Mode.EVAL, over)
        return cluster.protocol(run, specs=specs, rollout=rollout), list(over.asked)

    run = grpo.get_config("qwen3_5_4b")  # its judge is a model (the embedded one's is exact match)
    run.model.path = run.data.path = str(tmp_path)  # the user's Hugging Face folder and data
    run = GRPOConfig.parse(run)
    e = importlib.import_module("configs.eval").get_config()
    e.roles.judge.max_seq_len = 4096
    e.builder_temperature = float(run.rollout.config.builder.temperature)
    proto, asked = used(e)
    assert asked == ["roles.judge.max_seq_len"]
    diffs = cluster.protocol_diff(cluster.protocol(run), proto)
    assert diffs == [("judge", "max_seq_len", run.roles.judge.max_seq_len, 4096)], diffs
    e.roles.judge.max_seq_len = 0
    e.builder_temperature = 0.0  # the default: a greedy builder
    proto, asked = used(e)
    assert asked == []
    t = float(run.rollout.config.builder.temperature)
    assert t > 0 and cluster.protocol_diff(cluster.protocol(run), proto) == [
        ("builder", "temperature", t, 0.0)]
    table = cluster.protocol_table(proto, cluster.protocol(run))
    assert f"0.0 (trained: {t}) !" in table


# ------------------------------------------------------------------------------------------- one constructor


def _engine_constructions(package: pathlib.Path) -> list[str]:
    """`file:line` of every call that constructs an `Engine` in the package, outside `engine/` (the engine's
    own `generate`) and `bench/` (benchmarks of the engine and scheduler alone, no roles)."""
    import ast

    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in ("engine", "bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name == "Engine":
                    out.append(f"{rel}:{node.lineno}")
    return out


def test_one_place_in_the_package_constructs_a_roles_engine():
    """Every command's engines come from `Cluster.from_run` (issue 64): the package constructs an `Engine`
    in exactly one place, `cluster._engine`. Red when a command builds one of its own (as `eval.cli.Models`
    did beside the cluster)."""
    sites = _engine_constructions(ROOT / "librarian_jax")
    assert len(sites) == 1 and sites[0].startswith("cluster.py:"), sites


def test_rollout_settings_reach_an_agent_through_at_most_three_reshapes(monkeypatch):
    """From the typed config to the agents, an evaluation's rollout settings are re-shaped (a
    `dataclasses.replace` of a rollout dataclass, or a `RolloutConfig` rebuilt from a dict) in at most three
    places: the cluster's one derivation per mode (`cluster.mode_rollout`), then what one answer run needs
    (`answer_and_judge`, sampled repeats). Traced on a real cluster's evaluation config through a build and
    its sampled answers; red when a copy comes back (e.g. `fit_to_engines` clamping, a second eval config)."""
    import dataclasses
    import sys

    from librarian_jax.agents.runtime import FROZEN, POLICY
    from librarian_jax.rollout import RolloutConfig, rewards
    from librarian_jax.rollout.jobs import Job, answer_jobs, build_workspaces
    from librarian_jax.warm_start import demos

    c = grpo.get_config("embedded")
    c.rollout.update(policy_slots=2, frozen_slots=2, max_seq_len=4096)
    c.rollout.builder.update(max_turns=2)
    settings = GRPOConfig.parse(c)
    tok = testing.ByteTokenizer()
    package = str(ROOT / "librarian_jax")
    sites: set[str] = set()
    shaped = (RolloutConfig, rewards.BuilderConfig, rewards.AnswererConfig)

    def record() -> None:
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(package):
            sites.add(f"{os.path.relpath(frame.f_code.co_filename, package)}:{frame.f_code.co_name}")

    replace, from_dict = dataclasses.replace, RolloutConfig.from_dict.__func__

    def traced_replace(obj, /, **changes):
        if isinstance(obj, shaped):
            record()
        return replace(obj, **changes)

    def traced_from_dict(cls, d):
        record()
        return from_dict(cls, d)

    monkeypatch.setattr(dataclasses, "replace", traced_replace)
    monkeypatch.setattr(RolloutConfig, "from_dict", classmethod(traced_from_dict))
    over = cluster.Overrides(answer_temperature=0.7)  # sampled answer repeats: each its own answer run
    the_cluster = cluster.Cluster.from_run(settings, cluster.Mode.EVAL, over, tokenizer=tok, engine_mesh=None,
                                           base=testing.tiny_model(models.get_preset("tiny")))
    cfg = the_cluster.rollout
    assert cfg.builder.context_budget == 4096 and cfg.max_probes == 0 and cfg.repeat_mode == "sample"
    tpl = the_cluster.templates
    engine = testing.ScriptedEngine(tok, demos.scripted_builder("entities", 0, 2),
                                    end_id=tpl[POLICY].stop_ids[0])
    tasks = _world()[:1]
    built = build_workspaces("trained", tasks, lambda: {POLICY: engine, FROZEN: engine}, tok, cfg,
                             templates=tpl, progress=False)
    assert built[0].workspace is not None, built[0].failed
    answers = answer_jobs([Job.of(built[0], 2)], lambda: {POLICY: engine, FROZEN: engine}, tok, cfg,
                          templates=tpl, progress=False)
    assert not isinstance(answers[0], Exception) and answers[0]
    assert len(sites) <= 3, sorted(sites)
    assert "cluster.py:mode_rollout" in sites, sorted(sites)


def _world():
    from librarian_jax.data import synthetic

    return synthetic.generate_world(5, 1, docs_per_task=3, min_words=20, max_words=30, questions_per_task=2)
