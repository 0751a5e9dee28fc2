"""Supervised fine-tuning (the warm start before GRPO) on chat conversations.

    python -m librarian_jax.main --config=configs/sft.py       # noisy (default): demonstrations, tiny model
    python -m librarian_jax.main --config=configs/sft.py --config.data.path=convs.jsonl \\
        --config.model.preset=qwen3_5_4b --config.model.init=hf --config.model.path=/ckpt/Qwen3.5-4B \\
        --config.model.lora_rank=32 --config.workdir=/runs/sft

The `model`, `data`, `rollout`, `mesh` and `checkpoint` sections are the GRPO config's (`configs/grpo.py`,
same preset), so a warm start and the GRPO run that follows it agree on the model, tokenizer, world and
protocol; `train` is SFT's own, `data.packing` and `demos` are added. The keys are declared in
`librarian_jax.config_schema.SFTConfig`; this file sets values. With `data.path` empty and the synthetic
world, the conversations are the embedded world's demonstrations (`librarian_jax.warm_start.demos`),
made once and cached as `workdir/demos.jsonl`. The checkpoint (`workdir/checkpoints`) is a valid
`model.init="orbax"` for GRPO.
"""

from __future__ import annotations

import ml_collections

from librarian_jax import config_schema
from librarian_jax.presets import grpo

PRESETS = grpo.PRESETS


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    """The SFT config for `preset` (None = configs/grpo.py's DEFAULT_PRESET, "noisy"); see the module doc."""
    g = grpo.get_config(preset)
    c = config_schema.SFTConfig().to_config_dict()
    c.lock()  # only the schema's keys: setting another is a KeyError here
    for key in ("preset", "seed", "builder_thinking"):
        c[key] = g[key]
    for key in ("model", "data", "rollout", "roles", "mesh", "checkpoint"):  # GRPO's sections
        c[key].update(g[key].to_dict())
    c.workdir = g.workdir.rstrip("/") + "_sft"
    c.data.path = ""  # JSONL conversations; "" = the embedded demonstrations (synthetic world only)
    c.data.packing = "none"  # one conversation per row ("concat": several per row, see rl.sft)
    c.train.update(dict(
        num_steps=150,          # 100 steps (or 6 rows a step) made warm starts GRPO could not sharpen
                                # (BENCHMARKS, issue 11: X2, R1a)
        batch_rows=8,
        group_by_length=0,      # 8 cut the demonstrations' padding ~17%, but their lengths follow the style,
                                # so batches of one style made a poor warm start (BENCHMARKS, run 7)
        learning_rate=4e-3,
        warmup_steps=10,
        decay="cosine",
        end_lr_ratio=0.05,
        weight_decay=0.0,
        grad_clip=1.0,
        micro_batches=1,
        micro_batch_rows=0,     # > 0: micro-batches of this many rows per data shard (micro_batches unused)
        remat="none",
        logits_chunk=1024,
        logits_at="loss",       # the LM head only at the assistant tokens (~15% of a demonstration row)
        max_seq_len=c.rollout.max_seq_len,
        log_every=10,
    ))
    c.demos.update(dict(
        num_tasks=256,          # worlds to demonstrate on (seeded apart from the run's train/held-out tasks)
        per_task=1,             # demonstrations per world
        calls_per_turn=2,       # calls per scripted reply (0: as many as fit rollout.builder.max_new_tokens)
        # the mode is a poor style (own_doc); by_kind is the noisy preset's
        mix=dict(entities=0.25, by_kind=0.0, own_doc=0.4, generic=0.1, early_stop=0.25),
    ))
    if c.preset == "noisy":
        # the good styles only: entity files in a directory per kind (by_kind), or flat, and stopping. With
        # the classic mix's poor styles (own_doc 0.4, generic 0.1; by_kind 0.15, entities 0.1) its warm
        # start answered 5.2% of the held-out questions, with these 25.8% (raw navigation 31.9%; seed 0,
        # BENCHMARKS.md 2026-12-06 (fifth)); on the corpus listed by type, 74.2% ("(sixth)")
        c.demos.update(calls_per_turn=0, mix=dict(by_kind=0.6, entities=0.15, own_doc=0.0, generic=0.0,
                                                  early_stop=0.25))
    c.checkpoint.update(every=50, keep=1)
    if c.preset not in ("embedded", "noisy"):
        c.train.update(num_steps=500, batch_rows=32, learning_rate=1e-5, warmup_steps=20, micro_batches=8,
                       remat="full", logits_chunk=1024, log_every=10)
    c.unlock()
    return c
