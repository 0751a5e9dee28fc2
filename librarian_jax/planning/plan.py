"""The plan of a run for a TPU slice, made on any host: every program compiled for the slice's topology from
shapes, with its memory, FLOPs and roofline time, what each chip holds at once against its HBM, and the
projected time of one GRPO step.

    python -m librarian_jax.main --config=configs/grpo.py:qwen3_5_4b --dry_run --compile \\
        --config.topology=v5p-64

`make(settings, mode)` builds the run's cluster abstractly (`Cluster.from_run(..., abstract=True)`: every
engine an `Engine` on an `nnx.eval_shape` model, placed by the same `models.partitioning` rules a real run
uses) on the topology's devices (`planning.topology`): the trainer's mesh over every chip, the engines' mesh
over the first host's (engines are process-local: each host holds its own, `cluster.engine_mesh`), and the
trainer (`rl.Trainer` on the abstract policy, LoRA-wrapped as the run wraps it) and, with a warm start, the
SFT step. It compiles each engine's `programs_ahead` (prefill buckets, decode, slot copy), the update per
sequence bucket with the optimizer's programs (`Trainer.programs_ahead`), on worker threads, into the
persistent compilation cache, and reads XLA's `memory_analysis()` / `cost_analysis()` of each.

What lives on a device at once (`resident`): each engine's weights (one copy per distinct weights and mesh:
roles on the builder's initial weights share the policy engine's) and slot cache, the trainer's trainable,
frozen (shared with the policy engine when both are on one mesh: one host) and optimizer state, plus the
largest temporaries of any one program (programs run one at a time on a device). Against the chip's HBM
this gives the headroom, or names what does not fit and by how much.

The step projection (`project`) is a roofline: each program's time is the larger of its FLOPs over the
chip's peak and its bytes accessed over the HBM bandwidth (`topology.CHIPS`), and a step's time is the
decode rounds, prefill chunks and update micro-batches a stated `Workload` needs on one host (each host runs
its share of the episodes), summed: no overlap between roles, no communication beyond what XLA's cost
analysis counts. A lower bound of the device time, to say what to rent, not a benchmark.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import hashlib
import importlib.metadata
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from absl import logging

from librarian_jax import cluster, compile_cache, distributed, storage, training
from librarian_jax.agents.runtime import ANSWERER, COMPACTION, EXECUTOR, FROZEN, JUDGE, POLICY
from librarian_jax.config_schema import ConfigError, PlanSection, PlanWorkloadSection, RunConfig
from librarian_jax.engine import make_mesh
from librarian_jax.planning import topology as topology_lib
from librarian_jax.rl import rows as rows_lib
from librarian_jax.rl import train_step
from librarian_jax.warm_start import sft as warm_start_sft

PLAN_FILE = "plan.json"
TRAINER, SFT = "trainer", "sft"
ROLE_NAMES = {POLICY: cluster.BUILDER, ANSWERER: ANSWERER, EXECUTOR: EXECUTOR, COMPACTION: COMPACTION,
              JUDGE: JUDGE}
PLAN_ROLES = (cluster.BUILDER, ANSWERER, EXECUTOR, COMPACTION, JUDGE, TRAINER, SFT)
GiB = topology_lib.GiB


@dataclasses.dataclass
class Program:
    """One compiled program of the plan: per-device bytes and work as XLA reports them."""

    roles: list[str]
    name: str
    compile_s: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    roofline_s: float = 0.0
    lower_s: float = 0.0
    cached: bool = False  # the analysis came from the plan cache (`compile_s`: the first compile's)
    error: str = ""

    @property
    def peak_bytes(self) -> int:
        """What the program needs on a device while it runs: arguments + outputs - donated + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def row(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak_bytes": self.peak_bytes}


@dataclasses.dataclass
class Built:
    """The abstract run of a plan: its engines (each with its roles), trainers and meshes."""

    accel: topology_lib.Accelerator
    mesh: Any  # the trainer's: every device of the slice
    engine_mesh: Any  # the first host's devices: each host holds its own engines
    the_cluster: cluster.Cluster | None
    engines: list[tuple[Any, list[str]]]
    trainers: dict[str, tuple[Any, list[tuple[int, int]], int]]  # name -> (Trainer, update shapes, rows)
    rollout: Any


# ------------------------------------------------------------------------------------------- abstract run


def host_mesh(mesh: Any, process: int = 0) -> Any:
    """The engines' mesh of host `process` of a topology mesh: the mesh's axis names over that host's
    devices, shaped as `distributed.local_mesh_shape` shapes a process's share (the layout
    `cluster.engine_mesh` gives each process of a real run)."""
    hosts = sorted({d.process_index for d in mesh.devices.flat})
    if len(hosts) == 1:
        return mesh
    share = distributed.local_mesh_shape(dict(mesh.shape), len(hosts))
    devices = sorted((d for d in mesh.devices.flat if d.process_index == hosts[process]), key=lambda d: d.id)
    return make_mesh(share, devices=devices)


def _sequence_buckets(trainer: Any, max_row_len: int) -> list[tuple[int, int]]:
    """The update's `(seq, loss-position capacity)` shapes a run reaches: each sequence bucket up to
    `max_row_len` (`rl.rows` pads rows to them) at its largest capacity."""
    return list(dict.fromkeys(trainer.update_shape(seq, seq) for seq in rows_lib.seq_buckets(max_row_len)))


def _lora(settings: RunConfig) -> tuple[int, float, str] | None:
    m = settings.model
    return (m.lora_rank, m.lora_alpha, m.lora_module_path) if m.lora_rank else None


def _abstract_cluster(settings: RunConfig, accel: topology_lib.Accelerator, what: str, mode: str = "train",
                      overrides: cluster.Overrides | None = None) -> tuple[Any, Any, cluster.Cluster, Any]:
    """(the trainer's mesh over every chip, the first host's engine mesh, the cluster built from shapes, the
    abstract policy: LoRA-wrapped as the run wraps it) of `settings` on `accel`, for `mode` with an
    evaluation's `overrides` (`cluster.Cluster.from_run`)."""
    mesh = cluster.mesh_over(settings.mesh, accel.devices(), what)
    emesh = host_mesh(mesh)
    base = cluster.initial_model(settings, emesh, None, abstract=True)
    m, lora = settings.model, _lora(settings)
    policy = cluster.abstract_model(cluster.model_config(m.init, m.preset, m.path, m.dtype), lora) \
        if lora else base
    the_cluster = cluster.Cluster.from_run(settings, mode, overrides, tokenizer=None, engine_mesh=emesh,
                                           base=base, policy=policy, abstract=True)
    return mesh, emesh, the_cluster, policy


def build(settings: RunConfig, accel: topology_lib.Accelerator, *, with_sft: bool = True) -> Built:
    """The run of `settings` (GRPO's, or SFT's: its step alone) on `accel`, every array a shape (module
    doc)."""
    m = settings.model
    arch = cluster.model_config(m.init, m.preset, m.path, m.dtype)
    trainers: dict[str, tuple[Any, list[tuple[int, int]], int]] = {}
    if settings.COMMAND != "train":  # configs/sft.py
        mesh = cluster.mesh_over(settings.mesh, accel.devices(), "planning.plan.build")
        trainers[SFT] = _sft_trainer(settings, mesh, arch, _lora(settings))
        return Built(accel, mesh, host_mesh(mesh), None, [], trainers, None)
    mesh, emesh, the_cluster, policy = _abstract_cluster(settings, accel, "planning.plan.build")
    rollout = the_cluster.rollout
    trainer = train_step.Trainer(policy, training.train_config(settings), mesh=mesh)
    trainers[TRAINER] = (trainer, _sequence_buckets(trainer, settings.train.max_row_len), 0)
    if with_sft and settings.warm_start.enabled:
        trainers[SFT] = _sft_trainer(warm_start_sft.warm_start_config(settings), mesh, arch, _lora(settings))
    return Built(accel, mesh, emesh, the_cluster, the_cluster.engines_in_use(rollout), trainers, rollout)


def _sft_trainer(sft_settings: Any, mesh: Any, arch: Any,
                 lora: Any) -> tuple[Any, list[tuple[int, int]], int]:
    t = sft_settings.train
    trainer = train_step.Trainer(cluster.abstract_model(arch, lora), t.trainer_config(), mesh=mesh)
    multiple = trainer.row_multiple()
    rows = -(-t.batch_rows // multiple) * multiple
    return trainer, [trainer.update_shape(t.max_row_len, t.max_row_len)], rows


def build_eval(run_cfg: RunConfig, overrides: cluster.Overrides, accel: topology_lib.Accelerator,
               mode: str = "eval") -> Built:
    """The engines of an evaluation or a build (`mode`: the run's protocol with the evaluation's
    `overrides`) on the first host of `accel` (evaluation's engines are process-local; no trainer)."""
    mesh, emesh, the_cluster, _ = _abstract_cluster(run_cfg, accel, "planning.plan.build_eval", mode,
                                                    overrides)
    rollout = the_cluster.rollout
    return Built(accel, mesh, emesh, the_cluster, the_cluster.engines_in_use(rollout), {}, rollout)


# ------------------------------------------------------------------------------------------- which programs

_LARGEST = re.compile(r"(prefill_all\[\d+x(?P<chunk>\d+), attend all\]|decode\[\d+, attend all\]|"
                      r"copy\[(?P<slots>\d+)\]|update\[.*|optimizer|zero accumulator)$")


def _role_names(roles: list[str]) -> list[str]:
    return [ROLE_NAMES.get(r, r) for r in roles if r != FROZEN]


def jobs(built: Built, section: PlanSection) -> list[tuple[list[str], str, Callable[[], Any]]]:
    """(roles, program, compile) of every program of `built` that `section.roles` / `section.programs`
    keep: all by default; `programs="largest"`: each engine's largest prefill (every slot, the longest
    chunk, full attention), its decode at full attention and its copy of every slot, and each trainer's
    longest sequence bucket and optimizer (what sets the peak); else comma-separated patterns (`fnmatch`,
    `*` added on both sides) of program names."""
    wanted = [r.strip() for r in section.roles.split(",") if r.strip()]
    for r in wanted:
        if r not in PLAN_ROLES:
            raise ConfigError(f"config.plan.roles: unknown role {r!r}; known: {list(PLAN_ROLES)}")
    out: list[tuple[list[str], str, Callable[[], Any]]] = []
    for engine, roles in built.engines:
        names = _role_names(roles)
        if wanted and not set(names) & set(wanted):
            continue
        programs = engine.programs_ahead()
        longest = max(engine.prefill_buckets)
        for name, fn in programs:
            if _keep(name, section.programs, longest=longest, slots=engine.num_slots):
                out.append((names, name, fn))
    for tname, (trainer, shapes, rows) in built.trainers.items():
        if wanted and tname not in wanted:
            continue
        if section.programs == "largest":
            shapes = shapes[-1:]
        programs = trainer.programs_ahead(shapes, rows=rows)
        for name, fn in programs:
            if section.programs == "largest" or _keep(name, section.programs, longest=0, slots=0):
                out.append(([tname], name, fn))
    return out


def _keep(name: str, programs: str, *, longest: int, slots: int) -> bool:
    if not programs:
        return True
    if programs == "largest":
        m = _LARGEST.match(name)
        if not m:
            return False
        if m.group("chunk") is not None:
            return int(m.group("chunk")) == longest
        return m.group("slots") is None or int(m.group("slots")) == slots
    # commas inside a name's brackets (`decode[64, attend all]`) do not separate patterns
    pats = [p.strip() for p in re.split(r",(?![^\[]*\])", programs) if p.strip()]
    return any(p in name or (("*" in p or "?" in p) and fnmatch.fnmatchcase(name, p)) for p in pats)


# ------------------------------------------------------------------------------------------- compiling


def _analyse(compiled: Any, program: Program, accel: topology_lib.Accelerator) -> None:
    mem = compiled.memory_analysis()
    if mem is not None:
        program.argument_bytes = int(mem.argument_size_in_bytes)
        program.output_bytes = int(mem.output_size_in_bytes)
        program.alias_bytes = int(mem.alias_size_in_bytes)
        program.temp_bytes = int(mem.temp_size_in_bytes)
        program.code_bytes = int(mem.generated_code_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    cost = cost or {}
    program.flops = float(cost.get("flops", 0.0))
    program.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    per_device = accel.devices_per_chip()
    program.roofline_s = max(program.flops / (accel.chip.peak_flops / per_device),
                             program.bytes_accessed / (accel.chip.hbm_bandwidth / per_device))


_ANALYSIS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "flops",
             "bytes_accessed", "roofline_s", "compile_s")


def cache_dir() -> str:
    """Where compiled programs' analyses are kept: `plans/` beside the persistent compilation cache (the
    TPU compiler's executables of a compile-only client are not written there; a plan keeps what it reads
    of them), keyed by the lowered program, the chip generation and the compiler's versions."""
    base = jax.config.jax_compilation_cache_dir or compile_cache.default_dir()
    return os.path.join(base, "plans")


def _key(lowered: Any, accel: topology_lib.Accelerator) -> str:
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = ""
    # the chip generation, not the slice: a program over the same devices compiles alike in any slice of
    # that generation (each host's engines are the same 4-chip programs in a v5p-8 and a v5p-128)
    h = hashlib.sha256()
    for part in (lowered.as_text(), accel.generation, accel.chip.config, jax.__version__, libtpu,
                 os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
                 os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "")):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_all(todo: list[tuple[list[str], str, Callable[[], Any]]], accel: topology_lib.Accelerator,
                threads: int = 0, *, cache: bool = True) -> list[Program]:
    """Lowers and compiles every job on `threads` worker threads (0: the host's cores), in job order; a
    program whose analysis is in the plan cache (`cache_dir`) is lowered only. A program that fails to
    lower or compile is kept with its error (the plan names it), the others go on."""
    from tqdm import tqdm

    threads = max(1, threads or os.cpu_count() or 1)
    bar = tqdm(total=len(todo), desc=f"compiling for {accel.name}", unit="program", disable=None)
    where = cache_dir()

    def one(job: tuple[list[str], str, Callable[[], Any]]) -> Program:
        roles, name, fn = job
        p = Program(roles, name)
        t = time.perf_counter()
        try:
            lowered = fn()
            p.lower_s = time.perf_counter() - t
            path = os.path.join(where, _key(lowered, accel) + ".json") if cache else ""
            if path and os.path.isfile(path):
                with open(path) as f:
                    for k, v in json.load(f).items():
                        setattr(p, k, v)
                p.cached = True
            else:
                t = time.perf_counter()
                compiled = lowered.compile()
                p.compile_s = time.perf_counter() - t
                _analyse(compiled, p, accel)
                if path:
                    os.makedirs(where, exist_ok=True)
                    storage.write_text(path, json.dumps({k: getattr(p, k) for k in _ANALYSIS}))
        except Exception as e:  # noqa: BLE001 - a program that does not lower for TPU: named in the plan
            p.compile_s = time.perf_counter() - t
            p.error = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
            logging.warning("plan: %s %s did not compile for %s: %s", "+".join(roles), name, accel.name,
                            p.error)
        bar.update(1)
        return p

    try:
        if threads == 1:
            return [one(j) for j in todo]
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="plan") as pool:
            return list(pool.map(one, todo))
    finally:
        bar.close()


# ------------------------------------------------------------------------------------------- what fits


def resident(built: Built) -> list[dict[str, Any]]:
    """What a device holds between programs, one entry per part (role, what, bytes per device): each
    engine's weights (once per distinct weights and mesh) and cache, each trainer's state (the frozen base
    shared with the policy engine's weights when the trainer's mesh is the engines' own)."""
    out: list[dict[str, Any]] = []
    seen: dict[tuple[int, int], str] = {}
    one_mesh = built.mesh.devices.size == built.engine_mesh.devices.size
    for engine, roles in built.engines:
        names = _role_names(roles)
        b = engine.resident_bytes()
        key = (id(_weights_source(built, engine)), id(engine.mesh))
        if key in seen:
            out.append({"roles": names, "what": f"weights (shared with {seen[key]})", "bytes": 0})
        else:
            seen[key] = "+".join(names)
            out.append({"roles": names, "what": "weights", "bytes": b["weights"]})
        out.append({"roles": names, "what": "cache", "bytes": b["cache"]})
    for tname, (trainer, _, _) in built.trainers.items():
        b = trainer.resident_bytes()
        shared = tname == TRAINER and one_mesh and built.engines
        for what in ("trainable", "frozen", "optimizer", "reference"):
            n = b[what]
            if what == "frozen" and shared:
                out.append({"roles": [tname], "what": "frozen (the builder engine's weights)", "bytes": 0})
                continue
            if n:
                out.append({"roles": [tname], "what": what, "bytes": n})
    return out


def _weights_source(built: Built, engine: Any) -> Any:
    """The object whose weights `engine` serves: roles at init "policy" and the policy's own engine serve the
    builder's initial weights (one copy: the LoRA policy's base is those arrays)."""
    c = built.the_cluster
    if c is not None and engine is not c.engines.get(POLICY):
        for role, d in c.specs.items():
            if role.frozen and c.engines.get(role) is engine and d.init == "policy":
                return c.engines[POLICY]
    return engine


def fit(built: Built, programs: list[Program], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device: the resident bytes, the largest program's temporaries, their sum against HBM, and (when
    it does not fit) the largest parts, by how much, and what would fix them."""
    hbm = built.accel.hbm_per_device()
    held = sum(p["bytes"] for p in parts)
    ok = [p for p in programs if not p.error]
    worst = max(ok, key=lambda p: p.temp_bytes, default=None)
    temp = worst.temp_bytes if worst else 0
    peak = held + temp
    out = {"hbm_bytes_per_device": hbm, "resident_bytes": held, "largest_temp_bytes": temp,
           "largest_temp_program": f"{'+'.join(worst.roles)} {worst.name}" if worst else "",
           "peak_bytes": peak, "headroom_bytes": hbm - peak, "fits": peak <= hbm, "advice": []}
    if peak > hbm:
        over = peak - hbm
        biggest = sorted(parts, key=lambda p: -p["bytes"])[:3]
        for p in biggest:
            out["advice"].append(f"{'+'.join(p['roles'])} {p['what']}: {p['bytes'] / GiB:.2f} GiB a device"
                                 + _fix(p))
        if worst and temp > over / 2:
            out["advice"].append(f"{'+'.join(worst.roles)} {worst.name}: {temp / GiB:.2f} GiB of temporaries"
                                 + (" (train.remat='full' or 'layer', a smaller train.logits_chunk or "
                                    "train.micro_batch_rows)" if worst.roles[0] in (TRAINER, SFT) else
                                    " (a smaller prefill chunk, fewer slots)"))
        out["over_bytes"] = over
    return out


def _fix(part: Mapping[str, Any]) -> str:
    if part["what"] == "cache":
        return (" (fewer roles.<role>.slots or a shorter max_seq_len; or shard the cache over more devices: "
                "mesh fsdp / data)")
    if part["what"] == "weights":
        return " (more devices per host's engines, or roles.<role>.mesh over more of them; bfloat16 weights)"
    return " (a larger slice: the trainer's state is sharded over every chip)"


# ------------------------------------------------------------------------------------------- the step


def workload_of(settings: RunConfig, section: PlanWorkloadSection) -> dict[str, Any]:
    """The stated workload of one GRPO step (every field of `plan.workload`; 0 = the run's own setting)."""
    r, b = settings.rollout, settings.rollout.config.builder
    w = dataclasses.asdict(section)
    tasks = w["tasks_per_step"] or getattr(settings.data, "tasks_per_batch", 1)
    group = w["group_size"] or r.group_size
    return {**w, "tasks_per_step": tasks, "group_size": group, "builder_turns": w["builder_turns"] or
            b.max_turns, "probes_per_episode": w["probes_per_episode"] if w["probes_per_episode"] >= 0 else
            r.config.max_probes, "answer_repeats": w["answer_repeats"] or r.config.probe_repeats}


def project(built: Built, programs: list[Program], work: Mapping[str, Any]) -> dict[str, Any]:
    """One GRPO step's device time on one host (module doc), by role, from the programs' roofline times and
    `work` (`workload_of`). Roles whose programs were not compiled are left out, and said."""
    hosts = built.accel.hosts()
    episodes = work["tasks_per_step"] * work["group_size"]
    per_host = math.ceil(episodes / hosts)
    answers = per_host * (work["probes_per_episode"] + 1) * work["answer_repeats"]
    by_role: dict[str, dict[str, float]] = {}
    missing: list[str] = []
    # role -> (sessions on this host, decoded tokens each, prefilled tokens each)
    demand = {
        cluster.BUILDER: (per_host, work["builder_turns"] * work["builder_new_tokens_per_turn"],
                          work["builder_prefill_tokens"]),
        ANSWERER: (answers, work["answerer_new_tokens"], work["answerer_read_tokens"]),
        EXECUTOR: (per_host * work["executor_calls_per_episode"], work["executor_new_tokens"],
                   work["executor_prompt_tokens"]),
    }
    for engine, roles in built.engines:
        names = _role_names(roles)
        for role in names:
            if role not in demand:
                continue
            sessions, new, prefill = demand[role]
            decode = _program(programs, names, f"decode[{engine.num_slots}, attend all]")
            chunk = max(engine.prefill_buckets)
            pre = _program(programs, names, f"prefill_all[{engine.num_slots}x{chunk}, attend all]")
            if decode is None or pre is None:
                missing.append(role)
                continue
            rounds = math.ceil(sessions / engine.num_slots) * math.ceil(new / engine.round_steps)
            chunks = math.ceil(sessions / engine.num_slots) * math.ceil(prefill / chunk)
            # XLA's cost analysis counts a loop's body once: a decode round is `round_steps` such steps
            by_role[role] = {"decode_s": rounds * engine.round_steps * decode.roofline_s,
                             "prefill_s": chunks * pre.roofline_s,
                             "decode_rounds": rounds, "prefill_chunks": chunks}
    if TRAINER in built.trainers:
        trainer, shapes, _ = built.trainers[TRAINER]
        update = next((p for p in programs if p.roles == [TRAINER] and p.name.startswith("update[")
                       and f"x{shapes[-1][0]}," in p.name), None)
        opt = next((p for p in programs if p.roles == [TRAINER] and p.name == "optimizer"), None)
        if update is None or opt is None:
            missing.append(TRAINER)
        else:
            rows = episodes * work["rows_per_episode"]
            micro = math.ceil(rows / trainer.row_multiple())
            by_role[TRAINER] = {"update_s": micro * update.roofline_s + opt.roofline_s,
                                "micro_batches": micro}
    total = sum(sum(v for k, v in d.items() if k.endswith("_s")) for d in by_role.values())
    return {"hosts": hosts, "episodes": episodes, "episodes_per_host": per_host, "answers_per_host": answers,
            "by_role": by_role, "step_s": total, "not_projected": sorted(set(missing)),
            "note": "roofline lower bound: programs' FLOPs / peak or bytes / HBM bandwidth, summed; "
                    "decode rounds of `round_steps` tokens at full slots, the longest prefill chunk, the "
                    "longest update bucket"}


def _program(programs: list[Program], roles: list[str], name: str) -> Program | None:
    return next((p for p in programs if p.roles == roles and p.name == name and not p.error), None)


# ------------------------------------------------------------------------------------------- the plan


def make(settings: RunConfig, section: PlanSection, accel: topology_lib.Accelerator, *,
         overrides: cluster.Overrides | None = None, mode: str = "train") -> dict[str, Any]:
    """The plan (module doc) as data: the slice, every program, what is resident, the fit and (train) the
    step. `overrides`: an evaluation's or a build's (`mode`) protocol overrides."""
    t0 = time.perf_counter()
    built = build(settings, accel) if mode == "train" else \
        build_eval(settings, overrides or cluster.Overrides(), accel, mode)
    parts = resident(built)
    build_s = time.perf_counter() - t0
    before = fit(built, [], parts)  # resident state alone: a slice it cannot hold is said before compiling
    todo = jobs(built, section)
    t1 = time.perf_counter()
    if not before["fits"]:
        logging.warning("plan: %s does not fit on %s with no program running (nothing compiled): %s", mode,
                        accel.name, "; ".join(before["advice"]))
        programs: list[Program] = []
    else:
        logging.info("plan: compiling %d programs for %s on %d threads", len(todo), accel.name,
                     section.threads or os.cpu_count() or 1)
        programs = compile_all(todo, accel, section.threads)
    out = {"mode": mode, "topology": {"name": accel.name, "generation": accel.generation,
                                      "chips": accel.chips, "compiler_topology": accel.topology,
                                      "hosts": accel.hosts(), "devices": len(accel.devices()),
                                      "devices_per_chip": accel.devices_per_chip(),
                                      "chip": dataclasses.asdict(accel.chip)},
           "meshes": {"trainer": dict(built.mesh.shape), "engines": dict(built.engine_mesh.shape)},
           "selection": {"roles": section.roles, "programs": section.programs},
           "programs": [p.row() for p in programs], "resident": parts,
           "fit": fit(built, programs, parts),
           "compile": {"programs": len(programs), "failed": sum(bool(p.error) for p in programs),
                       "wall_s": time.perf_counter() - t1, "build_s": build_s,
                       "sum_s": sum(p.compile_s for p in programs), "threads": section.threads or
                       os.cpu_count() or 1, "host": host_description()}}
    if mode == "train" and built.the_cluster is not None:
        work = workload_of(settings, section.workload)
        out["workload"] = work
        out["step"] = project(built, programs, work)
    return out


def host_description() -> str:
    """The CPU this plan compiled on (model, cores, load): compile seconds are this host's."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{model}, {os.cpu_count()} cores, load {load:.2f}"


def write(workdir: str, plan: Mapping[str, Any]) -> str:
    path = storage.join(workdir, PLAN_FILE)
    storage.makedirs(workdir)
    storage.write_text(path, json.dumps(plan, indent=1, sort_keys=True))
    return path


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(plan: Mapping[str, Any]) -> str:
    """The plan as text: the slice, one row per program, what a device holds, the fit and the step."""
    t = plan["topology"]
    lines = [f"plan for {t['name']} ({t['chips']} {t['generation']} chips, {t['compiler_topology']}, "
             f"{t['hosts']} hosts, {t['devices_per_chip']} device(s) a chip; trainer mesh "
             f"{plan['meshes']['trainer']}, engines' mesh {plan['meshes']['engines']} on each host)", ""]
    rows = [("roles", "program", "args GiB", "temp GiB", "out GiB", "TFLOP", "GB accessed", "roofline ms",
             "compile s")]
    for p in plan["programs"]:
        if p["error"]:
            rows.append(("+".join(p["roles"]), p["name"], "FAILED", p["error"][:60], "", "", "", "",
                         f"{p['compile_s']:.1f}"))
            continue
        rows.append(("+".join(p["roles"]), p["name"], _gib(p["argument_bytes"]), _gib(p["temp_bytes"]),
                     _gib(p["output_bytes"]), f"{p['flops'] / 1e12:.3f}", f"{p['bytes_accessed'] / 1e9:.2f}",
                     f"{p['roofline_s'] * 1e3:.2f}", f"{p['compile_s']:.1f}"))
    lines.append(_text_table(rows))
    lines.append("")
    lines.append("per device, between programs:")
    lines.append(_text_table([("roles", "what", "GiB")] + [("+".join(p["roles"]), p["what"], _gib(p["bytes"]))
                                                            for p in plan["resident"]]))
    f = plan["fit"]
    lines.append(f"peak per device: {_gib(f['resident_bytes'])} resident + {_gib(f['largest_temp_bytes'])} "
                 f"temporaries ({f['largest_temp_program'] or 'no program compiled'}) = "
                 f"{_gib(f['peak_bytes'])} GiB of {_gib(f['hbm_bytes_per_device'])}: "
                 + ("fits, headroom " + _gib(f["headroom_bytes"]) + " GiB" if f["fits"] else
                    f"DOES NOT FIT, over by {_gib(f['over_bytes'])} GiB"))
    for a in f["advice"]:
        lines.append(f"  - {a}")
    if "step" in plan:
        s, w = plan["step"], plan["workload"]
        lines.append(f"projected GRPO step (device time on one host, roofline): {s['step_s']:.1f} s for "
                     f"{s['episodes']} episodes ({s['episodes_per_host']} a host, {s['answers_per_host']} "
                     f"answers a host)" + (f"; not projected: {s['not_projected']}" if s["not_projected"]
                                           else ""))
        for role, d in s["by_role"].items():
            lines.append("  " + role + ": " + ", ".join(f"{k} {v:.2f}" if k.endswith("_s") else f"{k} {v}"
                                                        for k, v in d.items()))
        lines.append("  workload: " + ", ".join(f"{k}={v}" for k, v in w.items()))
    c = plan["compile"]
    lines.append(f"compiled {c['programs']} programs ({c['failed']} failed) in {c['wall_s']:.1f} s wall "
                 f"({c['sum_s']:.1f} s summed, {c['threads']} threads) on {c['host']}")
    return "\n".join(lines)


def _text_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def check_fits(plan: Mapping[str, Any]) -> None:
    """Raises ConfigError when the plan does not fit or a program failed to compile (a plan asked for with
    `plan.require_fit`)."""
    f = plan["fit"]
    failed = [f"{'+'.join(p['roles'])} {p['name']}" for p in plan["programs"] if p["error"]]
    if failed:
        raise ConfigError(f"config.topology: {len(failed)} program(s) did not compile for "
                          f"{plan['topology']['name']}: {failed[:4]}")
    if not f["fits"]:
        raise ConfigError(f"config.topology: the run does not fit on {plan['topology']['name']}: peak "
                          f"{_gib(f['peak_bytes'])} GiB a device of {_gib(f['hbm_bytes_per_device'])} "
                          f"(over by {_gib(f['over_bytes'])}): " + "; ".join(f["advice"][:2]))


def run(settings: Any, run_cfg: RunConfig, out_dir: str, *, mode: str,
        overrides: cluster.Overrides | None = None) -> dict[str, Any]:
    """`--dry_run --compile --config.topology=ACCEL` of a command: the plan of `run_cfg` (the run's config;
    an evaluation's with its `overrides`) for `settings.topology` with `settings.plan`'s
    selection, printed as a table and written to `out_dir/plan.json`. With `plan.require_fit` a plan that
    does not fit (or a program that does not compile) raises ConfigError after it is written."""
    try:
        accel = topology_lib.parse(settings.topology)
        accel.devices()
    except topology_lib.TopologyError as e:
        raise ConfigError(f"config.topology: {e}") from None
    logging.info("plan: %s", accel.describe())
    plan = make(run_cfg, settings.plan, accel, overrides=overrides, mode=mode)
    path = write(out_dir, plan)
    print(table(plan))  # noqa: T201 - the CLI's answer
    print(f"plan: {path}")  # noqa: T201
    if settings.plan.require_fit:
        check_fits(plan)
    return plan
