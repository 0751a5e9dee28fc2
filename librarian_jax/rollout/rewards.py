"""Rollout configuration, the probe schedule and the reward arithmetic (pure functions, no engines).

Turns are counted 0-based in records (`turn_index`, `turn_rewards[t]`); the schedule counts completed turns
`n = t + 1`. A probe runs after turn t when all hold:
  - turn t made at least one successful create_file / merge_files,
  - `n - last_probe_n >= probe_min_gap` (8) where `last_probe_n` starts at 0 (so the first probe comes after
    the 8th turn at the earliest; a start probe, `probe_at_start`, does not move it),
  - fewer than `max_probes` (4) probes ran in this episode (the start probe does not count).
A probe's score is the mean correctness of `probe_repeats` (R = 4) answerer runs per hidden question on a
snapshot of the workspace. Its step reward is `probe_scale * (score - previous)` when
`|score - previous| >= probe_threshold` (0.25), else 0; `previous` is the last probe's score (the start
probe's, or 0 without one), updated at every probe whether or not its delta paid out.

At Stop or at the turn limit the terminal reward is the mean correctness of `terminal_repeats` answerer runs
per question of the terminal set (`terminal_questions`: `"reuse_if_any"` = the task's reuse questions when
it has them, else its hidden questions — the paper's main run; `"hidden"`; `"reuse"`; `"hidden+reuse"` =
both, a denser reward on training corpora whose evaluation asks the hidden ones, `rollout.jobs.eval_config`).
Ending without Stop (the turn limit, or a full context) costs `no_stop_penalty` (0.1) on the last turn's
reward. Every malformed tool call costs `builder.malformed_penalty` (0.05) on its turn's reward. The
episode's total reward is `sum(turn_rewards) + terminal_reward`.

Repeats (`repeat_mode`): R greedy answerer runs of one question are R copies of one run, so they are never
paid R times. `"greedy_once"` (default; the paper's answerer is greedy): with a greedy answerer (temperature
0) each question is answered once and the run counted R times (the copies carry `"copy": True` and no
tokens); an answerer with temperature > 0 samples all R. `"sample"`: the R runs sample at
`repeat_temperature`, so the mean estimates the answerer's expected correctness.

Cost-aware utility (paper §2.3, Equations 1-4; all zero by default, as in the main run): a correct answer's
score is `1 - token_cost * tokens_read - read_cost * files_read` (the penalties apply to correct answers
only; a wrong answer scores 0), so probe and terminal scores are mean utilities; every successful edit
(create / merge / delete) costs `edit_cost` on its turn's reward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from librarian_jax.agents.answerer import AnswererConfig
from librarian_jax.agents.builder import RAW_LISTINGS, BuilderConfig
from librarian_jax.agents.executor import EXECUTOR_KINDS
from librarian_jax.agents.prompt_text import PROMPT_NAMES

TERMINAL_SETS = ("reuse_if_any", "hidden", "reuse", "hidden+reuse")
REPEAT_MODES = ("greedy_once", "sample")


# keys a run's config.json may hold that no setting reads: dropped when read back, so it still reads
RETIRED_KEYS = frozenset({"dedupe_greedy_repeats"})


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Every rollout term (the module docstring). The defaults here and in `BuilderConfig` /
    `AnswererConfig` are the paper's main run, for code that builds an episode directly; a command's
    values are the config's, over the schema's defaults (`config_schema.ROLLOUT_DEFAULTS`)."""

    builder: BuilderConfig = BuilderConfig()
    answerer: AnswererConfig = AnswererConfig()
    probe_repeats: int = 4
    probe_min_gap: int = 8
    max_probes: int = 4
    probe_threshold: float = 0.25
    probe_scale: float = 1.0
    probe_at_start: bool = False
    terminal_repeats: int = 4
    terminal_questions: str = "reuse_if_any"
    no_stop_penalty: float = 0.1
    use_model_judge: bool = True
    judge_max_new_tokens: int = 16
    record_snapshots: bool = True
    snapshot_raw_text: bool = False  # snapshots keep raw doc hashes; texts only when True
    repeat_mode: str = "greedy_once"  # "greedy_once" | "sample" (module docstring)
    repeat_temperature: float = 1.0  # the answerer's temperature for repeat_mode="sample"
    token_cost: float = 0.0  # lambda_tok: per token a correct answer read
    read_cost: float = 0.0  # lambda_read: per file a correct answer read
    edit_cost: float = 0.0  # alpha: per successful create / merge / delete
    record_conversations: bool = False  # keep the builder's turns as chat messages in `meta["conversations"]`

    def __post_init__(self) -> None:
        if self.terminal_questions not in TERMINAL_SETS:
            raise ValueError(
                f"RolloutConfig.terminal_questions must be one of {TERMINAL_SETS}, "
                f"got {self.terminal_questions!r}"
            )
        if self.repeat_mode not in REPEAT_MODES:
            raise ValueError(f"RolloutConfig.repeat_mode must be one of {REPEAT_MODES}, "
                             f"got {self.repeat_mode!r}")
        if self.repeat_mode == "sample" and self.repeat_temperature <= 0:
            raise ValueError("RolloutConfig.repeat_temperature must be > 0 with repeat_mode='sample' (greedy "
                             f"repeats are copies of one run), got {self.repeat_temperature}")
        for name in ("token_cost", "read_cost", "edit_cost"):
            if getattr(self, name) < 0:
                raise ValueError(f"RolloutConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("probe_repeats", "terminal_repeats", "probe_min_gap", "max_probes"):
            if getattr(self, name) < 0:
                raise ValueError(f"RolloutConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.builder.max_turns < 1:
            raise ValueError(f"RolloutConfig.builder.max_turns must be >= 1, got {self.builder.max_turns}")

        if not self.builder.system_prompt.startswith("builder_system") or \
                self.builder.system_prompt not in PROMPT_NAMES:
            raise ValueError(
                f"RolloutConfig.builder.system_prompt must name a builder system prompt "
                f"({[n for n in PROMPT_NAMES if n.startswith('builder_system')]}), "
                f"got {self.builder.system_prompt!r}"
            )
        if self.builder.executor not in EXECUTOR_KINDS:
            raise ValueError(
                f"RolloutConfig.builder.executor must be one of {list(EXECUTOR_KINDS)}, "
                f"got {self.builder.executor!r}"
            )
        if self.builder.raw_listing not in RAW_LISTINGS:
            raise ValueError(
                f"RolloutConfig.builder.raw_listing must be one of {list(RAW_LISTINGS)}, "
                f"got {self.builder.raw_listing!r}"
            )
        if self.builder.compaction not in ("deterministic", "model", "none"):
            raise ValueError(
                f"RolloutConfig.builder.compaction must be 'deterministic', 'model' or 'none', "
                f"got {self.builder.compaction!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RolloutConfig:
        """From a (nested) dict or ml_collections ConfigDict; an unknown key raises KeyError naming it."""
        d = {k: v for k, v in dict(d).items() if k not in RETIRED_KEYS}
        kwargs: dict[str, Any] = {}
        sub = {"builder": BuilderConfig, "answerer": AnswererConfig}
        names = {f.name for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k not in names:
                raise KeyError(f"rollout config: unknown key {k!r}; known: {sorted(names)}")
            if k in sub:
                v = dict(v)
                sub_names = {f.name for f in dataclasses.fields(sub[k])}
                bad = sorted(set(v) - sub_names)
                if bad:
                    raise KeyError(f"rollout config: unknown key {k}.{bad[0]!r}; known: {sorted(sub_names)}")
                v = sub[k](**v)
            kwargs[k] = v
        return cls(**kwargs)


def should_probe(
    turns_done: int, made_write: bool, last_probe_turns_done: int, num_probes: int, config: RolloutConfig
) -> bool:
    """The probe schedule (module docstring): after a successful write, a gap since the last probe, a cap."""
    return (
        made_write
        and num_probes < config.max_probes
        and turns_done - last_probe_turns_done >= config.probe_min_gap
    )


def probe_reward(score: float, previous: float, config: RolloutConfig) -> float:
    """`scale * (score - previous)`, zeroed when `|score - previous| < threshold`."""
    delta = float(score) - float(previous)
    if abs(delta) < config.probe_threshold:
        return 0.0
    return float(config.probe_scale) * delta


def answer_utility(correct: float, tokens_read: int, files_read: int, config: RolloutConfig) -> float:
    """Paper §2.3: a correct answer's utility less its token and read costs; a wrong answer scores 0."""
    if not correct:
        return 0.0
    return float(correct) - config.token_cost * tokens_read - config.read_cost * files_read


def edit_penalty(num_edits: int, config: RolloutConfig) -> float:
    """The construction cost of a turn's successful edits (paper §2.3's alpha per edit)."""
    return config.edit_cost * num_edits


def repeat_plan(repeats: int, config: RolloutConfig) -> tuple[int, float | None]:
    """(answerer runs to make per question, temperature override or None) for `repeats` repeats."""
    if repeats <= 1:
        return repeats, None
    if config.repeat_mode == "sample":
        return repeats, config.repeat_temperature
    if config.answerer.temperature == 0.0:
        return 1, None  # greedy: one run, counted `repeats` times
    return repeats, None


def mean_correct(values: Sequence[float]) -> float:
    """Mean correctness; 0 for no runs (a task without questions scores 0)."""
    return float(sum(values) / len(values)) if values else 0.0


def terminal_question_set(task: Any, config: RolloutConfig) -> tuple[Any, ...]:
    hidden, reuse = tuple(task.questions), tuple(task.reuse_questions)
    if config.terminal_questions == "hidden":
        return hidden
    if config.terminal_questions == "reuse":
        return reuse
    if config.terminal_questions == "hidden+reuse":
        return hidden + reuse
    return reuse if reuse else hidden
