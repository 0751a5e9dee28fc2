"""A scripted engine: the real engine's session API, answering each turn with text from a policy function.

It replays scripted behaviour through the real agents and scheduler: the embedded world's demonstration
builders (`data.demos`) run through it, so their transcripts are exactly what the tool protocol produces, and
unit tests use it to script exact actions. `policy(session) -> str | list[int]`: text is encoded with the
engine's tokenizer and ends with `end_id`; ids are used as they are. Sampled ids get log-prob -0.5. It records
the batch size of every `step()`. Training and evaluation of models always use `librarian_jax.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Record:
    tokens: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray


@dataclasses.dataclass
class Result:
    session: FakeSession
    tokens: list[int]
    logprobs: np.ndarray
    status: str


class FakeSession:
    def __init__(self, engine: ScriptedEngine, prompt: Sequence[int]):
        self.engine = engine
        self.tokens = [int(t) for t in prompt]
        self.logprobs = [0.0] * len(self.tokens)
        self.mask = [0.0] * len(self.tokens)
        self.closed = False
        self.turns = 0
        self.inflight = False

    def append(self, ids: Sequence[int]) -> None:
        assert not self.inflight and not self.closed
        self.tokens += [int(t) for t in ids]
        self.logprobs += [0.0] * len(ids)
        self.mask += [0.0] * len(ids)

    def record(self) -> Record:
        return Record(
            np.asarray(self.tokens, np.int32),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.mask, np.float32),
        )

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
        self.queue: list[tuple[FakeSession, int, tuple[int, ...]]] = []
        self.batch_sizes: list[int] = []
        self.sessions: list[FakeSession] = []
        self.samplings: list[object] = []

    def new_session(self, prompt_ids: Sequence[int]) -> FakeSession:
        s = FakeSession(self, prompt_ids)
        self.sessions.append(s)
        return s

    def submit(
        self, session: FakeSession, max_new_tokens: int, sampling: object, stop_ids: Sequence[int]
    ) -> None:
        assert not session.inflight and not session.closed
        session.inflight = True
        self.samplings.append(sampling)
        self.queue.append((session, max_new_tokens, tuple(stop_ids)))

    def step(self) -> list[Result]:
        batch, self.queue = self.queue[: self.num_slots], self.queue[self.num_slots :]
        self.batch_sizes.append(len(batch))
        out = []
        for s, max_new, stops in batch:
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
            room = self.max_seq_len - len(s.tokens)
            if len(ids) > room:
                ids, status = ids[: max(room, 0)], "cache_full"
            s.tokens += ids
            s.logprobs += [-0.5] * len(ids)
            s.mask += [1.0] * len(ids)
            s.turns += 1
            s.inflight = False
            out.append(Result(s, ids, np.full(len(ids), -0.5, np.float32), status))
        return out
