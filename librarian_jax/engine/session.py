"""Sessions: multi-turn token records whose cache lives in an engine slot between turns.

A session's *record* is every token it has seen, in order: the prompt, then for each turn the sampled tokens
(loss mask 1, with their log-probs) and any appended observation tokens (loss mask 0). The record is the
single source of truth: a session evicted from its slot is re-prefilled from exactly these ids later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from librarian_jax.engine.sampling import GREEDY, SamplingParams

if TYPE_CHECKING:
    from librarian_jax.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class SessionRecord:
    """A whole session, ready for training.

    Attributes:
      tokens: int32 ``[L]``, every token in order.
      logprobs: float32 ``[L]``, log-prob of each sampled token under ``log_softmax(logits / T)`` over the
        full vocabulary (``T = 1`` for greedy turns); 0 on prompt/observation tokens.
      loss_mask: float32 ``[L]``, 1 exactly on sampled tokens.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray


@dataclasses.dataclass
class TurnResult:
    """One finished turn.

    Attributes:
      session: the session it belongs to.
      tokens: the sampled ids of this turn, the stop token included when ``status == "stop"``.
      logprobs: float32 ``[len(tokens)]`` full-distribution log-probs (see ``SessionRecord``).
      status: ``"stop"`` (a stop id was sampled), ``"length"`` (the turn's ``max_new_tokens`` were used up) or
        ``"cache_full"`` (the session reached the engine's ``max_seq_len``; it cannot continue).
      processed_logprobs: float32 ``[len(tokens)]`` log-probs under the truncated (top-k / top-p) distribution
        actually sampled from; 0 for greedy turns.
    """

    session: Session
    tokens: list[int]
    logprobs: np.ndarray
    status: str
    processed_logprobs: np.ndarray | None = None


@dataclasses.dataclass
class Request:
    """A submitted turn (the handle ``Engine.submit`` returns). ``result`` is set when it finishes."""

    session: Session
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    processed_logprobs: list[float] = dataclasses.field(default_factory=list)
    result: TurnResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None


class Session:
    """One conversation held by an ``Engine``; create with ``engine.new_session(prompt_ids)``."""

    def __init__(self, engine: Engine, session_id: int, prompt_ids: Sequence[int]) -> None:
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("new_session: prompt_ids is empty; a session needs at least one token")
        self.engine = engine
        self.id = session_id
        self._tokens: list[int] = ids
        self._logprobs: list[float] = [0.0] * len(ids)
        self._loss_mask: list[float] = [0.0] * len(ids)
        self.slot: int | None = None  # engine slot holding this session's cache, if any
        self.cached: int = 0  # number of leading record tokens in the slot's cache
        self._needs_reset: bool = False  # the slot must be zeroed before this session's first prefill
        self.request: Request | None = None  # the turn in flight, if any
        self.status: str = "idle"  # "idle" | "waiting" | "running" | "cache_full" | "closed"
        self.last_used: int = 0

    def __repr__(self) -> str:
        return f"Session(id={self.id}, len={len(self._tokens)}, slot={self.slot}, status={self.status!r})"

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """A copy of the record's token ids."""
        return list(self._tokens)

    def append(self, ids: Sequence[int]) -> None:
        """Appends observation (or any host-written) tokens; loss mask 0. Only between turns."""
        if self.status in ("waiting", "running"):
            raise RuntimeError(f"Session {self.id}: append() while a turn is in flight ({self.status})")
        if self.status == "closed":
            raise RuntimeError(f"Session {self.id}: append() on a closed session")
        new = [int(t) for t in ids]
        self._tokens.extend(new)
        self._logprobs.extend([0.0] * len(new))
        self._loss_mask.extend([0.0] * len(new))
        self.last_used = self.engine._tick()

    def _add_generated(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self._tokens.extend(int(t) for t in ids)
        self._logprobs.extend(float(x) for x in logprobs)
        self._loss_mask.extend([1.0] * len(ids))

    def record(self) -> SessionRecord:
        """The complete record: tokens, log-probs and loss mask (1 exactly on generated tokens)."""
        return SessionRecord(
            tokens=np.asarray(self._tokens, np.int32),
            logprobs=np.asarray(self._logprobs, np.float32),
            loss_mask=np.asarray(self._loss_mask, np.float32),
        )

    def submit(
        self,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        stop_ids: Sequence[int] = (),
    ) -> Request:
        """Shorthand for ``engine.submit(self, ...)``."""
        return self.engine.submit(self, max_new_tokens, sampling, stop_ids)

    def close(self) -> None:
        """Frees this session's slot; the record stays readable."""
        self.engine._close(self)
