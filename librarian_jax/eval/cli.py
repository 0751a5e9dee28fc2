"""The `eval` and `build` commands of `librarian_jax.main` (configs/eval.py, configs/build.py).

    run_eval(config)       validate -> restore builders -> build -> answer -> statistics -> report
    evaluate_run(run_dir)  the same from Python (main's end-of-training table uses it)
    run_build(config)      one workspace over a user's folder, exported as a plain directory tree

Every check of the config, the run directory and its checkpoints happens before any model is loaded; each
bad input is one `ConfigError("config.<key>: ...")` naming the key and the path. After `plan_eval` /
`plan_build` only typed configs are read: the evaluation's own (`Plan.settings`) and the run's recorded one
(`Plan.run_cfg`, read through its schema), with this evaluation's overrides (`cluster.Overrides`).

Multi-process: `run_eval`/`evaluate_run` split the held-out corpora over the processes and gather the records
(`execute`); `run_build` builds its one workspace on every process (`run_build`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from librarian_jax import (
    cluster,
    data,
    distributed,
    inputs,
    models,
    storage,
    tokenizers,
)
from librarian_jax.cluster import Mode, Overrides
from librarian_jax.config_schema import (
    EVAL_METHODS,
    BuildConfig,
    ConfigError,
    EvalConfig,
    GRPOConfig,
    RunConfig,
)
from librarian_jax.config_validation import validate_mesh
from librarian_jax.eval import baselines, pipeline, report, restore
from librarian_jax.models.placement import placed_copy
from librarian_jax.presets import eval as eval_presets
from librarian_jax.presets import grpo as grpo_presets
from librarian_jax.rollout import jobs as rjobs
from librarian_jax.workspace import UPDATE_META, ExportError, Workspace, carry_over, load_export

BUILTIN_METHODS = EVAL_METHODS  # the `methods` choices (config_schema), and run:/other/workdir
ABLATIONS = ("flattened", "shuffled")
ACCOUNTING = (
    "Construction tokens B (per corpus, per construction; the mean over a corpus's samples): every token of "
    "the builder's context segments that it did not sample (system prompt, corpus listing, tool "
    "observations; each segment's prompt once, since the engine keeps the session's KV cache across turns, "
    "so a history compaction's new prompt counts again) + every token the builder sampled + the executor's "
    "prompt and generated tokens of every create/merge + the compaction summariser's tokens. Probes are off "
    "in evaluation. Raw navigation, BM25, embedding retrieval, reranking and agentic RAG construct nothing "
    "(B = 0; an index costs no LLM tokens); GraphRAG's B is the executor's tokens of every extraction and "
    "community summary, AutoCompaction's the executor's tokens of every compaction step (0 with the "
    "model-free extractive executor). Tokens embedded (per corpus, apart from B and A): the embedding "
    "model's forward tokens (every passage once, every query) and the reranker's (every (query, passage) "
    "pair scored). A failed construction counts B = 0 and all its questions incorrect. Answer tokens A (per "
    "question): the answerer's prompt and observation tokens (tokens read: retrieved passages and search "
    "results included) + its generated tokens; a greedy repeat that is run once and recorded again costs "
    "what the original did. Passages read per question: those in the first prompt, or returned by search."
)


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config.{key}: {msg}")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def _ints(config: Any, key: str) -> list[int]:
    text = getattr(config, key)
    try:
        vals = [int(x) for x in _csv(text)]
    except ValueError:
        raise _err(key, f"must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise _err(key, f"must list integers >= 1, got {text!r}")
    return vals


def method_label(method: str) -> str:
    return f"run:{os.path.basename(os.path.normpath(method[4:]))}" if method.startswith("run:") else method


# ------------------------------------------------------------------------------------------- validation


@dataclasses.dataclass
class Plan:
    """What a validated eval config will do (no model loaded yet): `settings` is the validated, typed config
    (`config_schema.EvalConfig`, all evaluation reads of it); `run_cfg` the run's recorded config, typed."""

    run_dir: str
    run_cfg: RunConfig
    step: int
    step_dir: str
    methods: list[str]
    extra_runs: dict[str, tuple[RunConfig, str, int]]  # label -> (run config, step dir, step)
    out_dir: str
    pass_k: list[int]
    cost_qs: list[int]
    settings: EvalConfig


def _check_builder(c: Any) -> None:
    b = c.builder
    if b and not b.startswith("hf:"):
        raise _err("builder", f"must be '' (the run's checkpoint) or 'hf:/path', got {b!r}")
    if b and not os.path.isfile(os.path.join(b[3:], "config.json")):
        raise _err("builder", f"{b[3:]!r} is not a Hugging Face model folder (no config.json)")


def _no_run_config(c: EvalConfig) -> GRPOConfig:
    """Without a run: the `train_preset` of configs/grpo.py with the `builder=hf:` model as its policy."""
    try:
        cfg = grpo_presets.get_config(c.train_preset)
    except ValueError as e:
        raise _err("train_preset", str(e)) from None
    cfg.model.update(init="hf", path=c.builder[3:], lora_rank=0)
    cfg.topology = c.topology  # a plan reads no weights (`config_schema.planning`)
    try:
        return GRPOConfig.parse(cfg)
    except ConfigError as e:
        raise _err("train_preset", str(e)) from None


def plan_eval(config: Any) -> Plan:
    """Validates an eval config (every key: `config_schema.EvalConfig`) against the file system (run dir,
    checkpoints, shapes). No model loaded."""
    c = EvalConfig.parse(config)  # types, bounds and choices of every key, the method names
    _check_builder(c)
    methods = _csv(c.methods)
    if len(set(map(method_label, methods))) != len(methods):
        raise _err("methods", f"lists a method twice: {methods}")
    pass_k = _ints(c, "pass_k")
    if max(pass_k) > c.samples:
        raise _err("pass_k", f"k={max(pass_k)} needs at least that many samples (config.samples={c.samples})")
    cost_qs = _ints(c, "cost_qs")
    for role, needed in (("embedding", baselines.needs_embedding(methods, c)),
                         ("reranker", baselines.needs_reranker(methods))):
        path = getattr(c.roles, role).path
        if needed and not path:
            raise _err(f"roles.{role}.path", f"required by methods {methods} (a Hugging Face folder of the "
                       f"{role} model, e.g. Qwen3-{'Embedding' if role == 'embedding' else 'Reranker'}-0.6B)")
        if needed and not storage.isfile(storage.join(path, "config.json")):
            raise _err(f"roles.{role}.path", f"{path!r} is not a Hugging Face model folder (no config.json)")
    for k in ("tasks", "task_ids"):
        if getattr(c, k) and not os.path.exists(getattr(c, k)):
            raise _err(k, f"{getattr(c, k)!r} does not exist")
    validate_mesh(c.mesh.shape, jax.device_count())
    step, step_dir = -1, ""
    if c.run:
        run_dir = storage.abspath(c.run)  # a local directory or a URL (gs://...)
        run_cfg = restore.load_run_config(run_dir)
        if not c.builder and c.step == 0:  # the run's starting weights: the base builder's
            step = 0
        elif not c.builder:
            step, step_dir = restore.select_step(run_dir, c.step if c.step >= 0 else None)
            restore.check_checkpoint(step_dir, run_cfg)
        if not c.tasks and not c.task_ids and not storage.isfile(storage.join(run_dir, "split.json")):
            raise _err(
                "run",
                f"{storage.join(run_dir, 'split.json')!r} is missing (the run's held-out ids); "
                f"give config.task_ids or config.tasks",
            )
    else:
        if not c.builder:
            raise _err("run", "required: a training workdir (or config.builder=hf:/path with config.tasks)")
        if not c.tasks:
            raise _err("tasks", "required without config.run (a task file to evaluate on)")
        if "base" in methods:
            raise _err("methods", "'base' (the run's initial weights) needs config.run")
        run_dir, run_cfg = "", _no_run_config(c)
    extra = {}
    for m in methods:
        if m.startswith("run:"):
            d = storage.abspath(m[4:])
            rc = restore.load_run_config(d, key="methods")
            s, sd = restore.select_step(d, None, key="methods")
            restore.check_checkpoint(sd, rc)
            extra[method_label(m)] = (rc, sd, s)
    if c.out:
        out_dir = c.out
    elif run_dir:
        out_dir = storage.join(run_dir, "eval", c.name)
    else:
        raise _err("out", "required without config.run")
    restore.check_output_dir(out_dir, "out" if c.out else "run")  # writable, with free space: before any work
    return Plan(
        run_dir,
        run_cfg,
        step,
        step_dir,
        [method_label(m) for m in methods],
        extra,
        out_dir,
        pass_k,
        cost_qs,
        c,
    )


def _read_ids(path: str) -> list[str]:
    """The held-out ids of a task-id file (`data.read_task_ids`, the reader training's split_file uses)."""
    try:
        return data.read_task_ids(path)[1]
    except data.DataError as e:
        raise _err("task_ids", str(e)) from None


def heldout_tasks(plan: Plan) -> tuple[list[Any], str]:
    """The held-out tasks and where their ids came from: `tasks` (a file) filtered by `task_ids` when
    given; else the run's own data (`inputs.build_tasks` on its config) selected by its split.json ids."""
    c = plan.settings
    if c.tasks:
        try:
            n = c.questions_per_domain
            sample = n and data.sniff_format(c.tasks) == "bright"
            kwargs = {"questions_per_domain": n, "seed": c.sample_seed} if sample else {}
            pool = data.load_tasks(c.tasks, **kwargs)
        except data.DataError as e:
            raise _err("tasks", str(e)) from None
        source = f"tasks file {c.tasks}"
    else:
        train, held = inputs.build_tasks(plan.run_cfg)
        pool = train + held
        source = f"the run's data ({plan.run_cfg.data.source})"
    if c.task_ids:
        ids, source = _read_ids(c.task_ids), source + f", ids from {c.task_ids}"
    elif c.tasks and not plan.run_dir:
        ids = [t.task_id for t in pool]
    else:
        split = storage.join(plan.run_dir, "split.json")
        if c.tasks and not storage.isfile(split):
            ids = [t.task_id for t in pool]
        else:
            ids = json.loads(storage.read_text(split))["heldout"]
            source += f", held-out ids recorded in {split}"
    by_id = {t.task_id: t for t in pool}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise _err(
            "task_ids" if c.task_ids else "run",
            f"{len(missing)} held-out ids are not in the tasks "
            f"(first {missing[0]!r}); the data differs from the run's",
        )
    tasks = [by_id[i] for i in ids]
    if c.num_tasks:
        tasks = tasks[: c.num_tasks]
    if not tasks:
        raise _err("run", f"no held-out task to evaluate ({source})")
    return tasks, source


# ------------------------------------------------------------------------------------------- the cluster


def builder_weights(plan: Plan) -> str:
    """The trained builder as the protocol names it: `run:DIR@STEP`, or the HF folder of `builder=hf:`."""
    if plan.settings.builder.startswith("hf:"):
        return plan.settings.builder[3:]
    return f"run:{plan.run_dir}@{plan.step}"


def plan_topology(c: EvalConfig, mode: str) -> dict[str, Any]:
    """`--dry_run --compile --config.topology=ACCEL` of an evaluation or a build (`c`: its eval keys): the
    plan of its engines (the run's protocol with this evaluation's overrides, `Overrides.of_eval`) for that
    slice, written to the report folder's plan.json (`out`, else `<run>/eval/<name>`). No weights, tasks or
    checkpoints are read (the run's config.json is; without a run, `train_preset` with `builder=hf:`
    shapes)."""
    from librarian_jax.planning import plan as plan_lib

    if c.run:
        run_dir = storage.abspath(c.run)
        run_cfg = restore.load_run_config(run_dir)
    else:
        run_dir, run_cfg = "", _no_run_config(c)
    out_dir = c.out or (storage.join(run_dir, "eval", c.name) if run_dir else "")
    if not out_dir:
        raise _err("out", "required without config.run (the folder plan.json goes to)")
    return plan_lib.run(c, run_cfg, out_dir, mode=mode, overrides=Overrides.of_eval(c))


def eval_cluster(plan: Plan, mode: Mode, mesh: Any, tokenizer: Any) -> cluster.Cluster:
    """The cluster of this evaluation or build (`Cluster.from_run`): the training run's protocol from its
    recorded config with this evaluation's explicit overrides, on this process's engines; its builder serves
    the run's initial weights until a method's are synced (`Cluster.sync_weights`)."""
    base = placed_copy(restore.base_model(plan.run_cfg, mesh, tokenizer), mesh)
    overrides = Overrides.of_eval(plan.settings, builder_weights(plan))
    return cluster.Cluster.from_run(plan.run_cfg, mode, overrides, tokenizer=tokenizer, engine_mesh=mesh,
                                    base=base)


def eval_tokenizer(plan: Plan, tasks: list[Any]) -> Any:
    """The run's tokenizer (`restore.run_tokenizer`), or the `builder=hf:` folder's without a run."""
    if plan.run_dir:
        return restore.run_tokenizer(plan.run_cfg, plan.run_dir, tasks)
    return tokenizers.load_tokenizer(plan.settings.builder[3:])


def builder_model(label: str, plan: Plan, the_cluster: cluster.Cluster) -> Any:
    """The weights of builder method `label`, on the cluster's engine mesh."""
    mesh, tok = the_cluster.engine_mesh, the_cluster.tokenizer
    if label == "base" or (label == "trained" and plan.step == 0):  # step 0 (`plan_eval`): the run's
        return the_cluster.base  # starting weights
    if label == "trained":
        if plan.settings.builder.startswith("hf:"):
            return models.load_hf(plan.settings.builder[3:], dtype=plan.run_cfg.model.dtype or "bfloat16",
                                  mesh=mesh)
        return restore.restore_builder(  # a step asked for by number never falls back to another
            plan.run_cfg, plan.step_dir, mesh, tok, base=the_cluster.base, fallback=plan.settings.step < 0)
    run_cfg, step_dir, _ = plan.extra_runs[label]
    return restore.restore_builder(run_cfg, step_dir, mesh, tok)


def protocol_check(plan: Plan, the_cluster: cluster.Cluster) -> dict[str, Any]:
    """This evaluation's protocol, the training run's (`RUN/protocol.json`; rebuilt from its config for a
    run from before that file), and their differences (each an explicit override, or a setting evaluation
    changes, such as a greedy builder), logged as a warning."""
    used = the_cluster.protocol()
    asked = list(the_cluster.overrides.asked)
    trained = None
    if plan.run_dir:
        trained = cluster.read_protocol(storage.join(plan.run_dir, cluster.PROTOCOL_FILE))
        if trained is None:
            trained = cluster.protocol(plan.run_cfg, the_cluster.tokenizer)
    diffs = cluster.protocol_diff(trained, used) if trained else []
    # the builder's own sampling is evaluation's choice (`builder_temperature`, greedy by default): said, not
    # warned about; any other difference is an override or a changed run, and warned about
    sampling = [d for d in diffs if d[0] == cluster.BUILDER and d[1] in ("temperature", "top_p")]
    others = [d for d in diffs if d not in sampling]
    for level, group in ((logging.INFO, sampling), (logging.WARNING, others)):
        if group:
            logging.log(level, "eval protocol differs from the training run's in %d field(s) (explicit "
                        "overrides: %s):\n%s", len(group), ", ".join(asked) or "none",
                        "\n".join(f"  {r}.{f}: {y!r} (trained: {x!r})" for r, f, x, y in group))
    return {"used": used, "trained": trained, "overrides": asked,
            "differences": [{"role": r, "field": f, "trained": x, "eval": y} for r, f, x, y in diffs],
            "table": cluster.protocol_table(used, trained)}


# ------------------------------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class Evaluation:
    """One process's evaluation in progress (`execute`): its plan, cluster, its share of the held-out
    corpora (`mine`, the first at global index `start`), the jobs by section in the order of a
    single-process run, the answers so far, the constructions by method, and the timings."""

    plan: Plan
    the_cluster: cluster.Cluster
    mine: list[Any]
    start: int
    progress: bool
    timing: dict[str, float]
    sections: list[tuple[str, list[rjobs.Job]]] = dataclasses.field(default_factory=list)
    answer_of: dict[int, Any] = dataclasses.field(default_factory=dict)
    built_by: dict[str, list[rjobs.Built]] = dataclasses.field(default_factory=dict)

    @property
    def cfg(self) -> Any:
        return self.the_cluster.rollout

    @property
    def engines(self) -> rjobs.Engines:
        return lambda: self.the_cluster.engines

    def construction_shape(self) -> tuple[int, int, int]:
        """(episodes per corpus, corpora per build batch, answer repeats per construction): one construction
        per corpus answered `samples` times (a greedy builder, or sampled answers: BRIGHT's protocol), or (a
        sampling builder, greedy answers) each sample its own construction + answer."""
        c = self.plan.settings
        one_build = self.cfg.builder.temperature == 0.0 or self.cfg.repeat_mode == "sample"
        group = 1 if one_build else c.samples
        slots = self.the_cluster.specs[cluster.Role.BUILDER].slots
        return group, rjobs.batch_tasks_for(c.batch_tasks, slots, group), c.samples if one_build else 1

    def answer(self, jobs: list[rjobs.Job]) -> None:
        """Answers `jobs` (the frozen answerer on the cluster's engines) into `answer_of`."""
        t0 = time.perf_counter()
        out = rjobs.answer_jobs(jobs, self.engines, self.the_cluster.tokenizer, self.cfg,
                                templates=self.the_cluster.templates, seed=self.plan.settings.seed,
                                reset=self.the_cluster.reset, progress=self.progress)
        self.answer_of.update({id(j): a for j, a in zip(jobs, out, strict=True)})
        self.timing["answer_s"] += time.perf_counter() - t0

    def unanswered(self) -> list[rjobs.Job]:
        return [j for _, js in self.sections for j in js if id(j) not in self.answer_of]


def build_methods(ev: Evaluation) -> None:
    """Every builder method's constructions of this process's corpora (a section each): its weights synced
    to the builder's engine, then `rjobs.build_workspaces`; a greedy builder on the weights of an earlier
    method (the step chosen is 0: `trained` is the warm start, `base`) reuses that method's constructions."""
    c, the_cluster = ev.plan.settings, ev.the_cluster
    group, batch, repeats = ev.construction_shape()
    greedy = ev.cfg.builder.temperature == 0.0
    weights_of: dict[str, Any] = {}
    for label in ev.plan.methods:
        if label in baselines.METHODS:
            continue
        t0 = time.perf_counter()
        distributed.meet(f"restore_{label}")  # the restore is a collective; shares end at different times
        weights = builder_model(label, ev.plan, the_cluster)
        twin = next((m for m, w in weights_of.items() if w is weights), None) if greedy else None
        weights_of[label] = weights
        if twin is not None:
            logging.info("eval: %s has %s's weights and a greedy builder: its constructions reused", label,
                         twin)
            built = [dataclasses.replace(b, method=label,
                                         workspace=None if b.workspace is None else b.workspace.copy())
                     for b in ev.built_by[twin]]
        else:
            the_cluster.sync_weights(weights)
            built = rjobs.build_workspaces(
                label, ev.mine, ev.engines, the_cluster.tokenizer, ev.cfg, templates=the_cluster.templates,
                group_size=group, seed=c.seed, batch_tasks=batch, reset=the_cluster.reset,
                progress=ev.progress, start=ev.start)
        ev.built_by[label] = built
        ev.sections.append((f"build/{label}", [rjobs.Job.of(b, repeats) for b in built]))
        ev.timing[f"build_{label}_s"] = time.perf_counter() - t0


def retrieval_tuner(ev: Evaluation, tuned: dict[str, dict[str, Any]]) -> Any:
    """With a `matched` retrieval budget (docs/eval.md): the workspace methods answered first (what the
    answerer read on the `against` method's is the budget), and the function that tunes each retrieval
    method's k on the run's training corpora into `tuned`; else None (fixed k)."""
    c = ev.plan.settings
    budgeted = [m for m in ev.plan.methods if m in baselines.RETRIEVAL_METHODS]
    if c.retrieval_budget.mode != "matched" or not budgeted:
        return None
    if c.retrieval_budget.against not in ev.plan.methods:
        logging.info("retrieval budget: %r is not evaluated here, so %s keep their fixed k (bm25.top_k, "
                     "agentic.k)", c.retrieval_budget.against, budgeted)
        return None
    ev.answer(ev.unanswered())
    budget = reading_budget(c.retrieval_budget.against, ev.sections, ev.answer_of, ev.cfg)

    def tune(retrieval_models: baselines.RetrievalModels) -> dict[str, int]:
        train = training_tasks(ev.plan)[: c.retrieval_budget.corpora]
        tuned.update(baselines.tune_ks(budgeted, train, budget, ev.the_cluster, ev.the_cluster.tokenizer,
                                       ev.cfg, c, retrieval_models, seed=c.seed))
        return {m: t["k"] for m, t in tuned.items()}

    return tune


def ablation_jobs(ev: Evaluation) -> list[str]:
    """The ablation section (each trained first construction flattened and shuffled) when enabled; returns
    the ablation methods."""
    c = ev.plan.settings
    ablation = list(ABLATIONS) if c.ablation.enabled and "trained" in ev.built_by else []
    variants: list[rjobs.Job] = []
    for b in ev.built_by.get("trained", []) if ablation else []:
        if b.episode == 0:
            flat = b.workspace.flattened() if b.workspace is not None else None
            shuf = b.workspace.shuffled(c.ablation.shuffle_seed) if b.workspace is not None else None
            for name, ws in (("flattened", flat), ("shuffled", shuf)):
                variants.append(rjobs.Job.of(b, 1, method=name, workspace=ws))
    ev.sections.append(("ablation", variants))
    return ablation


def gather_shares(ev: Evaluation) -> tuple[list[tuple[str, list[dict]]], dict[str, Any]]:
    """(this process's records by section, what every process holds once gathered): its records, failed
    constructions, times, and (process 0 exports them) the first construction of each of its corpora per
    method. The workspaces travel to process 0 as snapshots rather than each process exporting its own: the
    report directory need not be shared (a gs:// report's workspaces go to a local stand-in directory; hosts
    of a pod slice share no local disk), and process 0 writes one complete tree, as in one process."""
    own = [(name, [dict(r, step=ev.plan.step) for j in js
                   for r in pipeline.job_records(j, ev.answer_of[id(j)], ev.cfg)])
           for name, js in ev.sections]
    firsts = [(m, b) for m, bs in ev.built_by.items() for b in bs
              if b.episode == 0 and b.workspace is not None]
    shares = [*own, ("failed", [{m: sum(1 for b in bs if b.failed) for m, bs in ev.built_by.items()}]),
              ("timing", [ev.timing]), ("shapes", [[m, b.workspace.stats()] for m, b in firsts])]
    if ev.plan.settings.export_workspaces:
        shares.append(("workspaces", [[m, b.task.task_id, b.workspace.to_dict(include_raw_text=False)]
                                      for m, b in firsts]))
    return own, distributed.gather_sections(shares, "execute")


def eval_setup(ev: Evaluation, split_source: str, retrieval_models: dict[str, Any]) -> dict[str, Any]:
    """The report's setup section: what was evaluated, on what, with which sampling."""
    c, plan, cfg = ev.plan.settings, ev.plan, ev.cfg
    greedy_builder, sampled = cfg.builder.temperature == 0.0, cfg.repeat_mode == "sample"
    return {
        "name": c.name,
        "run": plan.run_dir or c.builder,
        "step": plan.step,
        "split": split_source,
        "builder": c.builder or ("the run's starting weights (step 0, the base builder's)" if plan.step == 0
                                 else "the run's checkpoint"),
        "answerer": f"{cfg.answerer.kind} (temperature "
        f"{cfg.answerer.temperature}, {cfg.answerer.max_turns} turns)",
        "builder_temperature": cfg.builder.temperature,
        "samples": c.samples,
        "sample_unit": (f"one answer sampled at temperature {cfg.repeat_temperature} on the corpus's one "
                        f"{'greedy' if greedy_builder else 'sampled'} construction") if sampled
        else "one construction + one answer" if not greedy_builder
        else "one answer on the (greedy) construction",
        "answer_temperature": cfg.repeat_temperature if sampled else 0.0,
        "preset": c.preset,
        "protocol_overrides": list(ev.the_cluster.overrides.asked),
        "retrieval_models": retrieval_models,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "mesh": dict(ev.the_cluster.engine_mesh.shape),
    }


def export_gathered(ev: Evaluation, tasks: list[Any], gathered: dict[str, Any]) -> dict[str, int]:
    """Process 0: every process's first constructions exported under the report's `workspaces/` (plain
    local directories, `workspace.export`: a gs:// report's go to a local stand-in directory, logged)."""
    out_dir = ev.plan.out_dir
    root = storage.local_cache_dir(storage.join(out_dir, "workspaces"), "workspaces")
    if root != storage.join(out_dir, "workspaces"):
        logging.info("workspaces of %s exported locally to %s", out_dir, root)
    by_id = {t.task_id: t for t in tasks}
    firsts: dict[str, list[rjobs.Built]] = {m: [] for m in ev.built_by}
    for m, task_id, snap in gathered["workspaces"]:
        task = by_id[task_id]
        firsts[m].append(rjobs.Built(m, task, 0, Workspace.from_dict(snap, docs=task.documents)))
    return export_workspaces(root, firsts)


def execute(plan: Plan, *, progress: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Runs a validated plan: builds, answers, analyses and writes the report. Returns (results, records).

    Multi-process (every process calls it): each process builds and answers only its contiguous share of
    the held-out corpora (`distributed.share`, uneven or empty shares included) on its process-local engines;
    the per-question records are gathered in the order of a single-process run (`gather_shares`; no seed
    depends on the split), every process analyses all of them (the same results everywhere), and process 0
    exports the workspaces and writes the one report. Timing entries are the slowest process's. Every
    process still loads every builder (restores are collectives), even with an empty share."""
    c = plan.settings
    t_start = time.perf_counter()
    tasks, split_source = heldout_tasks(plan)
    part = distributed.share(len(tasks))
    logging.info("eval: process %d of %d builds and answers corpora [%d, %d) of %d", jax.process_index(),
                 jax.process_count(), part.start, part.stop, len(tasks))
    mesh = cluster.local_mesh(c.mesh)  # multi-process: this process's devices (engines are local)
    the_cluster = eval_cluster(plan, Mode.EVAL, mesh, eval_tokenizer(plan, tasks))
    proto = protocol_check(plan, the_cluster)
    ev = Evaluation(plan, the_cluster, tasks[part], part.start, progress,
                    {"load_s": time.perf_counter() - t_start})
    build_methods(ev)
    ev.timing["answer_s"] = 0.0
    tuned: dict[str, dict[str, Any]] = {}
    tune = retrieval_tuner(ev, tuned)
    # every method without the builder (eval.baselines): raw, retrieval, agentic RAG, GraphRAG, AutoCompaction
    base_jobs, constructed, retrieval_models = baselines.baseline_sections(
        plan.methods, ev.mine, the_cluster, the_cluster.tokenizer, ev.cfg, c, mesh, timing=ev.timing,
        tune=tune, batch_tasks=ev.construction_shape()[1])
    ev.built_by.update(constructed)
    ev.sections.append(("baselines", base_jobs))
    ablation = ablation_jobs(ev)
    ev.answer(ev.unanswered())
    own, gathered = gather_shares(ev)
    records = [r for name, _ in own for r in gathered[name]]
    timing = distributed.slowest(gathered["timing"])
    results = report.analyse(records, plan.methods + ablation, [t.task_id for t in tasks],
                             draws=c.bootstrap.draws, seed=c.bootstrap.seed, cost_qs=plan.cost_qs,
                             pass_k=plan.pass_k, ablation=ablation)
    results["failed_constructions"] = {m: sum(f[m] for f in gathered["failed"]) for m in ev.built_by}
    results["shapes"] = report.workspace_shapes(gathered["shapes"])
    results["retrieval_budget"] = {
        "mode": "matched" if tuned else "fixed",
        "ks": {m: baselines.method_k(m, c, {k: t["k"] for k, t in tuned.items()})
               for m in plan.methods if m in baselines.RETRIEVAL_METHODS},
        "tuning": tuned,
    }
    results["protocol"] = proto
    results["accounting"] = ACCOUNTING
    results["setup"] = eval_setup(ev, split_source, retrieval_models)
    if c.export_workspaces and jax.process_index() == 0:
        t0 = time.perf_counter()
        results["workspaces"] = export_gathered(ev, tasks, gathered)
        timing["export_s"] = time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t_start
    results["timing"] = timing
    if jax.process_index() == 0:  # multi-process: every process holds all the records; one report
        report.write_report(plan.out_dir, results, records, step=max(plan.step, 0))
        cluster.write_protocol(storage.join(plan.out_dir, cluster.PROTOCOL_FILE), proto["used"])
    return results, records


def reading_budget(against: str, sections: list[tuple[str, list[rjobs.Job]]], answer_of: dict[int, Any],
                   cfg: Any) -> float:
    """Tokens the answerer read per question on method `against`'s workspaces, over every process's corpora
    (the `matched` retrieval budget). A run without that method, or whose answers all failed: raises."""
    rows = [[r["tokens_read"], r["status"] in ("ok", "cache_full")] for _, js in sections for j in js
            if j.method == against for r in pipeline.job_records(j, answer_of[id(j)], cfg)]
    rows = distributed.gather_sections([("rows", rows)], "reading_budget")["rows"]
    read = [t for t, answered in rows if answered]
    if not read:
        raise _err("retrieval_budget.against", f"{against!r} has no answered question to take a reading "
                   f"budget from (methods must include it, or set retrieval_budget.mode='fixed')")
    return float(np.mean(read))


def training_tasks(plan: Plan) -> list[Any]:
    """The run's training corpora (its split.json `train` ids, in order): where a `matched` retrieval budget
    tunes its k. None recorded (a tasks file without a run): raises."""
    split = storage.join(plan.run_dir, "split.json") if plan.run_dir else ""
    if not split or not storage.isfile(split):
        raise _err("retrieval_budget.mode", "'matched' tunes k on the run's training corpora: it needs a run "
                   "with a split.json (or set retrieval_budget.mode='fixed')")
    ids = json.loads(storage.read_text(split)).get("train", [])
    train, held = inputs.build_tasks(plan.run_cfg)
    by_id = {t.task_id: t for t in train + held}
    tasks = [by_id[i] for i in ids if i in by_id]
    if not tasks:
        raise _err("retrieval_budget.mode", f"no training corpus of {split} is in the run's data")
    return tasks


def export_workspaces(root: str, built_by: dict[str, list[rjobs.Built]]) -> dict[str, int]:
    """Each method's first construction of each corpus, exported under `root/<method>/<corpus>/`."""
    if os.path.isdir(root) and not os.path.islink(root):
        shutil.rmtree(root)
    counts = {}
    for m, built in built_by.items():
        counts[m] = 0
        for b in built:
            if b.episode == 0 and b.workspace is not None:
                r = b.workspace.export(
                    os.path.join(root, m.replace(":", "_").replace("/", "_"), b.task.task_id)
                )
                counts[m] += int(r.ok)
    return counts


def evaluate_run(
    run_dir: str,
    *,
    methods: str | list[str] | None = None,
    name: str = "heldout",
    config: Any = None,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Evaluates a training workdir on its recorded held-out split and writes `run_dir/eval/<name>/`.

    Args:
      run_dir: the training workdir.
      methods: e.g. `["trained", "base", "raw"]` (default: the eval config's).
      name: the report's folder name.
      config: an eval ConfigDict (default `configs/eval.py`'s embedded preset).
      overrides: any top-level eval key (`num_tasks=2`, `samples=4`, ...).
    Returns the results dict (`format_table(results)` prints the held-out table).
    """
    c = config if config is not None else eval_presets.get_config()
    c = ml_collections.ConfigDict(c.to_dict())
    c.run, c.name = run_dir, name
    if methods is not None:
        c.methods = methods if isinstance(methods, str) else ",".join(methods)
    for k, v in overrides.items():
        if k not in c:
            raise _err(k, "unknown eval key")
        c[k] = v
    results, _ = execute(plan_eval(c), progress=progress)
    return results


format_table = report.format_table


def run_eval(config: Any, dry_run: bool = False, compile_programs: bool = False) -> dict[str, Any] | None:
    """`main --config=configs/eval.py`: validate, then evaluate and print the table; with `dry_run` and
    `compile_programs` and `topology`, the plan of its engines for that slice (`plan_topology`)."""
    if dry_run and compile_programs:
        plan_topology(_topology_config(EvalConfig.parse(config)), "eval")
        return None
    plan = plan_eval(config)
    what = (f"eval {plan.methods} of {plan.run_dir or plan.settings.builder} (step {plan.step}) -> "
            f"{plan.out_dir}")
    if dry_run:
        print(what)  # noqa: T201 - the CLI's answer
        return None
    logging.info("%s", what)
    results, _ = execute(plan)
    figures = report.format_figures(results)
    print(format_table(results) + ("\n" + figures if figures else ""))  # noqa: T201
    print(f"report: {storage.join(plan.out_dir, 'report.md')}")  # noqa: T201
    return results


# ------------------------------------------------------------------------------------------- build


def plan_build(config: Any) -> tuple[Plan, Any, BuildConfig]:
    """Validates a build config (every key: `config_schema.BuildConfig`; folder, output, run, checkpoint);
    returns (plan, the folder's task, the build config typed). The plan's settings are an eval config of the
    build's shared keys."""
    c = BuildConfig.parse(config)
    path = c.data.path
    if not path:
        raise _err("data.path", "required: a folder of .txt/.md files")
    if not os.path.isdir(path):
        raise _err("data.path", f"{path!r} is not a folder")
    exts = tuple(_csv(c.data.extensions))
    try:
        task = data.load_folder(path, extensions=exts, task_id=os.path.basename(os.path.normpath(path)))
    except data.DataError as e:
        raise _err("data.path", str(e)) from None
    if not task.documents:
        raise _err("data.path", f"{path!r} holds no non-empty {'/'.join(exts)} file")
    if not c.out:
        raise _err("out", "required: the directory to export the workspace to")
    if os.path.isfile(c.out) or (os.path.isdir(c.out) and os.listdir(c.out)):
        raise _err("out", f"{c.out!r} exists and is not an empty folder")
    if c.update_from:
        old, out = os.path.realpath(c.update_from), os.path.realpath(c.out)
        if os.path.commonpath([old, out]) == old:
            raise _err("out", f"{c.out!r} lies inside the workspace to update ({c.update_from!r}), which is "
                              f"never written to: export the update elsewhere")
        try:
            load_export(c.update_from)
        except ExportError as e:
            raise _err("update_from", str(e)) from None
    return plan_eval(_build_eval_keys(c)), task, c


def _build_eval_keys(c: BuildConfig) -> dict[str, Any]:
    """The eval config of a build's shared keys (run, step, builder, out, seed, engine, mesh, topology,
    plan, ...)."""
    e = EvalConfig().to_dict()
    b = c.to_dict()
    e.update({k: b[k] for k in sorted((set(e) & set(b)) - {"command"})})
    e.update(methods="trained", name="build", tasks="", task_ids="", samples=1, num_tasks=0, pass_k="1",
             cost_qs="1")
    return e


def _topology_config(c: EvalConfig) -> EvalConfig:
    if not c.topology:
        raise _err("topology", "--compile of an evaluation or a build plans for a slice: give "
                   "--config.topology=ACCEL (e.g. v5p-8); a run compiles its own programs ahead")
    return c


def run_build(config: Any, dry_run: bool = False, compile_programs: bool = False) -> dict[str, Any] | None:
    """`main --config=configs/build.py`: the trained builder's workspace over `data.path`, exported to `out`
    (README.md, raw_docs/ unchanged, synthetic files with source links and hashes, manifest.json,
    build.json with the construction's tokens, turns and status).

    With `update_from` (an old export) it is an incremental update (`workspace.update`): the old workspace
    carried over to the folder's documents, then an update episode of at most `update_max_turns` turns
    (none when nothing changed); the old directory is only read; build.json's `update` says what changed
    and which synthetic files are still stale.

    Multi-process: unlike `execute`, nothing is split. One construction is one episode, which cannot be
    shared out, so every process builds the same workspace (same seed, same weights; the restore is a
    collective) on its process-local engines and process 0 exports it; the others return None."""
    if dry_run and compile_programs:
        keys = _build_eval_keys(BuildConfig.parse(config))
        plan_topology(_topology_config(EvalConfig.parse(keys)), "build")
        return None
    plan, task, b = plan_build(config)  # `b`: the build's own keys; `plan.settings`: the eval keys it shares
    c = plan.settings
    folder = b.data.path
    if dry_run:
        print(
            f"build a workspace over {len(task.documents)} documents of {folder} with "  # noqa: T201
            f"{plan.run_dir or c.builder} (step {plan.step}) -> {c.out}"
            + (f" (an update of {b.update_from})" if b.update_from else "")
        )
        return None
    t0 = time.perf_counter()
    mesh = cluster.local_mesh(c.mesh)  # multi-process: this process's devices (engines are local)
    tokenizer = eval_tokenizer(plan, [task])
    start = None
    if b.update_from:  # an incremental update: the old export carried over to the folder's documents
        start = carry_over(load_export(b.update_from).workspace, task.documents, b.update_max_turns)
        logging.info("build: updating %s: %s, %d stale synthetic files", b.update_from,
                     start.changes.counts(), len(start.stale))
        task = dataclasses.replace(task, meta={**task.meta, UPDATE_META: start})
    if start is not None and start.changes.empty:  # nothing changed: the old workspace as it was
        built = rjobs.Built("trained", task, 0, start.workspace.copy())
    else:
        the_cluster = eval_cluster(plan, Mode.BUILD, mesh, tokenizer)
        the_cluster.sync_weights(builder_model("trained", plan, the_cluster))
        built = rjobs.build_workspaces(
            "trained", [task], lambda: the_cluster.engines, tokenizer, the_cluster.rollout,
            templates=the_cluster.templates, seed=c.seed, reset=the_cluster.reset)[0]
    if built.workspace is not None:
        ws = built.workspace
    else:  # a failed construction: the raw documents, or for an update the carried-over workspace
        ws = start.workspace.copy() if start is not None else Workspace.from_documents(list(task.documents))
    if jax.process_index() != 0:  # multi-process: every process built the same workspace; process 0 exports
        return None
    res = ws.export(c.out)
    if not res.ok:
        raise _err("out", res.message)
    summary = {
        "folder": os.path.abspath(folder),
        "documents": len(task.documents),
        "run": plan.run_dir or c.builder,
        "step": plan.step,
        "failed": built.failed,
        "construction_tokens": built.construction_tokens,
        "turns": built.turns,
        "stopped": built.stopped,
        "stats": ws.stats(),
        "wall_s": time.perf_counter() - t0,
    }
    if start is not None:
        summary["update"] = {
            "from": os.path.abspath(b.update_from),
            "changes": start.changes.counts(),
            "stale_before": len(start.stale),
            "stale_after": [s["path"] for s in ws.stale_nodes()],
            "max_turns": start.max_turns,
        }
    lines, warnings = build_report(summary, c.out)
    summary["warnings"] = warnings
    with open(os.path.join(c.out, "build.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for w in warnings:
        logging.warning("%s", w)
    logging.info("%s", lines[0])
    print("\n".join(lines + [f"warning: {w}" for w in warnings]))  # noqa: T201 - the CLI's answer
    return summary


# What to use on a real folder, named when a build wrote no synthetic file (README, "Evaluating a run...").
REAL_BUILDER_HINT = (
    "for a real folder use a builder that is a real model: a run trained from a real preset "
    "(--config.run=DIR of configs/grpo.py:qwen3_5_4b) or a Hugging Face instruct model "
    "(--config.builder=hf:/ckpt/Qwen3.5-4B --config.train_preset=qwen3_5_4b)"
)


def build_report(summary: dict[str, Any], out: str) -> tuple[list[str], list[str]]:
    """What `build` built, as (lines for the user, warnings): documents, synthetic files and directories,
    nesting depth, construction tokens and turns, how the builder ended, how to serve the export; a warning
    when the construction failed or wrote no synthetic file (the workspace then holds the raw documents
    only: with the embedded run's tiny builder, the usual case on a real folder), naming a real builder."""
    st = summary["stats"]
    how = "failed" if summary["failed"] else "called stop" if summary["stopped"] else "ended at its budget"
    turns = f"{summary['turns']} turn{'' if summary['turns'] == 1 else 's'}"
    lines = [
        f"built {out}: {summary['documents']} raw documents, {st['active_files']} synthetic files in "
        f"{st['active_dirs']} synthetic directories (nesting depth {st['max_depth']}, "
        f"{st['synthetic_chars']:,} characters); builder {summary['run']} (step {summary['step']}): "
        f"{summary['construction_tokens']:,} tokens over {turns}, {how}",
        f"serve it to any MCP client: python -m librarian_jax.serve {out}",
    ]
    warnings = []
    up = summary.get("update")
    if up is not None:
        ch = up["changes"]
        lines.insert(1, (
            f"updated from {up['from']} (left as it was): {ch['added']} added, {ch['removed']} removed, "
            f"{ch['modified']} modified, {ch['renamed']} renamed documents; {up['stale_before']} stale "
            f"synthetic files before the update, {len(up['stale_after'])} after"
        ))
        if up["stale_after"]:
            warnings.append(
                f"{len(up['stale_after'])} synthetic files still rest on a changed or removed document "
                f"(marked stale in manifest.json): {', '.join(up['stale_after'][:5])}"
            )
    if summary["failed"]:
        kept = "the old workspace carried over (stale files marked)" if up else "the raw documents only"
        warnings.append(f"the construction failed ({summary['failed']}); exported {kept}")
    elif st["active_synthetic"] == 0:
        warnings.append(
            f"the builder wrote no synthetic file ({how} after {turns}): the workspace "
            f"holds the raw documents only; {REAL_BUILDER_HINT}"
        )
    return lines, warnings
