"""Start-of-run validation of a command's config: every error names the bad key.

The keys, their types, bounds and choice lists are the schema's (`librarian_jax.config_schema`: one typed
dataclass per section, each checking itself); this module adds what needs more than one section or the
machine: the mesh against the device count, the frozen roles' defaults and budgets, the warm start's preset.
`validate(config, num_devices=None)` raises `ConfigError("config.train.num_steps: must be >= 0, got -1")`
style errors before anything heavy starts; `main` turns them into a one-line message and exit code 2.

Only `validate` (and `validate_common`) read the raw ConfigDict: it returns the typed config, and the
helpers here (`role_specs`, `validate_roles`, `check_budgets`) take that, as every module below the
commands does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
from absl import logging

from librarian_jax.agents.runtime import FROZEN_ROLES, Role
from librarian_jax.config_schema import (
    RUN_SCHEMAS,
    ConfigError,
    EvalConfig,
    GRPOConfig,
    RunConfig,
    SFTConfig,
    config_error,
    require_typed,
    validate_mesh,
)
from librarian_jax.planning import topology
from librarian_jax.presets import sft as sft_presets
from librarian_jax.rollout import RolloutConfig

__all__ = ["ConfigError", "Overrides", "RoleSpec", "check_budgets", "engine_groups", "engine_lengths",
           "parse_mesh_spec", "policy_weights", "role_specs", "validate", "validate_common", "validate_mesh",
           "validate_roles", "weights_name"]
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
# name the same weights share one engine and one copy of them (`cluster.Cluster.from_run`).
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


def weights_name(init: str, path: str, preset: str, seed: int) -> str:
    """Weights as the protocol names them, the one rule for the builder and every frozen role: a Hugging
    Face folder by its path, an Orbax checkpoint `orbax:<path>`, a random init `init:<preset>:<seed>`."""
    if init == "hf":
        return path
    if init == "orbax":
        return f"orbax:{path}"
    return f"init:{preset}:{int(seed)}"


def policy_weights(config: RunConfig) -> str:
    """The builder's initial weights as the protocol names them (random: seeded `config.seed`)."""
    require_typed(config, RUN_SCHEMAS, "config_validation.policy_weights")
    m = config.model
    return weights_name(m.init, m.path, m.preset, config.seed)


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What a command asks of a run's protocol beyond the run's own config (evaluation and `build`: their
    `roles.<role>.<key>`, `answerer.*`, `engine.*` and sampling keys; training asks nothing). `asked` names
    the protocol keys overridden, in the order the report lists them."""

    roles: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)  # role -> key -> value
    answerer: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # kind / temperature
    frozen_slots: int = 0  # 0: rollout.frozen_slots
    round_steps: int = 0  # 0: rollout.round_steps
    policy_slots: int = 0  # 0: rollout.policy_slots
    policy_max_seq_len: int = 0  # 0: rollout.max_seq_len
    builder_temperature: float = 0.0  # evaluation's and build's builder (training's samples as trained)
    answer_temperature: float = 0.0  # > 0: evaluation's answer repeats sampled at it
    builder_weights: str = ""  # the builder under evaluation, as the protocol names it ("": the initial)
    asked: tuple[str, ...] = ()

    @classmethod
    def of_eval(cls, c: EvalConfig, builder_weights: str = "") -> Overrides:
        """An evaluation's (or a build's eval keys') explicit overrides: every key at "" / 0 / -1 is the
        run's."""
        require_typed(c, EvalConfig, "config_validation.Overrides.of_eval")
        asked: list[str] = []
        roles: dict[str, dict[str, Any]] = {}
        for role in FROZEN_ROLES:
            over, changes = getattr(c.roles, role), {}
            for key in ROLE_OVERRIDES:
                value = getattr(over, key)
                if value not in ("", 0):
                    changes[key] = value
                    asked.append(f"roles.{role}.{key}")
            if over.thinking >= 0:
                changes["thinking"] = bool(over.thinking)
                asked.append(f"roles.{role}.thinking")
            roles[role] = changes
        answerer: dict[str, Any] = {}
        if c.answerer.kind:
            answerer["kind"] = c.answerer.kind
            asked.append("answerer.kind")
        if c.answerer.temperature >= 0:
            answerer["temperature"] = float(c.answerer.temperature)
            asked.append("answerer.temperature")
        asked += [f"engine.{k}" for k in ("frozen_slots", "round_steps") if getattr(c.engine, k)]
        e = c.engine
        return cls(roles, answerer, int(e.frozen_slots), int(e.round_steps), int(e.policy_slots),
                   int(e.max_seq_len), float(c.builder_temperature), float(c.answer_temperature),
                   builder_weights, tuple(asked))


# an evaluation's `roles.<role>` keys that override the run's (thinking apart: -1 is the run's)
ROLE_OVERRIDES = ("init", "path", "preset", "dtype", "slots", "max_seq_len", "mesh", "template")


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One role of a run's protocol with every default filled in (`role_specs`): where its weights come
    from (`init` policy | hf | orbax | random; `path`, `preset`, `dtype`), its engine's `slots`,
    `max_seq_len` and `mesh` ("" = the run's), its chat template and thinking switch, and `weights`, its
    weights as the protocol names them (`weights_name`)."""

    role: Role
    init: str
    path: str
    preset: str
    dtype: str
    slots: int
    max_seq_len: int
    mesh: str
    thinking: bool
    template: str
    weights: str

    @property
    def engine_key(self) -> tuple[str, str, str, str]:
        """Roles with equal keys share one engine and one copy of the weights: the weights' name, and unless
        they are the builder's initial weights (served as loaded) their dtype and, for Orbax, the
        architecture they are restored into; and the mesh."""
        if self.init == "policy":
            return ("policy", "", "", self.mesh)
        return (self.weights, self.dtype, self.preset if self.init == "orbax" else "", self.mesh)


def role_specs(config: RunConfig, overrides: Overrides | None = None) -> dict[Role, RoleSpec]:
    """Every role of `config` (typed) with its defaults filled in, `overrides` applied: the builder (the
    model section; slots and context from `rollout`, an evaluation's `engine` sizes) and each frozen role
    (`roles.<role>`): `init="policy"` (the builder's initial weights; `model.frozen_path`, when set, is an HF
    folder for every role left at "policy"), `preset` / `dtype` from `model`, `slots` from
    `rollout.frozen_slots`, `max_seq_len` from `rollout.max_seq_len`, the run's mesh. `init="executor"`
    (compaction, judge) takes the executor's weights, preset, dtype and mesh. Random frozen weights are
    seeded `config.seed + 1`. The keys' choices are the schema's; nothing here checks them again."""
    require_typed(config, RUN_SCHEMAS, "config_validation.role_specs")
    o = overrides or Overrides()
    m, r = config.model, config.rollout
    initial = policy_weights(config)
    out: dict[Role, RoleSpec] = {Role.BUILDER: RoleSpec(
        Role.BUILDER, m.init, m.path, m.preset, m.dtype, int(o.policy_slots or r.policy_slots),
        int(o.policy_max_seq_len or r.max_seq_len), "", bool(config.builder_thinking), m.template,
        o.builder_weights or initial)}
    for role in map(Role, FROZEN_ROLES):
        d = {**getattr(config.roles, role).to_dict(), **o.roles.get(role, {})}
        d["init"] = d["init"] or "policy"
        if d["init"] == "executor":
            if role is Role.EXECUTOR:
                raise _err("roles.executor.init", "cannot be 'executor' (its own weights)")
            ex = out[Role.EXECUTOR]
            d.update(init=ex.init, path=ex.path, preset=ex.preset, dtype=ex.dtype, mesh=ex.mesh)
            d["template"] = d["template"] or ex.template
        if d["init"] == "policy" and m.frozen_path:
            d["init"], d["path"] = "hf", m.frozen_path
        preset, dtype = d["preset"] or m.preset, d["dtype"] or m.dtype
        weights = initial if d["init"] == "policy" else weights_name(d["init"], d["path"], preset,
                                                                     config.seed + 1)
        out[role] = RoleSpec(role, d["init"], d["path"], preset, dtype,
                             int(d["slots"] or o.frozen_slots or r.frozen_slots),
                             int(d["max_seq_len"] or r.max_seq_len), d["mesh"], bool(d["thinking"]),
                             d["template"], weights)
    return out


def engine_groups(specs: Mapping[Role, RoleSpec]) -> list[list[Role]]:
    """The frozen roles grouped by engine: roles of one `RoleSpec.engine_key` share one."""
    groups: dict[tuple[str, ...], list[Role]] = {}
    for role, spec in specs.items():
        if role.frozen:
            groups.setdefault(spec.engine_key, []).append(role)
    return list(groups.values())


def engine_lengths(specs: Mapping[Role, RoleSpec]) -> dict[Role, int]:
    """Each role's engine's `max_seq_len`: the builder's own, a frozen role's the largest of the roles
    sharing its engine (`engine_groups`)."""
    out = {Role.BUILDER: specs[Role.BUILDER].max_seq_len}
    for members in engine_groups(specs):
        out.update(dict.fromkeys(members, max(specs[r].max_seq_len for r in members)))
    return out


def check_budgets(rollout: RolloutConfig, lengths: Mapping[Role, int]) -> None:
    """The one rule for the context budgets a mode's rollout settings ask of its engines (`lengths`:
    `engine_lengths`): a budget an engine cannot hold is an error naming its key, never clamped silently
    (a scripted answerer reads on no engine)."""
    a, b = rollout.answerer, rollout.builder
    policy, answerer = lengths[Role.BUILDER], lengths[Role.ANSWERER]
    if a.kind == "model" and a.context_budget > answerer:
        raise _err("rollout.answerer.context_budget",
                   f"{a.context_budget} exceeds the answerer engine's max_seq_len {answerer} "
                   "(config.roles.answerer.max_seq_len); raise that or lower this (it is never clamped "
                   "silently)")
    if b.compaction != "none" and b.compaction_budget + b.max_new_tokens > policy:
        raise _err("rollout.builder.compaction_budget",
                   f"{b.compaction_budget} + builder.max_new_tokens {b.max_new_tokens} exceeds "
                   f"the builder engine's max_seq_len {policy}: long episodes would end with a full context")


def validate_roles(config: RunConfig, num_devices: int | None = None) -> dict[Role, RoleSpec]:
    """The `roles` section of a typed run config (what needs the file system or the devices: paths, meshes)
    and every context budget a role must meet (`check_budgets` on the run's own settings, unset budgets
    being their engines' lengths; warnings where the run can go on). Returns the roles (`role_specs`)."""
    specs = role_specs(config)
    for role, d in specs.items():
        if not role.frozen:
            continue
        k = f"roles.{role}"
        if d.init in ("hf", "orbax") and not config.topology:  # a plan reads no weights
            if not d.path:
                raise _err(f"{k}.path", f"required when {k}.init={d.init!r}")
            if not os.path.exists(d.path):
                raise _err(f"{k}.path", f"{d.path!r} does not exist")
        if d.max_seq_len < 16:
            raise _err(f"{k}.max_seq_len", f"must be an integer >= 16, got {d.max_seq_len!r}")
        if d.mesh:
            shape = parse_mesh_spec(d.mesh, f"{k}.mesh")
            if num_devices is not None:
                validate_mesh(shape, num_devices)
    rs = config.rollout
    b = rs.config.builder
    check_budgets(rs.config, engine_lengths(specs))
    obs_cap = (rs.max_seq_len - b.max_new_tokens) // 2
    if b.observation_max_chars // CHARS_PER_TOKEN > obs_cap:
        logging.warning("config.rollout.builder.observation_max_chars=%d (~%d tokens) may not fit the half "
                        "of rollout.max_seq_len - builder.max_new_tokens (%d tokens) an observation may "
                        "take: long observations will be cut to fit", b.observation_max_chars,
                        b.observation_max_chars // CHARS_PER_TOKEN, obs_cap)
    if b.executor == "model":
        need = b.excerpt_max_chars // CHARS_PER_TOKEN + b.executor_max_new_tokens + 512
        if need > specs[Role.EXECUTOR].max_seq_len:
            logging.warning("config.roles.executor.max_seq_len=%d may not hold the executor's prompt and "
                            "reply (~%d tokens from rollout.builder.excerpt_max_chars and "
                            "executor_max_new_tokens)",
                            specs[Role.EXECUTOR].max_seq_len, need)
    return specs
