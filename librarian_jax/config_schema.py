"""The config schema: one typed, frozen dataclass per config section, each validating itself.

Every key of every command's config (`configs/grpo.py`, `sft.py`, `eval.py`, `build.py`) is a field here,
with its type, default, bounds and choice list, declared once; the files in `configs/` only set values on a
ConfigDict built from these defaults (`GRPOConfig().to_config_dict()`). `Schema.parse(mapping)` turns a
ConfigDict (or a plain nested dict) into the dataclass, or raises `ConfigError` naming the bad key:

    config.train.learning_rate: must be > 0, got -1.0
    config.rollout.builder: unknown keys ['bogus']; known: [...]

Keys a mapping leaves out take their defaults (a run's older `config.json` still reads). The `rollout`
section is `rollout.RolloutConfig` (its own schema, `from_dict`) plus the engine sizes main reads itself.
Checks that need the machine (the device count of `mesh.shape`) or several sections at once (role budgets)
are in `config_validation`; file-system checks of a section's own paths are here.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

import ml_collections

from librarian_jax import data as data_lib
from librarian_jax.agents.answerer import ANSWERER_KINDS
from librarian_jax.agents.runtime import FROZEN_ROLES
from librarian_jax.engine.mesh import MESH_AXES, resolve_mesh_shape
from librarian_jax.errors import ConfigError
from librarian_jax.models import PRESETS as MODEL_PRESETS
from librarian_jax.rl import advantages, losses, train_step
from librarian_jax.rl.sft import PACKING
from librarian_jax.rollout import RolloutConfig
from librarian_jax.tokenizers import STYLES as CHAT_STYLES

# The choice lists of this module's keys (lists owned by a lower layer are imported above).
MODEL_INITS = ("random", "hf", "orbax")
# "policy": the builder's initial weights, frozen; "executor" (compaction, judge): the executor's weights
ROLE_INITS = ("policy", *MODEL_INITS, "executor")
DTYPES = ("", "float32", "bfloat16", "float16")  # "" = the model preset's
DATA_SOURCES = ("synthetic", "file")
DATA_FORMATS = ("auto", *data_lib.FORMATS)
# plus "run:/other/workdir"; docs/eval.md says what each does and costs
EVAL_METHODS = ("trained", "base", "raw", "bm25", "embedding", "rerank", "agentic", "graphrag",
                "autocompaction")
POOLINGS = ("last", "mean")  # an embedding model's pooling: Qwen3-Embedding's last token, or the mean
RETRIEVAL_INDEXES = ("bm25", "embedding")  # what `rerank` re-scores and `agentic`'s search tool searches
RETRIEVAL_INSTRUCTION = "Given a question, retrieve passages of the documents that answer it"
EVAL_ANSWERER_KINDS = ("", *ANSWERER_KINDS)  # "" = the run's
# keys a config no longer has, each with the key that took its place; a config setting one is a ConfigError
# naming that key, a run's recorded config.json is read with them translated (`upgrade_recorded`)
RENAMED_KEYS: dict[str, str] = {"train.max_seq_len": "train.max_row_len",
                                "rollout.builder.context_budget": "rollout.max_seq_len"}
ROLLOUT_ENGINE_KEYS = ("group_size", "policy_slots", "frozen_slots", "max_seq_len", "round_steps",
                       "scan_layers", "compile_ahead")


# While a command's config with a `topology` is parsed (a plan: shapes only, `planning.plan`), neither weights
# nor data need exist: `model.path`, `roles.<role>.path` and `data.path` may be empty (a given model path's
# config.json is read).
_PLANNING: contextvars.ContextVar[bool] = contextvars.ContextVar("librarian_jax_planning", default=False)


def planning() -> bool:
    """Whether the config being parsed or validated is a plan's (`topology` set): no weights are read."""
    return _PLANNING.get()


def config_error(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config.{key}: {msg}")


def key_of(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def spec(default: Any = dataclasses.MISSING, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, choices: tuple[Any, ...] | None = None, nonempty: bool = False,
         factory: Any = dataclasses.MISSING) -> Any:
    """A schema field: its default (or `factory`), bounds (`lo` / `hi`, `lo_open` = strictly above `lo`),
    `choices`, and `nonempty` for strings that must be set."""
    meta = {"lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices, "nonempty": nonempty}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _as_dict(value: Any, key: str) -> dict[str, Any]:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return dict(value)
    raise config_error(key, f"must be a section (a mapping of keys), got {value!r}")


def _check_value(tp: Any, value: Any, key: str, meta: Mapping[str, Any]) -> Any:
    """`value` checked against the field's type and `meta` (bounds, choices); returns it (ints as floats for
    float fields, mappings as dicts)."""
    if isinstance(tp, type) and issubclass(tp, Section):
        return tp.parse(value, key)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise config_error(key, f"must be an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise config_error(key, f"must be a number, got {value!r}")
        value = float(value)
    elif tp is bool:
        if not isinstance(value, bool):
            raise config_error(key, f"must be True or False, got {value!r}")
    elif tp is str:
        if not isinstance(value, str):
            raise config_error(key, f"must be a string, got {value!r}")
    elif tp == (str | bool):
        if not isinstance(value, str | bool):
            raise config_error(key, f"must be a string or a bool, got {value!r}")
    elif typing.get_origin(tp) is dict:
        value = _as_dict(value, key)
    choices = meta.get("choices")
    if choices is not None and not isinstance(value, bool) and value not in choices:
        raise config_error(key, f"must be one of {sorted(choices)}, got {value!r}")
    if meta.get("nonempty") and not value:
        raise config_error(key, f"must not be empty, got {value!r}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value <= lo if meta.get("lo_open") else value < lo):
        raise config_error(key, f"must be {'>' if meta.get('lo_open') else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise config_error(key, f"must be <= {hi}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Section:
    """A config section: `parse` checks unknown keys, each field (type, bounds, choices), then `check`."""

    @classmethod
    def parse(cls, mapping: Any, key: str = "") -> typing.Self:
        """The section from `mapping` (ConfigDict or dict; missing keys take defaults); `key` is its path
        (`"train"`, `"rollout.builder"`, `""` for a whole config) for the error messages."""
        d = _as_dict(mapping, key or "config")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        _refuse_renamed(key, unknown)
        if unknown:
            raise ConfigError(f"config{'.' + key if key else ''}: unknown keys {unknown}; known: {names}")
        token = _PLANNING.set(True) if not key and d.get("topology") else None
        try:
            out = cls(**cls.parse_fields(d, names, key))
            out.check(key)
        finally:
            if token is not None:
                _PLANNING.reset(token)
        return out

    @classmethod
    def parse_fields(cls, mapping: Any, names: typing.Iterable[str], key: str = "") -> dict[str, Any]:
        """Only the fields `names` that `mapping` holds, each parsed (no check across fields)."""
        d = _as_dict(mapping, key or "config")
        hints = typing.get_type_hints(cls)
        wanted = set(names)
        return {f.name: _check_value(hints[f.name], d[f.name], key_of(key, f.name), f.metadata)
                for f in dataclasses.fields(cls) if f.name in d and f.name in wanted}

    def check(self, key: str) -> None:
        """Checks across this section's fields (and its own paths); raises ConfigError."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, Section) else dict(v) if isinstance(v, dict) else v
        return out

    def to_config_dict(self) -> ml_collections.ConfigDict:
        """A ConfigDict holding every key (what `configs/*.py` start from)."""
        return ml_collections.ConfigDict(self.to_dict())

    @classmethod
    def preset_config(cls, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
        """A ConfigDict of this schema's defaults with a preset's `overrides` set on it: a nested dict of
        the keys the preset changes (`librarian_jax.presets`). A key the schema does not declare is a
        ConfigError naming it."""
        c = cls().to_config_dict()
        _set_values(c, overrides, "")
        return c


def renamed_key_message(key: str) -> str | None:
    """What a config setting the retired `key` (a dotted path below `config.`) is told, or None."""
    new = RENAMED_KEYS.get(key)
    if new is None:
        return None
    if key == "rollout.builder.context_budget":
        return (f"config.{key}: removed; the tokens a builder session may hold are the builder engine's "
                f"context, {new}")
    return f"config.{key}: renamed to {new}"


def _refuse_renamed(key: str, names: typing.Iterable[str]) -> None:
    for name in names:
        msg = renamed_key_message(key_of(key, name))
        if msg:
            raise ConfigError(msg)


def upgrade_recorded(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """A run's recorded config (its config.json) with the keys written before `RENAMED_KEYS` translated:
    `train.max_seq_len` read as `train.max_row_len`; `rollout.builder.context_budget` (0 there: the builder
    engine's context) dropped."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in recorded.items()}
    train = out.get("train")
    if isinstance(train, dict) and "max_seq_len" in train:
        value = train.pop("max_seq_len")
        train.setdefault("max_row_len", value)
    rollout = out.get("rollout")
    if isinstance(rollout, dict) and isinstance(rollout.get("builder"), Mapping):
        rollout["builder"] = {k: v for k, v in rollout["builder"].items() if k != "context_budget"}
    return out


def _set_values(c: ml_collections.ConfigDict, overrides: Mapping[str, Any], key: str) -> None:
    """Sets `overrides` (nested: a section's keys one by one) on `c`; an unknown key is a ConfigError."""
    for name, value in overrides.items():
        k = key_of(key, name)
        if name not in c:
            _refuse_renamed(key, [name])
            raise config_error(k, f"not a key of the schema; known: {sorted(c)}")
        if isinstance(value, Mapping) and isinstance(c[name], ml_collections.ConfigDict):
            _set_values(c[name], value, k)
        else:
            c[name] = value


def _section(cls: type[Section]) -> Any:
    return spec(factory=cls)


def _existing_path(value: str, key: str) -> None:
    if value and not os.path.exists(value):
        raise config_error(key, f"{value!r} does not exist")


# ------------------------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    # models.PRESETS name (architecture): "tiny" is 4 layers of 128 over a 2,048-token vocab
    preset: str = spec("tiny", choices=tuple(MODEL_PRESETS))
    init: str = spec("random", choices=MODEL_INITS)  # "hf": safetensors folder, "orbax": checkpoint dir
    path: str = spec("")  # weights for init="hf" / "orbax"
    tokenizer: str = spec("")  # file/folder; "" = model.path (hf) or a SentencePiece trained on the data
    # a SentencePiece trained here (model.tokenizer ""): on the warm start's demonstration worlds (never the
    # run's tasks), the prompts and the builder's listings
    tokenizer_vocab_size: int = spec(2048, lo=64)
    dtype: str = spec("", choices=DTYPES)  # "" = the preset's; e.g. "float32" on CPU, "bfloat16" on TPU/GPU
    lora_rank: int = spec(0, lo=0)  # 0 = full fine-tuning
    lora_alpha: float = spec(64.0)
    lora_module_path: str = spec(train_step.LORA_ALL_LINEAR)  # regex of the adapted modules
    frozen_path: str = spec("")  # frozen roles' weights (HF folder); "" = the policy's initial weights
    template: str = spec("", choices=("", *CHAT_STYLES))  # the builder's chat template; "" = as for a role

    def check(self, key: str) -> None:
        if self.init in ("hf", "orbax") and not planning():
            if not self.path:
                what = "Hugging Face safetensors folder" if self.init == "hf" else "Orbax checkpoint"
                raise config_error(f"{key}.path", f"required when model.init={self.init!r} (a {what})")
            _existing_path(self.path, f"{key}.path")
        _existing_path(self.tokenizer, f"{key}.tokenizer")
        _existing_path(self.frozen_path, f"{key}.frozen_path")
        if self.lora_rank:
            if self.lora_alpha <= 0:
                raise config_error(f"{key}.lora_alpha", f"must be > 0, got {self.lora_alpha}")
            if not self.lora_module_path:
                raise config_error(f"{key}.lora_module_path",
                                   "must be a non-empty regex when model.lora_rank > 0")


# ------------------------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    source: str = spec("synthetic", choices=DATA_SOURCES)
    path: str = spec("")  # tasks file/folder for source="file" (data.load_tasks)
    format: str = spec("auto", choices=DATA_FORMATS)
    # the synthetic world (source="synthetic"): a named world (`data.WORLDS`: docs/world.md), its sizes below
    world: str = spec("noisy", choices=tuple(data_lib.WORLDS))
    num_tasks: int = spec(64)
    docs_per_task: int = spec(20)
    min_words: int = spec(50)
    max_words: int = spec(100)
    questions_per_task: int = spec(8)  # the hidden questions (half multi-hop: facts in >= 2 documents)
    # more questions per corpus, drawn after the hidden ones (so those and the documents stay the same):
    # what `rollout.terminal_questions` may ask
    reuse_questions_per_task: int = spec(24)
    heldout_fraction: float = spec(0.4, lo=0.0, hi=0.9)  # tasks kept out of training (task-id hash)
    # The paper's data protocol (docs/paper-settings.md, Data); the defaults leave the data as loaded.
    split_file: str = spec("")  # task-id file deciding train / held-out instead of the hash
    # without a split file: > 0 draws exactly this many held-out tasks at random (`split_seed`) instead of
    # the hash (the paper's 50 held-out BrowseComp-Plus tasks); split.json records the draw
    heldout_count: int = spec(0, lo=0)
    split_seed: int = spec(0, lo=0)
    exclude_file: str = spec("")  # task ids in neither train nor held-out (the authors' 100 excluded tasks)
    max_docs: int = spec(0, lo=0)  # tasks / browsecomp_plus: the noisy variant's document cap; 0 = all
    reuse_questions: str = spec("")  # JSONL of each named corpus's reuse questions; "" = the task rows'
    questions_per_domain: int = spec(0, lo=0)  # bright: a seeded sample per domain; 0 = every question
    sample_seed: int = spec(0, lo=0)  # seed of the max_docs negatives and the BRIGHT question sample
    tasks_per_batch: int = spec(4, lo=1)
    shuffle_seed: int = spec(0, lo=0)
    # Update tasks (issue 42, `inputs.update_tasks`): this fraction of the training tasks (by task-id hash)
    # become incremental updates (an old workspace + the corpus with `update_changes` of its documents
    # removed, as many changed and added; questions asked again). Synthetic world only.
    update_fraction: float = spec(0.0, lo=0.0, hi=1.0)
    update_changes: float = spec(0.2, lo=0.01, hi=0.5)

    def check(self, key: str) -> None:
        if self.update_fraction > 0 and self.source != "synthetic":
            raise config_error(f"{key}.update_fraction", "update tasks regenerate questions from the changed "
                               "corpus: only data.source='synthetic' has them")
        if self.source == "file":
            if not self.path and not planning():  # a plan reads no data
                raise config_error(f"{key}.path", "required when data.source='file' (a tasks file or folder)")
            _existing_path(self.path, f"{key}.path")
        else:
            for name in ("num_tasks", "docs_per_task", "min_words", "max_words", "questions_per_task"):
                _check_value(int, getattr(self, name), f"{key}.{name}", {"lo": 1})
            if self.max_words < self.min_words:
                raise config_error(f"{key}.max_words", f"must be >= data.min_words ({self.min_words}), "
                                   f"got {self.max_words}")
            _check_value(int, self.reuse_questions_per_task, f"{key}.reuse_questions_per_task", {"lo": 0})
        # the split and reuse files are read here (ids missing from the data are caught when the tasks
        # load, still before any model)
        for name, read in (("split_file", data_lib.read_task_ids), ("exclude_file", data_lib.read_task_ids),
                           ("reuse_questions", data_lib.load_reuse_questions)):
            p = getattr(self, name)
            if not p:
                continue
            if not os.path.isfile(p):
                raise config_error(f"{key}.{name}", f"{p!r} is not a file")
            try:
                read(p)
            except data_lib.DataError as e:
                raise config_error(f"{key}.{name}", str(e)) from None
        for name in ("max_docs", "questions_per_domain"):
            if getattr(self, name) and self.source != "file":
                raise config_error(f"{key}.{name}", f"applies to data.source='file' (BrowseComp-Plus / "
                                   f"BRIGHT), not {self.source!r}; 0 = off")


@dataclasses.dataclass(frozen=True)
class SFTDataSection(DataSection):
    """SFT's data: the GRPO data keys (the world the demonstrations come from) plus packing; `path` is a
    JSONL conversations file ("" = the embedded demonstrations, synthetic world only)."""

    packing: str = spec("none", choices=PACKING)  # "none": one conversation per row; "concat": several

    def check(self, key: str) -> None:
        super().check(key)
        if self.path and not os.path.isfile(self.path):
            raise config_error(f"{key}.path", f"{self.path} is not a file")
        if not self.path and self.source != "synthetic":
            raise config_error(f"{key}.path", "a JSONL conversations file is needed unless "
                               "config.data.source is 'synthetic' (the embedded demonstrations)")


# ------------------------------------------------------------------------------------------- rollout


# Every `rollout.RolloutConfig` key's default (its `builder` and `answerer` parts are `agents.BuilderConfig`
# and `agents.AnswererConfig`): the embedded run's. A command builds its RolloutConfig only from these and
# the config's values (`RolloutSection.parse`), never from the dataclasses' own defaults; the meaning of
# each term: `rollout.rewards` (the schedule and rewards), `agents.builder`, `agents.answer_start`. One
# field is no key (`DERIVED_ROLLOUT_FIELDS`): the tokens a builder session may hold are its engine's
# context, `rollout.max_seq_len`, set by `cluster.mode_rollout`.
ROLLOUT_DEFAULTS: dict[str, Any] = {
    "builder": {
        "max_turns": 4,
        "max_new_tokens": 240,
        # sampled at 0.35: a build is ~20 ids in a row, and a build sampled hotter slips into malformed calls
        # where the greedy one does not, so GRPO would compare broken builds (BENCHMARKS.md)
        "temperature": 0.35,
        "top_p": 1.0,
        "top_k": 0,
        "max_reads_per_turn": 8,
        "max_calls_per_turn": 16,
        "observation_max_chars": 48_000,
        # the model-free executor that writes what the sources state about what a file's title names
        "executor": "statements",
        "executor_max_new_tokens": 512,
        "executor_max_words": 360,
        "excerpt_max_lines": 100,
        "excerpt_max_chars": 16_000,
        "compaction": "deterministic",
        "compaction_budget": 1800,
        "compaction_summary_tokens": 256,
        "compaction_input_chars": 12_000,
        "malformed_penalty": 0.05,
        "system_prompt": "builder_system_compact",  # the paper's tools and rules in a quarter of the tokens
        "raw_listing": "compact",  # one `doc_id "title" (N chars)` line per raw document
        "write_text": False,
        "doc_id_titles": True,
    },
    # the scripted navigator (agents/navigator.py): model-free, reading through the answerer's own list/read
    # tools, first prompt and token accounting, with 6 tool calls in a 3,072-token context and root files
    # preloaded up to 512 tokens (a good builder's entity files do not all fit: it chooses)
    "answerer": {
        "max_turns": 6,
        "max_new_tokens": 64,
        "forced_max_new_tokens": 16,
        "temperature": 0.0,
        "max_calls_per_turn": 1,
        "context_budget": 3072,
        "observation_max_chars": 16_000,
        "answer_max_words": 128,
        "kind": "scripted",
        "max_reads": 0,
        "preload_root_files": True,
        "preload_max_tokens": 512,
    },
    "probe_repeats": 1,
    "probe_min_gap": 1,
    "max_probes": 1,
    "probe_threshold": 0.25,
    "probe_scale": 1.0,
    "probe_at_start": False,
    "terminal_repeats": 1,
    # the reward asks every question a training corpus has (its hidden ones and the reuse ones), so most
    # entities are asked about; evaluation asks the hidden ones
    "terminal_questions": "hidden+reuse",
    "no_stop_penalty": 0.1,
    "use_model_judge": False,
    "judge_max_new_tokens": 16,
    "record_snapshots": True,
    "snapshot_raw_text": False,
    "repeat_mode": "greedy_once",
    "repeat_temperature": 1.0,
    "token_cost": 0.0,
    "read_cost": 0.0,
    "edit_cost": 0.0,
    "record_conversations": False,
}


# RolloutConfig fields that are no config key: set from the engines (`cluster.mode_rollout`)
DERIVED_ROLLOUT_FIELDS = ("builder.context_budget",)


# (field, lowest value, strictly above it) of the builder's and answerer's sampling and length settings,
# checked when the config is parsed, so a bad one stops the run before the warm start or any compile
_SAMPLING_BOUNDS: dict[str, tuple[tuple[str, float, bool], ...]] = {
    "builder": (("temperature", 0.0, False), ("top_p", 0.0, True), ("top_k", 0, False),
                ("max_new_tokens", 1, False), ("executor_max_new_tokens", 1, False),
                ("compaction_summary_tokens", 1, False)),
    "answerer": (("temperature", 0.0, False), ("max_new_tokens", 1, False),
                 ("forced_max_new_tokens", 1, False)),
    "": (("repeat_temperature", 0.0, False), ("judge_max_new_tokens", 1, False)),
}


def check_sampling(rollout: RolloutConfig, key: str = "rollout") -> None:
    """Every sampling setting of `rollout` in range (temperature >= 0, 0 < top_p <= 1, top_k >= 0, token
    budgets >= 1); raises ConfigError naming the key."""
    for part, bounds in _SAMPLING_BOUNDS.items():
        obj = getattr(rollout, part) if part else rollout
        for name, lo, lo_open in bounds:
            v = getattr(obj, name)
            k = key_of(key, f"{part}.{name}" if part else name)
            kind = int if isinstance(lo, int) else float
            if isinstance(v, bool) or not isinstance(v, kind if kind is int else int | float):
                raise config_error(k, f"must be {'an integer' if kind is int else 'a number'}, got {v!r}")
            if v < lo or (lo_open and v == lo):
                raise config_error(k, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
        if part == "builder" and obj.top_p > 1:
            raise config_error(key_of(key, "builder.top_p"), f"must be <= 1, got {obj.top_p}")


@dataclasses.dataclass(frozen=True)
class RolloutSection(Section):
    """The engine sizes main reads itself, and every other key: `rollout.RolloutConfig` (its own schema)."""

    group_size: int = spec(4, lo=1)
    policy_slots: int = spec(16, lo=1)  # builder engine slots
    frozen_slots: int = spec(16, lo=1)  # answerer/executor engine slots
    # tokens one builder session may hold (the builder engine's context; a frozen role's own is
    # `roles.<role>.max_seq_len`, 0 = this)
    max_seq_len: int = spec(2048, lo=16)
    round_steps: int = spec(32, lo=1)  # decode steps per engine.step()
    # the engines' prefill and decode programs run the repeating decoder layers under one lax.scan
    # (`Engine(scan_layers=True)`): each program compiles each distinct layer once (CPU, 36 layers: decode
    # 2.2x, prefill 4x faster to compile), but the CPU decode step runs slower (BENCHMARKS.md)
    scan_layers: bool = spec(False)
    # at start, every program of the engines the run decodes with (and the update's optimizer program) is
    # compiled on worker threads, beside the run's own work (`compile_cache.Ahead`,
    # `cluster.Cluster.programs_ahead`, `rl.train_step.Trainer.programs_ahead`)
    compile_ahead: bool = spec(True)
    config: RolloutConfig = dataclasses.field(
        default_factory=lambda: RolloutConfig.from_dict(ROLLOUT_DEFAULTS))

    @classmethod
    def parse(cls, mapping: Any, key: str = "rollout") -> RolloutSection:
        d = _as_dict(mapping, key)
        hints = typing.get_type_hints(cls)
        kwargs = {f.name: _check_value(hints[f.name], d.pop(f.name), key_of(key, f.name), f.metadata)
                  for f in dataclasses.fields(cls) if f.name in ROLLOUT_ENGINE_KEYS and f.name in d}
        for part in ("builder", "answerer"):  # a section's missing keys take the schema's defaults
            given = _as_dict(d.get(part, {}), key_of(key, part))
            _refuse_renamed(key_of(key, part), given)
            d[part] = {**ROLLOUT_DEFAULTS[part], **given}
        try:
            rollout = RolloutConfig.from_dict({**ROLLOUT_DEFAULTS, **d})
        except KeyError as e:
            raise config_error(key, str(e.args[0]) if e.args else str(e)) from None
        except (TypeError, ValueError) as e:
            raise config_error(key, str(e)) from None
        if rollout.answerer.kind not in ANSWERER_KINDS:
            raise config_error(f"{key}.answerer.kind", f"must be one of {sorted(ANSWERER_KINDS)}, "
                               f"got {rollout.answerer.kind!r}")
        check_sampling(rollout, key)
        return cls(**kwargs, config=rollout)

    def to_dict(self) -> dict[str, Any]:
        d = self.config.to_dict()
        for field in DERIVED_ROLLOUT_FIELDS:
            part, name = field.split(".")
            d[part].pop(name)
        return {**{k: getattr(self, k) for k in ROLLOUT_ENGINE_KEYS}, **d}


# ------------------------------------------------------------------------------------------- train


# The train step's knobs: `rl`'s configs (`rl.OptimConfig`, `rl.TrainConfig`, `rl.LossConfig`,
# `rl.RowsConfig`) are built from these sections (`optim_config`, `trainer_config`, `training.build`'s
# rows config), each passed every key it has here, so a command never reads rl's own defaults.


@dataclasses.dataclass(frozen=True)
class OptimSection(Section):
    """The keys GRPO's and SFT's `train` sections share: the schedule, AdamW and the memory knobs."""

    num_steps: int = spec(12, lo=0)  # GRPO's held-out accuracy plateaus by step 5 (BENCHMARKS.md)
    # 2e-4 took a noisy-world warm start 75.0 -> 60.1% (its builds dropped their directories), 5e-5 holds it
    learning_rate: float = spec(5e-5, lo=0.0, lo_open=True)
    warmup_steps: int = spec(0, lo=0)
    decay: str = spec("cosine", choices=train_step.DECAYS)
    end_lr_ratio: float = spec(0.1, lo=0.0, hi=1.0)
    weight_decay: float = spec(0.0, lo=0.0)
    grad_clip: float = spec(1.0, lo=0.0)
    micro_batches: int = spec(1, lo=1)
    # > 0: micro-batches of this many rows per data-parallel shard, as many a step as its rows need, one
    # compiled program for any row count (micro_batches unused); 0: `micro_batches` equal micro-batches
    micro_batch_rows: int = spec(4, lo=0)
    # "none"; "full": whole forward, "layer": each decoder layer
    remat: str | bool = spec("none", choices=train_step.REMAT_MODES)
    logits_chunk: int = spec(1024, lo=0)  # logits of this many positions at a time; 0 = all
    # with logits_chunk > 0: the LM head runs only at the loss positions ("loss") or at every one ("all")
    logits_at: str = spec("loss", choices=train_step.LOGITS_AT)
    # the decoder layers that repeat a pattern run under one lax.scan: the step compiles each distinct layer
    # once, not once per layer (same values); pays on deep models (CPU: 36 layers compile 2.3x faster), not on
    # the 4-6 layer CPU presets (BENCHMARKS.md)
    scan_layers: bool = spec(False)
    # > 0: models with at least this many decoder layers scan them anyway; 0: only with scan_layers (the
    # scanned CPU step is 5-11% slower at every depth; deep ones compile 1.6-2.3x faster: rl.TrainConfig)
    scan_min_layers: int = spec(0, lo=0)
    # the longest training row: a longer one (an episode segment, an SFT conversation) is cut to it
    max_row_len: int = spec(2048, lo=16)
    # this many updates in a row skipped for a non-finite loss or gradient stop the run; 0 = never
    max_skipped_in_a_row: int = spec(3, lo=0)

    def optim_config(self) -> train_step.OptimConfig:
        return train_step.OptimConfig(learning_rate=self.learning_rate, warmup_steps=self.warmup_steps,
                                      decay=self.decay, total_steps=max(self.num_steps, 1),
                                      end_lr_ratio=self.end_lr_ratio, weight_decay=self.weight_decay,
                                      grad_clip=self.grad_clip)


@dataclasses.dataclass(frozen=True)
class TrainSection(OptimSection):
    """GRPO's `train`: the optimizer, the loss (`rl.losses`), advantages (`rl.advantages`) and rows."""

    # MoE models: weight of the router's load-balancing loss
    moe_aux_loss_coef: float = spec(0.0, lo=0.0)
    loss: str = spec("ppo", choices=tuple(losses.LOSSES))
    eps_low: float = spec(0.2, lo=0.0, hi=1.0, lo_open=True)
    eps_high: float = spec(0.28, lo=0.0, lo_open=True)
    dual_clip: float = spec(3.0, lo=0.0)  # 0 = off, else > 1
    tis_cap: float = spec(2.0, lo=0.0)
    # k3 KL to the warm start: without it, at this learning rate, one world's run collapsed (reward 0.81 ->
    # 0.24 in one update) where another's learned (BENCHMARKS.md)
    kl_beta: float = spec(0.1, lo=0.0)
    aggregation: str = spec("token_mean", choices=losses.AGGREGATIONS)
    # the ratio against the trainer's log-probs ("sampler": the sampler's)
    old_logprobs: str = spec("trainer", choices=train_step.OLD_LOGPROBS)
    advantage: str = spec("paper", choices=tuple(advantages.ADVANTAGES))
    step_weight: float = spec(0.0, lo=0.0)  # per-step (reward-to-go) advantage weight; 0 = off
    step_gamma: float = spec(1.0, lo=0.0, hi=1.0)

    def check(self, key: str) -> None:
        if 0 < self.dual_clip <= 1:
            raise config_error(f"{key}.dual_clip", f"must be 0 (off) or > 1, got {self.dual_clip}")

    def trainer_config(self, temperature: float) -> train_step.TrainConfig:
        """`rl.TrainConfig` for this section; `temperature` is the builder's sampling temperature."""
        return train_step.TrainConfig(
            loss=losses.LossConfig(name=self.loss, eps_low=self.eps_low, eps_high=self.eps_high,
                                   dual_clip=self.dual_clip, tis_cap=self.tis_cap, kl_beta=self.kl_beta,
                                   temperature=temperature, aggregation=self.aggregation),
            optim=self.optim_config(), micro_batches=self.micro_batches,
            micro_batch_rows=self.micro_batch_rows, old_logprobs=self.old_logprobs,
            remat=self.remat, logits_chunk=self.logits_chunk, logits_at=self.logits_at,
            scan_layers=self.scan_layers, scan_min_layers=self.scan_min_layers,
            moe_aux_loss_coef=self.moe_aux_loss_coef,
            max_skipped_in_a_row=self.max_skipped_in_a_row)


@dataclasses.dataclass(frozen=True)
class SFTTrainSection(OptimSection):
    """SFT's `train`: the optimizer keys, rows per batch and the log interval (the loss is `nll`)."""

    # fewer steps (100), or 6 rows a step, made warm starts GRPO could not sharpen (BENCHMARKS.md)
    num_steps: int = spec(150, lo=1)
    learning_rate: float = spec(4e-3, lo=0.0, lo_open=True)
    warmup_steps: int = spec(10, lo=0)
    end_lr_ratio: float = spec(0.05, lo=0.0, hi=1.0)
    micro_batch_rows: int = spec(0, lo=0)
    batch_rows: int = spec(8, lo=1)
    # > 0: batches of rows of similar length (windows of this many batches sorted by length,
    # rl.sft.RowStream), each padded only to its own longest row; 0: every batch padded to the data's longest.
    # Off: a demonstration's length follows its style, so batches of one style make a poor warm start
    group_by_length: int = spec(0, lo=0)
    log_every: int = spec(10, lo=1)

    def trainer_config(self) -> train_step.TrainConfig:
        return train_step.TrainConfig(
            loss=losses.LossConfig(name="nll", aggregation="token_mean", tis_cap=0.0, dual_clip=0.0),
            optim=self.optim_config(), micro_batches=self.micro_batches,
            micro_batch_rows=self.micro_batch_rows, old_logprobs="trainer",
            remat=self.remat, logits_chunk=self.logits_chunk, logits_at=self.logits_at,
            scan_layers=self.scan_layers, scan_min_layers=self.scan_min_layers,
            max_skipped_in_a_row=self.max_skipped_in_a_row)


# ------------------------------------------------------------------------------------------- the rest


def parse_methods(text: str, key: str) -> list[str]:
    """A comma-separated method list (`EVAL_METHODS` or `run:/workdir`); raises ConfigError naming `key`."""
    methods = [x.strip() for x in str(text).split(",") if x.strip()]
    for m in methods:
        if m not in EVAL_METHODS and not m.startswith("run:"):
            raise config_error(key, f"unknown method {m!r}; known: {list(EVAL_METHODS)} or run:/workdir")
    return methods


# `eval.select`: the final evaluation's "trained" builder is the last step's, or the step chosen on
# validation corpora carved from the training split (`inputs.validation_split`)
SELECT_RULES = ("last", "validation")


@dataclasses.dataclass(frozen=True)
class EvalSection(Section):
    """GRPO's periodic and final held-out evaluation."""

    every: int = spec(4, lo=0)  # evaluate on held-out tasks every N steps (0 = never)
    num_tasks: int = spec(6, lo=1)
    repeats: int = spec(1, lo=1)
    # after the last step: configs/eval.py on the run's held-out split with these methods ("" = none;
    # docs/eval.md) with a greedy builder (workdir/eval/final/), and with final_samples > 0 also with the
    # builder sampling at its training temperature, final_samples constructions per corpus
    # (workdir/eval/final_sampled/)
    final_methods: str = spec("trained,base,raw,bm25,agentic")
    final_samples: int = spec(0, lo=0)
    # which step's builder the final evaluation reports as "trained": "last", or "validation": the step (0,
    # the starting policy, or a multiple of `every`, or the last) whose greedy builder answers most of
    # `validation_tasks` training corpora kept out of GRPO's batches (ties to the later step)
    # `validation`: a run does not publish a drift it could see on corpora it may look at
    select: str = spec("validation", choices=SELECT_RULES)
    validation_tasks: int = spec(8, lo=0)

    def check(self, key: str) -> None:
        parse_methods(self.final_methods, f"{key}.final_methods")
        if self.select == "validation":
            if not self.validation_tasks:
                raise config_error(f"{key}.validation_tasks", "must be > 0 with eval.select='validation' "
                                   "(the training corpora the step is chosen on)")
            if not self.every:
                raise config_error(f"{key}.every", "must be > 0 with eval.select='validation' (the steps "
                                   "the validation corpora are answered at)")


@dataclasses.dataclass(frozen=True)
class WarmStartSection(Section):
    """Supervised fine-tuning on the embedded world's demonstrations before GRPO (`configs/sft.py`)."""

    enabled: bool = spec(True)
    sft_preset: str = spec("noisy")  # a configs/sft.py preset (checked by config_validation)
    sft_steps: int = spec(0, lo=0)  # the warm start's SFT steps; 0 = the preset's train.num_steps


@dataclasses.dataclass(frozen=True)
class RoleSection(Section):
    """One frozen role's model: init "policy" (the builder's initial weights, frozen) | "hf" | "orbax" |
    "random" | "executor" (compaction and judge: the executor's weights and engine); path / preset / dtype
    ("" = model's); slots and max_seq_len (0 = rollout.frozen_slots /
    rollout.max_seq_len); mesh ("" = the run's, or e.g. "data=1,fsdp=-1,tensor=1"); thinking (the Qwen3.5
    template's switch). Defaults are filled in once, by `config_validation.role_specs`."""

    init: str = spec("policy", choices=("", *ROLE_INITS))
    path: str = spec("")
    preset: str = spec("", choices=("", *MODEL_PRESETS))
    dtype: str = spec("", choices=DTYPES)
    slots: int = spec(0, lo=0)  # 0 = rollout.frozen_slots
    max_seq_len: int = spec(0, lo=0)  # 0 = rollout.max_seq_len
    mesh: str = spec("")
    thinking: bool = spec(False)
    template: str = spec("", choices=("", *CHAT_STYLES))  # "" = Qwen3.5's for a qwen3_5 preset, else detected


# One model per frozen role (`agents.runtime.FROZEN_ROLES`); roles naming the same weights share one engine
# and one copy of them.
RolesSection = dataclasses.make_dataclass(
    "RolesSection", [(role, RoleSection, _section(RoleSection)) for role in FROZEN_ROLES], bases=(Section,),
    frozen=True)


def validate_mesh(shape: Mapping[str, int], num_devices: int | None,
                  key: str = "mesh.shape") -> dict[str, int]:
    """The resolved mesh shape for `num_devices` devices (a shape without -1 may use fewer devices); with
    `num_devices=None` only the axis names and sizes are checked (and `shape` comes back)."""
    shape = dict(shape)
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise config_error(key, f"unknown axis names {unknown}; allowed: {list(MESH_AXES)}")
    for k, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
            raise config_error(f"{key}.{k}", f"must be a positive integer or -1, got {v!r}")
    if num_devices is None:
        return shape
    if -1 not in shape.values():
        used = 1
        for v in shape.values():
            used *= v
        if used > num_devices:
            raise config_error(key, f"{shape} needs {used} devices, only {num_devices} present")
        num_devices = used
    try:
        return resolve_mesh_shape(shape, num_devices)
    except ValueError as e:
        raise config_error(key, str(e)) from None


@dataclasses.dataclass(frozen=True)
class MeshSection(Section):
    shape: dict[str, int] = spec(factory=lambda: {"data": 1, "fsdp": 1, "tensor": 1})  # -1: the rest

    def check(self, key: str) -> None:
        validate_mesh(self.shape, None, f"{key}.shape")


@dataclasses.dataclass(frozen=True)
class CheckpointSection(Section):
    every: int = spec(1, lo=1)  # save every N steps (and at the end)
    keep: int = spec(2, lo=1)
    async_save: bool = spec(True)
    resume: bool = spec(True)  # restore the newest good checkpoint in workdir/checkpoints
    # checkpoints exist but none restores (all damaged): stop with each step's reason (False), or move them
    # to checkpoints/_damaged/ and train from step 0 (True); never silently
    start_fresh: bool = spec(False)


@dataclasses.dataclass(frozen=True)
class SFTCheckpointSection(CheckpointSection):
    """SFT's checkpoints: a warm start saves rarely and keeps its last."""

    every: int = spec(50, lo=1)
    keep: int = spec(1, lo=1)


# the warm start's scripted builder styles (`warm_start.demos`, a branch each) and their default mixture:
# named here, below the demonstrations, so the schema checks `demos.mix` without importing them
DEMO_STYLES = ("entities", "by_kind", "own_doc", "generic", "early_stop")
DEMO_MIX: dict[str, float] = {"entities": 0.25, "by_kind": 0.0, "own_doc": 0.4, "generic": 0.1,
                              "early_stop": 0.25}


@dataclasses.dataclass(frozen=True)
class DemosSection(Section):
    num_tasks: int = spec(256, lo=1)  # worlds to demonstrate on (seeded apart from the run's tasks)
    per_task: int = spec(1, lo=1)  # demonstrations per world
    calls_per_turn: int = spec(0, lo=0)  # tool calls per scripted reply (0: as many as its tokens allow)
    # share of each demos.STYLES style: the good styles only, entity files in a directory per kind
    # (by_kind) or flat, and stopping (the classic mix's poor styles made a warm start that answered 5.2% of
    # the noisy world's held-out questions, this one 25.8%; BENCHMARKS.md)
    mix: dict[str, float] = spec(factory=lambda: {"by_kind": 0.6, "entities": 0.15, "own_doc": 0.0,
                                                  "generic": 0.0, "early_stop": 0.25})

    def check(self, key: str) -> None:
        for style, share in self.mix.items():
            if style not in DEMO_STYLES:
                raise config_error(f"{key}.mix", f"unknown style {style!r}; known: {list(DEMO_STYLES)}")
            _check_value(float, share, f"{key}.mix.{style}", {"lo": 0.0})


@dataclasses.dataclass(frozen=True)
class PlanWorkloadSection(Section):
    """The workload one projected GRPO step is made of (`planning.plan.project`), per episode unless said.
    Defaults: the paper's reported figures where it reports them (`../shared/reference/`: 178,926 builder
    tokens a corpus, prompts re-sent each turn; 9,346 tokens an answerer read a query; <= 4 probes of 4
    answers), assumptions where it does not (new tokens a turn, executor calls, rows); 0 = the run's own
    setting (tasks a batch, group size, builder turns, probe repeats); -1 probes = `rollout.max_probes`."""

    tasks_per_step: int = spec(0, lo=0)  # 0 = data.tasks_per_batch
    group_size: int = spec(0, lo=0)  # 0 = rollout.group_size
    builder_turns: int = spec(0, lo=0)  # 0 = rollout.builder.max_turns
    builder_new_tokens_per_turn: int = spec(512, lo=1)  # assumed: the paper reports no output length
    builder_prefill_tokens: int = spec(178_926, lo=0)  # the paper's construction tokens a corpus
    probes_per_episode: int = spec(-1, lo=-1)  # -1 = rollout.max_probes (the terminal answers added)
    answer_repeats: int = spec(0, lo=0)  # 0 = rollout.probe_repeats
    answerer_read_tokens: int = spec(9_346, lo=0)  # the paper's RL-builder answer tokens a query
    answerer_new_tokens: int = spec(1_024, lo=1)  # assumed: ~27 actions a query (26.9 files read) + answer
    executor_calls_per_episode: int = spec(16, lo=0)  # assumed: half the turns create or merge
    executor_prompt_tokens: int = spec(4_000, lo=0)  # <= 16,000 characters of sources a call
    executor_new_tokens: int = spec(512, lo=1)  # the authors' executor cap
    rows_per_episode: int = spec(2, lo=1)  # assumed: one compaction a build (a row per segment)


@dataclasses.dataclass(frozen=True)
class PlanSection(Section):
    """`--dry_run --compile` with `topology` (`planning.plan`): which programs to compile and the step's
    workload."""

    roles: str = spec("")  # comma-separated: builder, answerer, executor, compaction, judge, trainer, sft
    # "" = every program; "largest" = each engine's largest prefill, decode and copy and each trainer's
    # longest bucket and optimizer (what sets the peak); else comma-separated name patterns ("decode,update")
    programs: str = spec("")
    threads: int = spec(0, lo=0)  # compile threads; 0 = the host's cores
    require_fit: bool = spec(False)  # exit 2 (one line) when the plan does not fit or a program fails
    workload: PlanWorkloadSection = _section(PlanWorkloadSection)


# ------------------------------------------------------------------------------------------- commands


def int_list(text: str) -> list[int]:
    """The integers of a comma-separated key ("0, 1,2,2": `seeds`, `retrieval_budget.ks`), in order, without
    repeats; ValueError on another item."""
    return list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))


@dataclasses.dataclass(frozen=True)
class GRPOConfig(Section):
    """`configs/grpo.py`: GRPO training of the builder (`main` with command "train")."""

    COMMAND: ClassVar[str] = "train"
    command: str = spec("train", choices=("train",))
    preset: str = spec("noisy")
    workdir: str = spec("/tmp/librarian_jax/grpo_noisy", nonempty=True)
    seed: int = spec(0, lo=0)
    # a seed sweep: "0,1,2,3,4" runs the whole command once per seed (its world, warm start, GRPO and final
    # evaluation) in workdir/seed_<s>/, then pools the final evaluations in workdir/sweep/ (eval.sweep)
    seeds: str = spec("")
    builder_thinking: bool = spec(True)  # Qwen3.5 template's thinking switch for the builder
    model: ModelSection = _section(ModelSection)
    data: DataSection = _section(DataSection)
    rollout: RolloutSection = _section(RolloutSection)
    train: TrainSection = _section(TrainSection)
    eval: EvalSection = _section(EvalSection)
    warm_start: WarmStartSection = _section(WarmStartSection)
    roles: RolesSection = _section(RolesSection)
    mesh: MeshSection = _section(MeshSection)
    checkpoint: CheckpointSection = _section(CheckpointSection)
    # an accelerator type (v5p-8, v5p-128, v6e-64, v5litepod-256, v4-32, tpu7x-16) or topology (v5p:2x2x1):
    # with --dry_run --compile, the plan for that slice (planning.plan) instead of compiling for this host
    topology: str = spec("")
    plan: PlanSection = _section(PlanSection)

    def check(self, key: str) -> None:
        if self.seeds:
            try:
                seeds = int_list(self.seeds)
            except ValueError:
                seeds = []
            if not seeds or min(seeds) < 0:
                raise config_error("seeds", f"must be comma-separated seeds >= 0 (e.g. '0,1,2'), got "
                                   f"{self.seeds!r}")
            if not self.eval.final_methods or "trained" not in parse_methods(self.eval.final_methods,
                                                                             "eval.final_methods"):
                raise config_error("seeds", "a sweep pools the final evaluations: eval.final_methods must "
                                   "include trained")
        if self.rollout.group_size < 2:
            raise config_error("rollout.group_size", f"must be >= 2 for GRPO, got {self.rollout.group_size}: "
                               "advantages are rewards relative to the group's mean, so a group of one gives "
                               "every episode advantage 0 and nothing trains")
        if self.warm_start.enabled and self.data.source != "synthetic":
            raise config_error("warm_start.enabled", "the warm start's demonstrations need the synthetic "
                               f"world (data.source is {self.data.source!r}); run configs/sft.py on your own "
                               "conversations and start GRPO from its checkpoint (model.init='orbax')")


@dataclasses.dataclass(frozen=True)
class SFTConfig(Section):
    """`configs/sft.py`: supervised warm start; model, data, rollout, roles, mesh and checkpoint as GRPO's."""

    COMMAND: ClassVar[str] = "sft"
    command: str = spec("sft", choices=("sft",))
    preset: str = spec("noisy")
    workdir: str = spec("/tmp/librarian_jax/grpo_noisy_sft", nonempty=True)
    seed: int = spec(0, lo=0)
    builder_thinking: bool = spec(True)
    model: ModelSection = _section(ModelSection)
    data: SFTDataSection = _section(SFTDataSection)
    rollout: RolloutSection = _section(RolloutSection)
    train: SFTTrainSection = _section(SFTTrainSection)
    roles: RolesSection = _section(RolesSection)
    mesh: MeshSection = _section(MeshSection)
    checkpoint: SFTCheckpointSection = _section(SFTCheckpointSection)
    demos: DemosSection = _section(DemosSection)
    # an accelerator type (v5p-8, v5p-128, v6e-64, v5litepod-256, v4-32, tpu7x-16) or topology (v5p:2x2x1):
    # with --dry_run --compile, the plan for that slice (planning.plan) instead of compiling for this host
    topology: str = spec("")
    plan: PlanSection = _section(PlanSection)


@dataclasses.dataclass(frozen=True)
class EngineSizesSection(Section):
    """Engine sizes for evaluation; 0 = the run's. `policy_slots` / `max_seq_len`: the builder's engine;
    `frozen_slots`: the frozen roles the run left at `rollout.frozen_slots` (a role's own context is its
    `roles.<role>.max_seq_len`, as in training); `round_steps`: every engine."""

    policy_slots: int = spec(0, lo=0)
    frozen_slots: int = spec(0, lo=0)
    max_seq_len: int = spec(0, lo=0)
    round_steps: int = spec(0, lo=0)


@dataclasses.dataclass(frozen=True)
class EvalAnswererSection(Section):
    kind: str = spec("", choices=EVAL_ANSWERER_KINDS)  # "" = the run's
    temperature: float = spec(-1.0)  # < 0 = the run's


@dataclasses.dataclass(frozen=True)
class BM25Section(Section):
    top_k: int = spec(3, lo=1)
    passage_words: int = spec(120, lo=1)


@dataclasses.dataclass(frozen=True)
class RerankSection(Section):
    """The `rerank` method: the first stage's top `candidates` re-scored by `roles.reranker`; its top
    `bm25.top_k` go into the answerer's first prompt."""

    candidates: int = spec(20, lo=1)
    first_stage: str = spec("bm25", choices=RETRIEVAL_INDEXES)


@dataclasses.dataclass(frozen=True)
class AgenticSection(Section):
    """The `agentic` method: the answerer's `search(query, k)` tool over this index of the raw documents'
    passages (`bm25.passage_words` words); `k`: the scripted navigator's (an LLM picks its own, <= 20)."""

    index: str = spec("bm25", choices=RETRIEVAL_INDEXES)
    k: int = spec(3, lo=1, hi=20)


BUDGET_MODES = ("fixed", "matched")


@dataclasses.dataclass(frozen=True)
class RetrievalBudgetSection(Section):
    """How many passages the retrieval methods get: their k (the passages in the first prompt of `bm25`,
    `embedding` and `rerank`, each `agentic` search's). `fixed`: `bm25.top_k` and `agentic.k`. `matched`
    (docs/eval.md, "Retrieval budget"): each method's k is tuned on up to `corpora` of the run's training
    corpora (never a held-out one) to its best accuracy among the candidates `ks` whose tokens read per
    question there stay within the tokens the answerer read per question on the `against` method's
    workspaces (held-out mean): the same reading budget as the workspace method it is compared with."""

    mode: str = spec("matched", choices=BUDGET_MODES)
    ks: str = spec("1,2,3,5,8,12,16,20")
    corpora: int = spec(16, lo=1)
    against: str = spec("trained")

    def check(self, key: str) -> None:
        try:
            ks = int_list(self.ks)
        except ValueError:
            ks = []
        if not ks or min(ks) < 1 or max(ks) > 20:
            raise config_error(f"{key}.ks", f"must list k values in 1..20, got {self.ks!r}")


@dataclasses.dataclass(frozen=True)
class GraphRAGSection(Section):
    """The `graphrag` method (eval.constructions): extraction and community summaries by the executor,
    Louvain communities (networkx, `seed`, `resolution`)."""

    seed: int = spec(0, lo=0)
    resolution: float = spec(1.0, lo=0.0, lo_open=True)
    extract_max_tokens: int = spec(2048, lo=16)  # document tokens the executor reads per extraction
    extract_max_new_tokens: int = spec(512, lo=1)
    summary_words: int = spec(200, lo=1)  # the extractive executor's summary budget
    summary_max_new_tokens: int = spec(512, lo=1)


@dataclasses.dataclass(frozen=True)
class AutoCompactionSection(Section):
    """The `autocompaction` method (eval.constructions): the corpus folded into one notes file of at most
    `budget_tokens` tokens, `chunk_tokens` of the corpus per executor step."""

    # 128: an embedded corpus (6 documents of 40-80 words) fits 2,000 tokens whole (96.0% on its held-out
    # corpora, no compaction at all), and 128 keeps the notes lossy, as a real corpus is against the paper's
    # budget (7.3%; 256: 17.7%)
    budget_tokens: int = spec(128, lo=16)
    chunk_tokens: int = spec(128, lo=16)


@dataclasses.dataclass(frozen=True)
class AblationSection(Section):
    enabled: bool = spec(True)
    shuffle_seed: int = spec(0, lo=0)


@dataclasses.dataclass(frozen=True)
class BootstrapSection(Section):
    draws: int = spec(2000, lo=1)
    seed: int = spec(0, lo=0)


@dataclasses.dataclass(frozen=True)
class EvalRoleSection(Section):
    """An evaluation's explicit override of one frozen role of the run's protocol ("" / 0 / -1: the run's;
    the keys of `RoleSection`). The report marks every difference from the training run's protocol."""

    init: str = spec("", choices=("", *ROLE_INITS))
    path: str = spec("")
    preset: str = spec("", choices=("", *MODEL_PRESETS))
    dtype: str = spec("", choices=DTYPES)
    slots: int = spec(0, lo=0)
    max_seq_len: int = spec(0, lo=0)
    mesh: str = spec("")
    thinking: int = spec(-1, lo=-1, hi=1)  # -1 = the run's; 0 off; 1 on
    template: str = spec("", choices=("", *CHAT_STYLES))


@dataclasses.dataclass(frozen=True)
class EmbeddingRoleSection(Section):
    """`roles.embedding`: the embedding model of the `embedding` method (and of `rerank` / `agentic` over the
    embedding index), a Hugging Face folder of one of our families (e.g. Qwen3-Embedding-0.6B); its own
    tokenizer when the folder has one, else the run's."""

    path: str = spec("")
    dtype: str = spec("", choices=DTYPES)  # "" = bfloat16
    pooling: str = spec("last", choices=POOLINGS)
    instruction: str = spec(RETRIEVAL_INSTRUCTION)  # before each query ("" = none); documents get none
    max_tokens: int = spec(512, lo=8)  # per passage or query (end-of-text id included)
    batch_size: int = spec(16, lo=1)


@dataclasses.dataclass(frozen=True)
class RerankerRoleSection(Section):
    """`roles.reranker`: the cross-encoder LLM of the `rerank` method (e.g. Qwen3-Reranker-0.6B), a Hugging
    Face folder of one of our families; its own tokenizer and chat template when the folder has one."""

    path: str = spec("")
    dtype: str = spec("", choices=DTYPES)  # "" = bfloat16
    instruction: str = spec(RETRIEVAL_INSTRUCTION)
    max_tokens: int = spec(1024, lo=32)  # per (query, passage) prompt
    batch_size: int = spec(8, lo=1)


EvalRolesSection = dataclasses.make_dataclass(
    "EvalRolesSection",
    [*((role, EvalRoleSection, _section(EvalRoleSection)) for role in FROZEN_ROLES),
     ("embedding", EmbeddingRoleSection, _section(EmbeddingRoleSection)),
     ("reranker", RerankerRoleSection, _section(RerankerRoleSection))],
    bases=(Section,), frozen=True)


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """`configs/eval.py`: a trained builder against baselines on held-out corpora (docs/eval.md)."""

    COMMAND: ClassVar[str] = "eval"
    command: str = spec("eval", choices=("eval",))
    preset: str = spec("embedded")
    run: str = spec("")  # the training workdir (config.json, split.json, checkpoints/, tokenizer/)
    # checkpoint step; -1 = the newest committed one; 0 = the run's starting weights (what "base" builds
    # with: a run's `eval.select` chose no GRPO step)
    step: int = spec(-1, lo=-1)
    builder: str = spec("")  # the "trained" method's weights: "" = the run's checkpoint, or "hf:/path"
    train_preset: str = spec("embedded")  # configs/grpo.py preset for rollout settings without a run
    methods: str = spec("trained,base,raw,bm25,agentic")  # comma-separated EVAL_METHODS, run:/other/workdir
    name: str = spec("default")  # report folder name under <run>/eval/
    out: str = spec("")  # report folder; "" = <run>/eval/<name>
    tasks: str = spec("")  # a task file (data.load_tasks); "" = the run's data, held-out ids from split.json
    task_ids: str = spec("")  # a file of task ids to evaluate (one per line, or JSON list / {"heldout": []})
    num_tasks: int = spec(0, lo=0)  # evaluate the first N held-out corpora (0 = all)
    questions_per_domain: int = spec(0, lo=0)  # a BRIGHT `tasks` folder: N questions per domain (0 = all)
    sample_seed: int = spec(0, lo=0)  # the seed of that sample (as configs/grpo.py data.sample_seed)
    seed: int = spec(0, lo=0)
    samples: int = spec(1, lo=1)  # n samples per question (pass@k); one construction + one answer each
    pass_k: str = spec("1")  # comma-separated k <= samples
    builder_temperature: float = spec(0.0, lo=0.0)  # 0 = greedy builder
    # > 0: the `samples` answers per question are sampled at this temperature on ONE construction per corpus,
    # for every method alike (BRIGHT's pass@k); 0: greedy answers, a sampling builder's samples each their
    # own construction
    answer_temperature: float = spec(0.0, lo=0.0)
    answerer: EvalAnswererSection = _section(EvalAnswererSection)
    bm25: BM25Section = _section(BM25Section)  # passages (every retrieval method) and the top-k budget
    rerank: RerankSection = _section(RerankSection)
    agentic: AgenticSection = _section(AgenticSection)
    retrieval_budget: RetrievalBudgetSection = _section(RetrievalBudgetSection)
    graphrag: GraphRAGSection = _section(GraphRAGSection)
    autocompaction: AutoCompactionSection = _section(AutoCompactionSection)
    ablation: AblationSection = _section(AblationSection)
    bootstrap: BootstrapSection = _section(BootstrapSection)
    cost_qs: str = spec("1,10,20,50")
    # corpora per scheduler batch (one progress-bar tick); 0 = as many as the builder engine's slots hold
    batch_tasks: int = spec(0, lo=0)  # (`rollout.jobs.batch_tasks_for`)
    export_workspaces: bool = spec(True)
    engine: EngineSizesSection = _section(EngineSizesSection)
    roles: EvalRolesSection = _section(EvalRolesSection)  # explicit overrides of the run's roles
    mesh: MeshSection = _section(MeshSection)
    # an accelerator type (v5p-8, v5p-128, v6e-64, v5litepod-256, v4-32, tpu7x-16) or topology (v5p:2x2x1):
    # with --dry_run --compile, the plan for that slice (planning.plan) instead of compiling for this host
    topology: str = spec("")
    plan: PlanSection = _section(PlanSection)

    def check(self, key: str) -> None:
        if not parse_methods(self.methods, "methods"):
            raise config_error("methods", "lists no method")


@dataclasses.dataclass(frozen=True)
class BuildDataSection(Section):
    path: str = spec("")  # the folder of documents
    extensions: str = spec(".txt,.md")


@dataclasses.dataclass(frozen=True)
class BuildConfig(Section):
    """`configs/build.py`: one workspace over a user's folder with a trained builder, exported."""

    COMMAND: ClassVar[str] = "build"
    command: str = spec("build", choices=("build",))
    run: str = spec("")  # the training workdir whose builder to use
    step: int = spec(-1, lo=-1)  # -1 = newest committed checkpoint; 0 = the run's starting weights
    builder: str = spec("")  # "" = the run's checkpoint; "hf:/path" for a Hugging Face model
    train_preset: str = spec("embedded")  # configs/grpo.py preset for rollout settings without a run
    out: str = spec("")  # the export directory (must not hold a previous export's files)
    seed: int = spec(0, lo=0)
    builder_temperature: float = spec(0.0, lo=0.0)
    # an incremental update: the old exported workspace (read only; "" = build from scratch) and the update
    # episode's own turn budget (`workspace.update`). Not `update`: that is ConfigDict's own method, and
    # absl's `--config.update=...` resolves to it and refuses the flag.
    update_from: str = spec("")
    update_max_turns: int = spec(8, lo=1)
    data: BuildDataSection = _section(BuildDataSection)
    engine: EngineSizesSection = _section(EngineSizesSection)
    mesh: MeshSection = _section(MeshSection)
    # an accelerator type (v5p-8, v5p-128, v6e-64, v5litepod-256, v4-32, tpu7x-16) or topology (v5p:2x2x1):
    # with --dry_run --compile, the plan for that slice (planning.plan) instead of compiling for this host
    topology: str = spec("")
    plan: PlanSection = _section(PlanSection)


# config.command -> its schema (main dispatches on the same names)
SCHEMAS: dict[str, type[Section]] = {s.COMMAND: s for s in (GRPOConfig, SFTConfig, EvalConfig, BuildConfig)}


def schema_for(config: Any) -> type[Section]:
    """The schema of a config by its `command` (a config without one is GRPO's)."""
    command = config.get("command", "train") if hasattr(config, "get") else "train"
    if command not in SCHEMAS:
        raise config_error("command", f"must be one of {sorted(SCHEMAS)}, got {command!r}")
    return SCHEMAS[command]


# The configs that describe a run (its model, data, rollout, roles, mesh and seed): GRPO's and SFT's.
# `cluster` and `inputs` take one of them, validated and typed; a run's recorded config.json reads back as
# one (`eval.restore.load_run_config`).
RunConfig = GRPOConfig | SFTConfig
RUN_SCHEMAS: tuple[type[Section], ...] = (GRPOConfig, SFTConfig)


def require_typed(value: Any, types: type | tuple[type, ...], what: str) -> None:
    """Raises TypeError unless `value` is one of the typed `types` (a schema, a section): the helpers below
    the commands take the validated config, never the raw ConfigDict it was parsed from."""
    if not isinstance(value, types):
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise TypeError(f"{what} takes the validated, typed config ({names}, `config_schema`), not a "
                        f"{type(value).__name__}: validate the ConfigDict first")
