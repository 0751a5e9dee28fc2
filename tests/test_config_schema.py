"""The config schema (`librarian_jax.config_schema`) is the one place each key and each choice list lives:
every key of every preset in configs/*.py is a schema field (and every field is in the presets), the schema
carries each value unchanged, bad values name their key, and no choice list is written out twice."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import re

import pytest

from librarian_jax import cli_flags
from librarian_jax import config_schema as S

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = {"grpo": S.GRPOConfig, "sft": S.SFTConfig, "eval": S.EvalConfig, "build": S.BuildConfig}


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def presets():
    for name, schema in CONFIG_FILES.items():
        mod = importlib.import_module(f"configs.{name}")
        for preset in getattr(mod, "PRESETS", (None,)):
            yield pytest.param(mod, preset, schema, id=f"{name}:{preset}")


def with_weights_and_data(config, tmp_path):
    """The paper presets name no weights or data: point them at existing (empty) files."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "data.jsonl").write_text("")
    if "model" in config and config.model.init != "random":
        config.model.path = str(tmp_path / "weights")
    if "data" in config and config.data.get("source") == "file":
        config.data.path = str(tmp_path / "data.jsonl")
    for role in config.get("roles", {}).values():
        if role.get("init") in ("hf", "orbax"):  # roles.embedding / reranker have no init
            role.path = str(tmp_path / "weights")
    return config


@pytest.mark.parametrize("mod,preset,schema", list(presets()))
def test_every_preset_key_is_a_schema_field_and_keeps_its_value(mod, preset, schema, tmp_path):
    config = with_weights_and_data(mod.get_config(preset), tmp_path)
    assert S.schema_for(config) is schema
    keys = set(flat(config.to_dict()))
    assert keys == set(flat(schema().to_dict())), "a config key without a schema field, or the reverse"
    parsed = schema.parse(config)
    assert flat(parsed.to_dict()) == flat(config.to_dict())  # the typed config carries every value


def test_a_key_the_schema_does_not_declare_fails_in_the_config_file_and_at_start():
    grpo = importlib.import_module("configs.grpo")
    base = S.GRPOConfig().to_config_dict()
    base.lock()
    with pytest.raises(KeyError, match="learning_rat"):
        base.train.update(learning_rat=1e-3)  # what configs/*.py do while they set values
    c = grpo.get_config("embedded")
    c.train.learning_rat = 1e-3
    with pytest.raises(S.ConfigError, match=r"config\.train: unknown keys \['learning_rat'\]"):
        S.GRPOConfig.parse(c)
    c = grpo.get_config("embedded")
    c.roles.judge.weights = "x"
    with pytest.raises(S.ConfigError, match=r"config\.roles\.judge: unknown keys \['weights'\]"):
        S.GRPOConfig.parse(c)


@pytest.mark.parametrize("schema,key,value,message", [
    (S.GRPOConfig, "train.learning_rate", -1, r"config\.train\.learning_rate: must be > 0\.0, got -1"),
    (S.GRPOConfig, "train.decay", "step", r"config\.train\.decay: must be one of \['constant', .*got 'step'"),
    (S.GRPOConfig, "train.num_steps", 2.5, r"config\.train\.num_steps: must be an integer, got 2\.5"),
    (S.GRPOConfig, "model.dtype", "int8", r"config\.model\.dtype: must be one of \['', 'bfloat16'"),
    (S.GRPOConfig, "data.format", "csv", r"config\.data\.format: must be one of \['auto', 'bright'"),
    (S.GRPOConfig, "rollout.answerer.kind", "oracle", r"config\.rollout\.answerer\.kind: must be one of"),
    (S.GRPOConfig, "eval.final_methods", "trained,dense", r"config\.eval\.final_methods: unknown method"),
    (S.GRPOConfig, "workdir", "", r"config\.workdir: must not be empty"),
    (S.GRPOConfig, "mesh.shape.fsdp", 0, r"config\.mesh\.shape\.fsdp: must be a positive integer or -1"),
    (S.GRPOConfig, "roles.executor.preset", "gpt5", r"config\.roles\.executor\.preset: must be one of"),
    (S.GRPOConfig, "data.world", "busy", r"config\.data\.world: must be one of \['classic', 'noisy'\]"),
    (S.GRPOConfig, "seeds", "0,one", r"config\.seeds: must be comma-separated seeds >= 0"),
    (S.GRPOConfig, "seeds", "0,-1", r"config\.seeds: must be comma-separated seeds >= 0"),
    (S.SFTConfig, "train.num_steps", 0, r"config\.train\.num_steps: must be >= 1, got 0"),
    (S.SFTConfig, "demos.mix.entities", -0.5, r"config\.demos\.mix\.entities: must be >= 0\.0"),
    (S.EvalConfig, "samples", 0, r"config\.samples: must be >= 1, got 0"),
    (S.EvalConfig, "retrieval_budget.mode", "tuned", r"config\.retrieval_budget\.mode: must be one of"),
    (S.EvalConfig, "retrieval_budget.ks", "0,3", r"config\.retrieval_budget\.ks: must list k values in 1"),
    (S.EvalConfig, "answerer.kind", "llm", r"config\.answerer\.kind: must be one of \['', 'model', 'scri"),
    (S.BuildConfig, "engine.policy_slots", -1, r"config\.engine\.policy_slots: must be >= 0"),
])
def test_bad_values_name_their_key(schema, key, value, message):
    config = schema().to_config_dict()
    node = config
    *path, name = key.split(".")
    for part in path:
        node = node[part]
    with config.ignore_type():
        node[name] = value
    with pytest.raises(S.ConfigError, match=message):
        schema.parse(config)


def test_main_dispatches_the_schema_commands():
    from librarian_jax import main

    assert set(main.COMMANDS) == set(S.SCHEMAS)


def _schema_choice_lists() -> dict[str, tuple[str, ...]]:
    """Every choice list a schema field names, by `section.key` (string choices, two or more)."""
    out: dict[str, tuple[str, ...]] = {}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            if isinstance(f.default_factory, type) and issubclass(f.default_factory, S.Section):
                walk(f.default_factory, f"{prefix}{f.name}.")
            choices = f.metadata.get("choices")
            if choices and len(choices) > 1 and all(isinstance(x, str) for x in choices):
                out[f"{prefix}{f.name}"] = tuple(choices)

    for schema in CONFIG_FILES.values():
        walk(schema, "")
    return out


def _string_literals() -> list[tuple[str, int, frozenset[str]]]:
    """(file, line, strings) of every tuple / list / set literal made only of string constants."""
    out = []
    for path in [*(ROOT / "librarian_jax").rglob("*.py"), *(ROOT / "configs").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) > 1 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                out.append((str(path.relative_to(ROOT)), node.lineno, frozenset(e.value for e in node.elts)))
    return out


def test_every_choice_list_is_written_out_once():
    lists = _schema_choice_lists()
    for key in ("train.decay", "train.old_logprobs", "train.aggregation", "train.remat", "model.init",
                "model.dtype", "data.source", "data.packing", "answerer.kind"):
        assert key in lists, key
    literals = _string_literals()
    for key, choices in lists.items():
        want = frozenset(choices) - {""}  # "" (= the default's) does not make a list another
        places = [f"{f}:{line}" for f, line, values in literals if values - {""} == want]
        assert len(places) <= 1, f"the choices of {key} are written out in {places}"


def test_a_retired_rollout_key_in_an_older_run_config_still_reads():
    """`rollout.dedupe_greedy_repeats` (nothing read it) is gone from the schema, so a flag naming it is a
    mistyped key; an older run's config.json that holds it still reads (evaluation reads those)."""
    from librarian_jax.rollout import RolloutConfig

    old = {**S.GRPOConfig().to_dict()["rollout"], "dedupe_greedy_repeats": True}
    assert S.RolloutSection.parse(old).config == RolloutConfig.from_dict(
        {k: v for k, v in old.items() if k not in S.ROLLOUT_ENGINE_KEYS})
    assert "dedupe_greedy_repeats" not in S.GRPOConfig().to_config_dict().rollout


@pytest.mark.parametrize("schema,old,new", [
    (S.GRPOConfig, "train.max_seq_len", r"renamed to train\.max_row_len"),
    (S.SFTConfig, "train.max_seq_len", r"renamed to train\.max_row_len"),
    (S.GRPOConfig, "rollout.builder.context_budget", r"removed; .* context, rollout\.max_seq_len"),
    (S.SFTConfig, "rollout.builder.context_budget", r"removed; .* context, rollout\.max_seq_len"),
])
def test_a_renamed_key_names_the_key_that_took_its_place(schema, old, new):
    """Each name means one thing: `max_seq_len` an engine's context, `max_row_len` a training row's cut, and
    the builder's context has one key. A config (a dict, a preset, a flag) setting an old key is told the
    new one; a run's config.json written before reads back with the old keys translated."""
    section, name = old.rsplit(".", 1)
    d = schema().to_dict()
    node = d
    for part in section.split("."):
        node = node[part]
    assert name not in node  # gone from the schema
    node[name] = 2048
    with pytest.raises(S.ConfigError, match=rf"config\.{re.escape(old)}: {new}"):
        schema.parse(d)
    preset: dict = {}
    leaf = preset
    for part in section.split("."):
        leaf = leaf.setdefault(part, {})
    leaf[name] = 2048
    with pytest.raises(S.ConfigError, match=rf"config\.{re.escape(old)}: {new}"):
        schema.preset_config(preset)
    assert re.search(new, cli_flags.unknown_key(schema().to_config_dict(), old))


def test_an_older_run_config_with_the_old_keys_reads_back(tmp_path):
    """A run recorded before the renames (`train.max_seq_len`, `rollout.builder.context_budget` = 0) reads
    back through `eval.restore.load_run_config`, its row length as `train.max_row_len`."""
    import json

    from librarian_jax.eval import restore

    d = S.GRPOConfig().to_dict()
    d["train"]["max_seq_len"] = d["train"].pop("max_row_len") + 512
    d["rollout"]["builder"]["context_budget"] = 0
    (tmp_path / "config.json").write_text(json.dumps(d))
    run = restore.load_run_config(str(tmp_path))
    assert run.train.max_row_len == S.GRPOConfig().train.max_row_len + 512
    assert run.rollout.config.builder.context_budget == 0  # set from the engine by cluster.mode_rollout
    assert "context_budget" not in run.to_dict()["rollout"]["builder"]  # a new record never carries it
    assert "max_seq_len" not in run.to_dict()["train"]


# ------------------------------------------------------------------ one home per default

PRESET_MODULES = {"grpo": S.GRPOConfig, "sft": S.SFTConfig, "eval": S.EvalConfig, "build": S.BuildConfig}


def _field(default, name):
    """The default of key `name` of section `default` (a schema section or a rollout dataclass)."""
    if isinstance(default, S.RolloutSection) and name not in S.ROLLOUT_ENGINE_KEYS:
        default = default.config
    return getattr(default, name)


def set_leaves(overrides: dict, default, prefix: str = ""):
    """(key, value, schema default) of every value a preset sets: a section's keys one by one, a
    dict-valued key (`mesh.shape`, `demos.mix`) whole."""
    for name, value in overrides.items():
        sub = _field(default, name)
        if isinstance(value, dict) and dataclasses.is_dataclass(sub):
            yield from set_leaves(value, sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value, sub


def preset_overrides():
    for name, schema in PRESET_MODULES.items():
        mod = importlib.import_module(f"librarian_jax.presets.{name}")
        for preset, overrides in mod.PRESETS.items():
            yield pytest.param(overrides, schema, id=f"{name}:{preset}")


@pytest.mark.parametrize("overrides,schema", list(preset_overrides()))
def test_a_preset_states_only_what_differs_from_the_schema(overrides, schema):
    same = [key for key, value, default in set_leaves(overrides, schema()) if value == default]
    assert not same, f"keys set to the schema's default (state only what differs): {same}"


def test_a_planted_redundant_key_is_caught():
    """The check above fails on a preset that restates a default."""
    grpo = importlib.import_module("librarian_jax.presets.grpo")
    planted = {**grpo.EMBEDDED, "train": {**grpo.EMBEDDED["train"], "grad_clip": 1.0}}
    same = [k for k, v, d in set_leaves(planted, S.GRPOConfig()) if v == d]
    assert same == ["train.grad_clip"]


@pytest.mark.parametrize("name", list(PRESET_MODULES))
def test_the_default_preset_is_the_schema_defaults(name):
    """What `--config=configs/<name>.py` runs (no preset) is the schema's defaults, key for key."""
    mod = importlib.import_module(f"librarian_jax.presets.{name}")
    schema = PRESET_MODULES[name]
    default = {"grpo": "noisy", "sft": "noisy", "eval": "embedded", "build": "default"}[name]
    assert mod.PRESETS[default] == {}
    assert schema.parse(mod.get_config()).to_dict() == schema().to_dict()


def test_a_preset_key_the_schema_does_not_declare_names_it():
    with pytest.raises(S.ConfigError, match=r"config\.rollout\.builder\.max_turn: not a key of the schema"):
        S.GRPOConfig.preset_config({"rollout": {"builder": {"max_turn": 3}}})


def test_the_rollout_defaults_name_every_rollout_key():
    """A command builds its RolloutConfig from `ROLLOUT_DEFAULTS` and the config alone: every field of the
    rollout dataclasses has a schema default, so none of theirs is ever read by a command."""
    from librarian_jax.agents import AnswererConfig
    from librarian_jax.agents.builder import BuilderConfig
    from librarian_jax.rollout import RolloutConfig

    d = S.ROLLOUT_DEFAULTS
    assert set(d) == {f.name for f in dataclasses.fields(RolloutConfig)}
    # the builder's context budget is no key: its engine's context (rollout.max_seq_len) sets it
    assert S.DERIVED_ROLLOUT_FIELDS == ("builder.context_budget",)
    assert set(d["builder"]) == {f.name for f in dataclasses.fields(BuilderConfig)} - {"context_budget"}
    assert set(d["answerer"]) == {f.name for f in dataclasses.fields(AnswererConfig)}
    # a partial section (an older config.json) takes the schema's defaults, not the dataclasses'
    parsed = S.RolloutSection.parse({"builder": {"max_turns": 7}}).config
    assert parsed.builder.max_turns == 7
    assert parsed.builder.executor == d["builder"]["executor"] != BuilderConfig().executor
    assert parsed.answerer.kind == d["answerer"]["kind"] != AnswererConfig().kind
    assert parsed.probe_min_gap == d["probe_min_gap"] != RolloutConfig().probe_min_gap


@pytest.mark.parametrize("section", [S.TrainSection, S.SFTTrainSection])
def test_the_train_step_config_takes_every_key_from_the_schema(section):
    """`trainer_config` passes each `train` key the step reads, so rl's own defaults are never a run's."""
    t = section()
    tc = t.trainer_config(1.0) if section is S.TrainSection else t.trainer_config()
    renamed = {"loss": ("loss", "name"), "num_steps": ("optim", "total_steps")}
    fixed = {"loss", "aggregation", "tis_cap", "dual_clip", "old_logprobs"} if section is S.SFTTrainSection \
        else set()  # SFT's loss is `nll`
    rows = {"advantage", "step_weight", "step_gamma", "max_row_len"}  # rl.RowsConfig (training.build)
    checked = 0
    for f in dataclasses.fields(section):
        if f.name in rows | fixed or f.name in ("batch_rows", "group_by_length", "log_every"):
            continue
        part, attr = renamed.get(f.name, (None, f.name))
        holders = [getattr(tc, part)] if part else [tc, tc.loss, tc.optim]
        found = [getattr(h, attr) for h in holders if hasattr(h, attr)]
        assert found == [getattr(t, f.name)], f"train.{f.name} does not reach rl's config: {found}"
        checked += 1
    assert checked >= 15
