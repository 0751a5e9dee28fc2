"""main: config validation names the bad key; the command runs end to end on a very small config."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from librarian_jax import config_validation as cv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(ROOT, "configs", "grpo.py")


def grpo():
    spec = importlib.util.spec_from_file_location("configs_grpo", CONFIG_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_and_paper_presets():
    mod = grpo()
    c = mod.get_config()
    cv.validate(c, num_devices=1)
    # the default is the noisy world (issue 40), its own warm start; the classic world stays a preset
    assert c.preset == "noisy" and c.model.preset == "tiny" and c.model.init == "random"
    assert c.warm_start.enabled and c.warm_start.sft_preset == "noisy" and c.data.world == "noisy"
    assert c.rollout.answerer.kind == "scripted" and c.eval.final_methods and c.eval.select == "validation"
    assert mod.get_config("embedded").data.world == "classic"
    for name in ("qwen3_5_4b", "gemma3_4b"):
        p = mod.get_config(name)
        assert (p.model.preset, p.model.lora_rank) == (name, 32)
        assert (p.rollout.group_size, p.data.tasks_per_batch) == (4, 16)
        assert p.rollout.builder.max_turns == 32 and p.rollout.builder.max_new_tokens == 4096
        assert (1 - p.train.eps_low, 1 + p.train.eps_high) == (0.8, 1.2)
        assert 1e-5 <= p.train.learning_rate <= 4e-5
        with pytest.raises(cv.ConfigError, match=r"config\.(model|roles\.executor)\.path: required when"):
            cv.validate(p, num_devices=8)
    with pytest.raises(ValueError, match="unknown preset 'nope'; known: \\['noisy', 'embedded'"):
        mod.get_config("nope")


def test_train_keys_reach_the_trainer_config():
    from librarian_jax import training

    c = grpo().get_config("embedded")
    c.train.logits_chunk, c.train.remat, c.train.micro_batches = 256, "layer", 2
    c.train.moe_aux_loss_coef, c.train.micro_batch_rows = 0.01, 3
    t = training.train_config(cv.validate(c, num_devices=1))
    assert (t.logits_chunk, t.remat, t.micro_batches, t.moe_aux_loss_coef) == (256, "layer", 2, 0.01)
    assert t.micro_batch_rows == 3
    c.train.moe_aux_loss_coef = -1.0
    with pytest.raises(cv.ConfigError, match=r"config\.train\.moe_aux_loss_coef: must be >= 0"):
        cv.validate(c, num_devices=1)


@pytest.mark.parametrize("key,value,message", [
    ("train.num_steps", -1, r"config\.train\.num_steps: must be >= 0, got -1"),
    ("rollout.group_size", 0, r"config\.rollout\.group_size: must be >= 1, got 0"),
    ("data.tasks_per_batch", -3, r"config\.data\.tasks_per_batch: must be >= 1"),
    ("model.preset", "gpt5", r"config\.model\.preset: must be one of .*got 'gpt5'"),
    ("train.aggregation", "mean", r"config\.train\.aggregation: must be one of"),
    ("train.advantage", "ppo", r"config\.train\.advantage: must be one of"),
    ("model.init", "hf", r"config\.model\.path: required when model\.init='hf'"),
    ("data.source", "file", r"config\.data\.path: required when data\.source='file'"),
    ("model.tokenizer", "/no/such/tokenizer.model", r"config\.model\.tokenizer: '/no/such/tokenizer\.model'"),
    ("train.eps_low", 1.5, r"config\.train\.eps_low: must be <= 1\.0"),
    ("checkpoint.keep", 0, r"config\.checkpoint\.keep: must be >= 1"),
    ("rollout.builder.max_turns", 0, r"config\.rollout: .*max_turns must be >= 1"),
    ("eval.select", "best", r"config\.eval\.select: must be one of \['last', 'validation'\]"),
    ("eval.select", "validation", r"config\.eval\.validation_tasks: must be > 0 with eval\.select"),
])
def test_validation_names_the_bad_key(key, value, message):
    c = grpo().get_config("embedded")
    section, _, name = key.rpartition(".")
    node = c
    for part in section.split("."):
        node = node[part]
    node[name] = value
    with pytest.raises(cv.ConfigError, match=message):
        cv.validate(c, num_devices=8)


def test_validation_of_mesh_and_unknown_rollout_keys():
    c = grpo().get_config("embedded")
    c.mesh.shape.update(data=3, fsdp=-1)
    with pytest.raises(cv.ConfigError, match=r"config\.mesh\.shape: .*8 devices not divisible by 3"):
        cv.validate(c, num_devices=8)
    c.mesh.shape.update(data=4, fsdp=4)
    with pytest.raises(cv.ConfigError, match=r"config\.mesh\.shape: .*needs 16 devices, only 8 present"):
        cv.validate(c, num_devices=8)
    c.mesh.shape.update(data=0, fsdp=1)
    with pytest.raises(cv.ConfigError, match=r"config\.mesh\.shape\.data: must be a positive integer or -1"):
        cv.validate(c, num_devices=8)
    c = grpo().get_config("embedded")
    c.rollout.builder.bogus = 1
    with pytest.raises(cv.ConfigError, match=r"config\.rollout: .*unknown key builder\.'bogus'"):
        cv.validate(c, num_devices=1)


def test_cli_reports_bad_key_and_dry_run():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    bad = subprocess.run([sys.executable, "-m", "librarian_jax.main", f"--config={CONFIG_FILE}",
                          "--config.train.num_steps=-2"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "error: config.train.num_steps: must be >= 0, got -2" in bad.stderr
    dry = subprocess.run([sys.executable, "-m", "librarian_jax.main", f"--config={CONFIG_FILE}", "--dry_run",
                          "--config.train.num_steps=7", "--config.workdir=/tmp/somewhere"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "GRPO preset 'noisy': model tiny (random init, full fine-tuning)" in dry.stdout
    assert "7 steps of 4 tasks x group 4" in dry.stdout and "workdir /tmp/somewhere" in dry.stdout


def tiny_run_config(workdir: str, num_steps: int):
    c = grpo().get_config("embedded")
    c.workdir = workdir
    c.warm_start.enabled = False
    c.eval.update(every=0, final_methods="")
    c.model.update(preset="tiny", tokenizer_vocab_size=2048)
    c.data.update(num_tasks=4, docs_per_task=2, min_words=20, max_words=30, questions_per_task=1,
                  heldout_fraction=0.2, tasks_per_batch=1)  # 2 train, 2 held-out tasks (by id hash)
    # compile_ahead off: these runs use a few of their engines' programs, and compiling every one ahead (the
    # command's default, `rollout.compile_ahead`) was half of a first run's time in a test process; compiling
    # ahead is checked where it is the subject (test_engine.py, test_compile_cache.py) and runs beside the
    # launched training runs of test_multihost.py
    c.rollout.update(group_size=2, policy_slots=2, frozen_slots=4, max_seq_len=2048, round_steps=16,
                     record_snapshots=False, compile_ahead=False)
    c.rollout.builder.update(max_turns=1, max_new_tokens=16, compaction_budget=1500)
    c.rollout.answerer.update(max_turns=1, max_new_tokens=8, forced_max_new_tokens=8)
    # no warmup and some weight decay: every step moves the weights (the hand-off test relies on it)
    c.train.update(num_steps=num_steps, max_row_len=2048, warmup_steps=0, weight_decay=0.1)
    return c


def _eval_values(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("eval/") and not k.endswith("_s")}


def _check_periodic_eval(m: dict[str, float]) -> None:
    """A periodic eval of `tiny_run_config` (one held-out corpus of one question, answered once) that really
    built and answered: a construction that failed, or an answer that never ran, still gives every key (its
    question counts as incorrect) but no builder tokens and no reading."""
    acc = m["eval/trained/accuracy"]
    assert m["eval/accuracy"] == acc and acc in (0.0, 1.0)
    # builder tokens read and written (its prompt, one turn): more than the turn's 16 new ones
    assert m["eval/trained/construction_tokens_per_corpus"] > 16
    assert m["eval/trained/tokens_read_per_query"] > 0 and m["eval/trained/passages_per_query"] == 0


def _checkpoint_arrays(step_dir: str, item: str = "params") -> dict[str, np.ndarray]:
    """One item (`params`, `opt_state`) of a checkpoint step, by path (read with Orbax, no target tree)."""
    import jax
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(os.path.join(step_dir, item))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _episodes(workdir: str, step: int) -> list[tuple[list[int], list[float]]]:
    """(tokens, sampler log-probs) of every segment of one step's episodes file."""
    from librarian_jax.rollout import read_jsonl

    records = read_jsonl(os.path.join(workdir, "episodes", f"step_{step}.jsonl"))
    return [(seg.tokens.tolist(), seg.logprobs.tolist()) for r in records for seg in r.segments]


@pytest.mark.slow
def test_main_hands_new_weights_to_the_engine_and_resumes_as_if_never_stopped(tmp_path):
    """Through `training.run` itself: a run of 2 steps in one invocation ("straight"), and one "killed" after
    step 1, then resumed by a second invocation. Step 2's rollouts are sampled by the step-1 weights only if
    main hands the trainer's weights to the policy engine after each update (straight) and after a resume
    (resumed): without either hand-off one run samples step 2 with the initial weights, and the two differ.
    With both, the runs are identical: same step-2 tokens and sampler log-probs, same step-2 checkpoint."""
    from librarian_jax import training

    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    config = tiny_run_config(straight, num_steps=2)
    # the straight run also evaluates, the starting policy (step 0) and after each step: evaluating must
    # leave training untouched (the episodes and checkpoints below equal the killed run's, which does not)
    config.eval.update(every=1, num_tasks=1, repeats=1)
    out = training.run(config)
    for evaluated in (out["initial_eval"], out["metrics"]):
        _check_periodic_eval(evaluated)
    # compile time apart from run time: the last step's (inside its rollout/update/eval times) and the run's
    last, run_total = out["metrics"], out["compile"]
    assert {"compile/programs", "compile/cache_hits", "compile/time_s"} <= last.keys()
    assert run_total["total_s"] >= last["compile/time_s"] >= 0
    assert run_total["programs"] >= last["compile/programs"]
    assert last["compile/time_s"] <= last["rollout/time_s"] + last["train/time_s"] + last["eval/time_s"]
    logged = {"probe/accuracy": np.nan, "train/kl": np.nan, **last}  # the summary keeps finite metrics only
    line = training.progress_line(2, 2, {**logged, "compile/programs": 3.0, "compile/time_s": 4.3})
    assert line.endswith("| compiled 3 programs 4.3s")
    assert "compiled" not in training.progress_line(2, 2, {**logged, "compile/programs": 0.0})
    first = training.run(tiny_run_config(killed, num_steps=1))
    assert (first["start_step"], first["last_step"]) == (0, 1)
    # step 1 updated the weights (weight decay alone moves each one), so a missed hand-off cannot pass unseen
    assert "train/loss" in first["metrics"] and first["metrics"].get("train/skipped", 0.0) == 0.0
    assert glob.glob(os.path.join(killed, "tb", "events.out.tfevents.*"))
    assert os.path.exists(os.path.join(killed, "checkpoints", "1", "commit_success.txt"))
    # step 1 is the same in both runs (same config, seed and data)
    assert _episodes(killed, 1) == _episodes(straight, 1)
    # a second invocation with more steps resumes after step 1 (and evaluates on a held-out task)
    config = tiny_run_config(killed, num_steps=2)
    config.eval.update(every=1, num_tasks=1, repeats=1)
    second = training.run(config)
    assert (second["start_step"], second["last_step"]) == (1, 2)
    _check_periodic_eval(second["metrics"])
    assert second["eval_s"] > 0
    # the resumed run evaluates step 2's policy on the same corpora and seeds as the run that never stopped
    assert _eval_values(second["metrics"]) == _eval_values(out["metrics"])
    assert second["initial_eval"] == {}  # a resumed run does not evaluate its starting point again
    with open(os.path.join(killed, "summary.json")) as f:
        assert json.load(f)["last_step"] == 2
    assert _episodes(killed, 2) == _episodes(straight, 2)
    for item in ("params", "opt_state"):
        a, b = (_checkpoint_arrays(os.path.join(d, "checkpoints", "2"), item) for d in (straight, killed))
        assert a.keys() == b.keys() and a
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{item}{k}")
    a = _checkpoint_arrays(os.path.join(straight, "checkpoints", "2"))
    c = _checkpoint_arrays(os.path.join(straight, "checkpoints", "1"))
    assert any(not np.array_equal(a[k], c[k]) for k in a)  # and step 2 moved them again


def test_select_step_takes_the_best_validation_accuracy_among_kept_steps_ties_to_the_later():
    from librarian_jax.training import select_step

    curve = [(0, 0.9), (4, 0.95), (8, 0.95), (12, 0.7)]
    assert select_step(curve, [4, 8, 12], 12) == 8  # a tie goes to the later step
    assert select_step(curve, [12], 12) == 0  # step 0 (the starting weights) needs no checkpoint
    assert select_step([(0, 0.5), (4, 0.9), (8, 0.6)], [8], 8) == 8  # step 4's checkpoint is gone
    assert select_step([], [3], 3) == 3


@pytest.mark.slow
def test_a_run_chooses_its_step_on_validation_corpora_it_never_trained_on(tmp_path, monkeypatch):
    """`eval.select="validation"`: the validation corpora (training split) are in no step's rollouts and in
    split.json apart; they are answered at step 0, every `eval.every` steps and the last; those steps'
    checkpoints outlive `checkpoint.keep`; the final evaluation reports the chosen step. And step 0 is the
    starting weights: no checkpoint restored, the base builder's workspaces."""
    from librarian_jax import eval as eval_lib
    from librarian_jax import training
    from librarian_jax.eval import restore
    from librarian_jax.rollout import read_jsonl

    wd = str(tmp_path / "run")
    c = tiny_run_config(wd, num_steps=3)
    c.data.num_tasks = 6
    c.eval.update(every=2, num_tasks=1, select="validation", validation_tasks=1, final_methods="trained,base")
    c.checkpoint.keep = 1
    out = training.run(c)
    with open(os.path.join(wd, "split.json")) as f:
        split = json.load(f)
    rolled_out = {r.task_id for s in (1, 2, 3)
                  for r in read_jsonl(os.path.join(wd, "episodes", f"step_{s}.jsonl"))}
    assert len(split["validation"]) == 1 and not set(split["validation"]) & (rolled_out | set(split["train"]))
    assert [s for s, _ in out["validation_curve"]] == [0, 2, 3]
    assert restore.committed_steps(os.path.join(wd, "checkpoints")) == [2, 3]  # step 2 outlives keep=1
    assert out["selected_step"] == training.select_step(out["validation_curve"], [2, 3], 3)
    with open(os.path.join(wd, "eval", "final", "results.json")) as f:
        assert json.load(f)["setup"]["step"] == out["selected_step"]
    def no_checkpoint(*args, **kwargs):
        raise AssertionError("step 0 restored a checkpoint")

    monkeypatch.setattr(restore, "restore_builder", no_checkpoint)  # step 0 is the base weights, no restore
    at0 = eval_lib.evaluate_run(wd, methods="trained,base", name="at_0", step=0, progress=False)
    assert at0["setup"]["step"] == 0 and "starting weights" in at0["setup"]["builder"]
    ws = os.path.join(wd, "eval", "at_0", "workspaces")
    assert _tree(os.path.join(ws, "trained")) == _tree(os.path.join(ws, "base"))


def _tree(root: str) -> dict[str, str]:
    """Every file under `root` by relative path, with its text."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            with open(p, encoding="utf-8", errors="replace") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5)
_JSON = st.recursive(_SCALARS, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=5), kids, max_size=3), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(curve=_JSON, extra=st.booleans())
def test_a_resumed_runs_validation_curve_from_any_meta_is_pairs_or_nothing(curve, extra):
    """Whatever a checkpoint's meta holds where the validation curve goes (a hand-edited or foreign meta),
    resuming reads (step >= 0, accuracy in [0, 1]) pairs or nothing, never an exception."""
    from librarian_jax.training import validation_curve_of

    meta = {"extra": {"validation_curve": curve}} if extra else {"extra": curve}
    out = validation_curve_of(meta, "ckpt/3")
    assert isinstance(out, list)
    assert all(type(s) is int and s >= 0 and type(a) is float and 0.0 <= a <= 1.0 for s, a in out)
    assert validation_curve_of({"extra": {"validation_curve": [[0, 0.5], [4, 1]]}}) == [(0, 0.5), (4, 1.0)]
    assert validation_curve_of({"extra": {"validation_curve": [[0, 0.5], [4, 1.5]]}}) == []
    # nothing that only unpacks like a pair: strings, dict keys, booleans; an infinite step neither
    for forged in (["01"], {"10": 1}, [[True, 0.5]], [[0, False]], [[float("inf"), 0.5]], [[1.0, 0.5]]):
        assert validation_curve_of({"extra": {"validation_curve": forged}}) == [], forged
