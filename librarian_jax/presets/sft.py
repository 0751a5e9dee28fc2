"""Supervised fine-tuning (the warm start before GRPO) on chat conversations.

    python -m librarian_jax.main --config=configs/sft.py       # noisy (default): demonstrations, tiny model
    python -m librarian_jax.main --config=configs/sft.py --config.data.path=convs.jsonl \\
        --config.model.preset=qwen3_5_4b --config.model.init=hf --config.model.path=/ckpt/Qwen3.5-4B \\
        --config.model.lora_rank=32 --config.workdir=/runs/sft

A preset's `seed`, `builder_thinking`, `model`, `data`, `rollout`, `roles` and `mesh` are the GRPO preset's
of the same name (`presets.grpo`), so a warm start and the GRPO run that follows it agree on the model,
tokenizer, world and protocol; `train`, `checkpoint`, `data.packing` and `demos` are SFT's own. The keys and
their defaults (the `noisy` warm start's) are declared in `librarian_jax.config_schema.SFTConfig`; a preset
states only what it changes. With `data.path` empty and the synthetic world, the conversations are the
world's scripted demonstrations (`librarian_jax.warm_start.demos`), made once and cached as
`workdir/demos.jsonl`. The checkpoint (`workdir/checkpoints`) is a valid `model.init="orbax"` for GRPO.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from librarian_jax import config_schema
from librarian_jax.presets import grpo

# the sections (and keys) a warm start shares with the GRPO run it starts
GRPO_KEYS = ("seed", "builder_thinking", "model", "data", "rollout", "roles", "mesh")
# the classic world's demonstrations: two calls a scripted reply, the mix with the poor styles (own_doc,
# generic) whose contrast the classic world's GRPO learns from
CLASSIC_DEMOS = {"calls_per_turn": 2, "mix": dict(config_schema.DEMO_MIX)}


def _preset(name: str) -> dict[str, Any]:
    g = grpo.PRESETS[name]
    out: dict[str, Any] = {k: g[k] for k in GRPO_KEYS if k in g}
    if "workdir" in g:
        out["workdir"] = g["workdir"].rstrip("/") + "_sft"
    if name != grpo.DEFAULT_PRESET:
        out["demos"] = CLASSIC_DEMOS
    row_len = g.get("rollout", {}).get("max_seq_len")
    train: dict[str, Any] = {"max_row_len": row_len} if row_len else {}  # rows as long as a session
    if name not in ("embedded", grpo.DEFAULT_PRESET):
        train.update(num_steps=500, batch_rows=32, learning_rate=1e-5, warmup_steps=20, micro_batches=8,
                     remat="full")
    if train:
        out["train"] = train
    return out


PRESETS: dict[str, dict[str, Any]] = {name: _preset(name) for name in grpo.PRESETS}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    """The SFT config for `preset` (None = configs/grpo.py's DEFAULT_PRESET, "noisy"); see the module doc."""
    preset = preset or grpo.DEFAULT_PRESET
    if preset not in PRESETS:
        raise ValueError(f"configs/sft.py: unknown preset {preset!r}; known: {list(PRESETS)}")
    return config_schema.SFTConfig.preset_config({**PRESETS[preset], "preset": preset})
