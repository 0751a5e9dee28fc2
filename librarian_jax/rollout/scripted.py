"""A scripted engine: the real engine's session API, answering each turn with text from a policy function.

It replays scripted behaviour through the real agents and scheduler: the embedded world's demonstration
builders (`warm_start.demos`) run through it, so their transcripts are exactly what the tool protocol
produces, and unit tests use it to script exact actions. `policy(session) -> str | list[int]`: text is
encoded with the engine's tokenizer and ends with `end_id`; ids are used as they are. Sampled ids get
log-prob -0.5 and the tag their turn was submitted with. Its sessions keep the real engine's token record
(`engine.session.TokenRecord`), so agents read the same record either way. It records the batch size of every
`step()`. Training and evaluation of models always use `librarian_jax.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from librarian_jax.engine.session import TokenRecord


@dataclasses.dataclass
class Result:
    session: FakeSession
    tokens: list[int]
    logprobs: np.ndarray
    status: str


class FakeSession(TokenRecord):
    """A session of the scripted engine: the engine's token record plus a turn counter."""

    def __init__(self, engine: ScriptedEngine, prompt: Sequence[int]):
        super().__init__(prompt)
        self.engine = engine
        self.closed = False
        self.turns = 0
        self.inflight = False

    @property
    def mask(self) -> list[float]:
        """The loss mask as a list (1.0 on sampled ids)."""
        return self.record().loss_mask.tolist()

    def append(self, ids: Sequence[int]) -> None:
        assert not self.inflight and not self.closed
        self.extend(ids)

    def close(self) -> None:
        self.closed = True

    def text(self) -> str:
        return self.engine.tok.decode(self.tokens)


class ScriptedEngine:
    """Answers every turn with `policy(session) -> str | list[int]` (text is encoded and ends with `end_id`;
    ids are used as they are). Works with any tokenizer (the byte double or a real one)."""

    def __init__(
        self,
        tok: Any,
        policy: Callable[[FakeSession], str | list[int]],
        num_slots: int = 64,
        max_seq_len: int = 1_000_000,
        end_id: int = 0,
    ):
        self.tok = tok
        self.policy = policy
        self.end_id = end_id
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.queue: list[tuple[FakeSession, int, tuple[int, ...], int]] = []
        self.batch_sizes: list[int] = []
        self.sessions: list[FakeSession] = []
        self.samplings: list[object] = []

    def new_session(self, prompt_ids: Sequence[int]) -> FakeSession:
        s = FakeSession(self, prompt_ids)
        self.sessions.append(s)
        return s

    def submit(
        self, session: FakeSession, max_new_tokens: int, sampling: object, stop_ids: Sequence[int],
        *, tag: int = -1,
    ) -> None:
        assert not session.inflight and not session.closed
        session.inflight = True
        self.samplings.append(sampling)
        self.queue.append((session, max_new_tokens, tuple(stop_ids), int(tag)))

    def step(self) -> list[Result]:
        batch, self.queue = self.queue[: self.num_slots], self.queue[self.num_slots :]
        self.batch_sizes.append(len(batch))
        out = []
        for s, max_new, stops, tag in batch:
            reply = self.policy(s)
            ids = list(reply) if isinstance(reply, list) else self.tok.encode(reply) + [self.end_id]
            status = "length"
            for k, t in enumerate(ids):
                if t in stops:
                    ids = ids[: k + 1]
                    status = "stop"
                    break
            if len(ids) > max_new:
                ids, status = ids[:max_new], "length"
            room = self.max_seq_len - len(s)
            if len(ids) > room:
                ids, status = ids[: max(room, 0)], "cache_full"
            s.extend(ids, [-0.5] * len(ids), tag=tag)
            s.turns += 1
            s.inflight = False
            out.append(Result(s, ids, np.full(len(ids), -0.5, np.float32), status))
        return out
