"""Training rows from episode records: exactly the sampled tokens, the sampler's log-probs and loss masks.

One row per context segment of an episode (history compaction starts a new segment, whose prompt is exactly
the tokens the sampler then saw). Rows are padded on the right into one `[rows, seq]` batch whose `seq` is
the smallest bucket that holds the longest row (so few shapes get compiled), and whose row count is a multiple
of `row_multiple` (micro-batches x data-parallel shards) — padding rows have weight 0 and an all-zero mask.

Per-row weights make each episode weigh the same however many rows it has: `1 / rows_of_episode`
(padding rows 0). Per-token advantages are the episode's advantage on every generated token, plus
`step_weight * A_step[turn]` for the builder turn that produced the token when per-step credit is on.

Records are duck-typed on the contract of `librarian_jax/rollout/records.py` (`EpisodeRecord.group_id,
.segments, .turn_rewards, .total_reward`); segments are `librarian_jax.segment.Segment`s, the contract both
layers import, validated when they were made (anything else with the same fields is made into one here).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from librarian_jax.rl import advantages as adv_lib
from librarian_jax.segment import Segment

# Powers of two and the midpoints above 512, and steps of 256 from 1,024 to 2,048 (where the embedded
# default's episodes fall: 1,100-1,500 tokens, 30% padding at 1,536 alone): a row is padded by at most 1.5x
# (1.25x from 1,024 to 2,048; attention cost grows with the square of the padded length), at the price of a
# few more compiled shapes.
DEFAULT_SEQ_BUCKETS: tuple[int, ...] = (64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072, 4096,
                                        6144, 8192, 12288, 16384, 24576, 32768)


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """How episodes become rows. `max_row_len` truncates longer segments (with a warning)."""

    advantage: str = "paper"
    step_weight: float = 0.0
    step_gamma: float = 1.0
    step_normalize_std: bool = False
    max_row_len: int = 4096
    seq_buckets: tuple[int, ...] = DEFAULT_SEQ_BUCKETS
    row_multiple: int = 1


@dataclasses.dataclass
class TrainBatch:
    """A padded batch of training rows (numpy, host side).

    tokens           int32   [rows, seq]  exactly the ids the sampler saw/produced, 0-padded on the right.
    valid            bool    [rows, seq]  True on real tokens (attention mask; padding is a suffix).
    loss_mask        float32 [rows, seq]  1 exactly on tokens the policy generated.
    sampler_logprobs float32 [rows, seq]  the sampler's log-prob of each generated token (0 elsewhere).
    advantages       float32 [rows, seq]  per-token advantage (0 where loss_mask is 0).
    row_weights      float32 [rows]       1 / rows of the row's episode; 0 for padding rows.
    episode_ids      int32   [rows]       index of the row's episode in the input list; -1 for padding.
    """

    tokens: np.ndarray
    valid: np.ndarray
    loss_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantages: np.ndarray
    row_weights: np.ndarray
    episode_ids: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays the train step consumes (episode_ids stay on the host)."""
        return {"tokens": self.tokens, "valid": self.valid, "loss_mask": self.loss_mask,
                "sampler_logprobs": self.sampler_logprobs, "advantages": self.advantages,
                "row_weights": self.row_weights}


class NoTrainableTokens(ValueError):
    """No segment of the batch holds a generated token (e.g. every session hit the cache limit at once)."""


def seq_buckets(max_len: int, buckets: Sequence[int] = DEFAULT_SEQ_BUCKETS) -> list[int]:
    """Every row length `pick_bucket` can give rows of at most `max_len` tokens: the buckets below it,
    then `max_len` itself (the shapes a run's update compiles for, `planning.plan`)."""
    return sorted({b for b in buckets if b < max_len} | {int(max_len)})


def pick_bucket(length: int, buckets: Sequence[int], max_len: int) -> int:
    """Smallest bucket >= length, capped at max_len (max_len itself when no bucket fits)."""
    for b in sorted(buckets):
        if b >= length and b <= max_len:
            return b
    return max_len


def episode_advantages(records: Sequence[Any], config: RowsConfig) -> tuple[list[float], list[np.ndarray],
                                                                              dict[str, float]]:
    """Episode advantages and per-turn step advantages, computed per group (`record.group_id`).

    Returns (episode advantage per record, per-turn step advantage `[T_i]` per record, metrics).
    """
    fn = adv_lib.get_advantage_fn(config.advantage)
    groups: dict[Any, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(records):
        groups[r.group_id].append(i)
    ep_adv = [0.0] * len(records)
    step_adv = [np.zeros(len(r.turn_rewards), np.float32) for r in records]
    equal_groups = 0
    for members in groups.values():
        rewards = np.array([float(records[i].total_reward) for i in members])
        equal_groups += adv_lib.all_equal(rewards)
        for i, a in zip(members, fn(rewards), strict=True):
            ep_adv[i] = float(a)
        if config.step_weight:
            per_step = adv_lib.step_advantages([records[i].turn_rewards for i in members],
                                               config.step_gamma, config.step_normalize_std)
            for i, s in zip(members, per_step, strict=True):
                step_adv[i] = s
    a = np.asarray(ep_adv, np.float64)
    metrics = {
        "adv/equal_reward_groups_frac": equal_groups / max(len(groups), 1),
        "adv/num_groups": float(len(groups)),
        "adv/episode_abs_mean": float(np.abs(a).mean()) if a.size else 0.0,
        "adv/episode_std": float(a.std()) if a.size else 0.0,
    }
    return ep_adv, step_adv, metrics


def build_rows(records: Sequence[Any], config: RowsConfig) -> tuple[TrainBatch, dict[str, float]]:
    """Episode records -> one padded `TrainBatch` and metrics (advantage spread, tokens, truncations)."""
    if not records:
        raise ValueError("build_rows: no episode records")
    ep_adv, step_adv, metrics = episode_advantages(records, config)
    rows: list[tuple[int, Segment]] = []
    for i, rec in enumerate(records):
        for j, seg in enumerate(rec.segments):
            try:  # a training segment: every sampled id names its builder turn (per-turn advantages)
                if not isinstance(seg, Segment):
                    seg = Segment(seg.tokens, seg.logprobs, seg.loss_mask, seg.turn_index)
                seg = seg.for_training()
            except ValueError as e:
                where = f"episode {i} (task {getattr(rec, 'task_id', '?')}) segment {j}"
                raise ValueError(f"{where}: {e}") from None
            if seg.num_sampled:
                rows.append((i, seg))
    if not rows:
        raise NoTrainableTokens("build_rows: no segment holds a generated token (every loss_mask is zero)")
    per_episode = collections.Counter(i for i, _ in rows)
    longest = max(len(seg.tokens) for _, seg in rows)
    seq = pick_bucket(longest, config.seq_buckets, config.max_row_len)
    n_rows = -(-len(rows) // config.row_multiple) * config.row_multiple
    batch = TrainBatch(
        tokens=np.zeros((n_rows, seq), np.int32), valid=np.zeros((n_rows, seq), bool),
        loss_mask=np.zeros((n_rows, seq), np.float32), sampler_logprobs=np.zeros((n_rows, seq), np.float32),
        advantages=np.zeros((n_rows, seq), np.float32), row_weights=np.zeros((n_rows,), np.float32),
        episode_ids=np.full((n_rows,), -1, np.int32))
    truncated = 0
    for r, (i, seg) in enumerate(rows):
        n = min(len(seg.tokens), seq)
        truncated += len(seg.tokens) > seq
        mask = seg.loss_mask[:n]
        turn = seg.turn_index[:n].astype(np.int64)
        steps = step_adv[i]
        per_tok = np.full((n,), ep_adv[i], np.float32)
        if config.step_weight and steps.size:
            ok = (turn >= 0) & (turn < steps.size)
            per_tok[ok] += config.step_weight * steps[turn[ok]]
        batch.tokens[r, :n] = seg.tokens[:n]
        batch.valid[r, :n] = True
        batch.loss_mask[r, :n] = mask
        batch.sampler_logprobs[r, :n] = seg.logprobs[:n]
        batch.advantages[r, :n] = per_tok * mask
        batch.row_weights[r] = 1.0 / per_episode[i]
        batch.episode_ids[r] = i
    if truncated:
        logging.warning("build_rows: %d of %d rows were longer than max_row_len=%d and were truncated",
                        truncated, len(rows), seq)
    metrics.update({
        "rows/num_rows": float(len(rows)),
        "rows/padded_rows": float(n_rows - len(rows)),
        "rows/seq_len": float(seq),
        "rows/truncated": float(truncated),
        "rows/loss_tokens": float(batch.loss_mask.sum()),
        "rows/tokens": float(batch.valid.sum()),
        "adv/token_abs_mean": float(np.abs(batch.advantages).sum() / max(batch.loss_mask.sum(), 1.0)),
    })
    return batch, metrics
