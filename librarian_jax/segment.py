"""`Segment`: the rollout -> rl contract, one context segment of a builder session, validated when it is made.

It sits beside `data/schema.py` below every layer (NumPy only): `agents/` makes segments from an engine
session's record, `rollout/` stores and serialises them, `rl/` turns them into training rows. Each field holds
exactly the ids the sampler saw and produced, in order:

    tokens     int32   [L]  prompt ids, sampled ids, appended observation ids
    logprobs   float32 [L]  the sampler's log-prob of each sampled id (full temperature-scaled distribution),
                            0 elsewhere
    loss_mask  float32 [L]  1 exactly on sampled ids (0 elsewhere; no other value)
    turn_index int32   [L]  the 0-based builder turn that sampled the id; -1 on prompt/observation ids

A `Segment` is checked once, when it is constructed (from an engine record, a JSONL line or by hand): a
malformed one raises `ValueError` naming the field, so no consumer re-checks it.

Why a segment is not the engine's `SessionRecord` (same four arrays, `tags` for `turn_index`), but derived
from it (`Segment.from_record`, the one conversion): a session record is any role's. Its tags are whatever
the agent submitted with, so an answerer's, executor's or judge's sampled ids carry tag -1, and those
sessions are never trained on. A segment is a builder session's record under one more invariant, the one
`rl` relies on: every sampled id names the builder turn that sampled it (`turn_index >= 0` exactly where
`loss_mask` is 1), which is what per-turn advantages are assigned by. Checking it when the record becomes a
segment, not in the engine, keeps the engine free of a builder's notion of turns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

FIELDS: dict[str, type] = {"tokens": np.int32, "logprobs": np.float32, "loss_mask": np.float32,
                           "turn_index": np.int32}


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """One training row's worth of one session (see the module docstring for the fields)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    turn_index: np.ndarray

    def __post_init__(self) -> None:
        for name, dtype in FIELDS.items():
            value = np.asarray(getattr(self, name))
            if value.dtype.kind not in "biuf" and value.size:
                raise ValueError(f"segment field {name!r} has dtype {value.dtype}; expected numbers")
            object.__setattr__(self, name, value.astype(dtype, copy=False))
        n = self.tokens.shape
        for name in FIELDS:
            a = getattr(self, name)
            if a.ndim != 1 or a.shape != n:
                raise ValueError(f"segment field {name!r} has shape {a.shape}; tokens has shape {n}")
        sampled = self.loss_mask > 0
        if np.any((self.loss_mask != 0) & (self.loss_mask != 1)):
            raise ValueError("segment loss_mask must be 0 or 1")
        if np.any((self.turn_index >= 0) != sampled):
            raise ValueError("segment turn_index must be >= 0 exactly where loss_mask is 1")
        if np.any(self.logprobs[~sampled] != 0):
            raise ValueError("segment logprobs must be 0 on tokens that were not sampled")
        if not np.all(np.isfinite(self.logprobs)):
            raise ValueError("segment logprobs must be finite")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_sampled(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def to_dict(self) -> dict[str, list]:
        return {k: getattr(self, k).tolist() for k in FIELDS}

    @classmethod
    def from_record(cls, record: Any) -> Segment:
        """A builder session's record (`engine.SessionRecord`: tokens, logprobs, loss_mask, tags) as a
        segment, its tags the turn indices; raises ValueError if a sampled id carries no turn (module doc)."""
        return cls(record.tokens, record.logprobs, record.loss_mask, record.tags)

    @classmethod
    def from_dict(cls, d: dict) -> Segment:
        missing = [k for k in FIELDS if k not in d]
        if missing:
            raise KeyError(f"segment record misses field {missing[0]!r}")
        return cls(**{k: np.asarray(d[k], FIELDS[k]) for k in FIELDS})
