"""Start-of-run validation of a command's config: every error names the bad key.

The keys, their types, bounds and choice lists are the schema's (`librarian_jax.config_schema`: one typed
dataclass per section, each checking itself); this module adds what needs more than one section or the
machine: the mesh against the device count, the frozen roles' defaults and budgets, the warm start's preset.
`validate(config, num_devices=None)` raises `ConfigError("config.train.num_steps: must be >= 0, got -1")`
style errors before anything heavy starts; `main` turns them into a one-line message and exit code 2.

Only `validate` (and `validate_common`) read the raw ConfigDict: it returns the typed config, and the
helpers here (`resolve_roles`, `validate_roles`) take that, as every module below the commands does.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from absl import logging

from librarian_jax.agents.runtime import FROZEN_ROLES
from librarian_jax.config_schema import (
    DTYPES,
    ROLE_INITS,
    RUN_SCHEMAS,
    ConfigError,
    GRPOConfig,
    RunConfig,
    SFTConfig,
    config_error,
    require_typed,
    validate_mesh,
)
from librarian_jax.models import PRESETS as MODEL_PRESETS
from librarian_jax.planning import topology
from librarian_jax.presets import sft as sft_presets

__all__ = ["ConfigError", "parse_mesh_spec", "resolve_roles", "validate", "validate_common", "validate_mesh",
           "validate_roles"]
_err = config_error


def validate(config: Any, num_devices: int | None = None) -> GRPOConfig:
    """Checks every key the GRPO command reads; returns the typed config. Raises ConfigError naming the
    first bad key."""
    parsed = GRPOConfig.parse(config)
    num_devices = plan_devices(parsed, num_devices)
    validate_mesh(parsed.mesh.shape, num_devices)
    validate_roles(parsed, num_devices)
    if parsed.warm_start.enabled:
        if parsed.warm_start.sft_preset not in sft_presets.PRESETS:
            raise _err("warm_start.sft_preset", f"must be one of {sorted(sft_presets.PRESETS)}, "
                       f"got {parsed.warm_start.sft_preset!r}")
    return parsed


def plan_devices(parsed: Any, num_devices: int | None = None) -> int:
    """The devices `parsed`'s mesh must cover: its `topology`'s (a plan: `planning.topology`; a topology
    that does not resolve is a ConfigError naming it), else `num_devices`, else this host's."""
    if getattr(parsed, "topology", ""):
        try:
            return len(topology.parse(parsed.topology).devices())
        except topology.TopologyError as e:
            raise _err("topology", str(e)) from None
    return jax.device_count() if num_devices is None else num_devices


# the sections every command that builds a model shares (SFT's data section adds `packing`)
COMMON_KEYS = ("seed", "workdir", "model", "data", "rollout", "checkpoint", "mesh")


def validate_common(config: Any, num_devices: int | None = None) -> None:
    """The keys every command that builds a model shares: seed, workdir, model, data, rollout, checkpoint,
    mesh (against `num_devices`, default: this process's devices)."""
    schema = SFTConfig if config.get("command", "train") == "sft" else GRPOConfig
    parsed = schema.parse_fields(config, COMMON_KEYS)
    if "mesh" in parsed:
        validate_mesh(parsed["mesh"].shape, jax.device_count() if num_devices is None else num_devices)


# ------------------------------------------------------------------------------------------- roles
# One model per frozen role (the paper: a Qwen3.5-35B-A3B executor, a separate compaction model, a fixed
# answerer that may be another model again, a judge). `config.roles.<role>` names its weights; roles that
# name the same weights share one engine and one copy of them (`cluster.build_cluster`).
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


def resolve_roles(config: RunConfig) -> dict[str, dict[str, Any]]:
    """Each frozen role's settings with the defaults filled in: `init="policy"` (the builder's initial
    weights; `model.frozen_path`, when set, is an HF folder for every role left at "policy"), `preset` /
    `dtype` from `model`, `slots` from `rollout.frozen_slots`, `max_seq_len` from `rollout.max_seq_len`, the
    run's mesh. `init="executor"` (compaction, judge) takes the executor's weights, preset, dtype and mesh.
    Adds `weights`: the key of the weights (roles with equal keys share one model and engine). `config` is
    the typed config of a run (`config_schema.RunConfig`)."""
    require_typed(config, RUN_SCHEMAS, "config_validation.resolve_roles")
    m, r = config.model, config.rollout
    out: dict[str, dict[str, Any]] = {}
    for role in FROZEN_ROLES:
        d = getattr(config.roles, role).to_dict()
        d["init"] = d["init"] or "policy"
        if d["init"] == "executor":
            if role == "executor":
                raise _err("roles.executor.init", "cannot be 'executor' (its own weights)")
            ex = out["executor"]
            d.update({k: ex[k] for k in ("init", "path", "preset", "dtype", "mesh")})
            d["template"] = d["template"] or ex["template"]
        if d["init"] == "policy" and m.frozen_path:
            d["init"], d["path"] = "hf", m.frozen_path
        d["preset"] = d["preset"] or m.preset
        d["dtype"] = d["dtype"] or m.dtype
        d["slots"] = d["slots"] or r.frozen_slots
        d["max_seq_len"] = d["max_seq_len"] or r.max_seq_len
        if d["init"] == "policy":
            d["weights"] = "policy"
        elif d["init"] == "random":
            d["weights"] = f"random:{d['preset']}:{d['dtype']}"
        else:
            preset = d["preset"] if d["init"] == "orbax" else ""
            d["weights"] = f"{d['init']}:{d['path']}:{preset}:{d['dtype']}"
        out[role] = d
    return out


def validate_roles(config: RunConfig, num_devices: int | None = None) -> dict[str, dict[str, Any]]:
    """The `roles` section of a typed run config and every context budget a role must meet: a budget that
    cannot be met is an error naming its key, or a logged warning naming it where the run can go on."""
    roles = resolve_roles(config)
    for role, d in roles.items():
        k = f"roles.{role}"
        if d["init"] not in ROLE_INITS:
            raise _err(f"{k}.init", f"must be one of {list(ROLE_INITS)}, got {d['init']!r}")
        if d["init"] in ("hf", "orbax") and not config.topology:  # a plan reads no weights
            if not d["path"]:
                raise _err(f"{k}.path", f"required when {k}.init={d['init']!r}")
            if not os.path.exists(d["path"]):
                raise _err(f"{k}.path", f"{d['path']!r} does not exist")
        if d["preset"] not in MODEL_PRESETS:
            raise _err(f"{k}.preset", f"must be one of {sorted(MODEL_PRESETS)}, got {d['preset']!r}")
        if d["dtype"] not in DTYPES:
            raise _err(f"{k}.dtype", f"must be one of {list(DTYPES)}, got {d['dtype']!r}")
        for key, lo in (("slots", 1), ("max_seq_len", 16)):
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise _err(f"{k}.{key}", f"must be an integer >= {lo}, got {v!r}")
        if d["mesh"]:
            shape = parse_mesh_spec(d["mesh"], f"{k}.mesh")
            if num_devices is not None:
                validate_mesh(shape, num_devices)
    # budgets
    rs = config.rollout
    a, b = rs.config.answerer, rs.config.builder
    if a.kind == "model" and a.context_budget > roles["answerer"]["max_seq_len"]:
        raise _err("rollout.answerer.context_budget",
                   f"{a.context_budget} exceeds the answerer engine's max_seq_len "
                   f"{roles['answerer']['max_seq_len']} (config.roles.answerer.max_seq_len); raise that or "
                   "lower this (it is never clamped silently)")
    if b.compaction != "none" and b.compaction_budget + b.max_new_tokens > rs.max_seq_len:
        raise _err("rollout.builder.compaction_budget",
                   f"{b.compaction_budget} + builder.max_new_tokens {b.max_new_tokens} exceeds "
                   f"rollout.max_seq_len {rs.max_seq_len}: long episodes would end with a full context")
    obs_cap = (rs.max_seq_len - b.max_new_tokens) // 2
    if b.observation_max_chars // CHARS_PER_TOKEN > obs_cap:
        logging.warning("config.rollout.builder.observation_max_chars=%d (~%d tokens) may not fit the half "
                        "of rollout.max_seq_len - builder.max_new_tokens (%d tokens) an observation may "
                        "take: long observations will be cut to fit", b.observation_max_chars,
                        b.observation_max_chars // CHARS_PER_TOKEN, obs_cap)
    if b.executor == "model":
        need = b.excerpt_max_chars // CHARS_PER_TOKEN + b.executor_max_new_tokens + 512
        if need > roles["executor"]["max_seq_len"]:
            logging.warning("config.roles.executor.max_seq_len=%d may not hold the executor's prompt and "
                            "reply (~%d tokens from rollout.builder.excerpt_max_chars and "
                            "executor_max_new_tokens)",
                            roles["executor"]["max_seq_len"], need)
    return roles
