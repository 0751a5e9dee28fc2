"""Supervised fine-tuning (SFT) on chat conversations: the warm start that teaches a model the tool protocol
before GRPO.

    python -m librarian_jax.main --config=configs/sft.py --config.data.path=convs.jsonl --config.workdir=DIR

Data: JSONL, one conversation per line: `{"messages": [{"role": "system"|"user"|"assistant"|"tool",
"content": "..."}, ...]}` ("tool": a tool-response turn, for templates that have one; other keys are kept
aside, e.g. a demonstration's style). Token in, token out: each message is
encoded on its own with the run's chat template (`start(system)`, `turn(role, content)`), exactly the ids the
builder's session holds at rollout time, and the loss covers only assistant tokens: each reply's content ids
and its end-of-turn id (the id the sampler must produce to end the turn), never the prompt, observations or
template headers. A conversation longer than `train.max_row_len` is cut there (its loss tokens beyond it are
dropped, counted in the log).

Rows: `data.packing = "none"` gives one conversation per row; `"concat"` packs several conversations into
one row of `max_row_len` tokens (first fit in data order). The model has no per-segment attention mask, so a
packed conversation attends to the ones before it in its row (the common "naive" packing); use it for short
conversations, where it saves most padding.

Training (`librarian_jax.warm_start.sft`): the GRPO trainer (`rl.Trainer`: the same sharded, micro-batched jit
update, optax schedule) with the `nll` loss, and the same Orbax checkpoints (`workdir/checkpoints`: params,
optimizer state, step, RNG and the data position), so a killed run resumes, and the result is a valid
`model.init = "orbax"` for GRPO.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
PACKING = ("none", "concat")


class ConversationError(ValueError):
    """A malformed conversation file; the message names the file and line."""


@dataclasses.dataclass
class Example:
    """One encoded conversation: ids `[L]` and its loss mask `[L]` (1 on assistant content + end-of-turn)."""

    tokens: np.ndarray
    loss_mask: np.ndarray


def load_conversations(path: str) -> list[dict[str, Any]]:
    """The conversations of a JSONL file; a malformed line raises `ConversationError` naming file and line."""
    out = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ConversationError(f"{path}: cannot read conversations ({e.strerror})") from None
    with f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ConversationError(f"{path}:{i}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise ConversationError(f"{path}:{i}: not a JSON object ({type(e).__name__})") from None
            msgs = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(msgs, list) or not msgs:
                raise ConversationError(f"{path}:{i}: needs a non-empty 'messages' list")
            for j, m in enumerate(msgs):
                ok = isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                if not ok:
                    raise ConversationError(
                        f"{path}:{i}: messages[{j}] must be {{'role': one of {list(ROLES)}, 'content': str}}")
                if m["role"] == "system" and j != 0:
                    raise ConversationError(f"{path}:{i}: messages[{j}]: a system message must come first")
            if not any(m["role"] == "assistant" for m in msgs):
                raise ConversationError(f"{path}:{i}: no assistant message (nothing to learn from)")
            out.append(obj)
    if not out:
        raise ConversationError(f"{path}: no conversations")
    return out


def encode_conversation(messages: Sequence[Mapping[str, str]], template: Any, tokenizer: Any) -> Example:
    """Token ids and loss mask of one conversation, built turn by turn with the chat template."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    tokens: list[int] = list(template.start(system))
    mask: list[float] = [0.0] * len(tokens)
    close = list(template.close_turn())
    rest = messages[1 if system is not None else 0:]
    for i, m in enumerate(rest):
        if m["role"] == "assistant":
            head = list(template.open_turn("assistant"))
            body = list(tokenizer.encode(m["content"])) + close[:1]
            # the rest of the turn's closing ids follows only when another turn comes (as in a session)
            tail = close[1:] if i + 1 < len(rest) else []
            tokens += head + body + tail
            mask += [0.0] * len(head) + [1.0] * len(body) + [0.0] * len(tail)
        else:
            ids = list(template.turn(m["role"], m["content"]))
            tokens += ids
            mask += [0.0] * len(ids)
    return Example(np.asarray(tokens, np.int32), np.asarray(mask, np.float32))


def make_rows(examples: Sequence[Example], max_row_len: int, packing: str = "none",
              multiple: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Rows `(tokens [R, S] int32, valid [R, S] bool, loss_mask [R, S] float32)` and counts.

    Each example is cut to `max_row_len`; `S` is the longest row rounded up to `multiple` (at most
    `max_row_len`). `packing="concat"` fills each row with consecutive examples while they fit.
    """
    if packing not in PACKING:
        raise ValueError(f"sft packing must be one of {PACKING}, got {packing!r}")
    cut_tokens = 0
    rows: list[list[Example]] = []
    used = 0
    for ex in examples:
        if len(ex.tokens) > max_row_len:
            cut_tokens += int(ex.loss_mask[max_row_len:].sum())
            ex = Example(ex.tokens[:max_row_len], ex.loss_mask[:max_row_len])
        if packing == "concat" and rows and used + len(ex.tokens) <= max_row_len:
            rows[-1].append(ex)
            used += len(ex.tokens)
        else:
            rows.append([ex])
            used = len(ex.tokens)
    longest = max(sum(len(e.tokens) for e in r) for r in rows)
    seq = min(max_row_len, -(-longest // multiple) * multiple)
    tokens = np.zeros((len(rows), seq), np.int32)
    valid = np.zeros((len(rows), seq), bool)
    mask = np.zeros((len(rows), seq), np.float32)
    for i, r in enumerate(rows):
        t = np.concatenate([e.tokens for e in r])
        m = np.concatenate([e.loss_mask for e in r])
        tokens[i, : len(t)], valid[i, : len(t)], mask[i, : len(t)] = t, True, m
    return tokens, valid, mask, {"rows": len(rows), "cut_loss_tokens": cut_tokens,
                                 "loss_tokens": int(mask.sum())}


class RowStream:
    """Batches of row indices over epochs, reshuffled per epoch with a seed; its state is `(epoch, pos)`, so a
    resumed run continues with the next batch it would have drawn.

    `group > 0` (with `lengths [num_rows]`) groups rows of similar length: each epoch's shuffled order is cut
    into windows of `group` batches, each window sorted by length and cut into batches, and the batches of the
    epoch shuffled again, so a batch padded to its own longest row (`batch_seq`) carries little padding while
    every row is still seen once an epoch in a random batch order.
    """

    def __init__(self, num_rows: int, batch_rows: int, seed: int, lengths: np.ndarray | None = None,
                 group: int = 0):
        if group and (lengths is None or len(lengths) != num_rows):
            raise ValueError(f"RowStream: group={group} needs lengths of all {num_rows} rows")
        self.n, self.b, self.seed = num_rows, batch_rows, seed
        self.lengths, self.group = lengths, group
        self.epoch, self.pos = 0, 0

    def _order(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(self.n)
        if not self.group:
            return order
        window = self.b * self.group
        batches: list[np.ndarray] = []
        for w in range(0, self.n, window):
            chunk = order[w : w + window]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches += [chunk[i : i + self.b] for i in range(0, len(chunk), self.b)]
        return np.concatenate([batches[i] for i in rng.permutation(len(batches))])

    def next(self) -> np.ndarray:
        out: list[int] = []
        while len(out) < self.b:
            order = self._order()
            take = order[self.pos : self.pos + self.b - len(out)]
            out += take.tolist()
            self.pos += len(take)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return np.asarray(out)

    def get_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def set_state(self, state: Mapping[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def batch_seq(valid: np.ndarray, multiple: int = 128) -> int:
    """Columns a batch of rows `valid [R, S]` needs: its longest row rounded up to `multiple`, at most `S`
    (few distinct lengths, so few compiled shapes)."""
    longest = int(valid.sum(axis=1).max()) if valid.size else 0
    return min(valid.shape[1], max(multiple, -(-longest // multiple) * multiple))


def batch_arrays(tokens: np.ndarray, valid: np.ndarray, loss_mask: np.ndarray) -> dict[str, np.ndarray]:
    """A trainer batch (`rl.Trainer.update`) for the `nll` loss from rows `[R, S]`."""
    zeros = np.zeros(loss_mask.shape, np.float32)
    return {"tokens": tokens, "valid": valid, "loss_mask": loss_mask, "sampler_logprobs": zeros,
            "advantages": zeros, "row_weights": np.ones(tokens.shape[0], np.float32)}
