"""Start-of-run validation of the GRPO config (`configs/grpo.py`): every error names the bad key.

`validate(config, num_devices=None)` raises `ConfigError("config.train.num_steps: must be >= 0, got -1")`
style errors, before anything heavy starts; `main` turns them into a one-line message and exit code 2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

MODEL_INITS = ("random", "hf", "orbax")
DATA_SOURCES = ("synthetic", "file")
SECTIONS = ("model", "data", "rollout", "train", "eval", "mesh", "checkpoint", "warm_start")
# rollout keys main consumes itself (engine sizes); the rest go to rollout.RolloutConfig.from_dict
ROLLOUT_ENGINE_KEYS = ("group_size", "policy_slots", "frozen_slots", "max_seq_len", "round_steps")


class ConfigError(ValueError):
    """A bad config value; the message starts with the key path (`config.section.key`)."""


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config.{key}: {msg}")


def _get(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, AttributeError, TypeError):
            raise _err(key, "missing") from None
    return node


def _int(config: Any, key: str, lo: int | None = None) -> int:
    v = _get(config, key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(key, f"must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise _err(key, f"must be >= {lo}, got {v}")
    return v


def _float(config: Any, key: str, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float:
    v = _get(config, key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _err(key, f"must be a number, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _err(key, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise _err(key, f"must be <= {hi}, got {v}")
    return float(v)


def _choice(config: Any, key: str, choices: Any) -> str:
    v = _get(config, key)
    if v not in tuple(choices):
        raise _err(key, f"must be one of {sorted(choices)}, got {v!r}")
    return v


def validate_mesh(shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """The resolved mesh shape for `num_devices` devices (a shape without -1 may use fewer devices)."""
    from librarian_jax.engine.mesh import MESH_AXES, resolve_mesh_shape

    shape = dict(shape)
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise _err("mesh.shape", f"unknown axis names {unknown}; allowed: {list(MESH_AXES)}")
    for k, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
            raise _err(f"mesh.shape.{k}", f"must be a positive integer or -1, got {v!r}")
    if -1 not in shape.values():
        used = 1
        for v in shape.values():
            used *= v
        if used > num_devices:
            raise _err("mesh.shape", f"{shape} needs {used} devices, only {num_devices} present")
        num_devices = used
    try:
        return resolve_mesh_shape(shape, num_devices)
    except ValueError as e:
        raise _err("mesh.shape", str(e)) from None


def validate(config: Any, num_devices: int | None = None) -> None:
    """Checks every key the GRPO command reads. Raises ConfigError naming the first bad key."""
    for s in SECTIONS:
        _get(config, s)
    validate_common(config, num_devices)  # the policy's own keys first: roles default to them
    validate_roles(config, num_devices)
    validate_train(config)
    _int(config, "eval.every", 0)
    _int(config, "eval.num_tasks", 1)
    _int(config, "eval.repeats", 1)
    _int(config, "eval.final_samples", 0)
    methods = _get(config, "eval.final_methods")
    from librarian_jax.eval.cli import BUILTIN_METHODS

    for m in (x.strip() for x in str(methods).split(",") if x.strip()):
        if m not in BUILTIN_METHODS and not m.startswith("run:"):
            raise _err("eval.final_methods", f"unknown method {m!r}; known: {list(BUILTIN_METHODS)}")
    if _get(config, "warm_start.enabled"):
        from configs import sft as sft_configs

        _choice(config, "warm_start.sft_preset", sft_configs.PRESETS)
        if config.data.source != "synthetic":
            raise _err("warm_start.enabled", "the warm start's demonstrations need the synthetic world "
                       f"(data.source is {config.data.source!r}); run configs/sft.py on your own "
                       "conversations and start GRPO from its checkpoint (model.init='orbax')")


def _validate_data_protocol(config: Any, source: str) -> None:
    """The paper's data protocol keys (configs/grpo.py, docs/paper-settings.md): the split and reuse files are
    read here (ids missing from the data are caught when the tasks load, still before any model)."""
    from librarian_jax import data

    readers = {"data.split_file": data.read_task_ids, "data.reuse_questions": data.load_reuse_questions}
    for key, read in readers.items():
        p = _get(config, key)
        if not isinstance(p, str):
            raise _err(key, f"must be a path string ('' = none), got {p!r}")
        if not p:
            continue
        if not os.path.isfile(p):
            raise _err(key, f"{p!r} is not a file")
        try:
            read(p)
        except data.DataError as e:
            raise _err(key, str(e)) from None
    for key in ("data.max_docs", "data.questions_per_domain"):
        if _int(config, key, 0) and source != "file":
            raise _err(key, f"applies to data.source='file' (BrowseComp-Plus / BRIGHT), not {source!r}; "
                       "0 = off")
    _int(config, "data.sample_seed", 0)


def validate_common(config: Any, num_devices: int | None = None) -> None:
    """The keys every command that builds a model shares: seed, workdir, model, data, rollout, checkpoint,
    mesh."""
    _int(config, "seed", 0)
    if not isinstance(_get(config, "workdir"), str) or not config.workdir:
        raise _err("workdir", f"must be a non-empty path, got {config.workdir!r}")

    # model
    from librarian_jax.models import PRESETS as MODEL_PRESETS

    _choice(config, "model.preset", MODEL_PRESETS)
    init = _choice(config, "model.init", MODEL_INITS)
    path = _get(config, "model.path")
    if init in ("hf", "orbax"):
        if not path:
            raise _err("model.path", f"required when model.init={init!r} (a "
                       f"{'Hugging Face safetensors folder' if init == 'hf' else 'Orbax checkpoint'})")
        if not os.path.exists(path):
            raise _err("model.path", f"{path!r} does not exist")
    for key in ("model.tokenizer", "model.frozen_path"):
        p = _get(config, key)
        if p and not os.path.exists(p):
            raise _err(key, f"{p!r} does not exist")
    _int(config, "model.tokenizer_vocab_size", 64)
    dtype = _get(config, "model.dtype")
    if dtype not in ("", "float32", "bfloat16", "float16"):
        raise _err("model.dtype", f"must be '', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    rank = _int(config, "model.lora_rank", 0)
    if rank:
        _float(config, "model.lora_alpha", 0.0, lo_open=True)
        if not _get(config, "model.lora_module_path"):
            raise _err("model.lora_module_path", "must be a non-empty regex when model.lora_rank > 0")

    # data
    source = _choice(config, "data.source", DATA_SOURCES)
    if source == "file":
        p = _get(config, "data.path")
        if not p:
            raise _err("data.path", "required when data.source='file' (a tasks file or folder)")
        if not os.path.exists(p):
            raise _err("data.path", f"{p!r} does not exist")
    else:
        _int(config, "data.num_tasks", 1)
        _int(config, "data.docs_per_task", 1)
        lo = _int(config, "data.min_words", 1)
        hi = _int(config, "data.max_words", 1)
        if hi < lo:
            raise _err("data.max_words", f"must be >= data.min_words ({lo}), got {hi}")
        _int(config, "data.questions_per_task", 1)
        _int(config, "data.reuse_questions_per_task", 0)
    _float(config, "data.heldout_fraction", 0.0, 0.9)
    _int(config, "data.tasks_per_batch", 1)
    _int(config, "data.shuffle_seed", 0)
    _validate_data_protocol(config, source)

    # rollout
    _int(config, "rollout.group_size", 1)
    _int(config, "rollout.policy_slots", 1)
    _int(config, "rollout.frozen_slots", 1)
    _int(config, "rollout.max_seq_len", 16)
    _int(config, "rollout.round_steps", 1)
    rollout_config(config)

    # checkpoint
    _int(config, "checkpoint.every", 1)
    _int(config, "checkpoint.keep", 1)

    # mesh
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    shape = _get(config, "mesh.shape")
    validate_mesh(shape.to_dict() if hasattr(shape, "to_dict") else dict(shape), num_devices)


def validate_train(config: Any) -> None:
    """The GRPO `train` section."""
    from librarian_jax.rl.advantages import ADVANTAGES
    from librarian_jax.rl.losses import AGGREGATIONS, LOSSES
    from librarian_jax.rl.train_step import REMAT_MODES

    _int(config, "train.num_steps", 0)
    _float(config, "train.learning_rate", 0.0, lo_open=True)
    _int(config, "train.warmup_steps", 0)
    _choice(config, "train.decay", ("cosine", "linear", "constant"))
    _float(config, "train.end_lr_ratio", 0.0, 1.0)
    _float(config, "train.weight_decay", 0.0)
    _float(config, "train.grad_clip", 0.0)
    _int(config, "train.micro_batches", 1)
    remat = _get(config, "train.remat")
    if not isinstance(remat, bool) and remat not in REMAT_MODES:
        raise _err("train.remat", f"must be one of {sorted(REMAT_MODES)} (or a bool), got {remat!r}")
    _int(config, "train.logits_chunk", 0)
    _float(config, "train.moe_aux_loss_coef", 0.0)
    _choice(config, "train.loss", LOSSES)
    _float(config, "train.eps_low", 0.0, 1.0, lo_open=True)
    _float(config, "train.eps_high", 0.0, lo_open=True)
    _float(config, "train.dual_clip", 0.0)
    if 0 < config.train.dual_clip <= 1:
        raise _err("train.dual_clip", f"must be 0 (off) or > 1, got {config.train.dual_clip}")
    _float(config, "train.tis_cap", 0.0)
    _float(config, "train.kl_beta", 0.0)
    _choice(config, "train.aggregation", AGGREGATIONS)
    _choice(config, "train.old_logprobs", ("trainer", "sampler"))
    _choice(config, "train.advantage", ADVANTAGES)
    _float(config, "train.step_weight", 0.0)
    _float(config, "train.step_gamma", 0.0, 1.0)
    _int(config, "train.max_seq_len", 16)


def rollout_config(config: Any) -> Any:
    """`rollout.RolloutConfig` from `config.rollout` minus the engine keys; errors name the key."""
    from librarian_jax.rollout import RolloutConfig

    section = _get(config, "rollout")
    d = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    for k in ROLLOUT_ENGINE_KEYS:
        d.pop(k, None)
    try:
        return RolloutConfig.from_dict(d)
    except KeyError as e:
        raise _err("rollout", str(e.args[0]) if e.args else str(e)) from None
    except (TypeError, ValueError) as e:
        raise _err("rollout", str(e)) from None


# ------------------------------------------------------------------------------------------- roles
# One model per frozen role (the paper: a Qwen3.5-35B-A3B executor, a separate compaction model, a fixed
# answerer that may be another model again, a judge). `config.roles.<role>` names its weights; roles that
# name the same weights share one engine and one copy of them (`main.build`).
FROZEN_ROLES = ("answerer", "executor", "compaction", "judge")
ROLE_INITS = ("policy", "hf", "orbax", "random")
ROLE_KEYS = ("init", "path", "preset", "dtype", "slots", "max_seq_len", "mesh", "thinking")
CHARS_PER_TOKEN = 3  # a conservative characters-per-token figure for the budget warnings


def parse_mesh_spec(spec: str, key: str) -> dict[str, int]:
    """`"data=1,fsdp=-1,tensor=2"` -> `{"data": 1, "fsdp": -1, "tensor": 2}`; "" -> {} (the run's mesh)."""
    out: dict[str, int] = {}
    for part in [p for p in str(spec).replace(" ", "").split(",") if p]:
        name, _, value = part.partition("=")
        try:
            out[name] = int(value)
        except ValueError:
            raise _err(key, f"must look like 'data=1,fsdp=-1,tensor=1', got {spec!r}") from None
    return out


def resolve_roles(config: Any) -> dict[str, dict[str, Any]]:
    """Each frozen role's settings with the defaults filled in: `init="policy"` (the builder's initial
    weights; `model.frozen_path`, when set, is an HF folder for every role left at "policy"), `preset` /
    `dtype` from `model`, `slots` from `rollout.frozen_slots`, `max_seq_len` from `rollout.max_seq_len`, the
    run's mesh. Adds `weights`: the key of the weights (roles with equal keys share one model and engine)."""
    roles = config.get("roles") if hasattr(config, "get") else None
    m, r = config.model, config.rollout
    out: dict[str, dict[str, Any]] = {}
    for role in FROZEN_ROLES:
        src = dict(roles[role]) if roles is not None and role in roles else {}
        unknown = sorted(set(src) - set(ROLE_KEYS))
        if unknown:
            raise _err(f"roles.{role}", f"unknown keys {unknown}; known: {list(ROLE_KEYS)}")
        d = {k: src.get(k) for k in ROLE_KEYS}
        d["init"] = d["init"] or "policy"
        d["path"] = d["path"] or ""
        if d["init"] == "policy" and m.get("frozen_path", ""):
            d["init"], d["path"] = "hf", m.frozen_path
        d["preset"] = d["preset"] or m.preset
        d["dtype"] = d["dtype"] or m.dtype
        d["slots"] = d["slots"] or r.frozen_slots
        d["max_seq_len"] = d["max_seq_len"] or r.max_seq_len
        d["mesh"] = d["mesh"] or ""
        d["thinking"] = bool(d["thinking"]) if d["thinking"] is not None else False
        if d["init"] == "policy":
            d["weights"] = "policy"
        elif d["init"] == "random":
            d["weights"] = f"random:{d['preset']}:{d['dtype']}"
        else:
            preset = d["preset"] if d["init"] == "orbax" else ""
            d["weights"] = f"{d['init']}:{d['path']}:{preset}:{d['dtype']}"
        out[role] = d
    return out


def validate_roles(config: Any, num_devices: int | None = None) -> dict[str, dict[str, Any]]:
    """The `roles` section (when the config has one) and every context budget a role must meet: a budget that
    cannot be met is an error naming its key, or a logged warning naming it where the run can go on."""
    from absl import logging

    from librarian_jax.models import PRESETS as MODEL_PRESETS

    roles = resolve_roles(config)
    for role, d in roles.items():
        k = f"roles.{role}"
        if d["init"] not in ROLE_INITS:
            raise _err(f"{k}.init", f"must be one of {list(ROLE_INITS)}, got {d['init']!r}")
        if d["init"] in ("hf", "orbax"):
            if not d["path"]:
                raise _err(f"{k}.path", f"required when {k}.init={d['init']!r}")
            if not os.path.exists(d["path"]):
                raise _err(f"{k}.path", f"{d['path']!r} does not exist")
        if d["preset"] not in MODEL_PRESETS:
            raise _err(f"{k}.preset", f"must be one of {sorted(MODEL_PRESETS)}, got {d['preset']!r}")
        if d["dtype"] not in ("", "float32", "bfloat16", "float16"):
            raise _err(f"{k}.dtype", f"must be '', 'float32', 'bfloat16' or 'float16', got {d['dtype']!r}")
        for key, lo in (("slots", 1), ("max_seq_len", 16)):
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise _err(f"{k}.{key}", f"must be an integer >= {lo}, got {v!r}")
        if d["mesh"]:
            shape = parse_mesh_spec(d["mesh"], f"{k}.mesh")
            if num_devices is not None:
                validate_mesh(shape, num_devices)
    # budgets
    r = config.rollout
    a, b = r.answerer, r.builder
    if a.get("kind", "model") == "model" and a.get("context_budget", 0) > roles["answerer"]["max_seq_len"]:
        raise _err("rollout.answerer.context_budget",
                   f"{a.context_budget} exceeds the answerer engine's max_seq_len "
                   f"{roles['answerer']['max_seq_len']} (config.roles.answerer.max_seq_len); raise that or "
                   "lower this (it is never clamped silently)")
    if b.get("compaction", "deterministic") != "none" and \
            b.get("compaction_budget", 0) + b.get("max_new_tokens", 0) > r.max_seq_len:
        raise _err("rollout.builder.compaction_budget",
                   f"{b.compaction_budget} + builder.max_new_tokens {b.max_new_tokens} exceeds "
                   f"rollout.max_seq_len {r.max_seq_len}: long episodes would end with a full context")
    obs_cap = (r.max_seq_len - b.get("max_new_tokens", 0)) // 2
    obs_chars = b.get("observation_max_chars", 48_000)
    if obs_chars // CHARS_PER_TOKEN > obs_cap:
        logging.warning("config.rollout.builder.observation_max_chars=%d (~%d tokens) may not fit the half "
                        "of rollout.max_seq_len - builder.max_new_tokens (%d tokens) an observation may "
                        "take: long observations will be cut to fit", obs_chars, obs_chars // CHARS_PER_TOKEN,
                        obs_cap)
    if b.get("executor", "model") == "model":
        need = (b.get("excerpt_max_chars", 16_000) // CHARS_PER_TOKEN + b.get("executor_max_new_tokens", 512)
                + 512)
        if need > roles["executor"]["max_seq_len"]:
            logging.warning("config.roles.executor.max_seq_len=%d may not hold the executor's prompt and "
                            "reply (~%d tokens from rollout.builder.excerpt_max_chars and "
                            "executor_max_new_tokens)",
                            roles["executor"]["max_seq_len"], need)
    return roles
