"""How agent code talks to engines: generators that yield requests, and exact per-session token logs.

Every agent episode (builder, answerer, executor write, model judge) is a Python generator. It creates its
engine sessions directly (`ctx.new_session(role, prompt_ids)`: host-only, no device work), appends observation
ids directly (`log.append(ids)`), and *yields* the two things that need the scheduler:

- `Generate(role, session, max_new_tokens, sampling, stop_ids, tag)`: submit one turn (its sampled ids enter
  the session's record tagged `tag`); the generator is resumed with the engine's `TurnResult` (`tokens,
  logprobs, status`) once the turn finished.
- `Parallel(generators)`: run sub-episodes concurrently (several executor writes of one builder turn, the
  R x Q answerer runs of a probe); resumed with the list of their return values, in order.

`rollout.scheduler` drives many such generators over the engines at once, so every live session of a batch
shares the engines' decode loops. A test double engine with the same session API can stand in for unit tests;
the real path always uses `librarian_jax.engine.Engine`.

`SessionLog` is an agent's handle on one engine session. It keeps no copy of the tokens: the session's record
(`engine.session.TokenRecord`: ids, sampler log-probs, loss mask, a turn index per token) is the only one, the
builder's turn index rides in as the tag of each sampled id, and a training `Segment` is that record as it
stands (`session.record()` is a `Segment`, checked as a builder's by `Segment.for_training`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from librarian_jax.engine.sampling import SamplingParams
from librarian_jax.segment import Segment

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


class Role(enum.StrEnum):
    """A role of the protocol. Its value is the key an agent asks the engines for (`engine_for_role`), so a
    mapping keyed by roles serves agents as it is; the builder is the policy (one role, two words: the
    protocol calls it "builder", `protocol_name`)."""

    BUILDER = POLICY
    ANSWERER = ANSWERER
    EXECUTOR = EXECUTOR
    COMPACTION = COMPACTION
    JUDGE = JUDGE

    @property
    def protocol_name(self) -> str:
        """The role's name in `protocol.json` and the role tables."""
        return "builder" if self is Role.BUILDER else self.value

    @property
    def frozen(self) -> bool:
        return self is not Role.BUILDER


def engine_for_role(engines: Mapping[str, Any], role: str) -> Any:
    """The engine serving `role`: its own entry, else (a frozen role) the "frozen" one, else the policy's."""
    if role in engines:
        return engines[role]
    if role in FROZEN_ROLES:
        for fallback in (FROZEN, POLICY):
            if fallback in engines:
                return engines[fallback]
    raise KeyError(f"no engine for role {role!r}; engines: {sorted(engines)}")


# One turn's sampling settings: the engine's own type (temperature, top_p, top_k, seed; checked when made),
# so a request goes to the engine as it is.
Sampling = SamplingParams


@dataclasses.dataclass
class Generate:
    """A request to generate one turn in `session` on the engine named `role`."""

    role: str
    session: Any
    max_new_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...]
    tag: int = -1  # written with each sampled id into the session's record (the builder's turn index)


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


class SessionLog:
    """An agent's handle on one engine session, whose record is the only copy of its tokens."""

    def __init__(self, ctx: AgentContext, role: str, prompt_ids: Sequence[int]):
        self.ctx = ctx
        self.role = role
        self.session = ctx.new_session(role, prompt_ids)
        self.num_prompt = len(self.session)
        self.closed = False

    def __len__(self) -> int:
        return len(self.session)

    @property
    def tokens(self) -> list[int]:
        """A copy of the session's ids."""
        return self.session.tokens

    @property
    def num_generated(self) -> int:
        return self.session.num_sampled

    @property
    def num_observed(self) -> int:
        return len(self.session) - self.session.num_sampled

    def append(self, ids: Sequence[int]) -> None:
        ids = [int(t) for t in ids]
        if ids:
            self.session.append(ids)

    def generate(
        self, max_new_tokens: int, sampling: Sampling, turn: int = -1
    ) -> Generator[Generate, Any, Any]:
        """Yields one `Generate` whose sampled ids are tagged `turn`; returns the engine's TurnResult."""
        stops = tuple(self.ctx.template_for(self.role).stop_ids)
        result = yield Generate(self.role, self.session, int(max_new_tokens), sampling, stops, int(turn))
        if len(result.tokens) != len(result.logprobs):
            raise RuntimeError(
                f"engine returned {len(result.tokens)} tokens but {len(result.logprobs)} logprobs"
            )
        return result

    def close_turn_ids(self, generated: Sequence[int]) -> list[int]:
        """The ids that close an assistant turn after `generated` (the rest of close_turn after a sampled
        stop id; all of it when the turn ended on its budget)."""
        close = list(self.ctx.template_for(self.role).close_turn())
        if generated and close and int(generated[-1]) == close[0]:
            return close[1:]
        return close

    def segment(self) -> Segment:
        """A builder session's record as a training segment (turn index = the tag of each sampled id); a
        sampled id without a turn raises ValueError (`Segment.for_training`)."""
        return self.session.record().for_training()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.session.close()
            except RuntimeError as e:  # only when unwinding after another error (a turn still in flight)
                logging.warning("could not close a %s session: %s", self.role, e)
