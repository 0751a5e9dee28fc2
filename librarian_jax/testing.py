"""Test doubles shipped with the library (as gemma ships `gm.testing`): a byte-level ChatML tokenizer and chat
template that need no tokenizer file, and the library's scripted engine
(`librarian_jax.rollout.scripted.ScriptedEngine`) ending turns with its end-of-turn id by default. The unit
tests of agents, rollout, SFT and the navigator use them; so can a user's own tests of a protocol change.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from librarian_jax.rollout import scripted

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


FakeSession = scripted.FakeSession


class ScriptedEngine(scripted.ScriptedEngine):
    """The library's scripted engine over the byte tokenizer, ending each scripted reply with `<|im_end|>`."""

    def __init__(self, tok: ByteTokenizer, policy: Callable[[FakeSession], str | list[int]],
                 num_slots: int = 64, max_seq_len: int = 1_000_000, end_id: int = IM_END):
        super().__init__(tok, policy, num_slots, max_seq_len, end_id)
