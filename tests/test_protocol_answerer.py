"""Issue 12, the answerer's protocol: it starts with the README and every root-level file in context; answer
records carry the files opened and tokens read; greedy repeats are never paid R times; the cost-aware
utility of the paper's section 2.3; every frozen role asks for its own engine."""

from __future__ import annotations

import pytest

from librarian_jax.agents.answerer import AnswererConfig, answer_question
from librarian_jax.agents.judge import judge_answer
from librarian_jax.agents.protocol import format_call
from librarian_jax.agents.runtime import ANSWERER, EXECUTOR, JUDGE, POLICY, AgentContext
from librarian_jax.data.schema import Document, Question
from librarian_jax.rollout import RolloutConfig, Scheduler
from librarian_jax.rollout import rewards as R
from librarian_jax.rollout.episode import evaluate
from librarian_jax.testing import ByteTokenizer, ScriptedEngine, chat_template
from librarian_jax.workspace import Workspace

TOK = ByteTokenizer()
TPL = chat_template(TOK)
DOCS = (Document("d1", "Paris is the capital of France.", title="France"),
        Document("d2", "The sky is blue.", title="Sky"))


def workspace() -> Workspace:
    ws = Workspace.from_documents(list(DOCS))
    raw = [d.path for d in ws.raw_docs]
    assert ws.create_file("Capital notes", [raw[0]], "ROOTFACT: the capital of France is Paris.").ok
    return ws



def test_answerer_starts_with_root_files_and_records_what_it_read():
    ws = workspace()
    raw0 = ws.raw_docs[0].path

    def policy(s):
        if s.turns == 0:
            return format_call("read_file", {"path": raw0})
        return format_call("answer", {"text": "Paris"})

    eng = ScriptedEngine(TOK, policy)
    ctx = AgentContext(TOK, TPL, {ANSWERER: eng})
    gen = answer_question(ctx, ws, "Capital?", AnswererConfig(max_turns=4))
    (out,) = Scheduler({ANSWERER: eng}).run([gen])
    first_prompt = eng.sessions[0].text()
    assert "ROOTFACT: the capital of France is Paris." in first_prompt  # a root file, in context
    assert out.files_preloaded == ["cluster_0001__capital_notes.txt"]
    assert out.files_read == [raw0]
    rec = out.record()
    assert rec["files_opened"] == ["cluster_0001__capital_notes.txt", raw0] and rec["num_files_opened"] == 2
    assert rec["tokens_read"] == out.prompt_tokens > 0


def test_preload_respects_the_budget_and_names_what_did_not_fit():
    ws = workspace()
    eng = ScriptedEngine(TOK, lambda s: format_call("answer", {"text": "x"}))
    ctx = AgentContext(TOK, TPL, {ANSWERER: eng})
    cfg = AnswererConfig(max_turns=2, preload_max_tokens=10)
    (out,) = Scheduler({ANSWERER: eng}).run([answer_question(ctx, ws, "Q?", cfg)])
    assert out.files_preloaded == []
    text = eng.sessions[0].text()
    assert "ROOTFACT" not in text and "not shown here" in text and "cluster_0001__capital_notes.txt" in text


def run_eval(config: RolloutConfig, repeats: int):
    ws = workspace()
    eng = ScriptedEngine(TOK, lambda s: format_call("answer", {"text": "Paris"}))
    ctx = AgentContext(TOK, TPL, {ANSWERER: eng, JUDGE: eng})
    q = Question("q1", "Capital?", "Paris")
    (out,) = Scheduler({ANSWERER: eng}).run([evaluate(ctx, ws, [q], repeats, "final", config)])
    return out, eng


def test_greedy_repeats_run_once_sampled_repeats_run_r_times():
    cfg = RolloutConfig(answerer=AnswererConfig(max_turns=2), use_model_judge=False)
    (score, answers), eng = run_eval(cfg, 4)
    assert score == 1.0 and len(answers) == 4 and len(eng.sessions) == 1  # one greedy run, counted 4 times
    assert sum(a["tokens_read"] for a in answers) == answers[0]["tokens_read"] > 0
    cfg = RolloutConfig(answerer=AnswererConfig(max_turns=2), use_model_judge=False, repeat_mode="sample",
                        repeat_temperature=0.8)
    (score, answers), eng = run_eval(cfg, 4)
    assert len(eng.sessions) == 4 and {s.temperature for s in eng.samplings} == {0.8}
    assert {a["temperature"] for a in answers} == {0.8}
    with pytest.raises(ValueError, match="repeat_temperature"):
        RolloutConfig(repeat_mode="sample", repeat_temperature=0.0)


def test_cost_aware_utility_charges_correct_answers_only():
    cfg = RolloutConfig(answerer=AnswererConfig(max_turns=2), use_model_judge=False, token_cost=1e-4,
                        read_cost=0.01)
    (score, answers), _ = run_eval(cfg, 1)
    a = answers[0]
    assert a["correct"] == 1.0
    assert score == pytest.approx(1.0 - 1e-4 * a["tokens_read"] - 0.01 * a["num_files_opened"])
    assert R.answer_utility(0.0, 10_000, 30, cfg) == 0.0  # a wrong answer is not charged
    assert R.edit_penalty(3, RolloutConfig(edit_cost=0.02)) == pytest.approx(0.06)
    assert RolloutConfig().token_cost == RolloutConfig().read_cost == RolloutConfig().edit_cost == 0.0


def test_each_frozen_role_uses_its_own_engine():
    ws = workspace()
    answerer = ScriptedEngine(TOK, lambda s: format_call("answer", {"text": "Lutetia"}))
    judge = ScriptedEngine(TOK, lambda s: '{"correct": 1}')
    engines = {POLICY: ScriptedEngine(TOK, lambda s: ""), ANSWERER: answerer, JUDGE: judge,
               EXECUTOR: ScriptedEngine(TOK, lambda s: "")}
    ctx = AgentContext(TOK, TPL, engines)

    def both():
        out = yield from answer_question(ctx, ws, "Capital?", AnswererConfig(max_turns=2))
        verdict = yield from judge_answer(ctx, "Capital?", out.answer, ["Paris"], use_model_judge=True)
        return out.answer, verdict

    ((answer, verdict),) = Scheduler(engines).run([both()])
    assert answer == "Lutetia" and verdict == 1.0
    assert len(answerer.sessions) == 1 and len(judge.sessions) == 1  # the judge never grades on the answerer
