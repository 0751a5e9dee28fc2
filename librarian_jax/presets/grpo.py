"""GRPO training of the librarian builder.

    python -m librarian_jax.main --config=configs/grpo.py                 # the noisy CPU run (default)
    python -m librarian_jax.main --config=configs/grpo.py:embedded        # the classic 6-document world
    python -m librarian_jax.main --config=configs/grpo.py:qwen3_5_4b \\
        --config.model.path=/ckpt/Qwen3.5-4B --config.data.path=/data/tasks.jsonl --config.workdir=/runs/q4b

Presets: `noisy` (the default, and the schema's defaults: tiny model, SentencePiece tokenizer trained on the
warm start's synthetic worlds and cached under the workdir, the noisy synthetic world of docs/world.md,
where the trained builder beats retrieval; 7-20 minutes on 2 CPU cores), `embedded` (the same tiny run on
the classic 6-document world, where retrieval answers everything; 6-12 minutes), `qwen3_5_4b` and
`gemma3_4b` (the paper's main-run settings: LoRA rank 32, lr 2e-5 (the paper sweeps 1e-5..4e-5), 16 tasks x
group 4, <= 4096 new tokens per builder turn, PPO clip 0.8/1.2, H = 32 builder turns, 4 probe repeats).
Every key, its type, bounds, choices and default are declared once, in
`librarian_jax.config_schema.GRPOConfig`, whose defaults are the `noisy` run's; a preset here states only
the keys it changes (`tests/test_config_schema.py` holds every preset to that).
`librarian_jax.config_validation` checks the whole config at start.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from librarian_jax import config_schema

DEFAULT_PRESET = "noisy"  # what `--config=configs/grpo.py` runs: the schema's defaults

# The classic 6-document world (`data.WORLDS["classic"]`): the builder writes extractive files from a full
# listing and samples at 1.0; the scripted answerer has 2 tool calls in a 2,048-token context.
EMBEDDED: dict[str, Any] = {
    "workdir": "/tmp/librarian_jax/grpo",
    "data": {"world": "classic", "docs_per_task": 6, "min_words": 40, "max_words": 80,
             "questions_per_task": 4, "reuse_questions_per_task": 0},
    "rollout": {
        "terminal_questions": "reuse_if_any",
        "builder": {"max_turns": 3, "temperature": 1.0, "executor": "extractive", "raw_listing": "full",
                    "doc_id_titles": False},
        "answerer": {"max_turns": 2, "context_budget": 2048},
    },
    "train": {"learning_rate": 2e-4},  # 5e-4 collapsed a run into malformed calls by step 6
    "eval": {"every": 5, "select": "last", "validation_tasks": 0},
    "warm_start": {"sft_preset": "embedded"},
}


def _paper(model_preset: str) -> dict[str, Any]:
    """The paper's main-run settings on a real model (HF safetensors in model.path)."""
    if model_preset.startswith("qwen3_5"):
        # the fixed answerer is the builder's base model (frozen); the Create/Merge executor is
        # Qwen3.5-35B-A3B (--config.roles.executor.path=...)
        answerer = {"slots": 64}
        executor = {"init": "hf", "preset": "qwen3_5_35b_a3b", "dtype": "bfloat16", "slots": 128}
    else:
        # every role reads the builder's tokenizer: a Gemma run's executor is its own base model, frozen.
        # Gemma 3 keeps K/V in all 34 layers (139 KB a token, 4.3x Qwen3.5-4B's): the answerer, executor,
        # compaction and judge share one engine (one copy of the weights) of 32 slots x 32,768 tokens, 34 GiB
        # a v5p chip
        answerer = {"slots": 32}
        executor = {"slots": 32}
    # Engine slots are per host (each host holds its own engines on its chips, whatever the slice), sized so
    # that every engine's weights and cache fit a v5p chip's 95 GiB with room for the programs' temporaries
    # (`--dry_run --compile --config.topology=v5p-8` prints the plan; BENCHMARKS.md). The answerer's
    # 32,768-token context makes its cache the largest part: 64 slots are 16.8 GiB a chip for Qwen3.5-4B
    # (its DeltaNet layers keep no K/V), 256 would be 67 GiB. Compaction and the judge take the executor's
    # weights and engine (the paper compacts with Gemini 3.1 Flash Lite, which we cannot run).
    frozen = {"max_seq_len": 8192, "slots": executor["slots"]}
    return {
        "workdir": f"/tmp/librarian_jax/grpo_{model_preset}",
        "model": {"preset": model_preset, "init": "hf", "dtype": "bfloat16", "lora_rank": 32},
        # BrowseComp-Plus as the authors train on it: the noisy variant (support documents plus shuffled
        # negatives, <= 50 documents), 680 train / 50 held-out tasks from --config.data.split_file (their
        # split as data); without a split file 50 held-out tasks drawn with a recorded seed (split.json
        # records the draw), and the authors' 100 excluded tasks left out of both sides when their ids are
        # given (--config.data.exclude_file); BRIGHT (zero-shot evaluation) as 50 sampled questions per
        # domain.
        # The synthetic world's keys are unread with data.source="file" (the classic world's here).
        "data": {"source": "file", "num_tasks": 0, "tasks_per_batch": 16, "heldout_fraction": 0.0,
                 "max_docs": 50, "questions_per_domain": 50, "heldout_count": 50,
                 "world": "classic", "docs_per_task": 6, "min_words": 40, "max_words": 80,
                 "questions_per_task": 4, "reuse_questions_per_task": 0},
        "rollout": {
            "policy_slots": 64, "frozen_slots": 256, "max_seq_len": 16384, "round_steps": 64,
            "probe_repeats": 4, "probe_min_gap": 8, "max_probes": 4, "terminal_repeats": 4,
            "terminal_questions": "reuse_if_any", "use_model_judge": True,
            # write_text: the builder may write a file's text itself (create/merge `text`), as the authors'
            # tools allow (cluster_text / merge_summary_text); the executor writes it when absent. The
            # reward: probe deltas, the terminal reward and the no-Stop penalty only (no malformed-call
            # penalty)
            "builder": {"system_prompt": "builder_system", "max_turns": 32, "max_new_tokens": 4096,
                        "temperature": 1.0, "executor": "model", "compaction": "model",
                        "compaction_budget": 3000, "malformed_penalty": 0.0, "raw_listing": "full",
                        "write_text": True, "doc_id_titles": False},
            "answerer": {"kind": "model", "max_turns": 32, "max_new_tokens": 1024,
                         "forced_max_new_tokens": 128, "context_budget": 32768},
        },
        # One update per rollout batch with the ratio taken against the sampler's log-probs, clipped to
        # [0.8, 1.2], as the paper's runs do: no dual clip, no TIS (the ratio itself carries the mismatch),
        # no KL. Each decoder layer rematerialised: with the whole forward rematerialised ("full") the update
        # of one 16,384-token row a chip does not fit a v5p chip's 95 GiB (the plan for v5p-8, BENCHMARKS.md).
        # The engines run their layers one by one (rollout.scan_layers=False): scanned engines compile
        # 2.4-3.8x faster for a v5p-8 but hold a stacked copy of their layers' weights beside their state
        # (+17.4 GiB a chip for this preset), which does not fit. The update scans its layers
        # (train.scan_layers): for a v5p-8 its temporaries fall from 41.5 to 29.2 GiB a chip (peak 92.5 ->
        # 80.1 of 95 GiB) at the same compile time (528 s against 558)
        "train": {"num_steps": 200, "learning_rate": 2e-5, "warmup_steps": 5, "decay": "constant",
                  "eps_high": 0.2, "dual_clip": 0.0, "tis_cap": 0.0, "kl_beta": 0.0,
                  "old_logprobs": "sampler", "micro_batch_rows": 1, "remat": "layer", "max_row_len": 16384,
                  "scan_layers": True},
        "eval": {"every": 20, "num_tasks": 16, "repeats": 4, "final_methods": "", "select": "last",
                 "validation_tasks": 0},
        "warm_start": {"enabled": False, "sft_preset": "embedded"},
        # thinking is off for every frozen role (the schema's default); the answerer's 32,768-token budget
        # fits its engine
        "roles": {"answerer": {**answerer, "max_seq_len": 32768},
                  "executor": {**executor, "max_seq_len": 8192},
                  "compaction": {"init": "executor", **frozen}, "judge": {"init": "executor", **frozen}},
        # the trainer: FSDP over one host's 4 chips (a v5p host; ICI), data-parallel across hosts. Over
        # every chip of a v5p-64 (fsdp 32) the update's temporaries were 56.6 GiB a chip and the plan did not
        # fit (107.7 of 95 GiB); data 8 x fsdp 4: 25.2 GiB, 78.1 of 95 (BENCHMARKS.md)
        "mesh": {"shape": {"data": -1, "fsdp": 4, "tensor": 1}},
        "checkpoint": {"every": 10, "keep": 3},
    }


# preset name -> the keys it sets on the schema's defaults (nested like the config)
PRESETS: dict[str, dict[str, Any]] = {
    "noisy": {},
    "embedded": EMBEDDED,
    "qwen3_5_4b": _paper("qwen3_5_4b"),
    "gemma3_4b": _paper("gemma3_4b"),
}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    """The GRPO config for `preset` (None = DEFAULT_PRESET, "noisy"); see the module doc."""
    preset = preset or DEFAULT_PRESET
    if preset not in PRESETS:
        raise ValueError(f"configs/grpo.py: unknown preset {preset!r}; known: {list(PRESETS)}")
    return config_schema.GRPOConfig.preset_config({**PRESETS[preset], "preset": preset})
