"""GRPO training of the librarian builder.

    python -m librarian_jax.main --config=configs/grpo.py                 # the noisy CPU run (default)
    python -m librarian_jax.main --config=configs/grpo.py:embedded        # the classic 6-document world
    python -m librarian_jax.main --config=configs/grpo.py:qwen3_5_4b \\
        --config.model.path=/ckpt/Qwen3.5-4B --config.data.path=/data/tasks.jsonl --config.workdir=/runs/q4b

Presets: `noisy` (the default: tiny model, SentencePiece tokenizer trained on the warm start's synthetic
worlds and cached under the workdir, the noisy synthetic world of docs/world.md, where the trained builder
beats retrieval; 7-20 minutes on 2 CPU cores), `embedded` (the same tiny run on the classic 6-document world,
where retrieval answers everything; 6-12 minutes), `qwen3_5_4b` and `gemma3_4b` (the
paper's main-run settings: LoRA rank 32, lr 2e-5 (the paper sweeps 1e-5..4e-5), 16 tasks x group 4, <= 4096
new tokens per builder turn, PPO clip 0.8/1.2, H = 32 builder turns, 4 probe repeats).
Every key, its type, bounds and choices are declared once, in `librarian_jax.config_schema.GRPOConfig`; this
file only sets values (on a ConfigDict built from the schema's defaults, locked while it is set, so a key the
schema does not declare is an error here). `librarian_jax.config_validation` checks the whole config at start.
"""

from __future__ import annotations

import ml_collections

from librarian_jax import config_schema
from librarian_jax.rl.train_step import LORA_ALL_LINEAR

PRESETS = ("noisy", "embedded", "qwen3_5_4b", "gemma3_4b")
DEFAULT_PRESET = "noisy"  # what `--config=configs/grpo.py` runs (issue 40: the world where structure matters)


def _base() -> ml_collections.ConfigDict:
    c = config_schema.GRPOConfig().to_config_dict()
    c.lock()  # only the schema's keys: setting another is a KeyError here
    c.preset = "embedded"
    c.workdir = "/tmp/librarian_jax/grpo"
    c.seed = 0

    c.model.update(dict(
        preset="tiny",          # models.PRESETS name (architecture): 4 layers of 128, a 2,048-token vocab
        init="random",          # the choices of every key: librarian_jax/config_schema.py
        path="",                # weights for init="hf" / "orbax"
        tokenizer="",           # file/folder; "" = model.path (hf) or a SentencePiece trained on data
        tokenizer_vocab_size=2048,  # embedded: trained on the warm start's demonstration worlds (never the
                                    # run's tasks), the prompts and the builder's listings
        dtype="",               # "" = the preset's; e.g. "float32" on CPU, "bfloat16" on accelerators
        lora_rank=0,            # 0 = full fine-tuning
        lora_alpha=64.0,
        lora_module_path=LORA_ALL_LINEAR,  # every linear projection of every layer type (rl.train_step)
        frozen_path="",         # answerer/executor weights (HF folder); "" = the policy's initial weights
    ))
    c.data.update(dict(
        source="synthetic",     # a generated world ("file": data.path)
        path="",                # tasks file/folder for source="file" (data.load_tasks)
        format="auto",
        world="classic",        # data.WORLDS: "classic" (this 6-document world) or "noisy" (docs/world.md,
                                # the `noisy` preset)
        num_tasks=64,           # synthetic world size: at seed 0, 33 training tasks and 31 held-out corpora
                                # (15 held-out corpora left the warm start's lead over raw inside its CI)
        docs_per_task=6,        # more than the answerer can read in its turns
        min_words=40,
        max_words=80,
        questions_per_task=4,   # half multi-hop (facts in >= 2 documents)
        reuse_questions_per_task=0,  # more, drawn after those: what rollout.terminal_questions may ask
        heldout_fraction=0.4,   # tasks kept out of training (by task-id hash), for eval
        # The paper's data protocol (docs/paper-settings.md, Data); the defaults leave the data as loaded.
        split_file="",          # task-id file deciding train / held-out instead of the hash: held-out ids
                                # (one a line or a JSON list) or JSON {"train": [...], "heldout": [...]}
        max_docs=0,             # tasks / browsecomp_plus: the noisy variant, support docs + shuffled
                                # negatives, at most this many documents; 0 = every document, file order
        reuse_questions="",     # JSONL of {task_id | question_id, amortization_questions: [...]} rows: each
                                # named corpus's reuse questions; "" = those the task rows carry
        questions_per_domain=0,  # bright: a seeded sample of N questions per domain; 0 = every question
        sample_seed=0,          # seed of the max_docs negatives and the BRIGHT question sample
        tasks_per_batch=4,
        shuffle_seed=0,
        update_fraction=0.0,    # training tasks that are incremental updates (issue 42; synthetic only)
        update_changes=0.2,     # an update task's fraction of documents removed, changed and added (each)
    ))
    c.rollout.update(dict(
        group_size=4,
        policy_slots=16,        # builder engine slots
        frozen_slots=16,        # answerer/executor engine slots
        max_seq_len=2048,       # tokens one session may hold (the embedded episodes stay under ~1,400)
        round_steps=32,         # decode steps per engine.step()
        scan_layers=False,      # engines scan repeating layers: faster compiles, slower CPU decode
        probe_repeats=1,
        probe_min_gap=1,
        max_probes=1,
        probe_threshold=0.25,
        probe_scale=1.0,
        terminal_repeats=1,
        no_stop_penalty=0.1,
        use_model_judge=False,
        record_snapshots=True,
        builder=dict(
            max_turns=3, max_new_tokens=240, temperature=1.0, executor="extractive",
            compaction="deterministic", compaction_budget=1800, malformed_penalty=0.05,
            system_prompt="builder_system_compact"),
        # The embedded answerer is the scripted navigator (agents/navigator.py, kind="scripted"): it reads
        # through the same list/read tools and token accounting as an LLM answerer. A small one: 2 tool calls,
        # root files preloaded up to 512 tokens (a good builder's entity files do not all fit: it chooses),
        # in a 2,048-token context (the budget every published classic run read with: until 2026-12-06 a
        # 4,096 here was silently lowered to the frozen engine's max_seq_len)
        answerer=dict(kind="scripted", max_turns=2, max_new_tokens=64, forced_max_new_tokens=16,
                      context_budget=2048, preload_max_tokens=512),
    ))
    c.train.update(dict(
        num_steps=12,           # the held-out accuracy plateaus by step 5 (BENCHMARKS, issue 11)
        learning_rate=2e-4,     # 5e-4 collapsed one run into malformed calls by step 6
        warmup_steps=0,
        decay="cosine",
        end_lr_ratio=0.1,
        weight_decay=0.0,
        grad_clip=1.0,
        micro_batches=1,
        micro_batch_rows=4,     # micro-batches of 4 rows (per data shard), as many as a step's rows need: one
                                # compiled update for any row count (0: micro_batches, one per row count);
                                # the same rewards and table, update 186 -> 121 s (BENCHMARKS, issue 15)
        remat="none",           # no rematerialisation ("full": whole forward, "layer": each decoder layer)
        logits_chunk=1024,      # logits of this many positions at a time (rematerialised); 0 = all at once
        logits_at="loss",       # the LM head only at the builder's own tokens ("all": every position)
        moe_aux_loss_coef=0.0,  # mixture-of-experts models: weight of the router's load-balancing loss
        loss="ppo",             # rl.losses registry
        eps_low=0.2,
        eps_high=0.28,
        dual_clip=3.0,
        tis_cap=2.0,
        kl_beta=0.1,            # k3 KL to the warm start: at this lr, without it one world's run collapsed
                                # (reward 0.81 -> 0.24 in the update after step 5) and another's learned
                                # (BENCHMARKS, issue 11)
        aggregation="token_mean",  # rl.losses.AGGREGATIONS
        old_logprobs="trainer",    # the ratio against the trainer's log-probs ("sampler": the sampler's)
        advantage="paper",         # rl.advantages registry
        step_weight=0.0,           # per-step (reward-to-go) advantage weight; 0 = off
        step_gamma=1.0,
        max_seq_len=2048,          # training rows longer than this are truncated
    ))
    c.eval.update(dict(
        every=5,                # evaluate the policy on held-out tasks every N steps (0 = never)
        num_tasks=6,
        repeats=1,
        # After the last step: configs/eval.py on this run's held-out split with these methods ("" = none),
        # with a greedy builder (workdir/eval/final/) and, when final_samples > 0, also with the builder
        # sampling at its training temperature, final_samples constructions per corpus (eval/final_sampled/).
        # bm25: retrieval, no workspace; agentic: a search tool beside list/read (docs/eval.md; the scripted
        # navigator's search policy, +0.2 s here: 94.4% on the 31 held-out corpora vs bm25's 80.6%)
        final_methods="trained,base,raw,bm25,agentic",
        final_samples=0,        # 2 adds the sampled table (~45 s here, over the 10-minute budget)
    ))
    c.warm_start.update(dict(
        # Before GRPO, supervised fine-tuning on the embedded world's scripted demonstrations
        # (configs/sft.py:<sft_preset>, run in workdir/warm_start, cached), and GRPO starts from it.
        enabled=True,
        sft_preset="embedded",
        sft_steps=0,            # 0 = the SFT preset's train.num_steps (150)
    ))
    # Every frozen role (answerer, executor, compaction, judge) on the builder's initial weights, frozen: the
    # schema's defaults (`config_schema.RoleSection`); `--dry_run` prints the role table.
    c.mesh.shape.update(dict(data=1, fsdp=1, tensor=1))
    c.checkpoint.update(dict(
        every=1,                # save every N steps (and at the end)
        keep=2,
        async_save=True,
        resume=True,            # restore the newest good checkpoint in workdir/checkpoints
        start_fresh=False,      # all checkpoints damaged: stop naming each (False) or start over (True)
    ))
    return c


def _paper(c: ml_collections.ConfigDict, model_preset: str) -> ml_collections.ConfigDict:
    """The paper's main-run settings on a real model (HF safetensors in model.path)."""
    c.model.update(preset=model_preset, init="hf", dtype="bfloat16", lora_rank=32, lora_alpha=64.0)
    c.warm_start.enabled = False
    c.data.update(source="file", num_tasks=0, tasks_per_batch=16, heldout_fraction=0.0)
    # BrowseComp-Plus as the authors train on it: the noisy variant (support documents plus shuffled
    # negatives, <= 50 documents), 680 train / 50 held-out tasks from --config.data.split_file (their split as
    # data); without a split file 50 held-out tasks drawn with a recorded seed (heldout_count, split_seed;
    # split.json records the draw), and the authors' 100 excluded tasks left out of both sides when their ids
    # are given (--config.data.exclude_file); BRIGHT (zero-shot evaluation) as 50 sampled questions per
    # domain.
    c.data.update(max_docs=50, questions_per_domain=50, heldout_count=50, split_seed=0)
    c.rollout.update(group_size=4, policy_slots=64, frozen_slots=256, max_seq_len=16384, round_steps=64,
                     probe_repeats=4, probe_min_gap=8, max_probes=4, terminal_repeats=4, use_model_judge=True,
                     # the first probe is paid against 0, not against a start probe of the raw workspace
                     # U(F0): the authors' code has no start probe (docs/paper-settings.md)
                     probe_at_start=False)
    # write_text: the builder may write a file's text itself (create/merge `text`), as the authors' tools
    # allow (cluster_text / merge_summary_text); the executor writes it when absent
    c.rollout.builder.update(system_prompt="builder_system", max_turns=32, max_new_tokens=4096,
                             executor="model", compaction_budget=3000, write_text=True)
    c.rollout.answerer.update(kind="model", max_turns=32, max_new_tokens=1024, forced_max_new_tokens=128,
                              context_budget=32768)
    # One update per rollout batch with the ratio taken against the sampler's log-probs, clipped to
    # [0.8, 1.2], as the paper's runs do (TIS is then 1: the ratio itself carries the mismatch). Each decoder
    # layer rematerialised: with the whole forward rematerialised ("full") the update of one 16,384-token row
    # a chip ran out of a v5p chip's 95 GiB when compiled for it (the plan for v5p-8, BENCHMARKS.md).
    # The engines run their layers one by one (rollout.scan_layers=False, as the base): compiled for a v5p-8,
    # scanned engines compiled 2.4-3.8x faster but hold a stacked copy of their layers' weights beside their
    # state (+17.4 GiB a chip for this preset), and the preset no longer fit (BENCHMARKS.md)
    c.train.update(num_steps=200, learning_rate=2e-5, warmup_steps=5, decay="constant", eps_low=0.2,
                   eps_high=0.2, old_logprobs="sampler", advantage="paper", micro_batch_rows=1, remat="layer",
                   logits_chunk=1024, max_seq_len=16384)
    c.eval.update(every=20, num_tasks=16, repeats=4, final_methods="", final_samples=0)
    c.mesh.shape.update(data=1, fsdp=-1, tensor=1)
    c.checkpoint.update(every=10, keep=3)
    # The paper's roles (docs/paper-settings.md): the fixed answerer is the builder's base model (Qwen3.5-4B,
    # frozen); the Create/Merge executor is Qwen3.5-35B-A3B (--config.roles.executor.path=...); compaction
    # and the judge share the executor's weights and engine (the paper compacts with Gemini 3.1 Flash Lite,
    # which we cannot run). Thinking is off for every frozen role; the answerer's 32,768-token budget fits.
    # Engine slots are per host (each host holds its own engines on its 4 chips, whatever the slice): sized
    # so that every engine's weights and cache fit a v5p chip's 95 GiB with room for the programs'
    # temporaries (`--dry_run --compile --config.topology=v5p-8` prints the plan; BENCHMARKS.md). The
    # answerer's 32,768-token context makes its cache the largest part: 64 slots are 16.8 GiB a chip for
    # Qwen3.5-4B (its DeltaNet layers keep no K/V), where 256 were 67 GiB and did not fit.
    if model_preset.startswith("qwen3_5"):
        c.roles.answerer.update(init="policy", slots=64, max_seq_len=32768, thinking=False)
        c.roles.executor.update(init="hf", preset="qwen3_5_35b_a3b", dtype="bfloat16", slots=128,
                                max_seq_len=8192, thinking=False)
        slots = 128
    else:  # every role reads the builder's tokenizer: a Gemma run's executor is its own base model, frozen
        # Gemma 3 keeps K/V in all 34 layers (139 KB a token, 4.3x Qwen3.5-4B's): the answerer, executor,
        # compaction and judge share one engine (one copy of the weights) of 32 slots x 32,768 tokens, 34 GiB
        # a v5p chip
        c.roles.answerer.update(init="policy", slots=32, max_seq_len=32768, thinking=False)
        c.roles.executor.update(init="policy", slots=32, max_seq_len=8192, thinking=False)
        slots = 32
    for role in ("compaction", "judge"):  # the executor's weights and engine (no path of their own)
        c.roles[role].update(init="executor", slots=slots, max_seq_len=8192, thinking=False)
    # The paper's reward and loss: probe deltas, the terminal reward and the 0.1 no-Stop penalty only; no
    # malformed-call penalty, no dual clip, no TIS (the ratio is taken against the sampler's log-probs).
    c.rollout.builder.update(compaction="model", malformed_penalty=0.0)
    c.train.update(dual_clip=0.0, tis_cap=0.0, kl_beta=0.0, step_weight=0.0)
    c.workdir = f"/tmp/librarian_jax/grpo_{model_preset}"
    return c


def _noisy(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The embedded run on the noisy world (docs/world.md): 20 near-duplicate documents per corpus, facts away
    from their pages, unnamed later hops and counting questions, read by an answerer with 6 tool calls in a
    3,072-token context. Its warm start demonstrates a directory per entity kind (configs/sft.py:noisy)."""
    c.data.update(world="noisy", docs_per_task=20, min_words=50, max_words=100, questions_per_task=8)
    # the reward asks every question a training corpus has: its 8 hidden ones and 24 more (reuse questions,
    # drawn after them, so the hidden ones and the documents are the same); evaluation asks the 8 hidden ones
    # (rollout.jobs.eval_config). With 8 a misplaced entity cost a build reward only when a question named
    # it; with 32 most entities are asked about: five seeds ahead of their warm starts on 4 (on 2 with 8),
    # pooled +6.4 [+3.2, +9.7] points (+4.7 [+2.1, +7.4]); seed 2 80.2 -> 86.7%, where the 8-question
    # reward's last step gave 82.7 and the warm start was kept (BENCHMARKS.md 2026-12-06 (ninth))
    c.data.reuse_questions_per_task = 24
    c.rollout.terminal_questions = "hidden+reuse"
    # the builder lists the raw documents compactly and names them all raw_docs; its files hold what the
    # sources state about what their titles name (agents.executor, "statements"): with every sentence naming
    # it ("focused") an entity file took 700-1,100 of the answerer's 3,072 tokens and the design check's
    # by_kind builder lost a third of the multi-hop questions to the context (81.9%; 100.0% with statements,
    # BENCHMARKS.md 2026-12-06 (seventh))
    # sampled at 0.35: a build is ~20 ids in a row, and a sampled one slips into malformed calls where the
    # greedy one does not, so GRPO compares broken builds and moves the greedy builder with them. At 1.0 a
    # sampled build scored 0.35 where the greedy one scored 0.73 (BENCHMARKS.md 2026-12-06 (sixth)); at 0.6
    # 48% of seed 5's sampled calls failed (33% at 0.35; seed 1: 25%, 8%), its sampled builds were flat where
    # its greedy ones nest, and GRPO took it 91.5 -> 73.2%; at 0.35 to 96.0% (seed 1: 67.8 -> 88.9, 90.4 at
    # 0.6; "2026-12-06 (eighth)")
    c.rollout.builder.update(max_turns=4, raw_listing="compact", executor="statements", doc_id_titles=True,
                             temperature=0.35)
    c.rollout.answerer.update(max_turns=6, context_budget=3072)
    # a quarter of the default's rate: at 2e-4 GRPO took seed 1's warm start 75.0 -> 60.1% (its builds
    # dropped the directories and stopped early), at 5e-5 it holds it (75.5%; BENCHMARKS.md 2026-12-06
    # (sixth))
    c.train.learning_rate = 5e-5
    # the reported builder is the step (0, 4, 8 or 12) whose greedy builds answer most of 8 training corpora
    # kept out of GRPO's batches: at 0.6 GRPO took seed 5's warm start 91.5 -> 73.2% on the held-out corpora
    # (its builds went flat), and a run should not publish a drift it could see on corpora it may look at
    c.eval.update(every=4, select="validation", validation_tasks=8)
    c.warm_start.sft_preset = "noisy"
    c.workdir = "/tmp/librarian_jax/grpo_noisy"
    return c


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    """The GRPO config for `preset` (None = DEFAULT_PRESET, "noisy"); see the module doc."""
    preset = preset or DEFAULT_PRESET
    if preset not in PRESETS:
        raise ValueError(f"configs/grpo.py: unknown preset {preset!r}; known: {list(PRESETS)}")
    c = _base()
    if preset == "noisy":
        c = _noisy(c)
    elif preset != "embedded":
        c = _paper(c, preset)
    c.preset = preset
    c.unlock()
    return c
