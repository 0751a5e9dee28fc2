"""Episode records: what a builder episode produced, for training (`rl/`) and for inspection (JSONL).

`Segment` (the training-row contract, docs/contracts.md) lives in `librarian_jax/segment.py`, which the
engine, this layer and `rl/` import; it is validated when made, and an episode's are builder segments
(`Segment.for_training`: every sampled id names its turn). History compaction starts a new segment whose
prompt is exactly the ids the model then saw.

`EpisodeRecord`: one builder episode: its segments, per-turn rewards (`turn_rewards[t]` for turn t: probe
delta + malformed-call penalties, and the turn-limit penalty on the last turn), the terminal reward, the total
(`sum(turn_rewards) + terminal_reward`), probe turns and scores, tool calls and errors per turn, workspace
snapshots (JSON) at probes and at the end, answers given, and token counts: construction (builder +
executor + summaries) and reading (answerer).

`write_jsonl(path, records)` / `read_jsonl(path)` round-trip records exactly (arrays become lists); the path
is local or a URL such as `gs://...` (`librarian_jax.storage`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from librarian_jax import storage
from librarian_jax.segment import Segment


@dataclasses.dataclass
class EpisodeRecord:
    """One builder episode (see the module docstring). `group_id` = index of the task in the batch."""

    task_id: str
    group_id: int
    episode_index: int
    segments: list[Segment]
    turn_rewards: list[float]
    terminal_reward: float
    total_reward: float
    probe_scores: list[float] = dataclasses.field(default_factory=list)
    probe_turns: list[int] = dataclasses.field(default_factory=list)  # 0-based turn after which each ran
    initial_score: float = 0.0  # the score deltas start from (the start probe's, or 0)
    num_turns: int = 0
    stopped: bool = False
    tool_calls: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)  # per turn
    tool_errors: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)  # per turn (malformed)
    replies: list[str] = dataclasses.field(default_factory=list)  # per turn: the decoded reply (cut)
    workspace_snapshots: dict[str, Any] = dataclasses.field(default_factory=dict)  # "probe_<t>", "final"
    answers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    token_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    compactions: int = 0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def construction_tokens(self) -> int:
        """Builder + executor (+ summary) tokens: everything read and written to build the workspace."""
        c = self.token_counts
        return sum(
            c.get(k, 0)
            for k in (
                "builder_prompt",
                "builder_generated",
                "executor_prompt",
                "executor_generated",
                "summary_tokens",
            )
        )

    @property
    def reading_tokens(self) -> int:
        """Answerer tokens (prompt + observations + generated) over every probe and the final evaluation."""
        c = self.token_counts
        return c.get("answerer_prompt", 0) + c.get("answerer_generated", 0)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "segments"}
        d["segments"] = [s.to_dict() for s in self.segments]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpisodeRecord:
        d = dict(d)
        segs = [Segment.from_dict(s).for_training() for s in d.pop("segments", [])]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise KeyError(f"episode record has unknown field {unknown[0]!r}")
        return cls(segments=segs, **d)

    def check(self) -> None:
        """Raises ValueError naming what is inconsistent (segments, reward sums, per-turn list lengths)."""
        for i, s in enumerate(self.segments):  # each was validated when made; a record holds nothing else
            if not isinstance(s, Segment):
                raise ValueError(f"episode {self.task_id}/{self.episode_index} segment {i} is a "
                                 f"{type(s).__name__}, not a Segment")
        if len(self.turn_rewards) != self.num_turns:
            raise ValueError(f"turn_rewards has {len(self.turn_rewards)} entries for {self.num_turns} turns")
        if any(len(x) != self.num_turns for x in (self.tool_calls, self.tool_errors, self.replies)):
            raise ValueError("tool_calls / tool_errors / replies need one entry per turn")
        total = float(sum(self.turn_rewards) + self.terminal_reward)
        if abs(total - self.total_reward) > 1e-6:
            raise ValueError(f"total_reward {self.total_reward} != sum(turn_rewards) + terminal = {total}")


def write_jsonl(path: str | os.PathLike[str], records: Iterable[EpisodeRecord]) -> int:
    """Writes one JSON object per record; returns how many. Creates parent directories."""
    n = 0
    with storage.open_file(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict(), separators=(",", ":")) + "\n")
            n += 1
    return n


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[EpisodeRecord]:
    with storage.open_file(path, "r") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield EpisodeRecord.from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{os.fspath(path)}:{line_no}: bad episode record: {e}") from None


def read_jsonl(path: str | os.PathLike[str]) -> list[EpisodeRecord]:
    return list(iter_jsonl(path))
