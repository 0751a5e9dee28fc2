"""Test doubles for agent/rollout unit tests: a byte-level ChatML tokenizer and a scripted engine.

The scripted engine has the real engine's session API (`new_session`, `append`, `submit`, `step`,
`record`, `close`) and answers each turn with text from a policy function of the session's decoded history,
encoded to ids (log-prob -0.5 per sampled id). It records the batch size of every `step()`. The real path
always uses `librarian_jax.engine.Engine`; these stand in only so unit tests can script exact actions.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<eos>"]
IM_END = 257
EOS = 260
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


class ByteTokenizer:
    """Bytes are ids 0..255; the ChatML markers and tool-call tags are single ids 256..260."""

    vocab_size = 256 + len(SPECIALS)
    eos_id = EOS
    bos_id = None
    pad_id = None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _SPLIT.split(text):
            if piece in SPECIALS:
                out.append(256 + SPECIALS.index(piece))
            elif piece:
                out.extend(piece.encode("utf-8"))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i >= 256:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(SPECIALS[i - 256] if i - 256 < len(SPECIALS) else "")
            else:
                buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class ByteChatML:
    """ChatML over `ByteTokenizer` with the contract's ChatTemplate methods."""

    def __init__(self, tok: ByteTokenizer):
        self.tok = tok
        self.stop_ids = (IM_END, EOS)

    def start(self, system: str | None = None) -> list[int]:
        return self.turn("system", system) if system else []

    def turn(self, role: str, content: str) -> list[int]:
        return self.tok.encode(f"<|im_start|>{role}\n{content}<|im_end|>\n")

    def open_turn(self, role: str) -> list[int]:
        return self.tok.encode(f"<|im_start|>{role}\n")

    def close_turn(self) -> list[int]:
        return self.tok.encode("<|im_end|>\n")


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
        tok: ByteTokenizer,
        policy: Callable[[FakeSession], str | list[int]],
        num_slots: int = 64,
        max_seq_len: int = 1_000_000,
        end_id: int = IM_END,
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
