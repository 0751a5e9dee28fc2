"""The training command: multi-turn GRPO of the librarian builder.

    python -m librarian_jax.main --config=configs/grpo.py [--config.train.num_steps=N --config.workdir=DIR]
    python -m librarian_jax.main --config=configs/grpo.py:qwen3_5_4b --config.model.path=... --dry_run

Per step: a batch of tasks (grain) -> G builder episodes per task on the policy engine, with probes and the
final evaluation answered on the frozen engine (`rollout.run_batch`) -> training rows -> one optimizer update
-> the policy engine takes the new weights on device -> metrics to TensorBoard (`workdir/tb`) and one
console line -> episode records to `workdir/episodes/step_N.jsonl` -> an Orbax checkpoint every
`checkpoint.every` steps (`workdir/checkpoints`; a restart resumes from the newest good one).
Multi-process runs (`JAX_COORDINATOR_ADDRESS`/`JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`, or a TPU pod slice) call
`jax.distributed.initialize` first; see launch/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from librarian_jax import compile_cache, config_validation, storage

# Defined once per process: `python -m librarian_jax.main` runs this file as `__main__`, and the commands
# import `librarian_jax.main` again for its building blocks; the second import must not define them twice.
if "config" not in flags.FLAGS:
    config_flags.DEFINE_config_file("config", None, "Path to a config file, e.g. configs/grpo.py[:preset].")
    flags.DEFINE_bool("dry_run", False, "Validate the config, say what would run, and exit.")
compile_cache.define_flag()


# ------------------------------------------------------------------------------------------- distributed


def maybe_initialize_distributed(env: dict[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize` for multi-process runs (explicit coordinator env vars, or a TPU pod
    slice), with heartbeat and start-up timeouts; see `librarian_jax.distributed.initialize`. Returns whether
    it did."""
    from librarian_jax import distributed

    return distributed.initialize(env)


# ------------------------------------------------------------------------------------------- building


# The loaders' options each data key sets, and the formats that have them (docs/paper-settings.md, Data).
_DATA_LOADER_KEYS = {"max_docs": ("tasks", "browsecomp_plus"), "questions_per_domain": ("bright",)}


def _loader_kwargs(d: Any, fmt: str) -> dict[str, Any]:
    """`data.load_tasks` options from the data config: the noisy variant's document cap (`max_docs`: support
    documents plus shuffled negatives, at most that many) and the BRIGHT question sample
    (`questions_per_domain`), both drawn with `sample_seed`. A key set for a format without it is logged."""
    kwargs: dict[str, Any] = {}
    for key, formats in _DATA_LOADER_KEYS.items():
        value = int(d.get(key, 0))
        if not value:
            continue
        if fmt not in formats:
            logging.warning("config.data.%s=%d does not apply to the %r format of %s (only %s)",
                            key, value, fmt, d.path, "/".join(formats))
            continue
        kwargs.update({key: value, "seed": int(d.get("sample_seed", 0))})
        if key == "max_docs":
            kwargs["shuffle_docs"] = True
    return kwargs


def build_tasks(config: Any) -> tuple[list[Any], list[Any]]:
    """(train tasks, held-out tasks) from the synthetic world or a tasks file.

    `data.reuse_questions` (a file) sets the named corpora's reuse questions; `data.split_file` (a task-id
    file, `data.read_task_ids`) decides train / held-out, else `data.heldout_fraction` by task-id hash."""
    from librarian_jax import data

    d = config.data
    if d.source == "synthetic":
        tasks = data.generate_world(config.seed, d.num_tasks, docs_per_task=d.docs_per_task,
                                    min_words=d.min_words, max_words=d.max_words,
                                    questions_per_task=d.questions_per_task,
                                    reuse_questions_per_task=d.reuse_questions_per_task)
    else:
        fmt = data.sniff_format(d.path) if d.format == "auto" else d.format
        tasks = data.load_tasks(d.path, format=fmt, **_loader_kwargs(d, fmt))
    if d.get("reuse_questions", ""):
        try:
            tasks = data.attach_reuse_questions(tasks, d.reuse_questions)
        except data.DataError as e:
            raise config_validation.ConfigError(f"config.data.reuse_questions: {e}") from e
    if d.get("split_file", ""):
        try:
            train, heldout = data.split_by_ids(tasks, d.split_file)
        except data.DataError as e:
            raise config_validation.ConfigError(f"config.data.split_file: {e}") from e
        if not train:
            raise config_validation.ConfigError(
                f"config.data.split_file: {d.split_file} leaves no training task of {len(tasks)}")
        return train, heldout
    train, heldout = data.split_tasks(tasks, float(d.heldout_fraction)) if d.heldout_fraction else (tasks, [])
    if not train:
        raise config_validation.ConfigError(
            f"config.data.heldout_fraction: {d.heldout_fraction} leaves no training task of {len(tasks)}")
    return list(train), list(heldout)


SPLIT_FILE = "split.json"


def write_split(workdir: str, train: list[Any], heldout: list[Any]) -> str:
    """Records the run's train / held-out task ids in `workdir/split.json`, so evaluation uses exactly the
    held-out tasks this run never trained on (never a re-derived split)."""
    path = storage.join(workdir, SPLIT_FILE)
    storage.write_text(path, json.dumps({"train": [t.task_id for t in train],
                                         "heldout": [t.task_id for t in heldout]}, indent=1))
    return path


def build_tokenizer(config: Any, tasks: list[Any], extra_texts: list[str] | None = None) -> Any:
    """The tokenizer: `model.tokenizer`, the HF folder's, or a SentencePiece trained (and cached) on the tasks
    plus the agents' own prompts and tool descriptions (and `extra_texts`, e.g. the tool calls of the
    warm start's demonstrations), so those encode compactly too."""
    from librarian_jax import data, tokenizers
    from librarian_jax.agents import prompt_text

    if config.model.tokenizer:
        return tokenizers.load_tokenizer(local_file(config.model.tokenizer, "tokenizer"))
    if config.model.init == "hf":
        return tokenizers.load_tokenizer(config.model.path)
    cache = storage.join(config.workdir, "tokenizer")
    texts = data.world_texts(tasks) + prompt_text.all_texts() + list(extra_texts or [])
    # SentencePiece reads and writes local files: a remote workdir's cache is mirrored in a local directory
    # (models there first copied down, so a restart on another host does not train again; a new one up)
    local = storage.local_cache_dir(cache, "tokenizer")
    remote = local != cache
    if remote:
        for name in storage.listdir(cache):
            if name.endswith(".model") and not os.path.exists(os.path.join(local, name)):
                storage.copy_file(storage.join(cache, name), os.path.join(local, name))
    tokenizer = tokenizers.cached_tokenizer(texts, local, config.model.tokenizer_vocab_size)
    if remote and jax.process_index() == 0:
        for name in sorted(os.listdir(local)):
            if name.endswith(".model") and not storage.exists(storage.join(cache, name)):
                storage.copy_file(os.path.join(local, name), storage.join(cache, name))
    return tokenizer


def local_file(path: str, purpose: str) -> str:
    """`path` itself when local; a remote file (`gs://...`) copied once into a local cache directory (for
    readers that need a local file, e.g. SentencePiece)."""
    if not storage.is_remote(path):
        return path
    local = os.path.join(storage.local_cache_dir(storage.dirname(path), purpose), storage.basename(path))
    if not os.path.exists(local):
        storage.copy_file(path, local)
    return local


def build_model(config: Any, mesh: Any, tokenizer: Any) -> Any:
    """The policy's initial weights: random, Hugging Face safetensors, or an Orbax checkpoint."""
    from flax import nnx

    from librarian_jax import checkpoint, models

    m = config.model
    overrides = {"dtype": m.dtype, "param_dtype": m.dtype} if m.dtype else {}
    if m.init == "hf":
        model = models.load_hf(m.path, dtype=m.dtype or "bfloat16", mesh=mesh)
    else:
        model = models.Transformer(models.get_preset(m.preset, **overrides), rngs=nnx.Rngs(config.seed))
        if m.init == "orbax":
            nnx.update(model, checkpoint.restore_params(m.path, nnx.state(model, nnx.Param)))
    if tokenizer.vocab_size > model.config.vocab_size:
        raise config_validation.ConfigError(
            f"config.model.preset: vocab_size {model.config.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}")
    return model


def make_mesh(config: Any) -> Any:
    from librarian_jax.engine import make_mesh as engine_mesh

    shape = config_validation.validate_mesh(config.mesh.shape.to_dict(), jax.device_count())
    n = int(np.prod(list(shape.values())))
    return engine_mesh(shape, devices=jax.devices()[:n])


def make_local_mesh(config: Any) -> Any:
    """`config.mesh` over this process's devices (evaluation and `build`, whose engines are process-local and
    have no trainer): the same as `make_mesh` in a single-process run."""
    from librarian_jax.engine import make_mesh as engine_mesh

    shape = config_validation.validate_mesh(config.mesh.shape.to_dict(), jax.local_device_count())
    n = int(np.prod(list(shape.values())))
    return engine_mesh(shape, devices=jax.local_devices()[:n])


def local_engine_mesh(mesh: Any) -> Any:
    """The mesh this process's engines use: `mesh` itself in a single-process run, else this process's share
    of it (`distributed.hybrid_meshes`: process-local engines, DESIGN.md "Multi-host")."""
    from librarian_jax import distributed

    return distributed.hybrid_meshes(mesh)[1]


def train_config(config: Any) -> Any:
    """`rl.TrainConfig` from the typed `train` section (`config_schema.TrainSection.trainer_config`); the
    loss's temperature is the builder's sampling temperature (0, greedy, counts as 1)."""
    temperature = config_validation.rollout_config(config).builder.temperature or 1.0
    return config_validation.validate_train(config).trainer_config(temperature)


# ------------------------------------------------------------------------------------------- metrics


def step_metrics(records: list[Any], row_metrics: dict[str, float], update: dict[str, float],
                 sched_stats: Any, rollout_s: float) -> dict[str, float]:
    """Everything logged for one step (TensorBoard scalars)."""
    nan = float("nan")
    rewards = np.array([r.total_reward for r in records])
    probes = [s for r in records for s in r.probe_scores]
    gen = float(sum(sched_stats.generated_tokens.values()))
    out = {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "reward/terminal_mean": float(np.mean([r.terminal_reward for r in records])),
        "probe/accuracy": float(np.mean(probes)) if probes else float("nan"),
        "probe/count": float(len(probes)),
        "episode/turns": float(np.mean([r.num_turns for r in records])),
        "episode/stopped": float(np.mean([r.stopped for r in records])),
        "rollout/time_s": rollout_s, "rollout/generated_tokens": gen,
        "rollout/tokens_per_s": gen / max(rollout_s, 1e-9),
        "rollout/engine_s": float(sched_stats.engine_s), "rollout/host_s": float(sched_stats.host_s),
        "train/time_s": update["time_s"],
        "train/tokens_per_s": row_metrics.get("rows/tokens", 0.0) / max(update["time_s"], 1e-9),
    }
    for k in ("adv/episode_std", "adv/equal_reward_groups_frac"):
        out[k] = nan
    out.update(row_metrics)
    for k in ("loss", "kl", "clip_frac", "entropy", "skipped"):
        out[f"train/{k}"] = nan
    out.update({f"train/{k}": v for k, v in update.items() if k != "time_s"})
    return out


def progress_line(step: int, total: int, m: dict[str, float]) -> str:
    return (f"step {step}/{total} | reward {m['reward/mean']:.3f} probe acc {m['probe/accuracy']:.3f} "
            f"adv spread {m['adv/episode_std']:.3f} (equal groups {m['adv/equal_reward_groups_frac']:.2f}) | "
            f"loss {m['train/loss']:.4f} kl {m['train/kl']:.4f} clip {m['train/clip_frac']:.3f} "
            f"ent {m['train/entropy']:.3f}{' SKIPPED' if m['train/skipped'] else ''} | "
            f"{m['rollout/tokens_per_s']:.0f} gen tok/s, {m['train/tokens_per_s']:.0f} train tok/s | "
            f"rollout {m['rollout/time_s']:.1f}s update {m['train/time_s']:.1f}s"
            + (f" | held-out acc {m['eval/accuracy']:.3f} ({m['eval/time_s']:.1f}s)"
               if "eval/accuracy" in m else "")
            + (f" | compiled {m['compile/programs']:.0f} programs {m['compile/time_s']:.1f}s"
               if m.get("compile/programs") else ""))


# ------------------------------------------------------------------------------------------- the run


def describe(config: Any) -> str:
    """What a run of `config` would do, in a few lines."""
    m, d, r, t = config.model, config.data, config.rollout, config.train
    weights = {"random": "random init", "hf": f"HF safetensors {m.path}", "orbax": f"Orbax {m.path}"}[m.init]
    data = f"a synthetic world of {d.num_tasks} tasks" if d.source == "synthetic" else f"tasks from {d.path}"
    tuning = f"LoRA rank {m.lora_rank}" if m.lora_rank else "full fine-tuning"
    return (f"GRPO preset {config.preset!r}: model {m.preset} ({weights}, {tuning}) on {data}; "
            f"{t.num_steps} steps of {d.tasks_per_batch} tasks x group {r.group_size}, "
            f"builder H={r.builder.max_turns}, {t.advantage} advantages, {t.loss} loss ({t.aggregation}), "
            f"lr {t.learning_rate}; "
            f"mesh {config.mesh.shape.to_dict()}; workdir {config.workdir}\n"
            f"roles (which model serves which role):\n{role_table(config)}")


@dataclasses.dataclass
class Run:
    """Everything a training run holds between steps."""

    config: Any
    train_tasks: list[Any]
    heldout: list[Any]
    tokenizer: Any
    # "policy" (the builder, trained), one entry per frozen role ("answerer", "executor", "compaction",
    # "judge"; roles naming the same weights hold the same Engine object) and "frozen" (= the answerer's)
    engines: dict[str, Any]
    trainer: Any
    rows_config: Any
    rollout_config: Any
    data_iter: Any
    rng: jax.Array
    step: int = 0
    templates: dict[str, Any] = dataclasses.field(default_factory=dict)  # a chat template per role
    roles: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # resolved `config.roles`
    localizer: Any = None  # multi-process: the trainer's global arrays -> this process's engine layout


def push_weights(run: Run) -> None:
    """The trainer's current policy to the policy engine, on device (resharded to the engine's process-local
    layout in a multi-process run; a collective there: every process calls it)."""
    state = run.trainer.policy_state()
    engine = run.engines["policy"]
    if run.localizer is not None:
        state = run.localizer(state, engine.params)
    engine.update_params(state)


def role_table(config: Any, roles: dict[str, dict[str, Any]] | None = None) -> str:
    """Which model serves which role, on which mesh, with which budgets (logged at start, printed by
    --dry_run; docs/paper-settings.md shows the paper preset's)."""
    roles = roles or config_validation.resolve_roles(config)
    m, r = config.model, config.rollout
    b, a = r.builder, r.answerer
    policy_w = {"random": f"random {m.preset}", "hf": f"HF {m.path}", "orbax": f"Orbax {m.path}"}[m.init]
    mesh = ",".join(f"{k}={v}" for k, v in config.mesh.shape.to_dict().items())
    engine_of: dict[tuple[str, str], int] = {}
    rows = [("role", "weights", "engine", "mesh", "slots", "max_seq_len", "thinking", "budget"),
            ("builder", f"{policy_w} ({m.preset}, LoRA {m.lora_rank})" if m.lora_rank else
             f"{policy_w} ({m.preset})", "policy", mesh, str(r.policy_slots), str(r.max_seq_len),
             str(bool(config.get("builder_thinking", True))),
             f"{b.max_new_tokens} new/turn, compaction {b.compaction} at {b.compaction_budget}")]
    budgets = {
        "answerer": (f"{a.get('kind', 'model')}: context {a.context_budget}, {a.max_new_tokens} new/turn, "
                     f"{a.max_turns} turns"),
        "executor": (f"{b.executor}: {b.get('executor_max_new_tokens', 512)} new, excerpts <= "
                     f"{b.get('excerpt_max_chars', 16000)} chars"),
        "compaction": f"{b.compaction}: {b.get('compaction_summary_tokens', 256)} new",
        "judge": f"{'model' if r.get('use_model_judge', True) else 'exact match only'}",
    }
    for role, d in roles.items():
        key = (d["weights"], d["mesh"])
        engine_of.setdefault(key, len(engine_of))
        w = "builder's initial weights (frozen)" if d["init"] == "policy" else \
            f"{d['init']} {d['path'] or d['preset']} ({d['preset']}, {d['dtype'] or 'preset dtype'})"
        rows.append((role, w, f"frozen#{engine_of[key]}", d["mesh"] or mesh, str(d["slots"]),
                     str(d["max_seq_len"]), str(d["thinking"]), budgets[role]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _role_model(config: Any, d: dict[str, Any], mesh: Any, base: Any, tokenizer: Any) -> Any:
    """The weights of one frozen role (`d` from `config_validation.resolve_roles`)."""
    from flax import nnx

    from librarian_jax import checkpoint, models

    if d["init"] == "policy":
        return base
    if d["init"] == "hf":
        model = models.load_hf(d["path"], dtype=d["dtype"] or "bfloat16", mesh=mesh)
    else:
        overrides = {"dtype": d["dtype"], "param_dtype": d["dtype"]} if d["dtype"] else {}
        cfg = models.get_preset(d["preset"], **overrides)
        model = models.Transformer(cfg, rngs=nnx.Rngs(config.seed + 1))
        if d["init"] == "orbax":
            nnx.update(model, checkpoint.restore_params(d["path"], nnx.state(model, nnx.Param)))
    if tokenizer.vocab_size > model.config.vocab_size:
        raise config_validation.ConfigError(
            f"config.roles: {d['weights']} has vocab_size {model.config.vocab_size}, smaller than the "
            f"tokenizer's {tokenizer.vocab_size} (every role reads the builder's tokenizer)")
    return model


def build_role_engines(config: Any, mesh: Any, base: Any, tokenizer: Any,
                       roles: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One Engine per distinct (weights, mesh) of the frozen roles: roles naming the same weights share one
    engine and one copy of the weights (slots and max_seq_len: the largest any of its roles asks for)."""
    from librarian_jax.engine import Engine
    from librarian_jax.engine import make_mesh as engine_mesh

    groups: dict[tuple[str, str], list[str]] = {}
    for role, d in roles.items():
        groups.setdefault((d["weights"], d["mesh"]), []).append(role)
    models: dict[tuple[str, str], Any] = {}  # one copy of each weights per placement
    out: dict[str, Any] = {}
    for (weights, mesh_spec), members in groups.items():
        role_mesh = mesh
        if mesh_spec:  # its own placement (a copy of the weights laid out on that mesh)
            # engines are process-local: a role's mesh covers (some of) this process's devices
            shape = config_validation.validate_mesh(
                config_validation.parse_mesh_spec(mesh_spec, f"roles.{members[0]}.mesh"),
                jax.local_device_count())
            role_mesh = engine_mesh(shape, devices=jax.local_devices()[: int(np.prod(list(shape.values())))])
        if (weights, mesh_spec) not in models:
            models[(weights, mesh_spec)] = _role_model(config, roles[members[0]], role_mesh, base, tokenizer)
        model = models[(weights, mesh_spec)]
        engine = Engine(model, max(roles[x]["slots"] for x in members),
                        max(roles[x]["max_seq_len"] for x in members), role_mesh,
                        round_steps=config.rollout.round_steps, scan_layers=config.rollout.scan_layers)
        for role in members:
            out[role] = engine
    return out


def build_templates(config: Any, tokenizer: Any, roles: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A chat template per role: Qwen3.5 checkpoints get the Qwen3.5 template with the role's thinking
    switch (the builder: `builder_thinking`, default on as the checkpoint's template); other models the
    detected style (no switch)."""
    from librarian_jax.tokenizers import chat_template

    if not str(config.model.preset).startswith("qwen3_5"):
        return {}
    out = {"policy": chat_template(tokenizer, "qwen3_5", thinking=bool(config.get("builder_thinking", True)))}
    for role, d in roles.items():
        out[role] = chat_template(tokenizer, "qwen3_5", thinking=d["thinking"])
    return out


def build(config: Any) -> Run:
    """Data, tokenizer, mesh, models, engines and trainer for `config` (validated)."""
    from librarian_jax import distributed
    from librarian_jax.data import TaskPipeline
    from librarian_jax.engine import Engine
    from librarian_jax.rl import rows as rows_lib
    from librarian_jax.rl import train_step

    train_tasks, heldout = build_tasks(config)
    if distributed.is_multi():  # process 0 trains (and caches) the tokenizer; the others then read it
        if distributed.is_primary():
            build_tokenizer(config, train_tasks + heldout)
        distributed.barrier("librarian_jax.main.tokenizer")
    tokenizer = build_tokenizer(config, train_tasks + heldout)
    mesh = make_mesh(config)  # the trainer's: every device of every process
    emesh = local_engine_mesh(mesh)  # the engines': this process's devices (== mesh in one process)
    base = build_model(config, emesh, tokenizer)
    distributed.uncommit(base)  # several processes: weights the trainer can place on the global mesh
    m, r, t = config.model, config.rollout, config.train
    policy = train_step.apply_lora(base, m.lora_rank, m.lora_alpha, m.lora_module_path, seed=config.seed) \
        if m.lora_rank else base
    roles = config_validation.resolve_roles(config)
    engines = {"policy": Engine(policy, r.policy_slots, r.max_seq_len, emesh, round_steps=r.round_steps,
                                scan_layers=r.scan_layers)}
    engines.update(build_role_engines(config, emesh, base, tokenizer, roles))
    engines["frozen"] = engines["answerer"]
    logging.info("roles:\n%s", role_table(config, roles))
    templates = build_templates(config, tokenizer, roles)
    trainer = train_step.Trainer(policy, train_config(config), mesh=mesh)
    logging.info("trainer: %d trainable params (%s)", trainer.num_trainable,
                 "LoRA" if trainer.lora else "full")
    rows_config = rows_lib.RowsConfig(advantage=t.advantage, step_weight=t.step_weight,
                                      step_gamma=t.step_gamma, max_seq_len=t.max_seq_len,
                                      row_multiple=trainer.row_multiple())
    # Every process iterates the same global pipeline (data.tasks_per_batch tasks a step) and rolls out its
    # own contiguous share of each batch (`distributed.process_slice`): the global batch is the one a single
    # process would see, whatever the process count.
    # (Several processes drop an epoch's short last batch, which cannot be split evenly.)
    pipeline = TaskPipeline(train_tasks, tasks_per_batch=config.data.tasks_per_batch,
                            seed=config.data.shuffle_seed, num_epochs=None, shard_index=0, shard_count=1,
                            drop_remainder=distributed.is_multi())
    return Run(config, train_tasks, heldout, tokenizer, engines, trainer, rows_config,
               config_validation.rollout_config(config), pipeline.iterator(), jax.random.key(config.seed),
               templates=templates, roles=roles,
               localizer=distributed.Localizer(mesh, emesh) if distributed.is_multi() else None)


def resume(run: Run, ck: Any) -> None:
    """Restores params, optimizer state, step, RNG and data position from the newest good checkpoint."""
    restored = ck.restore(params=run.trainer.params, opt_state=run.trainer.opt_state)
    if restored is None:
        return
    run.trainer.set_state(restored.params, restored.opt_state, restored.step)
    run.rng = restored.rng if restored.rng is not None else run.rng
    data_state = restored.data_state
    by_process = restored.meta.get("data_by_process")
    if by_process and len(by_process) == jax.process_count():
        data_state = by_process[jax.process_index()]  # this process's own iterator state
    if data_state is not None:
        run.data_iter.set_state(data_state)
    push_weights(run)
    run.step = restored.step
    logging.info("resumed from step %d", run.step)


def train_one_step(run: Run) -> tuple[list[Any], dict[str, float]]:
    """One GRPO step: rollouts -> rows -> update -> new weights to the policy engine. Returns (records,
    metrics)."""
    from librarian_jax import distributed, rollout
    from librarian_jax.rl import rows as rows_lib

    compiled_before = compile_cache.CompileClock.get().totals()
    run.step += 1
    global_tasks = next(run.data_iter)
    share = distributed.process_slice(len(global_tasks))  # this process's tasks of the global batch
    tasks = global_tasks[share]
    run.rng, sub = jax.random.split(run.rng)
    seed = int(jax.random.randint(sub, (), 0, 2**31 - 1))
    group = run.config.rollout.group_size
    sched = rollout.Scheduler(run.engines)
    t0 = time.perf_counter()
    records = rollout.run_batch(tasks, group, run.engines, run.tokenizer, run.rollout_config,
                                rng=distributed.episode_rng(seed, share.start * group), scheduler=sched,
                                template=run.templates.get("policy"), templates=run.templates)
    if share.start:  # group ids index the global batch (advantages are per group, all on one process)
        records = [dataclasses.replace(r, group_id=r.group_id + share.start) for r in records]
    rollout_s = time.perf_counter() - t0
    # the processes' rollouts take different times: meet here (no device collective waits minutes for another)
    distributed.wait_for_all(f"step_{run.step}/rollouts")
    try:
        batch, row_metrics = rows_lib.build_rows(records, run.rows_config)
        trainable = 1.0
    except rows_lib.NoTrainableTokens as e:
        batch, row_metrics, trainable = None, {}, 0.0
        logging.warning("step %d: %s", run.step, e)
    # every process updates, or none does (the update is one global program): a step where some process has
    # no trainable token is skipped everywhere
    if distributed.is_multi():
        trainable = float(min(distributed.allgather_json(trainable)))
    if trainable:
        if distributed.is_multi():
            # compile this step's update before the processes meet (a no-op once compiled): one process's
            # compile (another read it from the persistent cache) must not run out a collective's timeout
            run.trainer.memory_analysis(batch)
            distributed.wait_for_all(f"step_{run.step}/update_compiled")
        update = run.trainer.update(batch)
        push_weights(run)
    else:
        logging.warning("step %d: no trainable token on some process; no update this step", run.step)
        row_metrics, update = {}, {"time_s": 0.0, "skipped": 1.0}
    run.trainer.step = run.step  # the schedule counts loop steps, skipped ones included
    metrics = step_metrics(records, row_metrics, update, sched.stats, rollout_s)
    cfg = run.config.eval
    if cfg.every and run.step % cfg.every == 0 and run.heldout:
        t1 = time.perf_counter()
        metrics.update(evaluate(run.config, run.heldout, run.engines, run.tokenizer, run.rollout_config,
                                seed))
        metrics["eval/time_s"] = time.perf_counter() - t1
    # what this step spent compiling (rollout, update and eval programs; inside the times above)
    metrics.update(compile_cache.CompileClock.get().since(compiled_before).metrics())
    metrics = distributed.reduce_metrics(metrics, weight=len(records))
    return records, metrics


WARM_START_DIR = "warm_start"


def warm_start(config: Any) -> tuple[Any, dict[str, Any]]:
    """Runs the supervised warm start (`configs/sft.py:<warm_start.sft_preset>` on this run's model, data,
    rollout and mesh, in `workdir/warm_start`; resumed or skipped when done) and returns (the GRPO config
    starting from its checkpoint, the SFT summary)."""
    from configs import sft as sft_configs
    from librarian_jax import supervised

    sft_config = sft_configs.get_config(config.warm_start.sft_preset)
    with sft_config.unlocked():
        for key in ("seed", "preset"):
            sft_config[key] = config[key]
        for section in ("model", "data", "rollout", "mesh"):
            packing = sft_config.data.packing if section == "data" else None
            sft_config[section] = ml_collections.ConfigDict(config[section].to_dict())
            if packing is not None:
                sft_config.data.packing = packing
                sft_config.data.path = ""
        sft_config.workdir = storage.join(config.workdir, WARM_START_DIR)
    done = storage.join(sft_config.workdir, "sft_summary.json")
    summary: dict[str, Any] | None = None
    if storage.isfile(done):
        summary = json.loads(storage.read_text(done))
        if summary.get("last_step") != sft_config.train.num_steps:
            summary = None
    t0 = time.perf_counter()
    if summary is None:
        logging.info("warm start: supervised fine-tuning on the embedded demonstrations in %s",
                     sft_config.workdir)
        summary = supervised.main(sft_config) or {}
    else:
        logging.info("warm start: done earlier (%s); GRPO starts from its checkpoint", done)
    summary = {**summary, "this_run_s": time.perf_counter() - t0}
    tokenizers_dir = storage.join(sft_config.workdir, "tokenizer")
    models = [n for n in storage.listdir(tokenizers_dir) if n.endswith(".model")]
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.init = "orbax"
    config.model.path = storage.join(sft_config.workdir, "checkpoints")
    if models and not config.model.tokenizer:
        config.model.tokenizer = storage.join(tokenizers_dir, models[-1])
    config.warm_start.enabled = False
    return config, summary


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics with a finite value (NaN marks "not measured this step", e.g. probe accuracy)."""
    return {k: v for k, v in metrics.items() if np.isfinite(v)}


def _write_scalars(writer: Any, metrics: dict[str, float], step: int) -> None:
    """The finite metrics to TensorBoard at `step` (a no-op without a writer: processes other than 0)."""
    if writer is None:
        return
    for k, v in _finite(metrics).items():
        writer.add_scalar(k, v, step)
    writer.flush()


def run(config: Any) -> dict[str, Any]:
    """Trains per `config` (validated first). Returns a summary: steps run, times, the last metrics."""
    from tensorboardX import SummaryWriter

    from librarian_jax import checkpoint, distributed

    t_start = time.perf_counter()
    compiled_before = compile_cache.CompileClock.get().totals()
    config_validation.validate(config)
    logging.info("%s", describe(config))
    workdir = storage.abspath(config.workdir)  # a local directory or a URL (gs://...): launch/README.md
    storage.makedirs(workdir)
    primary = jax.process_index() == 0
    sft_summary: dict[str, Any] = {}
    if config.warm_start.enabled:
        config, sft_summary = warm_start(config)
        config_validation.validate(config)
    if primary:
        storage.write_text(storage.join(workdir, "config.json"), config.to_json_best_effort(indent=2))

    state = build(config)
    if primary:
        write_split(workdir, state.train_tasks, state.heldout)
    ck = checkpoint.Checkpointer(storage.join(workdir, "checkpoints"), save_every=config.checkpoint.every,
                                 keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    if config.checkpoint.resume:
        resume(state, ck)
    start, num_steps = state.step, config.train.num_steps
    # tensorboardX writes gs:// itself (google-cloud-storage), a local path as files
    writer = SummaryWriter(storage.join(workdir, "tb")) if primary else None
    totals = {"rollout_s": 0.0, "update_s": 0.0, "eval_s": 0.0}
    metrics: dict[str, float] = {}
    curve: list[tuple[int, float]] = []  # (step, mean reward) of this run's steps
    initial: dict[str, float] = {}
    try:
        if config.eval.every and state.heldout and state.step == 0 and num_steps > 0:
            # the starting policy on the same held-out tasks, so the held-out curve has its step-0 point;
            # greedy, seeded apart from the run's RNG (training draws exactly what it would without it)
            t1 = time.perf_counter()
            initial = evaluate(config, state.heldout, state.engines, state.tokenizer, state.rollout_config,
                               int(config.seed))
            took = time.perf_counter() - t1
            totals["eval_s"] += took
            if primary:
                logging.info("step 0/%d (the starting policy) | held-out acc %.3f (%.1fs)", num_steps,
                             initial["eval/accuracy"], took)
            _write_scalars(writer, initial, 0)
        while state.step < num_steps:
            records, metrics = train_one_step(state)
            step = state.step
            totals["rollout_s"] += metrics["rollout/time_s"]
            totals["update_s"] += metrics["train/time_s"]
            totals["eval_s"] += metrics.get("eval/time_s", 0.0)
            if primary:  # metrics are already reduced over the processes: one line for the job
                logging.info("%s", progress_line(step, num_steps, metrics))
            curve.append((step, metrics["reward/mean"]))
            _write_scalars(writer, metrics, step)
            # each process: its own tasks' episodes (step_N.jsonl, step_N.pK.jsonl)
            distributed.write_step_records(storage.join(workdir, "episodes"), step, records)
            due = step == num_steps or ck.should_save(step)
            data_state = state.data_iter.get_state()
            # each process's iterator state (a collective, so every process takes the same branch)
            by_process = distributed.allgather_json(data_state) if due and distributed.is_multi() else None
            ck.save(step, params=state.trainer.params, opt_state=state.trainer.opt_state, rng=state.rng,
                    data_state=data_state, data_by_process=by_process, force=step == num_steps)
    finally:
        ck.close()
        if writer is not None:
            writer.close()
    learning = reward_curve(curve, storage.join(workdir, "reward_curve.png") if primary else None)
    if learning:
        logging.info("reward curve: %s", learning["line"])
    final: dict[str, Any] = {}
    t_eval = time.perf_counter()
    # every process evaluates its share of the held-out corpora on its process-local engines and gets all the
    # records (eval.cli.execute; every process restores each builder, a collective); process 0 reports
    if config.eval.final_methods and state.heldout:
        final = final_evaluation(workdir, config.eval.final_methods)
        if config.eval.final_samples:
            final["sampled"] = final_evaluation(
                workdir, config.eval.final_methods, name="final_sampled", samples=config.eval.final_samples,
                builder_temperature=float(config.rollout.builder.temperature))
    totals["final_eval_s"] = time.perf_counter() - t_eval
    wall = time.perf_counter() - t_start
    compiled = compile_cache.CompileClock.get().since(compiled_before)  # this process's, warm start included
    summary = {"start_step": start, "last_step": state.step, "wall_s": wall, **totals,
               "compile": compiled.as_dict(),
               "reward_curve": learning, "final_eval": final,
               "warm_start_s": sft_summary.get("this_run_s", 0.0),
               "initial_eval": _finite(initial), "metrics": _finite(metrics)}
    logging.info("done: steps %d..%d in %.1fs (rollout %.1fs, update %.1fs, eval %.1fs; of the whole run, "
                 "compiling %s)", start + 1, state.step, wall, totals["rollout_s"], totals["update_s"],
                 totals["eval_s"], compiled.line() or "nothing")
    if primary:
        storage.write_text(storage.join(workdir, "summary.json"), json.dumps(summary, indent=2))
    return summary


def reward_curve(curve: list[tuple[int, float]], png: str | None = None) -> dict[str, Any]:
    """The mean reward of the first and last fifth of the steps (mean +- standard error over steps) and
    a plot of the curve (`png`). Empty for fewer than 2 steps."""
    if len(curve) < 2:
        return {}
    steps = [s for s, _ in curve]
    r = np.array([v for _, v in curve], float)
    k = max(1, len(r) // 5)

    def mean_se(x: np.ndarray) -> tuple[float, float]:
        return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0

    (m0, s0), (m1, s1) = mean_se(r[:k]), mean_se(r[-k:])
    out = {"first_fifth": [m0, s0], "last_fifth": [m1, s1], "steps_per_fifth": k,
           "line": f"mean reward, first {k} steps {m0:.3f} +- {s0:.3f}, last {k} steps {m1:.3f} +- {s1:.3f}"}
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, r, marker="o", ms=3)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("mean episode reward")
        ax.set_title(out["line"], fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        with storage.writing(png) as f:
            fig.savefig(f, dpi=120, format="png")
        plt.close(fig)
        out["png"] = png
    return out


def final_evaluation(workdir: str, methods: str, name: str = "final", **overrides: Any) -> dict[str, Any]:
    """configs/eval.py on this run's held-out split (`methods`; `overrides`: eval keys such as `samples`,
    `builder_temperature`), the table logged and printed; returns the accuracies and the report's path."""
    from librarian_jax import eval as eval_lib

    results = eval_lib.evaluate_run(workdir, methods=methods, name=name, **overrides)
    table = eval_lib.format_table(results)
    how = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "greedy builder"
    logging.info("held-out evaluation, %s (%s/eval/%s/report.md):\n%s", how, workdir, name, table)
    if jax.process_index() == 0:
        print(f"held-out evaluation, {how}:\n{table}")  # noqa: T201 - the run's closing answer
    return {"methods": methods, "report": storage.join(workdir, "eval", name, "report.md"),
            "accuracy": results["accuracy"]}


def evaluate(config: Any, heldout: list[Any], engines: dict[str, Any], tokenizer: Any, rollout_cfg: Any,
             seed: int) -> dict[str, float]:
    """Periodic held-out evaluation (`eval.every`): the eval command's own build and answer code
    (`eval.pipeline.periodic_eval`: greedy builder, no probes, the frozen answerer `eval.repeats` times per
    question) with its metric names, `eval/trained/accuracy` etc.; `eval/accuracy` is the same accuracy.
    Multi-process: each process evaluates its share of the corpora and every process gets the same metrics."""
    from librarian_jax.eval import pipeline

    tasks = heldout[: config.eval.num_tasks]
    _, metrics = pipeline.periodic_eval(tasks, engines, tokenizer, rollout_cfg, seed,
                                        repeats=config.eval.repeats)
    metrics["eval/accuracy"] = metrics["eval/trained/accuracy"]
    return metrics


def _train_command(config: Any, dry_run: bool = False) -> None:
    config_validation.validate(config)
    if dry_run:
        print(describe(config))  # noqa: T201 - the CLI's answer
        return
    run(config)


def _sft_command(config: Any, dry_run: bool = False) -> None:
    from librarian_jax import supervised

    supervised.main(config, dry_run=dry_run)


def _eval_command(config: Any, dry_run: bool = False) -> None:
    from librarian_jax.eval import cli

    cli.run_eval(config, dry_run=dry_run)


def _build_command(config: Any, dry_run: bool = False) -> None:
    from librarian_jax.eval import cli

    cli.run_build(config, dry_run=dry_run)


# config.command -> what main runs (configs/grpo.py: train, sft.py: sft, eval.py: eval, build.py: build)
COMMANDS = {"train": _train_command, "sft": _sft_command, "eval": _eval_command, "build": _build_command}


def _quiet_library_info_logs() -> None:
    """Orbax logs several INFO lines per save; keep the console to our progress lines and warnings."""
    import logging as py_logging

    def keep(record: py_logging.LogRecord) -> bool:
        return record.levelno >= py_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname

    logging.get_absl_handler().addFilter(keep)


def main(argv: list[str]) -> None:
    _quiet_library_info_logs()
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = flags.FLAGS["config"].value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/grpo.py")
    multi = maybe_initialize_distributed()
    compile_cache.enable(flags.FLAGS.compilation_cache_dir)  # before anything compiles
    command = config.get("command", "train")
    try:
        if command not in COMMANDS:
            raise config_validation.ConfigError(
                f"config.command: must be one of {sorted(COMMANDS)}, got {command!r}")
        COMMANDS[command](config, dry_run=flags.FLAGS.dry_run)
    except config_validation.ConfigError as e:
        logging.error("%s", e)
        print(f"error: {e}", file=sys.stderr)  # noqa: T201
        if multi:
            from librarian_jax import distributed

            distributed.abort(f"error: {e}", 2)
        sys.exit(2)
    except Exception as e:
        if not multi:
            raise
        # several processes: fail fast (the others stop on this one's missing heartbeats, naming it) rather
        # than wait minutes in the distributed shutdown barrier while they wait in a collective
        import traceback

        from librarian_jax import distributed

        traceback.print_exc()
        distributed.abort(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    from librarian_jax import cli_flags

    app.run(main, flags_parser=cli_flags.parse_flags)
