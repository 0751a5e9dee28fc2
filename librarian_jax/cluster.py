"""The protocol as one object: which model plays which role, with which template, context and sampling.

Every command takes its roles from here; none builds a model, engine or chat template of its own. `config`
is always the validated, typed config of a run (`config_schema.RunConfig`: GRPO's or SFT's; evaluation's is
the run's recorded one with its overrides), never the raw ConfigDict: each function here raises TypeError on
one.

    mesh = run_mesh(config.mesh)                         # the trainer's: every device of every process
    cluster = build_cluster(config, tokenizer, engine_mesh=engine_mesh(mesh), base=base, policy=policy)
    cluster.engines      # {"policy", "answerer", "executor", "compaction", "judge", "frozen"}: Engines
    cluster.templates    # a chat template per role ("policy" is the builder's)
    cluster.push_weights(trainer.policy_state())         # the trainer's weights to the builder's engine
    cluster.write_protocol(storage.join(workdir, PROTOCOL_FILE))

Roles (`config.roles.<role>`, resolved by `config_validation.resolve_roles`): the builder (the policy,
trained) and the frozen answerer, executor, compaction and judge. Each frozen role names its weights:
"policy" (the builder's initial weights, frozen), an HF folder, an Orbax checkpoint, a random init, or
"executor" (the executor's weights: compaction and judge). Roles that name the same weights share one model
and one engine.

`protocol(config)` is the same description as data, without loading a model: for each role its `weights`
(an HF path, `run:DIR@STEP`, `orbax:DIR`, `scripted:<name>`, `init:<preset>:<seed>`), `architecture`,
`dtype`, `template`, `thinking`, `max_seq_len`, `slots`, `temperature`, `top_p`, `max_new_tokens`. A training
run writes it to `WORKDIR/protocol.json`; an evaluation to `WORKDIR/eval/<name>/protocol.json`, and its report
compares the two (`protocol_diff`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from librarian_jax import checkpoint, config_validation, distributed, models, storage
from librarian_jax.agents.runtime import ANSWERER, COMPACTION, EXECUTOR, FROZEN, FROZEN_ROLES, JUDGE, POLICY
from librarian_jax.config_schema import (
    RUN_SCHEMAS,
    ConfigError,
    EmbeddingRoleSection,
    MeshSection,
    RerankerRoleSection,
    RunConfig,
    require_typed,
)
from librarian_jax.engine import Engine
from librarian_jax.engine import make_mesh as engine_make_mesh
from librarian_jax.rl import train_step
from librarian_jax.tokenizers import ChatTemplate, chat_template, detect_style, load_tokenizer

PROTOCOL_FILE = "protocol.json"
BUILDER = "builder"  # the policy's name in the protocol (the engine's role name is POLICY)
PROTOCOL_ROLES = (BUILDER, *FROZEN_ROLES)
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


def policy_weights(config: RunConfig) -> str:
    """The builder's initial weights as the protocol names them."""
    require_typed(config, RUN_SCHEMAS, "cluster.policy_weights")
    m = config.model
    if m.init == "hf":
        return m.path
    if m.init == "orbax":
        return f"orbax:{m.path}"
    return f"init:{m.preset}:{int(config.seed)}"


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


def role_model(config: RunConfig, d: Mapping[str, Any], mesh: Any, base: Any, tokenizer: Any, *,
               abstract: bool = False) -> Any:
    """The weights of one frozen role (`d` from `config_validation.resolve_roles`); with `abstract`, their
    shapes only."""
    if d["init"] == "policy":
        return base
    if abstract:
        return abstract_model(model_config(d["init"], d["preset"], d["path"], d["dtype"]))
    if d["init"] == "hf":
        model = models.load_hf(d["path"], dtype=d["dtype"] or "bfloat16", mesh=mesh)
    else:
        cfg = model_config(d["init"], d["preset"], d["path"], d["dtype"])
        model = models.Transformer(cfg, rngs=nnx.Rngs(config.seed + 1))
        if d["init"] == "orbax":
            nnx.update(model, checkpoint.restore_params(d["path"], nnx.state(model, nnx.Param)))
    _check_vocab(model, tokenizer, "roles", d["weights"])
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


def engine_groups(roles: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The frozen roles grouped by engine: roles naming the same weights and mesh share one."""
    groups: dict[tuple[str, str], list[str]] = {}
    for role, d in roles.items():
        groups.setdefault((d["weights"], d["mesh"]), []).append(role)
    return list(groups.values())


def build_role_engines(config: RunConfig, mesh: Any, base: Any, tokenizer: Any,
                       roles: Mapping[str, Mapping[str, Any]], *, abstract: bool = False) -> dict[str, Any]:
    """One Engine per distinct (weights, mesh) of the frozen roles: roles naming the same weights share one
    engine and one copy of the weights (slots and max_seq_len: the largest any of its roles asks for). With
    `abstract` the engines are built from the roles' shapes (`Engine` on an abstract model: a plan)."""
    require_typed(config, RUN_SCHEMAS, "cluster.build_role_engines")
    out: dict[str, Any] = {}
    for members in engine_groups(roles):
        role_mesh = _role_mesh(roles[members[0]]["mesh"], members[0], mesh)
        model = role_model(config, roles[members[0]], role_mesh, base, tokenizer, abstract=abstract)
        engine = Engine(model, max(roles[x]["slots"] for x in members),
                        max(roles[x]["max_seq_len"] for x in members), role_mesh,
                        round_steps=config.rollout.round_steps, scan_layers=config.rollout.scan_layers)
        for role in members:
            out[role] = engine
    return out


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
                   roles: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, ChatTemplate]:
    """A chat template for every role: "policy" (the builder: `model.template`, its thinking switch
    `builder_thinking`) and each frozen role (its `template`, `thinking`). GRPO, the warm start's
    demonstrations and SFT, periodic eval, eval and build all encode with these."""
    require_typed(config, RUN_SCHEMAS, "cluster.role_templates")
    roles = roles if roles is not None else config_validation.resolve_roles(config)
    m = config.model

    def make(preset: str, asked: str, thinking: bool) -> ChatTemplate:
        style = template_style(preset, tokenizer, asked)
        return chat_template(tokenizer, style, thinking=thinking if style == "qwen3_5" else None)

    out = {POLICY: make(m.preset, m.template, config.builder_thinking)}
    for role, d in roles.items():
        out[role] = make(d["preset"], d["template"], bool(d["thinking"]))
    out[FROZEN] = out[ANSWERER]
    return out


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


def _weights_name(d: Mapping[str, Any], builder_initial: str, seed: int) -> str:
    """A frozen role's weights as the protocol names them (random roles are seeded `config.seed + 1`)."""
    if d["init"] == "policy":
        return builder_initial
    if d["init"] == "hf":
        return d["path"]
    if d["init"] == "orbax":
        return f"orbax:{d['path']}"
    return f"init:{d['preset']}:{seed + 1}"


def protocol(config: RunConfig, tokenizer: Any = None, *,
             roles: Mapping[str, Mapping[str, Any]] | None = None, builder_weights: str | None = None,
             templates: Mapping[str, ChatTemplate] | None = None,
             policy_engine: Mapping[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """The protocol of `config` as data (module doc): one entry per role of `PROTOCOL_ROLES`.

    `builder_weights` names the builder under evaluation (default: the run's initial weights);
    `templates` (default: built from `tokenizer`) give each role's template style and thinking switch;
    `policy_engine` overrides the builder's `slots` / `max_seq_len` (eval's engine sizes)."""
    require_typed(config, RUN_SCHEMAS, "cluster.protocol")
    roles = roles if roles is not None else config_validation.resolve_roles(config)
    if templates is None and tokenizer is not None:
        templates = role_templates(config, tokenizer, roles)
    rc = config.rollout.config
    b, a = rc.builder, rc.answerer
    m, r = config.model, config.rollout
    initial = policy_weights(config)

    def tmpl(role: str) -> tuple[str, bool]:
        if templates is not None:
            t = templates[role]
            return t.style, bool(t.thinking)
        # no tokenizer (a dry run): the style as far as the config decides it
        if role == POLICY:
            preset, asked, thinking = m.preset, m.template, config.builder_thinking
        else:
            d = roles[role]
            preset, asked, thinking = d["preset"], d["template"], d["thinking"]
        style = template_style(preset, None, asked)
        return style, bool(thinking) if style == "qwen3_5" else False

    out: dict[str, dict[str, Any]] = {}
    style, thinking = tmpl(POLICY)
    sizes = dict(policy_engine or {})
    out[BUILDER] = {
        "weights": builder_weights or initial, "architecture": architecture(m.init, m.preset, m.path),
        "dtype": m.dtype or "preset",
        "template": style, "thinking": thinking,
        "max_seq_len": int(sizes.get("max_seq_len") or r.max_seq_len),
        "slots": int(sizes.get("slots") or r.policy_slots), "temperature": float(b.temperature),
        "top_p": float(b.top_p), "max_new_tokens": int(b.max_new_tokens)}
    # which frozen roles run a model, and their sampling (the agents sample the frozen roles greedily)
    scripted = {
        ANSWERER: "scripted:navigator" if a.kind == "scripted" else "",
        EXECUTOR: "scripted:extractive" if b.executor != "model" else "",
        COMPACTION: {"model": "", "none": "none"}.get(b.compaction, f"scripted:{b.compaction}"),
        JUDGE: "scripted:exact_match" if not rc.use_model_judge else "",
    }
    sampling = {
        ANSWERER: (float(a.temperature), 1.0, int(a.max_new_tokens)),
        EXECUTOR: (0.0, 1.0, int(b.executor_max_new_tokens)),
        COMPACTION: (0.0, 1.0, int(b.compaction_summary_tokens)),
        JUDGE: (0.0, 1.0, int(rc.judge_max_new_tokens)),
    }
    for role in FROZEN_ROLES:
        d = roles[role]
        style, thinking = tmpl(role)
        temperature, top_p, new = sampling[role]
        out[role] = {
            "weights": scripted[role] or _weights_name(d, initial, int(config.seed)),
            "architecture": "" if scripted[role] else architecture(d["init"], d["preset"], d["path"]),
            "dtype": d["dtype"] or "preset",
            "template": "" if scripted[role] else style, "thinking": False if scripted[role] else thinking,
            "max_seq_len": 0 if scripted[role] else int(d["max_seq_len"]),
            "slots": 0 if scripted[role] else int(d["slots"]),
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


def role_table(config: RunConfig, roles: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """Which model serves which role, on which engine and mesh, with which budgets (logged at start, printed
    by --dry_run; docs/paper-settings.md shows the paper preset's)."""
    require_typed(config, RUN_SCHEMAS, "cluster.role_table")
    roles = roles or config_validation.resolve_roles(config)
    m, r = config.model, config.rollout
    b, a = r.config.builder, r.config.answerer
    policy_w = {"random": f"random {m.preset}", "hf": f"HF {m.path}", "orbax": f"Orbax {m.path}"}[m.init]
    mesh = ",".join(f"{k}={v}" for k, v in config.mesh.shape.items())
    proto = protocol(config, roles=roles)
    engine_of: dict[tuple[str, str], int] = {}
    rows = [("role", "weights", "engine", "mesh", "slots", "max_seq_len", "template", "thinking", "budget"),
            ("builder", f"{policy_w} ({m.preset}, LoRA {m.lora_rank})" if m.lora_rank else
             f"{policy_w} ({m.preset})", "policy", mesh, str(r.policy_slots), str(r.max_seq_len),
             proto[BUILDER]["template"], str(proto[BUILDER]["thinking"]),
             f"{b.max_new_tokens} new/turn, compaction {b.compaction} at {b.compaction_budget}")]
    budgets = {
        ANSWERER: (f"{a.kind}: context {a.context_budget}, {a.max_new_tokens} new/turn, "
                   f"{a.max_turns} turns"),
        EXECUTOR: (f"{b.executor}: {b.executor_max_new_tokens} new, excerpts <= "
                   f"{b.excerpt_max_chars} chars"),
        COMPACTION: f"{b.compaction}: {b.compaction_summary_tokens} new",
        JUDGE: f"{'model' if r.config.use_model_judge else 'exact match only'}",
    }
    for role, d in roles.items():
        key = (d["weights"], d["mesh"])
        engine_of.setdefault(key, len(engine_of))
        w = "builder's initial weights (frozen)" if d["init"] == "policy" else \
            f"{d['init']} {d['path'] or d['preset']} ({d['preset']}, {d['dtype'] or 'preset dtype'})"
        rows.append((role, w, f"frozen#{engine_of[key]}", d["mesh"] or mesh, str(d["slots"]),
                     str(d["max_seq_len"]), proto[role]["template"] or "-", str(d["thinking"]),
                     budgets[role]))
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


@dataclasses.dataclass
class Cluster:
    """Every role's model, engine and template for one command (module doc).

    `engines` maps "policy" and each frozen role (and "frozen", the answerer's, for older callers) to its
    Engine; roles naming the same weights hold the same Engine object. `base` is the builder's initial
    weights (frozen roles at init "policy" serve from it); `policy` the model the builder's engine was made
    from (the trainer trains it)."""

    config: RunConfig
    tokenizer: Any
    roles: dict[str, dict[str, Any]]
    engines: dict[str, Any]
    templates: dict[str, ChatTemplate]
    base: Any
    builder_weights: str
    policy_sizes: dict[str, int]
    localizer: Any = None  # multi-process: the trainer's global arrays -> this process's engine layout
    policy: Any = None

    def push_weights(self, state: Any) -> None:
        """New policy weights (an nnx state, e.g. the trainer's) to the builder's engine, on device
        (resharded to the engine's process-local layout in a multi-process run: a collective there)."""
        engine = self.engines[POLICY]
        if self.localizer is not None:
            state = self.localizer(state, engine.params)
        engine.update_params(state)

    def protocol(self) -> dict[str, dict[str, Any]]:
        return protocol(self.config, roles=self.roles, builder_weights=self.builder_weights,
                        templates=self.templates or None, policy_engine=self.policy_sizes)

    def write_protocol(self, path: str) -> str:
        return write_protocol(path, self.protocol())

    def engines_in_use(self, rollout: Any) -> list[tuple[Any, list[str]]]:
        """(engine, its roles) for each distinct engine the roles of `rollout` (a `rollout.RolloutConfig`)
        decode with (`roles_on_engines`), in role order."""
        used = roles_on_engines(rollout)
        by_engine: dict[int, tuple[Any, list[str]]] = {}
        for role, engine in self.engines.items():
            if role in used:
                by_engine.setdefault(id(engine), (engine, []))[1].append(role)
        return list(by_engine.values())

    def programs_ahead(self, rollout: Any) -> list[tuple[str, Any]]:
        """`(name, lower)` pairs of every program of the engines the roles of `rollout` decode with
        (`engines_in_use`): each distinct engine once, named by its roles (`Engine.programs_ahead`). What a
        run compiles ahead of time, and what a plan compiles for its topology."""
        return [(f"{'+'.join(roles)} {name}", job) for engine, roles in self.engines_in_use(rollout)
                for name, job in engine.programs_ahead()]


def roles_on_engines(rollout: Any) -> set[str]:
    """The roles whose work runs on an engine under `rollout` (a `rollout.RolloutConfig`): the policy always;
    the answerer unless scripted, the executor when "model", compaction when "model", the judge with
    `use_model_judge` (the embedded default's frozen roles are all model-free: only the policy decodes)."""
    used = {POLICY}
    if rollout.answerer.kind != "scripted":
        used.add(ANSWERER)
    if rollout.builder.executor == "model":
        used.add(EXECUTOR)
    if rollout.builder.compaction == "model":
        used.add(COMPACTION)
    if rollout.use_model_judge:
        used.add(JUDGE)
    return used


def build_cluster(config: RunConfig, tokenizer: Any, *, engine_mesh: Any, base: Any, policy: Any,
                  builder_weights: str | None = None, policy_slots: int = 0, policy_max_seq_len: int = 0,
                  roles: Mapping[str, Mapping[str, Any]] | None = None, localizer: Any = None,
                  abstract: bool = False) -> Cluster:
    """The cluster of `config` (validated): the builder's engine on `policy`, one engine per distinct frozen
    weights (`build_role_engines`, init "policy" serving from `base`), every role's template.

    `policy_slots` / `policy_max_seq_len` (0: `rollout.policy_slots` / `rollout.max_seq_len`) size the
    builder's engine (evaluation may ask for others); `roles` defaults to `resolve_roles(config)`. With
    `abstract` (a plan: `base` and `policy` from `abstract_model`, `engine_mesh` over a topology's devices,
    no tokenizer) every engine is built from shapes and no template is made: its `programs_ahead` compile
    for that topology, nothing else runs."""
    require_typed(config, RUN_SCHEMAS, "cluster.build_cluster")
    roles = {k: dict(v) for k, v in (roles or config_validation.resolve_roles(config)).items()}
    r = config.rollout
    sizes = {"slots": int(policy_slots or r.policy_slots),
             "max_seq_len": int(policy_max_seq_len or r.max_seq_len)}
    engines = {POLICY: Engine(policy, sizes["slots"], sizes["max_seq_len"], engine_mesh,
                              round_steps=r.round_steps, scan_layers=r.scan_layers)}
    engines.update(build_role_engines(config, engine_mesh, base, tokenizer, roles, abstract=abstract))
    engines[FROZEN] = engines[ANSWERER]
    templates = {} if abstract else role_templates(config, tokenizer, roles)
    cluster = Cluster(config, tokenizer, roles, engines, templates, base,
                      builder_weights or policy_weights(config), sizes, localizer, policy)
    logging.info("protocol:\n%s", protocol_table(cluster.protocol()))
    return cluster
