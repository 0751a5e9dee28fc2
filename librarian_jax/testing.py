"""Test doubles shipped with the library (as gemma ships `gm.testing`): the library's real parts with the
smallest stand-ins, one module.

- `ByteTokenizer`: a real `tokenizers.Tokenizer` (the same atomic-token splitting and decoding) whose plain
  text is UTF-8 bytes (ids 0..255) and whose special tokens are single ids from 256: every chat style's turn
  markers, the tool-call and tool-response tags, BOS and EOS. It needs no tokenizer file.
- `chat_template(tokenizer=None, style="chatml", **kw)`: the real `tokenizers.chat_template` over it (ChatML,
  Qwen3.5 with its thinking switch, Gemma with or without the system fold, Llama 3), so a test runs exactly
  the templates a run uses, not a re-implementation.
- `tiny_config(**overrides)` / `tiny_model(config=None, *, seed=0, scale=1.0, **overrides)`: the smallest
  real model (`models.Transformer`, one full-attention layer of 32) built the way a run builds one
  (`models.init_model`, one compiled program); `scale` multiplies every matrix so greedy decisions are well
  separated (random weights near initialisation give near-uniform logits).
- `returned(gen)`: what an agent generator that needs no engine (the scripted navigator, a model-free
  executor) returns; an AssertionError if it asks for one.
- `ScriptedEngine` / `FakeSession`: the real engine's session API answering each turn with text from a
  policy function (below). The embedded world's demonstration builders (`warm_start.demos`) run through it,
  so their transcripts are exactly what the tool protocol produces, and unit tests use it to script exact
  actions.

The unit tests of agents, rollout, SFT and the navigator use them; so can a user's own tests of a protocol
change. Training and evaluation of models always use `librarian_jax.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from librarian_jax import models
from librarian_jax.engine import slots as slot_programs
from librarian_jax.engine.session import TokenRecord
from librarian_jax.tokenizers import ChatTemplate
from librarian_jax.tokenizers import chat_template as real_chat_template
from librarian_jax.tokenizers.tokenizer import Tokenizer

# ids 256.. in this order (the first five keep the ids tests have always seen: <|im_end|> 257, <eos> 260)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<eos>", "<tool_response>",
            "</tool_response>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<think>", "</think>"]
IM_END = 256 + SPECIALS.index("<|im_end|>")
EOS = 256 + SPECIALS.index("<eos>")
BOS = 256 + SPECIALS.index("<bos>")


class ByteTokenizer(Tokenizer):
    """Bytes are ids 0..255; the chat markers, tool tags, BOS and EOS are single ids from 256 (`SPECIALS`)."""

    def __init__(self) -> None:
        super().__init__("byte-tokenizer (librarian_jax.testing)",
                         atomic={s: 256 + i for i, s in enumerate(SPECIALS)},
                         special_ids=(BOS, EOS), bos_id=BOS, eos_id=EOS, pad_id=None, unk_id=None,
                         add_bos=False)

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIALS)

    def _encode_plain(self, segments: list[str]) -> list[list[int]]:
        return [list(s.encode("utf-8")) for s in segments]

    def _decode_plain(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in SPECIALS:
            return 256 + SPECIALS.index(token)
        b = token.encode("utf-8")
        return b[0] if len(b) == 1 else None

    def id_to_token(self, token_id: int) -> str:
        i = int(token_id)
        if 0 <= i < 256:
            return bytes([i]).decode("latin-1")
        if 256 <= i < self.vocab_size:
            return SPECIALS[i - 256]
        raise IndexError(f"token id {i} is outside [0, {self.vocab_size}) of {self.path}")

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (type(self), ())


def chat_template(tokenizer: Tokenizer | None = None, style: str = "chatml", **kw: Any) -> ChatTemplate:
    """The real chat template of `style` (`tokenizers.chat_template`, keywords as there: `fold_system`,
    `thinking`, `add_bos`) over `tokenizer` (default a new `ByteTokenizer`)."""
    return real_chat_template(tokenizer or ByteTokenizer(), style, **kw)


TINY = dict(vocab_size=64, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
            head_dim=16, layer_types=("full_attention",))


def tiny_config(**overrides: Any) -> models.ModelConfig:
    """The `tiny` preset cut to one full-attention layer of 32 (`TINY`), with field overrides (e.g.
    `vocab_size=`, `num_layers=2, layer_types=("full_attention",) * 2`, `dtype="float32"`)."""
    return models.get_preset("tiny", **{**TINY, **overrides})


def tiny_model(config: models.ModelConfig | None = None, *, seed: int = 0, scale: float = 1.0,
               **overrides: Any) -> models.Transformer:
    """A random-weight `models.Transformer` of `config` (default `tiny_config(**overrides)`), initialised
    from `seed` by `models.init_model`; every parameter of two or more dimensions multiplied by `scale`."""
    if config is None:
        config = tiny_config(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    model = models.init_model(config, seed=seed)
    if scale != 1.0:
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params))
    return model


def returned(gen: Any) -> Any:
    """Drives an agent generator that needs no engine (the scripted navigator, a model-free executor) to its
    return value; an AssertionError if it yields (asks for an engine)."""
    try:
        request = next(gen)
    except StopIteration as stop:
        return stop.value
    raise AssertionError(f"the generator asked for an engine: {request!r}")


# ------------------------------------------------------------------------------------------- scripted engine


@dataclasses.dataclass
class Result:
    session: FakeSession
    tokens: list[int]
    logprobs: np.ndarray
    status: str


class FakeSession(TokenRecord):
    """A session of the scripted engine: the engine's token record (`engine.session.TokenRecord`, so agents
    read the same record either way) plus a turn counter."""

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
    """Answers every turn with `policy(session) -> str | list[int]`: text is encoded with the engine's
    tokenizer and ends with `end_id` (default: `ByteTokenizer`'s `<|im_end|>`); ids are used as they are.
    Sampled ids get log-prob -0.5 and the tag their turn was submitted with. Works with any tokenizer (the
    byte tokenizer or a real one); records the batch size of every `step()`."""

    def __init__(
        self,
        tok: Any,
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

    def _turn(self, s: FakeSession, max_new: int, stops: tuple[int, ...]) -> tuple[list[int], str]:
        """The policy's reply cut where the real engine would end the turn, by the engine's own rules
        (`engine.slots.admission_status`, `engine.slots.finish_reason`); a reply that runs out first ends
        as "length" (the policy stopped writing)."""
        ends = slot_programs.admission_status(len(s), max_new, self.max_seq_len)
        if ends is not None:
            return [], ends
        reply = self.policy(s)
        ids = list(reply) if isinstance(reply, list) else self.tok.encode(reply) + [self.end_id]
        for k, t in enumerate(ids, start=1):
            reason = int(slot_programs.finish_reason(t in stops, k, max_new, len(s) + k - 1, self.max_seq_len,
                                                     where=np.where))
            if reason != slot_programs.RUNNING:
                return ids[:k], slot_programs.REASONS[reason]
        return ids, "length"

    def step(self) -> list[Result]:
        batch, self.queue = self.queue[: self.num_slots], self.queue[self.num_slots :]
        self.batch_sizes.append(len(batch))
        out = []
        for s, max_new, stops, tag in batch:
            ids, status = self._turn(s, max_new, stops)
            s.extend(ids, [-0.5] * len(ids), tag=tag)
            s.turns += 1
            s.inflight = False
            out.append(Result(s, ids, np.full(len(ids), -0.5, np.float32), status))
        return out
