"""The GRPO training loop (`configs/grpo.py`, `main` with command "train").

    summary = run(config)          # validate -> warm start -> build -> resume -> steps -> final evaluation

`run` and `train_command` take the command's ConfigDict and validate it (`config_validation.validate`);
everything after reads only the typed `config_schema.GRPOConfig` (`Run.settings`), which `prepare` / `build`
/ `describe` / `compile_ahead` take.

Per step: a batch of tasks (grain) -> G builder episodes per task on the policy engine, with probes and the
final evaluation answered by the frozen roles (`rollout.run_batch`, every role from the run's `Cluster`) ->
training rows -> one optimizer update -> the policy engine takes the new weights on device -> metrics to
TensorBoard (`workdir/tb`) and one console line -> episode records to `workdir/episodes/step_N.jsonl` -> an
Orbax checkpoint every `checkpoint.every` steps (`workdir/checkpoints`; a restart resumes from the newest good
one). The run's protocol (every role's weights, template, context and sampling) goes to
`workdir/protocol.json` at start; evaluations compare theirs with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from librarian_jax import (
    checkpoint,
    cluster,
    compile_cache,
    config_schema,
    config_validation,
    distributed,
    inputs,
    rollout,
    storage,
    train_loop,
)
from librarian_jax import eval as eval_lib
from librarian_jax.config_schema import GRPOConfig, require_typed
from librarian_jax.data import TaskPipeline
from librarian_jax.eval import pipeline, report, restore
from librarian_jax.eval import sweep as sweep_lib
from librarian_jax.rl import rows as rows_lib
from librarian_jax.rl import train_step
from librarian_jax.warm_start import sft as warm_start_sft


def train_config(settings: GRPOConfig) -> train_step.TrainConfig:
    """`rl.TrainConfig` from the typed `train` section (`config_schema.TrainSection.trainer_config`) of a
    validated config; the loss's temperature is the builder's sampling temperature (0, greedy, counts as
    1)."""
    require_typed(settings, GRPOConfig, "training.train_config")
    return settings.train.trainer_config(settings.rollout.config.builder.temperature or 1.0)


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
            + (f" | held-out acc {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else "")
            + (f" | validation acc {m['valid/accuracy']:.3f}" if "valid/accuracy" in m else "")
            + (f" ({m['eval/time_s']:.1f}s)" if "eval/time_s" in m else "")
            + (f" | compiled {m['compile/programs']:.0f} programs {m['compile/time_s']:.1f}s"
               if m.get("compile/programs") else ""))


# ------------------------------------------------------------------------------------------- the run


def describe(c: GRPOConfig) -> str:
    """What a run of `c` would do, in a few lines, with the role table (`cluster.role_table`)."""
    require_typed(c, GRPOConfig, "training.describe")
    m, d, r, t = c.model, c.data, c.rollout, c.train
    weights = {"random": "random init", "hf": f"HF safetensors {m.path}", "orbax": f"Orbax {m.path}"}[m.init]
    data = f"a synthetic world of {d.num_tasks} tasks" if d.source == "synthetic" else f"tasks from {d.path}"
    tuning = f"LoRA rank {m.lora_rank}" if m.lora_rank else "full fine-tuning"
    return (f"GRPO preset {c.preset!r}: model {m.preset} ({weights}, {tuning}) on {data}; "
            f"{t.num_steps} steps of {d.tasks_per_batch} tasks x group {r.group_size}, "
            f"builder H={r.config.builder.max_turns}, {t.advantage} advantages, "
            f"{t.loss} loss ({t.aggregation}), "
            f"lr {t.learning_rate}; "
            f"mesh {c.mesh.shape}; workdir {c.workdir}\n"
            f"roles (which model serves which role):\n{cluster.role_table(c)}")


@dataclasses.dataclass
class Prepared:
    """What a run rolls out with (`prepare`): its tasks, tokenizer, the trainer's mesh and the cluster (every
    role's model, engine and template). No trainer: `--dry_run --compile` builds only this."""

    train_tasks: list[Any]
    heldout: list[Any]
    tokenizer: Any
    mesh: Any  # the trainer's: every device of every process
    cluster: cluster.Cluster
    validation: list[Any] = dataclasses.field(default_factory=list)  # eval.validation_tasks (training split)


@dataclasses.dataclass
class Run:
    """Everything a training run holds between steps; `settings` is the validated, typed config (all the
    loop and the modules below it read)."""

    train_tasks: list[Any]
    heldout: list[Any]
    tokenizer: Any
    cluster: cluster.Cluster  # every role's engine and template; the policy's weight hand-off
    trainer: Any
    rows_config: Any
    rollout_config: Any
    data_iter: Any
    rng: jax.Array
    settings: GRPOConfig
    step: int = 0
    validation: list[Any] = dataclasses.field(default_factory=list)  # kept out of the batches
    # (step, accuracy) of the greedy builder on `validation` (step 0: the starting policy); saved in each
    # checkpoint's meta, so a resumed run chooses among every step it evaluated
    validation_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    @property
    def engines(self) -> dict[str, Any]:
        return self.cluster.engines

    @property
    def templates(self) -> dict[str, Any]:
        return self.cluster.templates

    def push_weights(self) -> None:
        """The trainer's current policy to the policy engine (a collective in a multi-process run)."""
        self.cluster.sync_weights(self.trainer.policy_state())


def prepare(settings: GRPOConfig) -> Prepared:
    """Data, tokenizer, meshes and the cluster (every role's model, engine and template; the policy, LoRA
    wrapped when `model.lora_rank`) for a validated config: all of a run but its trainer."""
    require_typed(settings, GRPOConfig, "training.prepare")
    train_tasks, heldout = inputs.build_tasks(settings)
    if distributed.is_multi():  # process 0 trains (and caches) the tokenizer; the others then read it
        if distributed.is_primary():
            inputs.build_tokenizer(settings, train_tasks + heldout)
        distributed.barrier("librarian_jax.training.tokenizer")
    tokenizer = inputs.build_tokenizer(settings, train_tasks + heldout)
    # eval.validation_tasks of the training tasks kept out of GRPO's batches (the step is chosen on them),
    # then data.update_fraction of the rest as incremental updates (after the tokenizer, which so depends
    # on neither)
    train_tasks, validation = inputs.validation_split(train_tasks, settings)
    train_tasks = inputs.update_tasks(train_tasks, settings)
    mesh = cluster.run_mesh(settings.mesh)  # the trainer's: every device of every process
    emesh = cluster.engine_mesh(mesh)  # the engines': this process's devices (== mesh in one process)
    base = cluster.initial_model(settings, emesh, tokenizer)
    distributed.uncommit(base)  # several processes: weights the trainer can place on the global mesh
    m = settings.model
    policy = train_step.apply_lora(base, m.lora_rank, m.lora_alpha, m.lora_module_path, seed=settings.seed) \
        if m.lora_rank else base
    logging.info("roles:\n%s", cluster.role_table(settings))
    the_cluster = cluster.Cluster.from_run(
        settings, cluster.Mode.TRAIN, tokenizer=tokenizer, engine_mesh=emesh, base=base, policy=policy,
        localizer=distributed.Localizer(mesh, emesh) if distributed.is_multi() else None)
    return Prepared(train_tasks, heldout, tokenizer, mesh, the_cluster, validation)


def build(settings: GRPOConfig) -> Run:
    """A run of a validated config: `prepare` (data, tokenizer, meshes, cluster), then the trainer of the
    cluster's policy, the rows config and the task pipeline."""
    p = prepare(settings)
    t = settings.train
    trainer = train_step.Trainer(p.cluster.policy, train_config(settings), mesh=p.mesh)
    logging.info("trainer: %d trainable params (%s)", trainer.num_trainable,
                 "LoRA" if trainer.lora else "full")
    rows_config = rows_lib.RowsConfig(advantage=t.advantage, step_weight=t.step_weight,
                                      step_gamma=t.step_gamma, max_row_len=t.max_row_len,
                                      row_multiple=trainer.row_multiple())
    # Every process iterates the same global pipeline (data.tasks_per_batch tasks a step) and rolls out its
    # own contiguous share of each batch (`distributed.process_slice`): the global batch is the one a single
    # process would see, whatever the process count.
    # (Several processes drop an epoch's short last batch, which cannot be split evenly.)
    pipeline_ = TaskPipeline(p.train_tasks, tasks_per_batch=settings.data.tasks_per_batch,
                             seed=settings.data.shuffle_seed, num_epochs=None, shard_index=0, shard_count=1,
                             drop_remainder=distributed.is_multi())
    return Run(p.train_tasks, p.heldout, p.tokenizer, p.cluster, trainer, rows_config,
               p.cluster.rollout, pipeline_.iterator(), jax.random.key(settings.seed), settings,
               validation=p.validation)


def resumed(run: Run, restored: checkpoint.Restored, directory: str) -> None:
    """Takes a restored checkpoint (`train_loop.resume`): params, optimizer state, step, RNG, this process's
    data position and the validation curve; the policy engine gets the restored weights."""
    checkpoint.check_schedule(restored, run.trainer.schedule_info(), directory)
    run.trainer.set_state(restored.params, restored.opt_state, restored.step)
    run.rng = restored.rng if restored.rng is not None else run.rng
    data_state = restored.data_state
    by_process = restored.meta.get("data_by_process")
    if by_process and len(by_process) == jax.process_count():
        data_state = by_process[jax.process_index()]  # this process's own iterator state
    if data_state is not None:
        run.data_iter.set_state(data_state)
    run.validation_curve = validation_curve_of(restored.meta, directory)
    run.push_weights()
    run.step = restored.step
    logging.info("resumed from step %d", run.step)


def validation_curve_of(meta: Any, where: str = "") -> list[tuple[int, float]]:
    """The (step, accuracy) points a checkpoint's meta carries (`extra.validation_curve`, `eval.select`).
    A meta without them gives []; one whose points are not (step >= 0, accuracy in [0, 1]) pairs gives []
    with a warning naming `where`: the resumed run then chooses among the steps it evaluates from here on."""
    extra = meta.get("extra") if isinstance(meta, dict) else None
    raw = extra.get("validation_curve", []) if isinstance(extra, dict) else []

    def point(p: Any) -> bool:  # [step, accuracy] as JSON writes it: no strings, booleans or infinities
        if not isinstance(p, list | tuple) or len(p) != 2 or any(isinstance(x, bool) for x in p):
            return False
        step, accuracy = p
        return (isinstance(step, int) and step >= 0 and isinstance(accuracy, int | float)
                and 0.0 <= accuracy <= 1.0)

    if not isinstance(raw, list | tuple) or not all(point(p) for p in raw):
        logging.warning("checkpoint meta in %s: validation_curve is not (step, accuracy) pairs (%.80r); "
                        "choosing among the steps evaluated after the resume only", where or "?", raw)
        return []
    return [(int(s), float(a)) for s, a in raw]


def train_one_step(run: Run) -> tuple[list[Any], dict[str, float]]:
    """One GRPO step: rollouts -> rows -> update -> new weights to the policy engine. Returns (records,
    metrics)."""
    compiled_before = compile_cache.CompileClock.get().totals()
    run.step += 1
    global_tasks = next(run.data_iter)
    share = distributed.process_slice(len(global_tasks))  # this process's tasks of the global batch
    tasks = global_tasks[share]
    run.rng, sub = jax.random.split(run.rng)
    seed = int(jax.random.randint(sub, (), 0, 2**31 - 1))
    group = run.settings.rollout.group_size
    sched = rollout.Scheduler(run.engines)
    t0 = time.perf_counter()
    records = rollout.run_batch(tasks, group, run.engines, run.tokenizer, run.rollout_config,
                                rng=distributed.episode_rng(seed, share.start * group), scheduler=sched,
                                template=run.templates["policy"], templates=run.templates)
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
        run.push_weights()
    else:
        logging.warning("step %d: no trainable token on some process; no update this step", run.step)
        row_metrics, update = {}, {"time_s": 0.0, "skipped": 1.0}
    run.trainer.step = run.step  # the schedule counts loop steps, skipped ones included
    metrics = step_metrics(records, row_metrics, update, sched.stats, rollout_s)
    cfg = run.settings.eval
    heldout = bool(cfg.every and run.step % cfg.every == 0 and run.heldout)
    # the validation corpora at the held-out evaluation's steps and the last: the candidates `select_step`
    # chooses among
    validation = bool(run.validation and cfg.every and (
        run.step % cfg.every == 0 or run.step == run.settings.train.num_steps))
    if heldout or validation:
        t1 = time.perf_counter()
        metrics.update(evaluate(run, seed, heldout=heldout, validation=validation))
        metrics["eval/time_s"] = time.perf_counter() - t1
    # what this step spent compiling (rollout, update and eval programs; inside the times above)
    metrics.update(compile_cache.CompileClock.get().since(compiled_before).metrics())
    metrics = distributed.reduce_metrics(metrics, weight=len(records))
    return records, metrics


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics with a finite value (NaN marks "not measured this step", e.g. probe accuracy)."""
    return {k: v for k, v in metrics.items() if np.isfinite(v)}


class GRPOSteps:
    """GRPO's step on `train_loop`: `train_one_step` (rollouts, rows, the update, the new weights to the
    policy engine), its console line, the curves (mean reward; periodic held-out and validation accuracy)
    and this process's episode records (`workdir/episodes/step_N[.pK].jsonl`); before the first step of a
    fresh run, the starting policy's evaluation (the curves' step-0 point)."""

    def __init__(self, run: Run, workdir: str):
        self.run, self.workdir = run, workdir
        self.totals = {"rollout_s": 0.0, "update_s": 0.0, "eval_s": 0.0}
        self.metrics: dict[str, float] = {}  # the last step's
        self.initial: dict[str, float] = {}  # the starting policy's evaluation
        self.curve: list[tuple[int, float]] = []  # (step, mean reward) of this invocation's steps
        self.heldout_curve: list[tuple[int, float]] = []  # (step, held-out accuracy), periodic evaluations

    @property
    def step(self) -> int:
        return self.run.step

    def restore_targets(self) -> tuple[Any, Any]:
        return self.run.trainer.params, self.run.trainer.opt_state

    def resumed(self, restored: checkpoint.Restored, directory: str) -> None:
        resumed(self.run, restored, directory)

    def before_first(self, summaries: train_loop.Summaries) -> None:
        state, settings = self.run, self.run.settings
        num_steps = settings.train.num_steps
        if not (settings.eval.every and (state.heldout or state.validation) and state.step == 0
                and num_steps > 0):
            return
        # the starting policy on the same held-out (and validation) tasks, so the curves have their step-0
        # point; greedy, seeded apart from the run's RNG (training draws exactly what it would without it)
        t1 = time.perf_counter()
        initial = evaluate(state, settings.seed, heldout=bool(state.heldout),
                           validation=bool(state.validation))
        took = time.perf_counter() - t1
        self.totals["eval_s"] += took
        if jax.process_index() == 0:
            logging.info("step 0/%d (the starting policy)%s%s (%.1fs)", num_steps,
                         f" | held-out acc {initial['eval/accuracy']:.3f}" if state.heldout else "",
                         f" | validation acc {initial['valid/accuracy']:.3f}" if state.validation else "",
                         took)
        summaries.write(_finite(initial), 0)
        if "eval/accuracy" in initial:
            self.heldout_curve.append((0, initial["eval/accuracy"]))
        if "valid/accuracy" in initial:
            state.validation_curve.append((0, initial["valid/accuracy"]))
        self.initial = initial

    def train_step(self) -> train_loop.StepOut:
        state = self.run
        records, metrics = train_one_step(state)
        step = state.step
        self.metrics = metrics
        self.totals["rollout_s"] += metrics["rollout/time_s"]
        self.totals["update_s"] += metrics["train/time_s"]
        self.totals["eval_s"] += metrics.get("eval/time_s", 0.0)
        self.curve.append((step, metrics["reward/mean"]))
        if "eval/accuracy" in metrics:
            self.heldout_curve.append((step, metrics["eval/accuracy"]))
        if "valid/accuracy" in metrics:
            state.validation_curve.append((step, metrics["valid/accuracy"]))
        # each process: its own tasks' episodes (step_N.jsonl, step_N.pK.jsonl)
        distributed.write_step_records(storage.join(self.workdir, "episodes"), step, records)
        # metrics are already reduced over the processes: one line for the job
        return train_loop.StepOut(_finite(metrics),
                                  line=progress_line(step, state.settings.train.num_steps, metrics))

    def saved_state(self, due: bool) -> train_loop.Saved:
        state = self.run
        data_state = state.data_iter.get_state()
        # each process's iterator state (a collective, so every process takes the same branch)
        by_process = distributed.allgather_json(data_state) if due and distributed.is_multi() else None
        return train_loop.Saved(state.trainer.params, state.trainer.opt_state, rng=state.rng,
                                data_state=data_state, data_by_process=by_process,
                                extra={"schedule": state.trainer.schedule_info(),
                                       "validation_curve": state.validation_curve})


def loop_config(settings: GRPOConfig, workdir: str, validation: bool) -> train_loop.LoopConfig:
    """GRPO's `train_loop` settings. Choosing the step on validation corpora (`validation`) keeps every step
    they are answered at (multiples of `eval.every`) besides the newest `checkpoint.keep`."""
    c = settings.checkpoint
    return train_loop.LoopConfig(workdir, num_steps=settings.train.num_steps, save_every=c.every,
                                 keep=c.keep, async_save=c.async_save,
                                 keep_period=settings.eval.every if validation else None, resume=c.resume,
                                 start_fresh=c.start_fresh)


def run(config: Any) -> dict[str, Any]:
    """Trains per `config`: the command's ConfigDict (validated here) or a validated `GRPOConfig`. Returns a
    summary: steps run, times, the last metrics."""
    clock = train_loop.Clock()
    settings = config if isinstance(config, GRPOConfig) else config_validation.validate(config)
    logging.info("%s", describe(settings))
    workdir = storage.abspath(settings.workdir)  # a local directory or a URL (gs://...): launch/README.md
    restore.check_output_dir(workdir, "workdir")  # writable, with free disk: one line before any work
    storage.makedirs(workdir)
    sft_summary: dict[str, Any] = {}
    if settings.warm_start.enabled:
        settings, sft_summary = warm_start_sft.warm_start(settings)
    if jax.process_index() == 0:  # the config the run trains with (after the warm start: its checkpoint)
        storage.write_text(storage.join(workdir, "config.json"), json.dumps(settings.to_dict(), indent=2))
    state = build(settings)
    ahead = start_compile_ahead(state)
    if jax.process_index() == 0:
        inputs.write_split(workdir, state.train_tasks, state.heldout, settings, validation=state.validation)
        state.cluster.write_protocol(storage.join(workdir, cluster.PROTOCOL_FILE))
    steps = GRPOSteps(state, workdir)
    done = train_loop.run(loop_config(settings, workdir, bool(state.validation)), steps)
    learning = plot_curves(steps, workdir)
    selected = choose_step(state, workdir)
    t_eval = time.perf_counter()
    final = final_evaluations(state, workdir, selected)
    steps.totals["final_eval_s"] = time.perf_counter() - t_eval
    ahead_report = ahead.wait() if ahead is not None else None
    return finish(steps, done, clock, learning=learning, final=final, selected=selected,
                  ahead_report=ahead_report, warm_start_s=sft_summary.get("this_run_s", 0.0))


def start_compile_ahead(state: Run) -> compile_cache.Ahead | None:
    """With `rollout.compile_ahead`: every program of the engines the run decodes with, and the update's
    programs no batch shape changes (the optimizer's, first: a few programs the first update needs),
    compiling on worker threads beside the run's own work (a program the run calls meanwhile waits for its
    compile rather than compiling it twice). Not ahead: the update's program per rows shape
    (`Trainer.programs_ahead(shapes)`), known only as a step's episodes end; compiling it then, during the
    rollout, made the embedded default's first two steps slower (BENCHMARKS.md, "2026-12-06 (fourth)")."""
    if not state.settings.rollout.compile_ahead:
        return None
    return compile_cache.Ahead(state.trainer.programs_ahead([])
                               + state.cluster.programs_ahead(state.rollout_config),
                               what="optimizer and engines").start()


def plot_curves(steps: GRPOSteps, workdir: str) -> dict[str, Any]:
    """The reward curve's summary (logged), and on process 0 its plot and, with two or more periodic
    evaluations, the held-out / validation accuracy curve's (`eval.report`)."""
    state, primary = steps.run, jax.process_index() == 0
    learning = reward_curve(steps.curve, storage.join(workdir, "reward_curve.png") if primary else None)
    if learning:
        logging.info("reward curve: %s", learning["line"])
    if primary and (len(steps.heldout_curve) >= 2 or len(state.validation_curve) >= 2):
        report.accuracy_curve(
            steps.heldout_curve, storage.join(workdir, "heldout_curve.png"),
            f"greedy builder, {min(state.settings.eval.num_tasks, len(state.heldout))} held-out corpora",
            validation=state.validation_curve)
    return learning


def choose_step(state: Run, workdir: str) -> int | None:
    """With `eval.select="validation"`: the step whose builder the final evaluation restores
    (`select_step` among step 0 and the kept checkpoints), logged; else None (the newest)."""
    if state.settings.eval.select != "validation":
        return None
    kept = restore.committed_steps(storage.join(workdir, restore.CHECKPOINT_DIR))
    selected = select_step(state.validation_curve, kept, state.step)
    if jax.process_index() == 0:
        logging.info("selected step %d of %s on %d validation corpora (accuracy by step: %s)", selected,
                     [0, *kept], len(state.validation), ", ".join(
                         f"{s}: {100 * a:.1f}%" for s, a in state.validation_curve))
    return selected


def final_evaluations(state: Run, workdir: str, selected: int | None) -> dict[str, Any]:
    """The eval command on the held-out split (`eval.final_methods`; greedy, then `eval.final_samples`
    sampled builds when asked), of the `selected` step's builder (None: the newest). Every process evaluates
    its share of the held-out corpora on its process-local engines and gets all the records
    (`eval.cli.execute`; every process restores each builder, a collective); process 0 reports."""
    e = state.settings.eval
    if not (e.final_methods and state.heldout):
        return {}
    at = {} if selected is None else {"step": selected}
    final = final_evaluation(workdir, e.final_methods, **at)
    if e.final_samples:
        final["sampled"] = final_evaluation(
            workdir, e.final_methods, name="final_sampled", samples=e.final_samples,
            builder_temperature=state.settings.rollout.config.builder.temperature, **at)
    return final


def finish(steps: GRPOSteps, done: train_loop.LoopResult, clock: train_loop.Clock, *,
           learning: dict[str, Any], final: dict[str, Any], selected: int | None, ahead_report: Any,
           warm_start_s: float) -> dict[str, Any]:
    """The run's `done:` line and `summary.json` (process 0 writes it); returns the summary."""
    state = steps.run
    wall = clock.wall_s()
    compiled = clock.compiled()  # this process's, warm start included
    by_process = compile_by_process(compiled)
    totals = steps.totals
    summary = {"start_step": done.start_step, "last_step": state.step, "wall_s": wall, **totals,
               "compile": {**compiled.as_dict(), "by_process": by_process,
                           "ahead": dataclasses.asdict(ahead_report) if ahead_report else None},
               "reward_curve": learning, "heldout_curve": steps.heldout_curve, "final_eval": final,
               "validation_curve": state.validation_curve, "selected_step": selected,
               "warm_start_s": warm_start_s, "initial_eval": _finite(steps.initial),
               "metrics": _finite(steps.metrics)}
    logging.info("done: steps %d..%d in %.1fs (rollout %.1fs, update %.1fs, eval %.1fs; of the whole run, "
                 "compiling %s; %s%s)", done.start_step + 1, state.step, wall, totals["rollout_s"],
                 totals["update_s"], totals["eval_s"], compiled.line() or "nothing", compile_line(by_process),
                 f"; ahead: {ahead_report.line()}" if ahead_report else "")
    if jax.process_index() == 0:
        storage.write_text(storage.join(steps.workdir, "summary.json"), json.dumps(summary, indent=2))
    return summary


def compile_by_process(compiled: compile_cache.CompileTotals) -> list[dict[str, int]]:
    """Every process's programs compiled anew and read from the persistent cache (one entry per process,
    in process order; a collective in a multi-process run)."""
    mine = {"compiled": compiled.compiled, "from_cache": compiled.cache_hits}
    return distributed.allgather_json(mine) if distributed.is_multi() else [mine]


def compile_line(by_process: list[dict[str, int]]) -> str:
    """`programs compiled / from the cache by process: 0: 3/57, 1: 0/58` (one process: `... 3/57`)."""
    parts = [f"{d['compiled']}/{d['from_cache']}" for d in by_process]
    if len(parts) == 1:
        return f"programs compiled / from the cache: {parts[0]}"
    return "programs compiled / from the cache by process: " + ", ".join(
        f"{i}: {p}" for i, p in enumerate(parts))


def reward_curve(curve: list[tuple[int, float]], png: str | None = None) -> dict[str, Any]:
    """The mean reward of the first and last fifth of the steps (mean +- standard error over steps) and
    a plot of the curve (`png`, `eval.report.reward_curve`). Empty for fewer than 2 steps."""
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
        out["png"] = report.reward_curve(steps, r, out["line"], png)
    return out


def select_step(curve: list[tuple[int, float]], kept: list[int], last: int) -> int:
    """The step whose greedy builder answered most validation questions (`curve`: (step, accuracy)), among
    step 0 (the starting policy) and the steps with a checkpoint (`kept`); ties go to the later step. No
    validation point: `last`."""
    candidates = [(a, s) for s, a in curve if s == 0 or s in kept]
    return max(candidates)[1] if candidates else last


def final_evaluation(workdir: str, methods: str, name: str = "final", **overrides: Any) -> dict[str, Any]:
    """configs/eval.py on this run's held-out split (`methods`; `overrides`: eval keys such as `samples`,
    `builder_temperature`), the table logged and printed; returns the accuracies and the report's path."""
    results = eval_lib.evaluate_run(workdir, methods=methods, name=name, **overrides)
    table = eval_lib.format_table(results)
    figures = eval_lib.format_figures(results)
    table = table + ("\n" + figures if figures else "")
    how = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "greedy builder"
    logging.info("held-out evaluation, %s (%s/eval/%s/report.md):\n%s", how, workdir, name, table)
    if jax.process_index() == 0:
        print(f"held-out evaluation, {how}:\n{table}")  # noqa: T201 - the run's closing answer
    return {"methods": methods, "report": storage.join(workdir, "eval", name, "report.md"),
            "accuracy": results["accuracy"]}


def evaluate(run: Run, seed: int, *, heldout: bool = True, validation: bool = False) -> dict[str, float]:
    """Periodic evaluation (`eval.every`): the eval command's own build and answer code
    (`eval.pipeline.periodic_eval`: greedy builder, no probes, the frozen answerer `eval.repeats` times per
    question) on the run's cluster, in one batch: `heldout`, the first `eval.num_tasks` held-out corpora, with
    the eval command's metric names, `eval/trained/accuracy` etc. (`eval/accuracy` the same accuracy);
    `validation`, the run's validation corpora (training split), `valid/accuracy`. Multi-process: each
    process evaluates its share of the corpora and every process gets the same metrics."""
    held = run.heldout[: run.settings.eval.num_tasks] if heldout else []
    val = run.validation if validation else []
    records, metrics = pipeline.periodic_eval(held + val, run.engines, run.tokenizer,
                                              run.cluster.rollout_for(cluster.Mode.EVAL),
                                              seed, repeats=run.settings.eval.repeats,
                                              templates=run.templates)
    metrics = {k: v for k, v in metrics.items() if k.endswith("_s")}  # build / answer times, both sets
    if held:
        metrics.update(pipeline.corpus_metrics(records, [t.task_id for t in held]))
        metrics["eval/accuracy"] = metrics["eval/trained/accuracy"]
    if val:
        metrics["valid/accuracy"] = pipeline.corpus_metrics(
            records, [t.task_id for t in val])["eval/trained/accuracy"]
    return metrics


def train_command(config: Any, dry_run: bool = False, compile_programs: bool = False) -> None:
    """`main --config=configs/grpo.py`: validate; with `dry_run` print what would run (the role table); with
    `compile_programs` too (`--dry_run --compile`) build the run's cluster and compile its engines' programs
    into the persistent compilation cache, then exit (`compile_ahead`)."""
    settings = config_validation.validate(config)
    if dry_run:
        print(describe(settings))  # noqa: T201 - the CLI's answer
        if compile_programs and settings.topology:  # the plan for a slice, from shapes (planning.plan)
            from librarian_jax.planning import plan as plan_lib

            plan_lib.run(settings, settings, storage.abspath(settings.workdir), mode="train")
            return
        if compile_programs:
            before = compile_cache.CompileClock.get().totals()
            report = compile_ahead(settings)
            spent = compile_cache.CompileClock.get().since(before)
            print(f"compiled ahead: {report.line()} (the engines' programs); this process: "  # noqa: T201
                  f"{spent.compiled} programs compiled, {spent.cache_hits} from the "
                  "persistent cache")
        return
    if settings.seeds:
        sweep(settings)
        return
    run(settings)


def sweep(settings: GRPOConfig) -> dict[str, Any]:
    """`--config.seeds=0,1,2,3,4`: the whole command (`run`) once per seed, each in `workdir/seed_<s>/` (a
    seed whose run finished is resumed, which evaluates again and returns at once), then the final
    evaluations pooled (`eval.sweep`): `workdir/sweep/report.md` and `results.json`, the table printed.
    Returns the pooled results."""
    require_typed(settings, GRPOConfig, "training.sweep")
    seeds = config_schema.int_list(settings.seeds)
    runs: dict[int, str] = {}
    for s in seeds:
        workdir = storage.join(settings.workdir, f"seed_{s}")
        c = dataclasses.replace(settings, seed=s, seeds="", workdir=workdir)
        logging.info("sweep: seed %d of %s in %s", s, seeds, c.workdir)
        run(c)
        runs[s] = storage.abspath(c.workdir)
    results = sweep_lib.pooled(runs, "final", draws=config_schema.EvalConfig().bootstrap.draws)
    out = storage.join(storage.abspath(settings.workdir), sweep_lib.REPORT_DIR)
    path = sweep_lib.write_pooled(out, results)
    table = sweep_lib.format_pooled(results)
    logging.info("sweep over seeds %s (%s):\n%s", seeds, path, table)
    if jax.process_index() == 0:
        print(f"seed sweep, final evaluations pooled ({path}):\n{table}")  # noqa: T201 - the answer
    return results


def compile_ahead(settings: GRPOConfig) -> compile_cache.AheadReport:
    """`--dry_run --compile`: prepares `settings`' run (tasks, tokenizer, meshes, cluster: `prepare`, no
    trainer and no optimizer state, which the engines' programs do not need; the warm start's model as its
    preset's random weights, which give the same programs; a tokenizer, if one is trained, in a temporary
    directory, not the workdir) and compiles every program of the engines it decodes with, on every core,
    into the persistent compilation cache, so a later run (or another process on the same cache) starts with
    them compiled. The train step's programs are not among them: each depends on a step's rows (a sequence
    bucket and a loss-position bucket), known after a rollout."""
    require_typed(settings, GRPOConfig, "training.compile_ahead")
    with tempfile.TemporaryDirectory(prefix="librarian_jax_compile_") as tmp:
        # the warm start off: the same architecture, the preset's
        c = dataclasses.replace(settings, workdir=tmp,
                                warm_start=dataclasses.replace(settings.warm_start, enabled=False))
        prepared = prepare(c)
        jobs = prepared.cluster.programs_ahead()
        logging.info("compiling %d programs of the run's engines ahead", len(jobs))
        return compile_cache.Ahead(jobs, threads=os.cpu_count() or 1, what="engines, --dry_run --compile"
                                   ).run()
