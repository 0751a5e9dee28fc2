"""The embedded default learns (issues 11, 40), in a version that fits the suite.

The default is the noisy world (docs/world.md). Its warm start (150 SFT steps, ~6 minutes on 2 cores) is too
long for the suite; its checkpoint is a fixture made by `tests/make_warm_start_fixture.py` with the real SFT
command (tests/test_sft.py checks the SFT code itself on a small config): seed 1's, a warm start whose sampled
builds often stop at once, which GRPO learns to leave (the five-seed sweep's seed 1: 67.8 -> 89.9% held-out,
BENCHMARKS.md 2026-12-06 (ninth)). From it: the warm-started builder writes valid tool calls in most turns,
and a few GRPO steps of main's own loop raise the mean reward of the sampled policy on fixed tasks and seeds.

Both run with the compiler users get (`production_codegen.rerun`: in the suite, each in a fresh process
without its older code generator), fully optimised: this file's time is its programs' run time, and the old
code generator compiles optimised programs 2-4x slower.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import production_codegen
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "warm_start")


def _config(workdir: str):
    spec = importlib.util.spec_from_file_location("configs_grpo", os.path.join(ROOT, "configs", "grpo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()  # the default: the noisy world
    c.workdir = workdir
    c.warm_start.enabled = False
    c.model.update(init="orbax", path=FIXTURE, tokenizer=os.path.join(FIXTURE, "tokenizer.model"))
    # no periodic evaluation, hence no step chosen on validation corpora
    c.eval.update(every=0, final_methods="", select="last", validation_tasks=0)
    # a small world: the steps revisit the tasks the reward is measured on (4 training corpora, 6 held out)
    c.data.update(num_tasks=10, heldout_fraction=0.25)
    c.train.update(num_steps=4)
    c.checkpoint.update(async_save=False)
    return c


@pytest.fixture(scope="module", autouse=True)
def _optimised_programs():
    """This file's time is its programs' run time (GRPO updates, rollout batches), not their compile: it runs
    XLA's fully optimised programs even where the suite compiles cheaply (tests/run.sh)."""
    import jax

    was = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", was)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from librarian_jax import config_validation, training

    if not os.path.isdir(os.path.join(FIXTURE, "params")):
        pytest.fail(f"missing fixture {FIXTURE}: run tests/make_warm_start_fixture.py")
    return training.build(config_validation.validate(_config(str(tmp_path_factory.mktemp("learn")))))


def _batch(run, tasks, temperature: float, seed: int):
    from librarian_jax import rollout

    cfg = run.rollout_config
    cfg = dataclasses.replace(cfg, builder=dataclasses.replace(cfg.builder, temperature=temperature))
    return rollout.run_batch(tasks, 4 if temperature else 1, run.engines, run.tokenizer, cfg, rng=seed)


@pytest.mark.slow
def test_warm_started_builder_writes_valid_calls_and_helps_the_answerer(request):
    if production_codegen.rerun(request):  # the programs users run (and ~25 CPU-s less than the suite's)
        return
    run = request.getfixturevalue("run")
    records = _batch(run, run.heldout[:6], 0.0, 0)
    turns = [errs for r in records for errs in r.tool_errors]
    clean = np.mean([not errs for errs in turns])
    assert clean >= 0.6, f"only {clean:.2f} of turns without a malformed call"
    calls = [c for r in records for t in r.tool_calls for c in t]
    assert sum(c["ok"] for c in calls) >= 0.7 * len(calls)
    # it acts: its workspaces hold files it wrote (the demonstrations' mixture's mode writes a directory per
    # entity kind; a quarter of them stop at once, which this warm start does too often when sampled)
    written = [sum(c["ok"] and c["name"] in ("create_file", "merge_files") for t in r.tool_calls for c in t)
               for r in records]
    assert np.mean([n > 0 for n in written]) >= 0.5, written


@pytest.mark.slow
def test_a_few_grpo_steps_raise_the_mean_reward(request):
    if production_codegen.rerun(request):  # the programs users run (and ~30 CPU-s less than the suite's)
        return
    from librarian_jax import training

    run = request.getfixturevalue("run")

    tasks = run.train_tasks
    # the mean over 2 sampled batches (seeds) before and after 2 of the run's 4 steps, at the preset's
    # sampling temperature. Measured on the fixture (2026-12-07), per seed 123-126: before 0.934 0.878 0.916
    # 0.953; after 2 steps 1.096 1.259 1.224 1.290 (+0.16 to +0.38 each); after 4 steps 1.164 1.270 1.250
    # 1.289: the gain is there after 2 steps, and 2 seeds (0.906 -> 1.178) keep the margin at half the time.
    # (Seed 0's warm start, which already builds well, moved 1.300 -> 1.351 in 2 steps: too little to test.)
    seeds = (123, 124)
    temperature = run.rollout_config.builder.temperature

    def mean_reward() -> float:
        return float(np.mean([r.total_reward for s in seeds for r in _batch(run, tasks, temperature, s)]))

    before = mean_reward()
    for _ in range(2):
        training.train_one_step(run)
    after = mean_reward()
    assert after > before + 0.1, (before, after)
