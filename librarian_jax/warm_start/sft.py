"""The warm start's SFT loop and command (`configs/sft.py`): supervised fine-tuning of a builder on chat
conversations, and the warm start GRPO runs before its first step (`warm_start`).

    python -m librarian_jax.main --config=configs/sft.py                      # embedded demonstrations
    python -m librarian_jax.main --config=configs/sft.py --config.data.path=convs.jsonl \\
        --config.model.init=hf --config.model.path=/ckpt/Qwen3.5-4B --config.workdir=/runs/sft

Data encoding and rows: `rl.sft`. The loop: `rl.Trainer` with the `nll` loss, Orbax checkpoints in
`workdir/checkpoints` (resumed when present), TensorBoard under `workdir/tb`, a progress bar and a log line
every `train.log_every` steps. The checkpoint is a valid `model.init="orbax"` start for GRPO.

Several processes (launch/README.md) run the same loop on one global mesh: every process draws the same
global batch of `train.batch_rows` rows (one `RowStream`, same seed) and hands the trainer its contiguous
share (`distributed.process_slice`), which the trainer assembles into one global array; Orbax saves from every
process; process 0 alone writes the config, the summary and TensorBoard. The demonstrations and the tokenizer
are made by process 0 first, then read by the others (one shared workdir). The workdir may be `gs://...`
(`librarian_jax.storage`).

`main` validates the command's ConfigDict; everything after (`run`, `train`, the demonstrations, the warm
start) reads only the typed `config_schema.SFTConfig` / `GRPOConfig`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import logging

from librarian_jax import (
    checkpoint,
    cluster,
    config_validation,
    data,
    distributed,
    inputs,
    storage,
    train_loop,
)
from librarian_jax.config_schema import GRPOConfig, RunConfig, SFTConfig, require_typed
from librarian_jax.presets import sft as sft_presets
from librarian_jax.rl import sft, train_step
from librarian_jax.warm_start import demos


def builder_template(config: RunConfig, tokenizer: Any) -> Any:
    """The builder's chat template of the run's protocol (`cluster.role_templates`): the warm start's
    demonstrations and SFT encode with the template GRPO's policy engine samples with."""
    return cluster.role_templates(config, tokenizer)["policy"]


def train(model: Any, tokenizer: Any, conversations: Sequence[Mapping[str, Any]], settings: SFTConfig, *,
          workdir: str, mesh: Any = None, template: Any = None) -> dict[str, Any]:
    """SFT of `model` (an nnx Transformer, LoRA-wrapped or not) on `conversations` per `settings` (the
    validated `configs/sft.py` config: the loop reads `train`, `data.packing`, `checkpoint` and `seed`), each
    encoded with `template` (default: the builder's, `cluster.role_templates`: the template GRPO samples
    with), on `train_loop` (checkpoints in `workdir/checkpoints`, resumed from the newest good one;
    TensorBoard in `workdir/tb`). Returns a summary (losses, times, steps)."""
    require_typed(settings, SFTConfig, "warm_start.sft.train")
    clock = train_loop.Clock()
    t, c = settings.train, settings.checkpoint
    template = template or builder_template(settings, tokenizer)
    examples = [sft.encode_conversation(c_["messages"], template, tokenizer) for c_ in conversations]
    tokens, valid, mask, counts = sft.make_rows(examples, t.max_row_len, settings.data.packing)
    logging.info("sft: %d conversations -> %d rows of %d tokens, %d loss tokens (%d cut by max_row_len)",
                 len(examples), counts["rows"], tokens.shape[1], counts["loss_tokens"],
                 counts["cut_loss_tokens"])
    tcfg = t.trainer_config()
    # the LM head's per-row loss positions sized for the data's fullest row: one compiled update for every
    # batch (a batch of shorter answers would otherwise compile a smaller bucket)
    trainer = train_step.Trainer(model, tcfg, mesh=mesh, min_loss_positions=train_step.most_loss_tokens(mask))
    # the global batch: a multiple of every process's row multiple, split evenly over the processes
    multiple = trainer.row_multiple() * jax.process_count()
    batch_rows = -(-t.batch_rows // multiple) * multiple
    if batch_rows != t.batch_rows:
        logging.info("sft: %d rows a step (train.batch_rows=%d rounded up to a multiple of %d)", batch_rows,
                     t.batch_rows, multiple)
    stream = sft.RowStream(counts["rows"], batch_rows, settings.seed, lengths=valid.sum(axis=1),
                           group=t.group_by_length)
    steps = SFTSteps(trainer, stream, batch_rows, (tokens, valid, mask), settings)
    loop = train_loop.LoopConfig(workdir, num_steps=t.num_steps, save_every=c.every, keep=c.keep,
                                 async_save=c.async_save, resume=c.resume, start_fresh=c.start_fresh,
                                 progress="sft")
    done = train_loop.run(loop, steps)
    compiled = clock.compiled()
    wall = clock.wall_s()
    logging.info("sft: steps %d..%d in %.1fs; compiling %s", done.start_step + 1, done.last_step, wall,
                 compiled.line() or "nothing")
    losses = steps.losses
    summary = {"start_step": done.start_step, "last_step": done.last_step, "wall_s": wall,
               "compile": compiled.as_dict(), "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, **counts}
    if jax.process_index() == 0:
        storage.write_text(storage.join(workdir, "sft_summary.json"), json.dumps(summary, indent=2))
    return summary


class SFTSteps:
    """SFT's step on `train_loop`: the next global batch of rows (every process draws it from one
    `RowStream` and keeps its contiguous share, `distributed.process_slice`), one `nll` update; a log line
    every `train.log_every` steps; the `sft/*` scalars."""

    def __init__(self, trainer: train_step.Trainer, stream: sft.RowStream, batch_rows: int,
                 rows: tuple[Any, Any, Any], settings: SFTConfig):
        self.trainer, self.stream = trainer, stream
        self.tokens, self.valid, self.mask = rows
        self.train = settings.train
        self.share = distributed.process_slice(batch_rows)  # this process's rows of every global batch
        self.rng = jax.random.key(settings.seed)
        self.losses: list[float] = []

    @property
    def step(self) -> int:
        return self.trainer.step

    def restore_targets(self) -> tuple[Any, Any]:
        return self.trainer.params, self.trainer.opt_state

    def resumed(self, restored: checkpoint.Restored, directory: str) -> None:
        self.trainer.set_state(restored.params, restored.opt_state, restored.step)
        if restored.data_state:
            self.stream.set_state(restored.data_state)
        logging.info("sft: resumed from step %d", restored.step)

    def before_first(self, summaries: train_loop.Summaries) -> None:
        pass

    def train_step(self) -> train_loop.StepOut:
        t = self.train
        rows = self.stream.next()  # every process draws the global batch and keeps its share
        idx = rows[self.share]
        # the batch's length: the same on every process
        seq = sft.batch_seq(self.valid[rows]) if t.group_by_length else self.tokens.shape[1]
        batch = sft.batch_arrays(self.tokens[idx, :seq], self.valid[idx, :seq], self.mask[idx, :seq])
        out = self.trainer.update(batch)
        step = self.trainer.step
        self.losses.append(out["loss"])
        line = None
        if step % max(1, t.log_every) == 0 or step == t.num_steps:
            line = (f"sft step {step}/{t.num_steps} | loss {out['loss']:.4f} | "
                    f"grad norm {out['grad_norm']:.3f} | lr {out['lr']:.2e} | "
                    f"{batch['valid'].sum() / max(out['time_s'], 1e-9):.0f} tok/s")
        return train_loop.StepOut({f"sft/{k}": out[k] for k in ("loss", "grad_norm", "lr", "entropy")},
                                  postfix={"loss": f"{out['loss']:.3f}"}, line=line)

    def saved_state(self, due: bool) -> train_loop.Saved:
        return train_loop.Saved(self.trainer.params, self.trainer.opt_state, rng=self.rng,
                                data_state=self.stream.get_state())


def describe(settings: SFTConfig) -> str:
    m, t = settings.model, settings.train
    return (f"SFT: model {m.preset} ({m.init}) on {settings.data.path or 'embedded demonstrations'}; "
            f"{t.num_steps} steps of {t.batch_rows} rows, lr {t.learning_rate}; workdir {settings.workdir}")


def main(config: Any, dry_run: bool = False) -> dict[str, Any] | None:
    """The `configs/sft.py` command: validate, then `run` (or with `dry_run` say what would run)."""
    settings = validate(config)
    if dry_run:
        print(describe(settings))  # noqa: T201 - the CLI's answer
        return None
    return run(settings)


def run(settings: SFTConfig) -> dict[str, Any]:
    """SFT per a validated config: data / tokenizer / mesh / model, then `train`. Returns its summary."""
    require_typed(settings, SFTConfig, "warm_start.sft.run")
    m = settings.model
    logging.info("%s", describe(settings))
    workdir = storage.abspath(settings.workdir)
    storage.makedirs(workdir)
    if distributed.is_primary():
        storage.write_text(storage.join(workdir, "config.json"), json.dumps(settings.to_dict(), indent=2))

    def data() -> tuple[list[dict[str, Any]], Any]:
        if settings.data.path:
            return (sft.load_conversations(inputs.local_file(settings.data.path, "sft_data")),
                    inputs.build_tokenizer(settings, []))
        return embedded_demonstrations(settings)

    if distributed.is_multi():  # process 0 makes (and caches) the demonstrations and tokenizer; then the rest
        if distributed.is_primary():
            data()
        distributed.barrier("librarian_jax.warm_start.data")
    convs, tokenizer = data()
    mesh = cluster.run_mesh(settings.mesh)  # the trainer's: every device of every process
    # weights loaded onto this process's devices, then made placeable on the global mesh (as GRPO's)
    model = cluster.initial_model(settings, cluster.engine_mesh(mesh), tokenizer)
    distributed.uncommit(model)
    if m.lora_rank:
        model = train_step.apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_module_path,
                                      seed=settings.seed)
    try:
        return train(model, tokenizer, convs, settings, workdir=workdir, mesh=mesh)
    except sft.ConversationError as e:
        raise config_validation.ConfigError(f"config.data.path: {e}") from None


DEMO_SEED_OFFSET = 7919  # the demonstrations' worlds are seeded apart from the run's train and held-out tasks


def demo_tasks(config: SFTConfig) -> list[Any]:
    """The worlds the demonstrations are made on: `demos.num_tasks` synthetic tasks of the run's world and
    sizes, seeded apart from the run's tasks (ids `synth-<seed + 7919>-...`), so no held-out corpus is ever
    shown. They carry the hidden questions only: the scripted demonstrations do not read questions, and a
    run's reuse questions (`data.reuse_questions_per_task`, the noisy preset's denser reward) would change the
    tokenizer trained on these worlds' texts, and so the warm start, for nothing."""
    require_typed(config, SFTConfig, "warm_start.sft.demo_tasks")
    d = config.data
    return data.generate_world(config.seed + DEMO_SEED_OFFSET, config.demos.num_tasks, data.WORLDS[d.world],
                               docs_per_task=d.docs_per_task, min_words=d.min_words, max_words=d.max_words,
                               questions_per_task=d.questions_per_task, reuse_questions_per_task=0)


def demo_tokenizer(config: SFTConfig, pool: Sequence[Any]) -> Any:
    """The warm start's tokenizer: trained (and cached under the workdir) on the demonstration worlds `pool`,
    the agents' texts, and what the builder and the answerer read and write there
    (`demos.tokenizer_texts`)."""
    return inputs.build_tokenizer(config, list(pool),
                                  demos.tokenizer_texts(pool, config.rollout.config.builder.raw_listing,
                                                        config.rollout.config.builder.doc_id_titles))


def embedded_demonstrations(config: SFTConfig) -> tuple[list[dict[str, Any]], Any]:
    """The embedded world's demonstrations (`demos`, cached as `workdir/demos.jsonl`) and the tokenizer
    (GRPO and eval then load that file). Each is scored with the `config.rollout` answerer.

    The tokenizer is trained on the demonstrations' worlds only, never on the run's tasks: no held-out text
    reaches the warm start, and the warm start does not depend on the run's world size or split (runs that
    differ only in `data.num_tasks` / `data.heldout_fraction` start from the same policy)."""
    pool = demo_tasks(config)
    tokenizer = demo_tokenizer(config, pool)
    rollout_cfg = config.rollout.config
    d = config.demos
    key = {"tasks": [t.task_id for t in pool], "data": config.data.to_dict(),
           "rollout": rollout_cfg.to_dict(), "demos": d.to_dict(), "vocab": tokenizer.vocab_size}
    # the cache is a local file (`demos` reads it with open()): the workdir, or a local stand-in for gs://
    path = demos.cached_demonstrations(
        os.path.join(storage.local_cache_dir(config.workdir, "demos"), "demos.jsonl"), key,
        lambda: demos.make_demonstrations(pool, tokenizer, rollout_cfg, mix=dict(d.mix),
                                          per_task=d.per_task, calls_per_turn=d.calls_per_turn,
                                          seed=config.seed,
                                          template=builder_template(config, tokenizer)))
    return sft.load_conversations(path), tokenizer


def validate(config: Any, num_devices: int | None = None) -> SFTConfig:
    """Checks every key of the SFT config (`config_schema.SFTConfig`, the mesh against the devices); returns
    it typed. Raises ConfigError naming the first bad key. `config`: a ConfigDict or a plain nested dict."""
    parsed = SFTConfig.parse(config)
    config_validation.validate_mesh(parsed.mesh.shape,
                                    jax.device_count() if num_devices is None else num_devices)
    return parsed


# ------------------------------------------------------------------------------------------- before GRPO

WARM_START_DIR = "warm_start"


def warm_start_config(settings: GRPOConfig) -> SFTConfig:
    """The SFT config of `settings`' warm start: `configs/sft.py:<warm_start.sft_preset>` on the run's model,
    world, rollout, roles and mesh, in `workdir/warm_start`, validated."""
    require_typed(settings, GRPOConfig, "warm_start.sft.warm_start_config")
    grpo = settings.to_dict()
    preset = SFTConfig.parse(sft_presets.get_config(settings.warm_start.sft_preset)).to_dict()
    if settings.warm_start.sft_steps:  # the schedule (warmup, cosine decay) spans the steps asked for
        preset["train"]["num_steps"] = settings.warm_start.sft_steps
    shared = {k: grpo[k] for k in ("seed", "preset", "builder_thinking", "model", "rollout", "roles", "mesh")}
    # the run's world, the preset's packing; the demonstrations, not a conversations file
    data = {**grpo["data"], "packing": preset["data"]["packing"], "path": ""}
    return validate({**preset, **shared, "data": data,
                     "workdir": storage.join(settings.workdir, WARM_START_DIR)})


def warm_start(settings: GRPOConfig) -> tuple[GRPOConfig, dict[str, Any]]:
    """Runs the supervised warm start (`configs/sft.py:<warm_start.sft_preset>` on this run's model, data,
    rollout, roles and mesh, in `workdir/warm_start`; resumed or skipped when done) and returns (the GRPO
    config starting from its checkpoint, validated, and the SFT summary). The demonstrations and SFT encode
    with the builder's template of the run's protocol (`cluster.role_templates`), as GRPO samples."""
    require_typed(settings, GRPOConfig, "warm_start.sft.warm_start")
    grpo = settings.to_dict()
    sft_settings = warm_start_config(settings)
    done = storage.join(sft_settings.workdir, "sft_summary.json")
    summary: dict[str, Any] | None = None
    if storage.isfile(done):
        summary = json.loads(storage.read_text(done))
        if summary.get("last_step") != sft_settings.train.num_steps:
            summary = None
    t0 = time.perf_counter()
    if summary is None:
        logging.info("warm start: supervised fine-tuning on the embedded demonstrations in %s",
                     sft_settings.workdir)
        summary = run(sft_settings)
    else:
        logging.info("warm start: done earlier (%s); GRPO starts from its checkpoint", done)
    summary = {**summary, "this_run_s": time.perf_counter() - t0}
    tokenizers_dir = storage.join(sft_settings.workdir, "tokenizer")
    models = [n for n in storage.listdir(tokenizers_dir) if n.endswith(".model")]
    model = {**grpo["model"], "init": "orbax", "path": storage.join(sft_settings.workdir, "checkpoints")}
    if models and not model["tokenizer"]:
        model["tokenizer"] = storage.join(tokenizers_dir, models[-1])
    after = config_validation.validate({**grpo, "model": model,
                                        "warm_start": {**grpo["warm_start"], "enabled": False}})
    return after, summary
