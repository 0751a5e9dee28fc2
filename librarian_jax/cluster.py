"""The protocol as one object: which model plays which role, with which template, context and sampling.

Every command builds its roles here, one way (`Cluster.from_run`); none builds a model's engine, a chat
template or a rollout config of its own. `config` is always the validated, typed config of a run
(`config_schema.RunConfig`: GRPO's or SFT's; evaluation's is the run's recorded one), never the raw
ConfigDict: each function here raises TypeError on one.

    mesh = run_mesh(config.mesh)                         # the trainer's: every device of every process
    cluster = Cluster.from_run(config, Mode.TRAIN, tokenizer=tok, engine_mesh=engine_mesh(mesh), base=base,
                               policy=policy)
    cluster.engines      # {Role.BUILDER, Role.ANSWERER, ...}: Engines (roles of one engine key share one)
    cluster.templates    # a chat template per role
    cluster.rollout      # the mode's rollout config (`rollout_for(Mode.EVAL)`: periodic evaluation's)
    cluster.sync_weights(trainer.policy_state())         # new builder weights to the builder's engine
    cluster.write_protocol(storage.join(workdir, PROTOCOL_FILE))

Roles (`Role`; `config.roles.<role>` and evaluation's `Overrides`, resolved once by
`config_validation.role_specs`): the builder (the policy, trained) and the frozen answerer, executor,
compaction and judge. Each frozen role names its weights: "policy" (the builder's initial weights, frozen), an
HF folder, an Orbax checkpoint, a random init, or "executor" (the executor's weights: compaction and judge).
Roles of the same weights (`RoleSpec.engine_key`) share one model and one engine.

Modes (`Mode`): training (the run's rollout settings), evaluation and build (probes off, final snapshots
kept, the builder's and the answers' sampling as asked): one rollout config each (`mode_rollout`), its unset
context budgets its engines' lengths, checked against them once (`config_validation.check_budgets`).

`protocol(config)` is the same description as data, without loading a model: for each role its `weights`
(an HF path, `run:DIR@STEP`, `orbax:DIR`, `scripted:<name>`, `init:<preset>:<seed>`), `architecture`,
`dtype`, `template`, `thinking`, `max_seq_len`, `slots`, `temperature`, `top_p`, `max_new_tokens`. A training
run writes it to `WORKDIR/protocol.json`; an evaluation to `WORKDIR/eval/<name>/protocol.json`, and its report
compares the two (`protocol_diff`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import textwrap
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from librarian_jax import checkpoint, config_validation, distributed, models, storage
from librarian_jax.agents.runtime import Role
from librarian_jax.config_schema import (
    RUN_SCHEMAS,
    ConfigError,
    EmbeddingRoleSection,
    MeshSection,
    RerankerRoleSection,
    RunConfig,
    require_typed,
)
from librarian_jax.config_validation import Overrides, RoleSpec, policy_weights, role_specs
from librarian_jax.engine import Engine
from librarian_jax.engine import make_mesh as engine_make_mesh
from librarian_jax.rl import train_step
from librarian_jax.rollout import RolloutConfig
from librarian_jax.tokenizers import ChatTemplate, chat_template, detect_style, load_tokenizer

__all__ = ["PROTOCOL_FILE", "Cluster", "Mode", "Overrides", "Role", "RoleSpec", "mode_rollout",
           "policy_weights", "protocol", "protocol_diff", "protocol_table", "role_specs", "role_table"]

PROTOCOL_FILE = "protocol.json"
BUILDER = Role.BUILDER.protocol_name  # "builder": the policy's name in the protocol
PROTOCOL_ROLES = tuple(r.protocol_name for r in Role)
FROZEN = tuple(r for r in Role if r.frozen)  # the frozen roles, in protocol order
PROTOCOL_FIELDS = ("weights", "architecture", "dtype", "template", "thinking", "max_seq_len", "slots",
                   "temperature", "top_p", "max_new_tokens")


# ------------------------------------------------------------------------------------------- meshes


def mesh_over(mesh: MeshSection, devices: list[Any], what: str) -> Any:
    """The `mesh` section's shape over `devices`."""
    require_typed(mesh, MeshSection, what)
    shape = config_validation.validate_mesh(mesh.shape, len(devices))
    return engine_make_mesh(shape, devices=devices[: int(np.prod(list(shape.values())))])


def run_mesh(mesh: MeshSection) -> Any:
    """A config's `mesh` section over every device of every process: the trainer's mesh."""
    return mesh_over(mesh, jax.devices(), "cluster.run_mesh")


def local_mesh(mesh: MeshSection) -> Any:
    """A config's `mesh` section over this process's devices (evaluation and `build`, whose engines are
    process-local and have no trainer): the same as `run_mesh` in a single-process run."""
    return mesh_over(mesh, jax.local_devices(), "cluster.local_mesh")


def engine_mesh(mesh: Any) -> Any:
    """The mesh this process's engines use: `mesh` itself in a single-process run, else this process's share
    of it (`distributed.hybrid_meshes`: process-local engines, DESIGN.md "Multi-host")."""
    return distributed.hybrid_meshes(mesh)[1]


# ------------------------------------------------------------------------------------------- weights


def _check_vocab(model: Any, tokenizer: Any, key: str, what: str) -> None:
    if tokenizer is None:  # an abstract cluster (a plan): no tokenizer is read
        return
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(f"config.{key}: {what} has vocab_size {model.config.vocab_size}, smaller than the "
                          f"tokenizer's {tokenizer.vocab_size} (every role reads the builder's tokenizer)")


def model_config(init: str, preset: str, path: str, dtype: str) -> models.ModelConfig:
    """A role's architecture without its weights: a Hugging Face folder's `config.json` (init "hf", when
    the folder has one), else the preset's, in `dtype` when set."""
    if init == "hf" and path and storage.isfile(storage.join(path, "config.json")):
        return models.hf_io.read_config(path, dtype or "bfloat16")
    return models.get_preset(preset, **({"dtype": dtype, "param_dtype": dtype} if dtype else {}))


def abstract_model(config: models.ModelConfig, lora: tuple[int, float, str] | None = None) -> Any:
    """A `Transformer` of `config` whose arrays are shapes (`nnx.eval_shape`: nothing allocated), LoRA
    wrapped (rank, alpha, module path) when `lora` is given: what an abstract cluster's engines and trainer
    are built from (a plan for a topology, `planning.plan`)."""
    def make() -> Any:
        model = models.Transformer(config, rngs=nnx.Rngs(0))
        return train_step.apply_lora(model, *lora) if lora else model

    return nnx.eval_shape(make)


def initial_model(config: RunConfig, mesh: Any, tokenizer: Any, *, abstract: bool = False) -> Any:
    """The policy's initial weights: random (seeded by `config.seed`), Hugging Face safetensors, or an Orbax
    checkpoint; with `abstract`, their shapes only (`abstract_model`: no file but `config.json` is read)."""
    require_typed(config, RUN_SCHEMAS, "cluster.initial_model")
    m = config.model
    if abstract:
        return abstract_model(model_config(m.init, m.preset, m.path, m.dtype))
    if m.init == "hf":
        model = models.load_hf(m.path, dtype=m.dtype or "bfloat16", mesh=mesh)
    else:
        cfg = model_config(m.init, m.preset, m.path, m.dtype)  # the preset's (init random / orbax)
        model = models.Transformer(cfg, rngs=nnx.Rngs(config.seed))
        if m.init == "orbax":
            nnx.update(model, checkpoint.restore_params(m.path, nnx.state(model, nnx.Param)))
    _check_vocab(model, tokenizer, "model.preset", f"model {m.preset}")
    return model


def role_model(config: RunConfig, spec: RoleSpec, mesh: Any, base: Any, tokenizer: Any, *,
               abstract: bool = False) -> Any:
    """The weights of one frozen role (`spec`); with `abstract`, their shapes only. Random weights are
    seeded `config.seed + 1`."""
    if spec.init == "policy":
        return base
    if abstract:
        return abstract_model(model_config(spec.init, spec.preset, spec.path, spec.dtype))
    if spec.init == "hf":
        model = models.load_hf(spec.path, dtype=spec.dtype or "bfloat16", mesh=mesh)
    else:
        cfg = model_config(spec.init, spec.preset, spec.path, spec.dtype)
        model = models.Transformer(cfg, rngs=nnx.Rngs(config.seed + 1))
        if spec.init == "orbax":
            nnx.update(model, checkpoint.restore_params(spec.path, nnx.state(model, nnx.Param)))
    _check_vocab(model, tokenizer, "roles", spec.weights)
    return model


def _role_mesh(spec: str, role: str, default: Any) -> Any:
    if not spec:
        return default
    # engines are process-local: a role's mesh covers (some of) this process's devices (the devices of
    # `default`, the engines' mesh: this process's, or an abstract cluster's first host's)
    devices = jax.local_devices() if default is None else sorted(default.devices.flat, key=lambda d: d.id)
    shape = config_validation.validate_mesh(config_validation.parse_mesh_spec(spec, f"roles.{role}.mesh"),
                                            len(devices))
    return engine_make_mesh(shape, devices=devices[: int(np.prod(list(shape.values())))])


def engine_groups(specs: Mapping[Role, RoleSpec]) -> list[list[Role]]:
    """The frozen roles grouped by engine: roles of one `RoleSpec.engine_key` share one."""
    return config_validation.engine_groups(specs)


def _engine(model: Any, slots: int, max_seq_len: int, mesh: Any, round_steps: int, scan_layers: bool) -> Any:
    """A role's engine: the one place a cluster, and so every command, constructs one."""
    return Engine(model, slots, max_seq_len, mesh, round_steps=round_steps, scan_layers=scan_layers)


# ------------------------------------------------------------------------------------------- retrieval roles

RETRIEVAL_ROLES = ("embedding", "reranker")  # evaluation's `roles.embedding` / `roles.reranker`
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclasses.dataclass
class RetrievalModel:
    """An embedding model or a reranker of the evaluation's cluster: weights of one of our families (a
    `Transformer` from `models.load_hf`, sharded onto the mesh), its tokenizer (the folder's own when it has
    one, else the run's) and a chat template (the reranker's judging prompt; thinking off)."""

    role: str
    path: str
    model: Any
    tokenizer: Any
    template: ChatTemplate

    def describe(self) -> dict[str, Any]:
        """Its entry in the evaluation's setup: weights, architecture, tokenizer, template."""
        return {"weights": self.path, "architecture": architecture("hf", "", self.path),
                "tokenizer": "own" if _own_tokenizer(self.path) else "the run's",
                "template": self.template.style}


def _own_tokenizer(path: str) -> bool:
    return any(storage.isfile(storage.join(path, f)) for f in _TOKENIZER_FILES)


def retrieval_model(role: str, section: EmbeddingRoleSection | RerankerRoleSection, mesh: Any,
                    tokenizer: Any) -> RetrievalModel:
    """The `roles.<role>` model (`role` in RETRIEVAL_ROLES; `section` the eval config's typed
    `EmbeddingRoleSection` or `RerankerRoleSection`) loaded through our families onto `mesh`."""
    require_typed(section, (EmbeddingRoleSection, RerankerRoleSection), "cluster.retrieval_model")
    path = str(section.path)
    if not path:
        raise ConfigError(f"config.roles.{role}.path: required (a Hugging Face folder of the {role} model)")
    model = models.load_hf(path, dtype=section.dtype or "bfloat16", mesh=mesh)
    tok = load_tokenizer(path) if _own_tokenizer(path) else tokenizer
    _check_vocab(model, tok, f"roles.{role}.path", path)
    style = detect_style(tok)
    template = chat_template(tok, style, thinking=False if style == "qwen3_5" else None)
    logging.info("%s model %s (%s), %s tokenizer", role, path, architecture("hf", "", path),
                 "its own" if tok is not tokenizer else "the run's")
    return RetrievalModel(role, path, model, tok, template)


# ------------------------------------------------------------------------------------------- templates


def template_style(preset: str, tokenizer: Any, asked: str = "") -> str:
    """A role's chat template style: `asked` when set, else Qwen3.5's for a `qwen3_5*` preset (detection
    never picks it: its vocabulary looks like ChatML), else the style the tokenizer's vocabulary has."""
    if asked:
        return asked
    if str(preset).startswith("qwen3_5"):
        return "qwen3_5"
    return detect_style(tokenizer) if tokenizer is not None else "detected"


def role_templates(config: RunConfig, tokenizer: Any,
                   specs: Mapping[Role, RoleSpec] | None = None) -> dict[Role, ChatTemplate]:
    """A chat template for every role (its `template` and `thinking`; the builder's are `model.template`
    and `builder_thinking`). GRPO, the warm start's demonstrations and SFT, periodic eval, eval and build
    all encode with these."""
    require_typed(config, RUN_SCHEMAS, "cluster.role_templates")
    specs = specs if specs is not None else role_specs(config)

    def make(spec: RoleSpec) -> ChatTemplate:
        style = template_style(spec.preset, tokenizer, spec.template)
        return chat_template(tokenizer, style, thinking=spec.thinking if style == "qwen3_5" else None)

    return {role: make(spec) for role, spec in specs.items()}


# ------------------------------------------------------------------------------------------- the protocol


def architecture(init: str, preset: str, path: str) -> str:
    """A model's architecture as the protocol names it: the preset, or for Hugging Face weights the
    `model_type`, depth and width their `config.json` declares."""
    if init != "hf":
        return preset
    try:
        cfg = json.loads(storage.read_text(storage.join(path, "config.json")))
        cfg = cfg.get("text_config", cfg)
        layers, width = cfg.get("num_hidden_layers", "?"), cfg.get("hidden_size", "?")
        return f"{cfg.get('model_type', '?')}:{layers}x{width}"
    except (OSError, ValueError, AttributeError):
        return f"hf:{path}"


def protocol(config: RunConfig, tokenizer: Any = None, *, specs: Mapping[Role, RoleSpec] | None = None,
             rollout: RolloutConfig | None = None,
             templates: Mapping[Role, ChatTemplate] | None = None) -> dict[str, dict[str, Any]]:
    """The protocol of `config` as data (module doc): one entry per role of `PROTOCOL_ROLES`.

    `specs` (default: `role_specs(config)`, the training run's) name each role's weights and engine sizes;
    `rollout` (default: the run's own) gives its sampling; `templates` (default: built from `tokenizer`)
    each role's template style and thinking switch (without either: as far as the config decides them)."""
    require_typed(config, RUN_SCHEMAS, "cluster.protocol")
    specs = specs if specs is not None else role_specs(config)
    if templates is None and tokenizer is not None:
        templates = role_templates(config, tokenizer, specs)
    rc = rollout if rollout is not None else config.rollout.config
    b, a, m = rc.builder, rc.answerer, config.model

    def tmpl(role: Role) -> tuple[str, bool]:
        if templates is not None:
            t = templates[role]
            return t.style, bool(t.thinking)
        spec = specs[role]  # no tokenizer (a dry run): the style as far as the config decides it
        style = template_style(spec.preset, None, spec.template)
        return style, bool(spec.thinking) if style == "qwen3_5" else False

    # which frozen roles run a model, and every role's sampling (the agents sample the frozen roles greedily)
    scripted = {
        Role.BUILDER: "",
        Role.ANSWERER: "scripted:navigator" if a.kind == "scripted" else "",
        Role.EXECUTOR: "scripted:extractive" if b.executor != "model" else "",
        Role.COMPACTION: {"model": "", "none": "none"}.get(b.compaction, f"scripted:{b.compaction}"),
        Role.JUDGE: "scripted:exact_match" if not rc.use_model_judge else "",
    }
    sampling = {
        Role.BUILDER: (float(b.temperature), float(b.top_p), int(b.max_new_tokens)),
        Role.ANSWERER: (float(a.temperature), 1.0, int(a.max_new_tokens)),
        Role.EXECUTOR: (0.0, 1.0, int(b.executor_max_new_tokens)),
        Role.COMPACTION: (0.0, 1.0, int(b.compaction_summary_tokens)),
        Role.JUDGE: (0.0, 1.0, int(rc.judge_max_new_tokens)),
    }
    out: dict[str, dict[str, Any]] = {}
    for role in Role:
        spec, off = specs[role], scripted[role]
        style, thinking = tmpl(role)
        temperature, top_p, new = sampling[role]
        init, preset, path = (m.init, m.preset, m.path) if role is Role.BUILDER else \
            (spec.init, spec.preset, spec.path)
        out[role.protocol_name] = {
            "weights": off or spec.weights, "architecture": "" if off else architecture(init, preset, path),
            "dtype": spec.dtype or "preset",
            "template": "" if off else style, "thinking": False if off else thinking,
            "max_seq_len": 0 if off else int(spec.max_seq_len), "slots": 0 if off else int(spec.slots),
            "temperature": temperature, "top_p": top_p, "max_new_tokens": new}
    return out


def protocol_diff(trained: Mapping[str, Mapping[str, Any]], used: Mapping[str, Mapping[str, Any]], *,
                  ignore: tuple[tuple[str, str], ...] = ((BUILDER, "weights"),)) -> list[tuple[str, str, Any,
                                                                                             Any]]:
    """(role, field, training's value, this one's) for every field where two protocols differ, except
    `ignore` (by default the builder's weights: an evaluation restores another step of the same builder)."""
    out = []
    for role in PROTOCOL_ROLES:
        for f in PROTOCOL_FIELDS:
            x, y = trained.get(role, {}).get(f), used.get(role, {}).get(f)
            if x != y and (role, f) not in ignore:
                out.append((role, f, x, y))
    return out


def protocol_table(used: Mapping[str, Mapping[str, Any]],
                   trained: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The protocol as a text table, one row per role; with `trained`, each field that differs from the
    training run's reads `value (trained: other) !`."""
    diffs = {(r, f): x for r, f, x, _ in protocol_diff(trained, used, ignore=())} if trained else {}
    rows = [("role", *PROTOCOL_FIELDS)]
    for role in PROTOCOL_ROLES:
        cells = []
        for f in PROTOCOL_FIELDS:
            v = str(used.get(role, {}).get(f, ""))
            if (role, f) in diffs and not (role == BUILDER and f == "weights"):
                v += f" (trained: {diffs[(role, f)]}) !"
            cells.append(v)
        rows.append((role, *cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def role_table(config: RunConfig, specs: Mapping[Role, RoleSpec] | None = None) -> str:
    """Which model serves which role, on which engine and mesh, with which budgets (logged at start, printed
    by --dry_run; docs/paper-settings.md shows the paper preset's)."""
    require_typed(config, RUN_SCHEMAS, "cluster.role_table")
    specs = specs or role_specs(config)
    m, r = config.model, config.rollout
    b, a = r.config.builder, r.config.answerer
    policy_w = {"random": f"random {m.preset}", "hf": f"HF {m.path}", "orbax": f"Orbax {m.path}"}[m.init]
    mesh = ",".join(f"{k}={v}" for k, v in config.mesh.shape.items())
    proto = protocol(config, specs=specs)
    bs = specs[Role.BUILDER]
    rows = [("role", "weights", "engine", "mesh", "slots", "max_seq_len", "template", "thinking", "budget"),
            (BUILDER, f"{policy_w} ({m.preset}, LoRA {m.lora_rank})" if m.lora_rank else
             f"{policy_w} ({m.preset})", "policy", mesh, str(bs.slots), str(bs.max_seq_len),
             proto[BUILDER]["template"], str(proto[BUILDER]["thinking"]),
             f"{b.max_new_tokens} new/turn, compaction {b.compaction} at {b.compaction_budget}")]
    budgets = {
        Role.ANSWERER: (f"{a.kind}: context {a.context_budget}, {a.max_new_tokens} new/turn, "
                        f"{a.max_turns} turns"),
        Role.EXECUTOR: (f"{b.executor}: {b.executor_max_new_tokens} new, excerpts <= "
                        f"{b.excerpt_max_chars} chars"),
        Role.COMPACTION: f"{b.compaction}: {b.compaction_summary_tokens} new",
        Role.JUDGE: f"{'model' if r.config.use_model_judge else 'exact match only'}",
    }
    engine_of: dict[tuple[str, ...], int] = {}
    for role in FROZEN:
        d = specs[role]
        engine_of.setdefault(d.engine_key, len(engine_of))
        w = "builder's initial weights (frozen)" if d.init == "policy" else \
            f"{d.init} {d.path or d.preset} ({d.preset}, {d.dtype or 'preset dtype'})"
        rows.append((str(role), w, f"frozen#{engine_of[d.engine_key]}", d.mesh or mesh, str(d.slots),
                     str(d.max_seq_len), proto[role]["template"] or "-", str(d.thinking), budgets[role]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def write_protocol(path: str, proto: Mapping[str, Any]) -> str:
    storage.write_text(path, json.dumps(proto, indent=1, sort_keys=True))
    return path


def read_protocol(path: str) -> dict[str, Any] | None:
    """A recorded protocol, or None when the file is missing (a run from before protocol.json)."""
    if not storage.isfile(path):
        return None
    return json.loads(storage.read_text(path))


# ------------------------------------------------------------------------------------------- the cluster


class Mode(enum.StrEnum):
    """What a cluster's roles are for: training the builder, evaluating builders, building one workspace."""

    TRAIN = "train"
    EVAL = "eval"
    BUILD = "build"


def mode_rollout(rollout: RolloutConfig, mode: Mode | str, overrides: Overrides | None = None,
                 lengths: Mapping[Role, int] | None = None) -> RolloutConfig:
    """The rollout settings of `mode`, derived from the run's (`rollout`) in one step (the one re-shape
    between the config file and the agents):

    - every mode: an evaluation's answerer overrides (`overrides.answerer`), and each unset (<= 0) context
      budget set to its engine's `max_seq_len` (`lengths`, `config_validation.engine_lengths`; without them
      left as set);
    - eval and build: no probes, final snapshots kept (raw texts left out), the builder sampled at
      `overrides.builder_temperature` (greedy by default), greedy answer repeats made once (and recorded n
      times, at the original's cost) or, with `overrides.answer_temperature` > 0, each its own answer sampled
      at that temperature; a reward over every question a training corpus has
      (`terminal_questions="hidden+reuse"`) evaluated on the hidden ones, the questions every report asks."""
    o = overrides or Overrides()
    d = rollout.to_dict()
    d["answerer"].update(o.answerer)
    if lengths is not None:
        for part, role in (("builder", Role.BUILDER), ("answerer", Role.ANSWERER)):
            if d[part]["context_budget"] <= 0:
                d[part]["context_budget"] = int(lengths[role])
    if Mode(mode) is not Mode.TRAIN:
        sampled = float(o.answer_temperature) > 0
        d["builder"]["temperature"] = float(o.builder_temperature)
        d.update(max_probes=0, probe_at_start=False, record_snapshots=True, snapshot_raw_text=False,
                 repeat_mode="sample" if sampled else "greedy_once",
                 repeat_temperature=float(o.answer_temperature) if sampled else rollout.repeat_temperature)
        if rollout.terminal_questions == "hidden+reuse":
            d["terminal_questions"] = "hidden"
    return RolloutConfig.from_dict(d)


def _same_tree(params: Any, state: Any) -> bool:
    """Whether `state` fits an engine holding `params` (the same tree and leaf shapes): `update_params`."""
    if jax.tree.structure(params) != jax.tree.structure(state):
        return False
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(state), strict=True)
    return all(x.shape == y.shape for x, y in pairs)


@dataclasses.dataclass
class Cluster:
    """Every role's spec, model, engine and template, and the rollout settings of one command's mode (module
    doc). Build it with `from_run`.

    `engines` maps each `Role` to its Engine; roles of one engine key hold the same Engine object. `base` is
    the builder's initial weights (frozen roles at init "policy" serve from it); `policy` the model the
    builder's engine serves (the trainer trains it; an evaluation's current builder). `rollouts` holds the
    rollout config of each mode this cluster runs (`mode`; training's also periodic evaluation's)."""

    config: RunConfig
    mode: Mode
    overrides: Overrides
    specs: dict[Role, RoleSpec]
    rollouts: dict[Mode, RolloutConfig]
    tokenizer: Any
    templates: dict[Role, ChatTemplate]
    engine_mesh: Any
    base: Any
    policy: Any
    localizer: Any = None  # multi-process: the trainer's global arrays -> this process's engine layout
    abstract: bool = False
    engines: dict[Role, Any] = dataclasses.field(default_factory=dict)
    _state: Any = None  # the last builder state synced (re-applied by `reset`)

    @classmethod
    def from_run(cls, config: RunConfig, mode: Mode | str, overrides: Overrides | None = None, *,
                 tokenizer: Any, engine_mesh: Any, base: Any = None, policy: Any = None,
                 localizer: Any = None, abstract: bool = False) -> Cluster:
        """The cluster of run `config` (validated, typed) for `mode`, with an evaluation's `overrides`: every
        role's spec (`role_specs`), the mode's rollout config (`mode_rollout`, checked against the engines'
        lengths: `check_budgets`), the builder's engine on `policy` (default `base`), one engine per distinct
        frozen weights (init "policy" serving from `base`; default: `initial_model`), every role's template.

        With `abstract` (a plan: `base` and `policy` from `abstract_model`, `engine_mesh` over a topology's
        devices, no tokenizer) every engine is built from shapes and no template is made: its
        `programs_ahead` compile for that topology, nothing else runs."""
        require_typed(config, RUN_SCHEMAS, "cluster.Cluster.from_run")
        mode, o = Mode(mode), overrides or Overrides()
        specs = role_specs(config, o)
        lengths = config_validation.engine_lengths(specs)
        rollouts = {}
        for m in (Mode.TRAIN, Mode.EVAL) if mode is Mode.TRAIN else (mode,):
            rollouts[m] = mode_rollout(config.rollout.config, m, o, lengths)
            config_validation.check_budgets(rollouts[m], lengths)
        if base is None:
            base = initial_model(config, engine_mesh, tokenizer, abstract=abstract)
        templates = {} if abstract else role_templates(config, tokenizer, specs)
        cluster = cls(config, mode, o, specs, rollouts, tokenizer, templates, engine_mesh, base,
                      base if policy is None else policy, localizer, abstract)
        cluster.reset()
        logging.info("protocol:\n%s", textwrap.indent(protocol_table(cluster.protocol()), "  "))
        return cluster

    @property
    def rollout(self) -> RolloutConfig:
        """The rollout config of this cluster's mode."""
        return self.rollouts[self.mode]

    def rollout_for(self, mode: Mode | str) -> RolloutConfig:
        return self.rollouts[Mode(mode)]

    def _builder_engine(self) -> Any:
        spec, r = self.specs[Role.BUILDER], self.config.rollout
        return _engine(self.policy, spec.slots, spec.max_seq_len, self.engine_mesh,
                       self.overrides.round_steps or r.round_steps, r.scan_layers)

    def reset(self) -> None:
        """Fresh engines for every role (after a batch raised with sessions still in the old ones' slots):
        the builder's on `policy` (with the last weights synced), one per distinct frozen weights (slots and
        max_seq_len: the largest any of its roles asks for)."""
        r = self.config.rollout
        self.engines = {Role.BUILDER: self._builder_engine()}
        for members in engine_groups(self.specs):
            spec = self.specs[members[0]]
            mesh = _role_mesh(spec.mesh, members[0], self.engine_mesh)
            model = role_model(self.config, spec, mesh, self.base, self.tokenizer, abstract=self.abstract)
            engine = _engine(model, max(self.specs[x].slots for x in members),
                             max(self.specs[x].max_seq_len for x in members), mesh,
                             self.overrides.round_steps or r.round_steps, r.scan_layers)
            self.engines.update(dict.fromkeys(members, engine))
        if self._state is not None:
            self.sync_weights(self._state)

    def sync_weights(self, weights: Any) -> None:
        """New builder weights to the builder's engine, on device: the trainer's state (resharded to the
        engine's process-local layout in a multi-process run: a collective there), or a model (an
        evaluation's builder), which becomes `policy`; a model of another graph (LoRA vs full, another
        architecture) gets an engine of its own."""
        if isinstance(weights, nnx.Module):
            self.policy, self._state = weights, None
            state = nnx.state(weights)
            if not _same_tree(self.engines[Role.BUILDER].params, state):
                self.engines[Role.BUILDER] = self._builder_engine()
                return
        else:
            state = self._state = weights
        engine = self.engines[Role.BUILDER]
        if self.localizer is not None:
            state = self.localizer(state, engine.params)
        engine.update_params(state)

    def protocol(self) -> dict[str, dict[str, Any]]:
        return protocol(self.config, specs=self.specs, rollout=self.rollout, templates=self.templates or None)

    def write_protocol(self, path: str) -> str:
        return write_protocol(path, self.protocol())

    def engines_in_use(self, rollout: RolloutConfig | None = None) -> list[tuple[Any, list[Role]]]:
        """(engine, its roles) for each distinct engine the roles of `rollout` (default: this mode's) decode
        with (`roles_on_engines`), in role order."""
        used = roles_on_engines(rollout or self.rollout)
        by_engine: dict[int, tuple[Any, list[Role]]] = {}
        for role, engine in self.engines.items():
            if role in used:
                by_engine.setdefault(id(engine), (engine, []))[1].append(role)
        return list(by_engine.values())

    def programs_ahead(self, rollout: RolloutConfig | None = None) -> list[tuple[str, Any]]:
        """`(name, lower)` pairs of every program of the engines the roles of `rollout` (default: this
        mode's) decode with (`engines_in_use`): each distinct engine once, named by its roles
        (`Engine.programs_ahead`). What a run compiles ahead of time, and what a plan compiles for its
        topology."""
        return [(f"{'+'.join(roles)} {name}", job) for engine, roles in self.engines_in_use(rollout)
                for name, job in engine.programs_ahead()]


def roles_on_engines(rollout: RolloutConfig) -> set[Role]:
    """The roles whose work runs on an engine under `rollout`: the builder always; the answerer unless
    scripted, the executor when "model", compaction when "model", the judge with `use_model_judge` (the
    embedded default's frozen roles are all model-free: only the builder decodes)."""
    used = {Role.BUILDER}
    if rollout.answerer.kind != "scripted":
        used.add(Role.ANSWERER)
    if rollout.builder.executor == "model":
        used.add(Role.EXECUTOR)
    if rollout.builder.compaction == "model":
        used.add(Role.COMPACTION)
    if rollout.use_model_judge:
        used.add(Role.JUDGE)
    return used
