"""Grading answers: SQuAD-style normalised exact match, then optionally a frozen model judge.

`normalize_answer` lowercases, removes punctuation, removes the articles a/an/the and folds whitespace (the
SQuAD v1.1 evaluation script's normalisation). `exact_match(pred, answers)` is True when the normalised
prediction equals any normalised gold answer or alias.

The model judge (off unless `use_model_judge`) runs only when exact match fails: the frozen engine reads the
question, gold answers and prediction (prompt `prompts/judge.txt`) and replies `{"correct": 0|1}`; anything
unparseable counts as 0. It is a generator for the rollout scheduler, so judge calls of a probe are batched.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

from librarian_jax.agents import prompt_text as prompts
from librarian_jax.agents.runtime import JUDGE, AgentContext, AgentGen, Sampling, SessionLog

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_VERDICT = re.compile(r'"?correct"?\s*:\s*"?([01])')


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation and articles, fold whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    """Normalised exact match against any of `answers` (gold + aliases). An empty prediction never matches."""
    pred = normalize_answer(prediction or "")
    if not pred:
        return False
    return any(pred == normalize_answer(a) for a in answers if normalize_answer(a))


def parse_verdict(text: str) -> int:
    """`{"correct": 1}` -> 1; `{"correct": 0}` or anything unparseable -> 0."""
    m = _VERDICT.search(text or "")
    return int(m.group(1)) if m else 0


def judge_answer(
    ctx: AgentContext | None,
    question: str,
    prediction: str,
    answers: Sequence[str],
    *,
    use_model_judge: bool = False,
    max_new_tokens: int = 32,
) -> AgentGen:
    """Generator: returns 1.0 for a correct prediction, else 0.0. Exact match first, then the model judge."""
    if exact_match(prediction, answers):
        return 1.0
    if not use_model_judge or ctx is None or not normalize_answer(prediction or ""):
        return 0.0
    text = prompts.render("judge", question=question, gold=" | ".join(answers), prediction=prediction)
    tpl = ctx.template_for(JUDGE)
    log = SessionLog(ctx, JUDGE, tpl.start() + tpl.turn("user", text) + tpl.open_turn("assistant"))
    try:
        result = yield from log.generate(max_new_tokens, Sampling(temperature=0.0, seed=0))
        return float(parse_verdict(ctx.decode_new(result.tokens)))
    finally:
        log.close()
