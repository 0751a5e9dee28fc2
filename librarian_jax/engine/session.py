"""Sessions: one multi-turn token record per conversation; the engine that serves it owns everything else.

A session's record is every token it has seen, in order: the prompt, then for each turn the sampled tokens
(loss mask 1, with their log-probs) and any appended observation tokens (loss mask 0), each sampled token with
the turn index its turn was submitted with (`tag`: the builder's turn; -1 when untagged, and on every
observation). It is the single copy of a session's tokens: turn results are slices of it, a session evicted
from its slot is re-prefilled from exactly these ids, and a builder's training segments are it as it stands
(`record()` returns a `segment.Segment`, the one session-array type). The engine keeps the slot, the cached
length and the turn in flight (``Engine`` bookkeeping); ``Session`` holds only the record and forwards
``append``/``submit``/``close`` to its engine's public methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from librarian_jax.engine.sampling import GREEDY, SamplingParams
from librarian_jax.segment import Segment

if TYPE_CHECKING:
    from librarian_jax.engine.engine import Engine


class TokenRecord:
    """Every token of one conversation in order, with log-prob, sampled flag and turn index per token.

    The one implementation of a session's record, shared by ``Session`` and test/scripted doubles.
    """

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("new_session: prompt_ids is empty; a session needs at least one token")
        self._tokens: list[int] = ids
        self._logprobs: list[float] = [0.0] * len(ids)
        self._sampled: list[bool] = [False] * len(ids)
        self._tags: list[int] = [-1] * len(ids)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """A copy of the record's token ids."""
        return list(self._tokens)

    @property
    def last_token(self) -> int:
        return self._tokens[-1]

    def token_slice(self, start: int, stop: int | None = None) -> list[int]:
        """The ids ``[start:stop]`` (a copy)."""
        return self._tokens[start:stop]

    @property
    def num_sampled(self) -> int:
        return sum(self._sampled)

    def extend(self, ids: Sequence[int], logprobs: Sequence[float] | None = None, tag: int = -1) -> None:
        """Adds tokens at the end: sampled ones (``logprobs`` given, loss mask 1, turn index ``tag``) or
        host-written ones (loss mask 0, log-prob 0, turn index -1). Only the owner of the session's lifecycle
        (its engine) calls this; agents use ``append``, which checks that no turn is in flight."""
        new = [int(t) for t in ids]
        self._tokens.extend(new)
        if logprobs is None:
            self._logprobs.extend([0.0] * len(new))
            self._sampled.extend([False] * len(new))
            tag = -1
        else:
            lps = [float(x) for x in logprobs]
            if len(lps) != len(new):
                raise ValueError(f"extend: {len(new)} tokens but {len(lps)} log-probs")
            self._logprobs.extend(lps)
            self._sampled.extend([True] * len(new))
        self._tags.extend([int(tag)] * len(new))

    def record(self, start: int = 0) -> Segment:
        """The record from position ``start`` on (the whole session by default) as a ``Segment``: tokens;
        log-probs of sampled tokens under ``log_softmax(logits / T)`` over the full vocabulary (``T = 1`` for
        greedy turns), 0 elsewhere; loss mask 1 exactly on sampled tokens; each token's turn index."""
        return Segment(
            tokens=np.asarray(self._tokens[start:], np.int32),
            logprobs=np.asarray(self._logprobs[start:], np.float32),
            loss_mask=np.asarray(self._sampled[start:], np.float32),
            turn_index=np.asarray(self._tags[start:], np.int32),
        )


@dataclasses.dataclass
class TurnResult:
    """One finished turn.

    Attributes:
      session: the session it belongs to.
      tokens: the sampled ids of this turn, the stop token included when ``status == "stop"`` (a slice of
        the session's record).
      logprobs: float32 ``[len(tokens)]`` full-distribution log-probs (see ``TokenRecord.record``).
      status: ``"stop"`` (a stop id was sampled), ``"length"`` (the turn's ``max_new_tokens`` were used up) or
        ``"cache_full"`` (the session reached the engine's ``max_seq_len``; it cannot continue).
      processed_logprobs: float32 ``[len(tokens)]`` log-probs under the truncated (top-k / top-p) distribution
        actually sampled from (0 for greedy turns), only from an engine built with
        ``processed_logprobs=True``; else None.
    """

    session: Any
    tokens: list[int]
    logprobs: np.ndarray
    status: str
    processed_logprobs: np.ndarray | None = None


@dataclasses.dataclass
class Request:
    """A submitted turn (the handle ``Engine.submit`` returns). ``result`` is set when it finishes.

    ``start`` is the record length at submission: the turn's tokens are ``session.record(start)``; sampled
    tokens are tagged ``tag``.
    """

    session: Session
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    start: int
    tag: int = -1
    processed_logprobs: list[float] | None = None
    result: TurnResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def generated(self) -> int:
        """Tokens this turn sampled so far."""
        return len(self.session) - self.start


class Session(TokenRecord):
    """One conversation's token record; create with ``engine.new_session(prompt_ids)``.

    Slot, cache length, status and the turn in flight are the engine's (``engine.status(session)``,
    ``engine.slot_of(session)``); the methods below are shorthands for the engine's public ones.
    """

    def __init__(self, engine: Engine, session_id: int, prompt_ids: Sequence[int]) -> None:
        super().__init__(prompt_ids)
        self.engine = engine
        self.id = session_id

    def __repr__(self) -> str:
        return f"Session(id={self.id}, len={len(self)})"

    @property
    def status(self) -> str:
        """``"idle" | "waiting" | "running" | "cache_full" | "closed"`` (the engine's view)."""
        return self.engine.status(self)

    def append(self, ids: Sequence[int]) -> None:
        """``engine.append(self, ids)``: observation (host-written) ids, loss mask 0; only between turns."""
        self.engine.append(self, ids)

    def submit(
        self,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        stop_ids: Sequence[int] = (),
        tag: int = -1,
    ) -> Request:
        """``engine.submit(self, ...)``."""
        return self.engine.submit(self, max_new_tokens, sampling, stop_ids, tag=tag)

    def close(self) -> None:
        """``engine.close(self)``: frees this session's slot; the record stays readable."""
        self.engine.close(self)
