"""The config schema (`librarian_jax.config_schema`) is the one place each key and each choice list lives:
every key of every preset in configs/*.py is a schema field (and every field is in the presets), the schema
carries each value unchanged, bad values name their key, and no choice list is written out twice."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib

import pytest

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
