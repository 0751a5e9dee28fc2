"""How agent code talks to engines: generators that yield requests, and exact per-session token logs.

Every agent episode (builder, answerer, executor write, model judge) is a Python generator. It creates its
engine sessions directly (`ctx.new_session(role, prompt_ids)`: host-only, no device work), appends observation
ids directly (`log.append(ids)`), and *yields* the two things that need the scheduler:

- `Generate(role, session, max_new_tokens, sampling, stop_ids)`: submit one turn; the generator is resumed
  with the engine's `TurnResult` (`tokens, logprobs, status`) once the turn finished.
- `Parallel(generators)`: run sub-episodes concurrently (several executor writes of one builder turn, the
  R x Q answerer runs of a probe); resumed with the list of their return values, in order.

`rollout.scheduler` drives many such generators over the engines at once, so every live session of a batch
shares the engines' decode loops. A test double engine with the same session API can stand in for unit tests;
the real path always uses `librarian_jax.engine.Engine`.

`SessionLog` keeps, next to the engine's own record, which turn produced each token, so a training
`Segment` (tokens, sampler log-probs, loss mask, turn index) comes out exactly as the sampler saw and produced
it; at the end it is checked against the engine's `session.record()` when the engine offers one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

POLICY = "policy"  # the engine of the trained builder
FROZEN = "frozen"  # the default engine of every frozen role (and the name older callers pass)
# The frozen roles, one model each in the paper (answerer, Create/Merge executor, history compaction, judge).
# An agent asks for its role; `engine_for_role` falls back to FROZEN, then to POLICY, so `{"policy": e,
# "frozen": f}` still serves every role, and one engine object may serve several roles.
ANSWERER = "answerer"
EXECUTOR = "executor"
COMPACTION = "compaction"
JUDGE = "judge"
FROZEN_ROLES = (ANSWERER, EXECUTOR, COMPACTION, JUDGE)
ROLES = (POLICY, *FROZEN_ROLES)


def engine_for_role(engines: Mapping[str, Any], role: str) -> Any:
    """The engine serving `role`: its own entry, else (a frozen role) the "frozen" one, else the policy's."""
    if role in engines:
        return engines[role]
    if role in FROZEN_ROLES:
        for fallback in (FROZEN, POLICY):
            if fallback in engines:
                return engines[fallback]
    raise KeyError(f"no engine for role {role!r}; engines: {sorted(engines)}")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling settings of one turn (converted to the engine's own type by the scheduler)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclasses.dataclass
class Generate:
    """A request to generate one turn in `session` on the engine named `role`."""

    role: str
    session: Any
    max_new_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...]


@dataclasses.dataclass
class Parallel:
    """Run these generators concurrently; the yielding generator receives their return values in order."""

    generators: list[Generator]


AgentGen = Generator[Any, Any, Any]


@dataclasses.dataclass
class AgentContext:
    """What every agent generator needs: tokenizer, chat template, engines by role, a seed stream.

    `templates` optionally maps a role to its own chat template (e.g. Qwen3.5 with thinking off for the
    answerer, executor and judge, on for the builder); `template_for(role)` falls back to `template`.
    """

    tokenizer: Any
    template: Any
    engines: Mapping[str, Any]
    rng: np.random.Generator = dataclasses.field(default_factory=lambda: np.random.default_rng(0))
    templates: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def new_session(self, role: str, prompt_ids: Sequence[int]) -> Any:
        return engine_for_role(self.engines, role).new_session(list(prompt_ids))

    def template_for(self, role: str) -> Any:
        return self.templates.get(role, self.template)

    def next_seed(self) -> int:
        return int(self.rng.integers(0, 2**31 - 1))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode_new(self, ids: Sequence[int]) -> str:
        """Decodes newly generated ids for parsing, dropping stop ids and ids outside the tokenizer's
        vocabulary (a model's embedding table may be larger); never raises. The ids stay as sampled."""
        stops = set(self.template.stop_ids)
        vocab = getattr(self.tokenizer, "vocab_size", None)
        keep = [int(t) for t in ids if int(t) not in stops and (vocab is None or 0 <= int(t) < vocab)]
        try:
            return self.tokenizer.decode(keep)
        except (
            ValueError,
            IndexError,
            TypeError,
            UnicodeDecodeError,
        ):  # a model id the tokenizer cannot decode
            parts = []
            for t in keep:
                try:
                    parts.append(self.tokenizer.decode([t]))
                except (ValueError, IndexError, TypeError, UnicodeDecodeError):
                    parts.append("\ufffd")
            return "".join(parts)


@dataclasses.dataclass
class Segment:
    """One training row's worth of one session (see rollout.records for the contract)."""

    tokens: np.ndarray  # int32 [L]
    logprobs: np.ndarray  # float32 [L]; 0 on non-sampled tokens
    loss_mask: np.ndarray  # float32 [L]; 1 exactly on sampled tokens
    turn_index: np.ndarray  # int32 [L]; builder turn that produced the token, -1 for prompt/observation


class SessionLog:
    """An engine session plus an exact log of its tokens: prompt, sampled turns, appended observations."""

    def __init__(self, ctx: AgentContext, role: str, prompt_ids: Sequence[int]):
        self.ctx = ctx
        self.role = role
        self.session = ctx.new_session(role, prompt_ids)
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.logprobs: list[float] = [0.0] * len(self.tokens)
        self.mask: list[float] = [0.0] * len(self.tokens)
        self.turn_index: list[int] = [-1] * len(self.tokens)
        self.num_prompt = len(self.tokens)
        self.closed = False

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return int(sum(self.mask))

    @property
    def num_observed(self) -> int:
        return len(self.tokens) - self.num_generated

    def append(self, ids: Sequence[int]) -> None:
        ids = [int(t) for t in ids]
        if not ids:
            return
        self.session.append(ids)
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0.0] * len(ids)
        self.turn_index += [-1] * len(ids)

    def generate(
        self, max_new_tokens: int, sampling: Sampling, turn: int = -1
    ) -> Generator[Generate, Any, Any]:
        """Yields one `Generate`; logs and returns the engine's TurnResult."""
        stops = tuple(self.ctx.template_for(self.role).stop_ids)
        result = yield Generate(self.role, self.session, int(max_new_tokens), sampling, stops)
        toks = [int(t) for t in result.tokens]
        lps = [float(x) for x in result.logprobs]
        if len(toks) != len(lps):
            raise RuntimeError(f"engine returned {len(toks)} tokens but {len(lps)} logprobs")
        self.tokens += toks
        self.logprobs += lps
        self.mask += [1.0] * len(toks)
        self.turn_index += [turn] * len(toks)
        return result

    def close_turn_ids(self, generated: Sequence[int]) -> list[int]:
        """The ids that close an assistant turn after `generated` (the rest of close_turn after a sampled
        stop id; all of it when the turn ended on its budget)."""
        close = list(self.ctx.template_for(self.role).close_turn())
        if generated and close and int(generated[-1]) == close[0]:
            return close[1:]
        return close

    def segment(self, check: bool = True) -> Segment:
        """The session as a training segment; cross-checked against `session.record()` when available."""
        seg = Segment(
            np.asarray(self.tokens, np.int32),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.mask, np.float32),
            np.asarray(self.turn_index, np.int32),
        )
        record = getattr(self.session, "record", None)
        if check and record is not None:
            rec = record()
            rt = np.asarray(rec.tokens, np.int32)
            if rt.shape != seg.tokens.shape or not np.array_equal(rt, seg.tokens):
                raise RuntimeError(
                    f"session record ({rt.shape[0]} tokens) differs from the agent's log "
                    f"({seg.tokens.shape[0]} tokens); first mismatch at "
                    f"{_first_mismatch(rt, seg.tokens)}"
                )
            rm = np.asarray(rec.loss_mask, np.float32)
            if not np.array_equal(rm, seg.loss_mask):
                raise RuntimeError(
                    f"session loss_mask differs from the agent's log at {_first_mismatch(rm, seg.loss_mask)}"
                )
            seg.logprobs = np.where(seg.loss_mask > 0, np.asarray(rec.logprobs, np.float32), 0.0).astype(
                np.float32
            )
        return seg

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            close = getattr(self.session, "close", None)
            if close is not None:
                try:
                    close()
                except RuntimeError as e:  # only when unwinding after another error (a turn still in flight)
                    logging.warning("could not close a %s session: %s", self.role, e)


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n
