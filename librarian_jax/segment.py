"""`Segment`: the one session-array type. Every engine session's token record comes out as one, and a builder
session's is the rollout -> rl contract, one context segment of an episode. NumPy only, below every layer:
`engine/` returns it (`Session.record()`), `agents/` keep a builder's, `rollout/` stores and serialises them,
`rl/` turns them into training rows. Each field holds exactly the ids the sampler saw and produced, in order:

    tokens     int32   [L]  prompt ids, sampled ids, appended observation ids
    logprobs   float32 [L]  the sampler's log-prob of each sampled id (full temperature-scaled distribution),
                            0 elsewhere
    loss_mask  float32 [L]  1 exactly on sampled ids (0 elsewhere; no other value)
    turn_index int32   [L]  the turn index the sampled id was submitted with (`Engine.submit(tag=)`: the
                            builder's 0-based turn); -1 on prompt/observation ids and on untagged turns

A `Segment` is checked once, when it is constructed (by the engine, from a JSONL line or by hand): a
malformed one raises `ValueError` naming the field, so no consumer re-checks it.

One type for any role's record and for a training segment: the one invariant a builder's segment adds, the
one `rl` relies on, is a check, not a second type. In any role's record a sampled id may carry turn index
-1 (an answerer's, executor's or judge's turns are untagged: those sessions are never trained on); in a
builder's, every sampled id names the builder turn that sampled it (`turn_index >= 0` exactly where
`loss_mask` is 1), which is what per-turn advantages are assigned by. `for_training()` checks it where a
segment becomes training data (the builder's `SessionLog.segment()`, `rl.rows.build_rows`), so the engine
stays free of a builder's notion of turns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FIELDS: dict[str, type] = {"tokens": np.int32, "logprobs": np.float32, "loss_mask": np.float32,
                           "turn_index": np.int32}


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """A session's token record, or a part of it (see the module docstring for the fields)."""

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
        if np.any((self.turn_index >= 0) & ~sampled) or np.any(self.turn_index < -1):
            raise ValueError("segment turn_index must be -1 on tokens that were not sampled (>= -1 on "
                             "sampled ones)")
        if np.any(self.logprobs[~sampled] != 0):
            raise ValueError("segment logprobs must be 0 on tokens that were not sampled")
        if not np.all(np.isfinite(self.logprobs)):
            raise ValueError("segment logprobs must be finite")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_sampled(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def for_training(self) -> Segment:
        """This segment as training data: every sampled id names the builder turn that sampled it
        (`turn_index >= 0` exactly where `loss_mask` is 1); raises ValueError otherwise (module doc)."""
        if np.any((self.turn_index >= 0) != (self.loss_mask > 0)):
            raise ValueError("segment turn_index must be >= 0 exactly where loss_mask is 1 (every sampled id "
                             "of a training segment names its builder turn)")
        return self

    def to_dict(self) -> dict[str, list]:
        return {k: getattr(self, k).tolist() for k in FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> Segment:
        missing = [k for k in FIELDS if k not in d]
        if missing:
            raise KeyError(f"segment record misses field {missing[0]!r}")
        return cls(**{k: np.asarray(d[k], FIELDS[k]) for k in FIELDS})
