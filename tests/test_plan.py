"""The plan for a TPU slice (`planning`): accelerator types resolved as Cloud TPU counts them, abstract
engines and trainers laid out by the real placement code, every program of the tiny preset's train and eval
commands compiled for a 4-chip v5p by the TPU compiler on this CPU host, a planted overflow named before
anything compiles, and the plan's figures checked against the compiled programs and the arrays' own sizes.

The TPU compiler comes with the test install (`jax[tpu]`, pyproject's `test` extra): these tests never skip in
CI. Each compile is seconds even for the tiny model (the TPU compiler's fixed cost), so the configs below keep
the program count small: one attended length (max_seq_len 512), two slots, two update buckets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from librarian_jax import cluster, config_validation, models
from librarian_jax.config_schema import ConfigError, MeshSection, PlanSection
from librarian_jax.engine import Engine, make_mesh
from librarian_jax.models import partitioning
from librarian_jax.planning import plan as plan_lib
from librarian_jax.planning import topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the tiny preset, small enough that each of its programs compiles in seconds for TPU, with a model answerer
SMALL = ["--config.mesh.shape.fsdp=-1", "--config.warm_start.enabled=False", "--config.train.max_row_len=128",
         "--config.rollout.max_seq_len=512", "--config.rollout.policy_slots=2",
         "--config.rollout.frozen_slots=2",
         "--config.rollout.builder.compaction_budget=256", "--config.rollout.builder.max_new_tokens=64",
         "--config.rollout.answerer.kind=model", "--config.rollout.answerer.context_budget=512",
         "--config.rollout.builder.executor=model", "--config.rollout.builder.compaction=model",
         "--config.rollout.use_model_judge=True"]


@pytest.mark.parametrize("name,generation,chips,topo", [
    ("v5p-8", "v5p", 4, "v5p:2x2x1"), ("v5p-128", "v5p", 64, "v5p:4x4x4"), ("v5p-64", "v5p", 32, "v5p:2x4x4"),
    ("v6e-64", "v6e", 64, "v6e:8x8"), ("v5litepod-256", "v5e", 256, "v5e:16x16"),
    ("v5e-8", "v5e", 8, "v5e:2x4"), ("v4-32", "v4", 16, "v4:2x2x4"), ("tpu7x-16", "tpu7x", 8, "tpu7x:2x2x2"),
    ("v5p:2x2x3", "v5p", 12, "v5p:2x2x3"),
])
def test_accelerator_types_count_as_cloud_tpu_counts_them(name, generation, chips, topo):
    accel = topology.parse(name)
    assert (accel.generation, accel.chips, accel.topology) == (generation, chips, topo)


@pytest.mark.parametrize("name,words", [("v9-8", "unknown TPU generation"), ("v5p-7", "not a multiple"),
                                        ("v5p-24", "powers of two"), ("tpu", "expected an accelerator type")])
def test_a_bad_accelerator_type_is_named(name, words):
    with pytest.raises(topology.TopologyError, match=words):
        topology.parse(name)


def test_the_compiler_sees_the_slice_as_cloud_tpu_lays_it_out():
    """v5p-64: 32 chips on 8 hosts of 4 (one device a chip, megacore); v4 compiles as megacore too; a TPU7x
    chip is two devices (each of its TensorCores)."""
    v5p = topology.parse("v5p-64")
    assert (len(v5p.devices()), v5p.hosts(), v5p.devices_per_chip()) == (32, 8, 1)
    assert v5p.hbm_per_device() == 95 * topology.GiB
    assert topology.parse("v4-8").devices_per_chip() == 1
    ironwood = topology.parse("tpu7x-8")
    assert (ironwood.chips, len(ironwood.devices()), ironwood.hbm_per_device()) == (4, 8, 96 * topology.GiB)


def test_an_abstract_engine_lays_out_what_a_real_one_allocates():
    """The same Engine on an `nnx.eval_shape` model holds shapes with exactly the shardings a real engine's
    arrays get (params and cache), on an 8-device CPU mesh: one placement code for a run and a plan."""
    cfg = models.get_preset("tiny")
    mesh = make_mesh({"data": 2, "fsdp": 4}, devices=jax.devices()[:8])
    real = Engine(models.Transformer(cfg, rngs=nnx.Rngs(0)), 4, 256, mesh)
    shaped = Engine(cluster.abstract_model(cfg), 4, 256, mesh)
    assert shaped.abstract and not real.abstract
    for a, b in ((real.params, shaped.params), (real.cache, shaped.cache)):
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        assert [(x.shape, x.dtype, x.sharding) for x in la] == [(x.shape, x.dtype, x.sharding) for x in lb]
    assert real.resident_bytes() == shaped.resident_bytes()
    # bytes a device holds: every leaf's shard, as the arrays report their own shards
    first = jax.devices()[0]
    assert real.resident_bytes()["cache"] == sum(s.data.nbytes for x in jax.tree.leaves(real.cache)
                                                 for s in x.addressable_shards if s.device == first)
    with pytest.raises(RuntimeError, match="abstract"):
        shaped.step()


def _main(workdir, *args, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "librarian_jax.main", *args,
           *([f"--config.workdir={workdir}"] if workdir is not None else [])]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_tiny_train_command_plans_every_program_for_a_v5p_8(tmp_path):
    """`--dry_run --compile --config.topology=v5p-8`: every program of the run (each engine's prefill buckets,
    decode and copies; the update per sequence bucket, the optimizer's) compiles for TPU, plan.json names
    them all with their bytes and FLOPs, and the fit and the step projection are there."""
    out = _main(tmp_path, "--config=configs/grpo.py", "--dry_run", "--compile", "--config.topology=v5p-8",
                *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["topology"]["compiler_topology"] == "v5p:2x2x1" and plan["topology"]["chips"] == 4
    programs = {(tuple(p["roles"]), p["name"]): p for p in plan["programs"]}
    assert not [k for k, p in programs.items() if p["error"]], "programs that do not compile for TPU"
    # what the run itself would compile: the cluster's engines' and the trainer's programs, by name
    settings = config_validation.validate(_config(*SMALL))
    built = plan_lib.build(settings, topology.parse("v5p-8"))
    want = {(tuple(plan_lib._role_names(roles)), name) for engine, roles in built.engines
            for name, _ in engine.programs_ahead()}
    trainer, shapes, _ = built.trainers["trainer"]
    want |= {(("trainer",), name) for name, _ in trainer.programs_ahead(shapes)}
    assert set(programs) == want
    # every role runs a model here; the frozen ones on the builder's initial weights share one engine
    assert {k[0] for k in programs} == {("builder",), ("answerer", "executor", "compaction", "judge"),
                                        ("trainer",)}
    # micro-batches of 4 rows a data shard, 4 shards (fsdp=4)
    assert [n for (r, n) in programs if r == ("trainer",)] == [
        "update[16x64, positions all]", "update[16x128, positions all]", "optimizer", "zero accumulator"]
    for p in programs.values():
        assert p["compile_s"] > 0 and (p["argument_bytes"] > 0 or p["name"] == "zero accumulator")
        assert p["roofline_s"] == pytest.approx(max(p["flops"] / 459e12, p["bytes_accessed"] / 2765e9))
    assert plan["fit"]["fits"] and plan["fit"]["headroom_bytes"] > 90 * topology.GiB
    assert plan["step"]["step_s"] > 0
    assert set(plan["step"]["by_role"]) == {"builder", "answerer", "executor", "trainer"}
    assert plan["workload"]["builder_prefill_tokens"] == 178_926  # the paper's figure, stated
    assert "plan for v5p-8" in out.stdout and "fits, headroom" in out.stdout


def test_the_tiny_eval_command_plans_its_engines(tmp_path):
    """The eval command of a run of that config plans its engines (the builder's at eval's sizes, the frozen
    roles'), from the run's recorded config.json alone: no checkpoint, task or weight is read."""
    run = tmp_path / "run"
    run.mkdir()
    settings = config_validation.validate(_config(*SMALL))
    (run / "config.json").write_text(json.dumps(settings.to_dict()))
    out = _main(None, "--config=configs/eval.py", f"--config.run={run}", "--dry_run", "--compile",
                "--config.topology=v5p-8", "--config.engine.policy_slots=4", "--config.plan.programs=largest")
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads((run / "eval" / "default" / "plan.json").read_text())
    assert plan["mode"] == "eval" and "step" not in plan
    names = {(tuple(p["roles"]), p["name"]) for p in plan["programs"]}
    assert not [p for p in plan["programs"] if p["error"]]
    # each engine's largest programs (`plan.programs=largest`), the builder's at eval's own engine size
    assert names == {(("builder",), n) for n in ("prefill_all[4x512, attend all]", "decode[4, attend all]",
                                                 "copy[4]")} | {
        (("answerer", "executor", "compaction", "judge"), n)
        for n in ("prefill_all[2x512, attend all]", "decode[2, attend all]", "copy[2]")}
    assert not any(r == ("trainer",) for r, _ in names)


def test_an_overflowing_setting_is_named_before_anything_compiles(tmp_path):
    """The answerer's slots x 1,000 (16,000, the default 16) at a 32,768-token context do not fit a v5p chip's
    95 GiB: the plan says so,
    naming the answerer's cache and by how much, and with `plan.require_fit` exits 2 with one line, before
    any program compiles."""
    t = time.perf_counter()
    out = _main(tmp_path, "--config=configs/grpo.py", "--dry_run", "--compile", "--config.topology=v5p-8",
                *SMALL, "--config.rollout.frozen_slots=16000", "--config.roles.answerer.max_seq_len=32768",
                "--config.rollout.answerer.context_budget=32768", "--config.plan.require_fit=True")
    took = time.perf_counter() - t
    assert out.returncode == 2, out.stderr[-3000:]
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "does not fit on v5p-8" in line[0]
    assert "answerer" in line[0] and "cache" in line[0]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert not plan["fit"]["fits"] and plan["fit"]["over_bytes"] > 0 and plan["programs"] == []
    assert took < 60, took


def _config(*flags: str):
    """configs/grpo.py (default preset) with `--config.a.b=v` flags applied (as main parses them)."""
    from configs import grpo

    c = grpo.get_config()
    for f in flags:
        key, value = f.removeprefix("--config.").split("=", 1)
        node = c
        *path, last = key.split(".")
        for k in path:
            node = node[k]
        old = node[last]
        node[last] = type(old)(value == "True") if isinstance(old, bool) else type(old)(value)
    return c


def test_the_plans_figures_are_the_compiled_programs_and_the_arrays_own(tmp_path):
    """One program compiled by hand from the abstract engine (its `programs_ahead` job, then `compile()`)
    reports what the plan says; its argument bytes are the resident weights and cache the plan adds up from
    the arrays' shardings (plus the small per-call arguments)."""
    settings = config_validation.validate(_config(*SMALL))
    accel = topology.parse("v5p-8")
    built = plan_lib.build(settings, accel, with_sft=False)
    engine, roles = built.engines[0]
    name = f"prefill_all[{engine.num_slots}x512, attend all]"
    section = PlanSection(roles="builder", programs=name)
    todo = plan_lib.jobs(built, section)
    assert [n for _, n, _ in todo] == [name]
    (program,) = plan_lib.compile_all(todo, accel, threads=1, cache=False)
    compiled = todo[0][2]().compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    assert program.temp_bytes == mem.temp_size_in_bytes
    assert program.argument_bytes == mem.argument_size_in_bytes
    assert program.flops == cost["flops"]
    # a prefill computes no logits, so XLA drops the weights it never reads (the last layer's MLP) from its
    # arguments; the decode round reads every one: its arguments are the resident weights and cache plus the
    # round's per-slot scalars, and the TPU's tiled layout pads small arrays (norm scales, `lengths`) a little
    held = engine.resident_bytes()
    assert program.argument_bytes <= 1.05 * (held["weights"] + held["cache"])
    decode = plan_lib.jobs(built, PlanSection(roles="builder",
                                              programs=f"decode[{engine.num_slots}, attend all]"))
    args = decode[0][2]().compile().memory_analysis().argument_size_in_bytes
    assert held["weights"] + held["cache"] <= args <= 1.05 * (held["weights"] + held["cache"])


def test_a_plan_without_the_tpu_compiler_says_how_to_install_it(monkeypatch):
    assert "pip install -e '.[tpu]'" in topology.compiler_hint(installed=False)
    assert topology.compiler_hint(installed=True) == ""
    topology._devices.cache_clear()
    monkeypatch.setattr("jax.experimental.topologies.get_topology_desc",
                        lambda **kw: (_ for _ in ()).throw(RuntimeError("no plugin")))
    try:
        hint = re.escape(topology.compiler_hint(topology.has_libtpu()))
        with pytest.raises(topology.TopologyError, match=rf"could not describe it{hint}: no plugin"):
            topology.parse("v5p-8").devices()
    finally:
        topology._devices.cache_clear()


def test_partitioning_places_shapes_as_it_places_arrays():
    mesh = make_mesh({"fsdp": 8}, devices=jax.devices()[:8])
    x = np.zeros((16, 8), np.float32)
    sharding = partitioning.named_sharding(("embed", None), mesh, x.shape)
    real = partitioning.place({"a": x}, {"a": sharding})["a"]
    shaped = partitioning.place({"a": jax.ShapeDtypeStruct(x.shape, x.dtype)}, {"a": sharding})["a"]
    assert shaped.sharding == real.sharding and shaped.shape == real.shape
    assert partitioning.bytes_per_device({"a": shaped}) == 2 * 8 * 4 == real.addressable_shards[0].data.nbytes


def test_plan_keys_are_validated():
    with pytest.raises(ConfigError, match="config.topology"):
        config_validation.validate(_config("--config.topology=v9-8"))
    settings = config_validation.validate(_config(*SMALL))
    built = plan_lib.build(settings, topology.parse("v5p-8"), with_sft=False)
    with pytest.raises(ConfigError, match="config.plan.roles: unknown role 'builderz'"):
        plan_lib.jobs(built, PlanSection(roles="builderz"))


def test_copying_split_slots_compiles_without_gathering_the_cache():
    """An engine whose slots split over the host's 4 chips copies slots (prefix sharing) without gathering
    every slot on every chip: the TPU program's temporaries stay below the cache a chip holds (a gather on
    the split axis needed several times it: 50 GiB for the paper builder's 64-slot copy of 8.8 GiB a chip on
    a v5p)."""
    accel = topology.parse("v5p-8")
    mesh = make_mesh({"fsdp": 4}, devices=accel.devices())
    engine = Engine(cluster.abstract_model(models.get_preset("tiny")), 8, 1024, mesh)
    cache = engine.resident_bytes()["cache"]
    assert engine.cache.layers[0]["keys"].sharding.spec[0] == "fsdp"  # the TPU engine's "keys" layout
    (job,) = [fn for name, fn in engine.programs_ahead() if name == "copy[8]"]
    stats = job().compile().memory_analysis()
    # one-hot chunks: 0.68x the cache here; the gather it replaced: 4.2x (6.0x at 64 slots)
    assert stats.temp_size_in_bytes < cache, (stats.temp_size_in_bytes, cache)


def test_a_model_path_gives_its_config_json_shapes(tmp_path):
    """`model.path` with a Hugging Face `config.json` (and no weights beside it): the plan's engines and
    trainer take that architecture, here the tiny preset with 3 layers and a 4,096-token vocabulary."""
    cfg = models.get_preset("tiny").replace(num_layers=3, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(models.config_to_hf(cfg)))
    settings = config_validation.validate(_config(*SMALL, "--config.topology=v5p-8", "--config.model.init=hf",
                                                  f"--config.model.path={tmp_path}"))
    built = plan_lib.build(settings, topology.parse("v5p-8"), with_sft=False)
    for engine, _ in built.engines:
        assert (engine.config.num_layers, engine.config.vocab_size) == (3, 4096)
    trainer = built.trainers["trainer"][0]
    assert len(trainer.model().layers) == 3


def test_a_scanned_abstract_engine_lays_out_its_stack():
    """With `scan_layers` the abstract engine stacks the repeating layers' shapes as a real one stacks their
    arrays (same shapes, dtypes and shardings), so a scanned run plans too."""
    cfg = models.get_preset("tiny")
    mesh = make_mesh({"data": 2, "fsdp": 4}, devices=jax.devices()[:8])
    real = Engine(models.Transformer(cfg, rngs=nnx.Rngs(0)), 4, 256, mesh, scan_layers=True)
    shaped = Engine(cluster.abstract_model(cfg), 4, 256, mesh, scan_layers=True)
    assert shaped.scan_layers and real.scan_layers
    la, lb = jax.tree.leaves(real._stacked), jax.tree.leaves(shaped._stacked)
    assert [(x.shape, x.dtype, x.sharding) for x in la] == [(x.shape, x.dtype, x.sharding) for x in lb]
    assert real.resident_bytes() == shaped.resident_bytes()


@pytest.mark.parametrize("layout,most", [("keys", 0.2), ("heads", None)])
def test_the_tpu_decode_round_keeps_the_keys_layout_cache_in_place(layout, most):
    """The engine's decode round compiled for a v5p-8 (one attention layer of 4 K/V heads x 256, 16 slots x
    2,048 positions): in the "keys" layout an engine on TPU devices keeps by default, the compiler updates the
    cache in place (temporaries under a fifth of it: the logits and the MLP); in the CPU's "heads" layout
    it copies the layer's K/V into its own layout around the loop (`bench.cache_layout`)."""
    cfg = models.get_preset("qwen3_4b", num_layers=1, layer_types=("full_attention",), vocab_size=512,
                            hidden_size=256, intermediate_size=256, num_heads=8, num_kv_heads=4, head_dim=256)
    mesh = cluster.mesh_over(MeshSection({"data": 1, "fsdp": -1, "tensor": 1}),
                             list(topology.parse("v5p-8").devices()), "mesh")
    engine = Engine(cluster.abstract_model(cfg), 16, 2048, mesh, cache_layout="auto" if most else layout,
                    round_steps=8, prefill_buckets=(64,), share_prefix=0)
    assert engine.cache_layout == layout
    jobs = dict(engine.programs_ahead())
    (lower,) = [job for name, job in jobs.items() if name.startswith("decode[16") and "all" in name]
    temp = lower().compile().memory_analysis().temp_size_in_bytes
    cache = engine.resident_bytes()["cache"]
    if most:
        assert temp < most * cache, (temp, cache)
    else:
        assert temp > 0.5 * cache, (temp, cache)
