"""Episodes with a scripted builder (test double engine), the real workspace and the extractive executor:
probes fire exactly on schedule, rewards equal hand-computed values, records are exact; fuzzed replies never
raise; compaction starts a new segment whose prompt is exactly what the model then saw."""

from __future__ import annotations

import dataclasses
import random
import re

import numpy as np
import pytest

from librarian_jax.agents.answerer import AnswererConfig, answer_question
from librarian_jax.agents.builder import BuilderConfig
from librarian_jax.agents.protocol import format_call
from librarian_jax.agents.runtime import FROZEN, POLICY, AgentContext
from librarian_jax.data.schema import CorpusTask, Document, Question
from librarian_jax.rollout import EpisodeRecord, RolloutConfig, Scheduler, read_jsonl, run_batch, write_jsonl
from librarian_jax.rollout.rewards import probe_reward, should_probe
from librarian_jax.rollout.scheduler import fit_to_engines
from librarian_jax.testing import IM_END, ByteTokenizer, ScriptedEngine, chat_template
from librarian_jax.workspace import Workspace

TOK = ByteTokenizer()
TPL = chat_template(TOK)
DOCS = (
    Document("d1", "Paris is the capital of France. It has many bridges.", title="France facts"),
    Document("d2", "The sky is blue on a clear day. Clouds are white.", title="Sky"),
)
TASK = CorpusTask(
    "t0",
    DOCS,
    questions=(
        Question("q1", "What is the capital of France?", "Paris"),
        Question("q2", "What colour is the sky?", "blue", aliases=("Blue",)),
    ),
)
RAW = [d.path for d in Workspace.from_documents(list(DOCS)).raw_docs]
# Which file title makes the scripted answerer answer each question correctly.
KEYS = {
    "What is the capital of France?": ("capital notes", "Paris"),
    "What colour is the sky?": ("colour notes", "blue"),
}

SCRIPT = [
    format_call("read_file", {"path": RAW[0]}),
    "Creating. " + format_call("create_file", {"title": "Capital notes", "input_paths": [RAW[0]]}),
    "hello",
    format_call("create_file", {"title": "Colour notes", "input_paths": [RAW[1]], "instructions": "sky"})
    + format_call("frobnicate", {}),
    format_call("create_file", {"title": "Extra", "input_paths": RAW}),
    format_call("stop"),
]


def builder_policy(script):
    def policy(s):
        return script[min(s.turns, len(script) - 1)]

    return policy


def answerer_policy(s):
    text = s.text()
    if "Source excerpts:" in text:
        return "EXECUTOR WROTE THIS."
    if "Predicted answer:" in text:
        return '{"correct": 1}' if "city of light" in text and "capital" in text else '{"correct": 0}'
    question = re.search(r"Question: (.*)", text).group(1).strip()
    key, gold = KEYS[question]
    if "<tool_response>" not in text:
        return format_call("list_files", {"path": "."})
    low = text.lower()
    return format_call(
        "answer", {"text": gold if (key in low or key.replace(" ", "_") in low) else "unknown"}
    )


def config(**kw):
    b = dict(max_turns=6, max_new_tokens=4096, executor="extractive", compaction="none")
    b.update(kw.pop("builder", {}))
    base = dict(
        builder=BuilderConfig(**b),
        answerer=AnswererConfig(max_turns=4),
        probe_repeats=2,
        probe_min_gap=2,
        max_probes=2,
        terminal_repeats=3,
        terminal_questions="hidden",
        use_model_judge=False,
        # sampled repeats, so every (question, repeat) run is made (the scripted engine is deterministic)
        repeat_mode="sample",
        repeat_temperature=0.7,
    )
    base.update(kw)
    return RolloutConfig(**base)


def run(cfg, script=SCRIPT, tasks=(TASK,), group=1, frozen_policy=answerer_policy, seed=0, policy_fn=None):
    policy = ScriptedEngine(TOK, policy_fn or builder_policy(script))
    frozen = ScriptedEngine(TOK, frozen_policy)
    recs = run_batch(list(tasks), group, {POLICY: policy, FROZEN: frozen}, TOK, cfg, seed, template=TPL)
    return recs, policy, frozen


def test_probes_fire_on_schedule_and_rewards_match_hand_computation():
    recs, policy, frozen = run(config())
    (r,) = recs
    r.check()
    assert r.num_turns == 6 and r.stopped
    assert r.replies == SCRIPT
    assert r.probe_turns == [1, 3]  # after the 2nd and 4th turns; the 5th write is 1 turn after, cap reached
    assert r.probe_scores == [0.5, 1.0]
    # turn 0: read; 1: probe 0 -> 0.5; 2: no call (-0.05); 3: probe 0.5 -> 1.0 and an unknown tool (-0.05)
    assert r.turn_rewards == pytest.approx([0.0, 0.5, -0.05, 0.45, 0.0, 0.0])
    assert r.terminal_reward == 1.0
    assert r.total_reward == pytest.approx(1.9)
    assert [e["code"] for e in r.tool_errors[2]] == ["no_tool_call"]
    assert [e["code"] for e in r.tool_errors[3]] == ["unknown_tool"]
    assert [c["name"] for c in r.tool_calls[1]] == ["create_file"] and r.tool_calls[1][0]["ok"]
    phases = [a["phase"] for a in r.answers]
    assert phases.count("probe_1") == 4 and phases.count("probe_3") == 4 and phases.count("final") == 6
    assert set(r.workspace_snapshots) == {"probe_1", "probe_3", "final"}
    assert (
        "text" not in r.workspace_snapshots["final"]["raw"][0]
    )  # raw texts are in the task, not each record
    snap = Workspace.from_dict(r.workspace_snapshots["probe_1"], docs=DOCS)
    assert [n.title for n in snap.active_nodes()] == ["Capital notes"]  # snapshot, not the live workspace
    assert len(Workspace.from_dict(r.workspace_snapshots["final"], docs=DOCS).active_nodes()) == 3
    # builder: every turn one engine session, sampled at temperature 1 with fresh seeds
    temps = {s.temperature for s in policy.samplings}
    assert temps == {1.0} and len({s.seed for s in policy.samplings}) == 6
    assert r.token_counts["answerer_runs"] == 14 and r.reading_tokens > 0 and r.construction_tokens > 0
    assert all(s.closed for s in policy.sessions + frozen.sessions)


def test_turn_limit_costs_the_no_stop_penalty_and_start_probe_sets_the_baseline():
    recs, _, _ = run(config(builder={"max_turns": 5}))
    (r,) = recs
    assert not r.stopped and r.num_turns == 5
    assert r.turn_rewards == pytest.approx([0.0, 0.5, -0.05, 0.45, -0.1])
    assert r.total_reward == pytest.approx(1.8)
    # with a start probe on a raw workspace (score 0) the deltas are unchanged; its answers are recorded
    recs, _, _ = run(config(probe_at_start=True, probe_threshold=0.6))
    (r,) = recs
    assert r.initial_score == 0.0 and "start" in r.workspace_snapshots
    assert r.turn_rewards == pytest.approx([0.0, 0.0, -0.05, -0.05, 0.0, 0.0])  # |0.5| < 0.6: zeroed


def test_schedule_and_reward_arithmetic():
    cfg = RolloutConfig()
    assert not should_probe(7, True, 0, 0, cfg) and should_probe(8, True, 0, 0, cfg)
    assert not should_probe(8, False, 0, 0, cfg)
    assert not should_probe(16, True, 9, 1, cfg) and should_probe(17, True, 9, 1, cfg)
    assert not should_probe(40, True, 24, 4, cfg)
    assert probe_reward(0.5, 0.3, cfg) == 0.0 and probe_reward(0.55, 0.3, cfg) == pytest.approx(0.25)
    assert probe_reward(0.0, 0.75, cfg) == pytest.approx(-0.75)
    assert probe_reward(1.0, 0.0, RolloutConfig(probe_scale=2.0)) == 2.0
    with pytest.raises(KeyError, match="builder.'colour'"):
        RolloutConfig.from_dict({"builder": {"colour": 1}})
    c = RolloutConfig.from_dict({"builder": {"max_turns": 3}, "probe_repeats": 1})
    assert c.builder.max_turns == 3 and c.probe_repeats == 1 and RolloutConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="terminal_questions"):
        RolloutConfig(terminal_questions="all")

    class Small:
        max_seq_len = 1000

    c = fit_to_engines(
        RolloutConfig(answerer=AnswererConfig(context_budget=800)), {POLICY: Small(), FROZEN: Small()}
    )
    assert c.builder.context_budget == 1000 and c.answerer.context_budget == 800
    engines = {POLICY: Small(), FROZEN: Small()}
    model = fit_to_engines(RolloutConfig(answerer=AnswererConfig(context_budget=3000)), engines)
    assert model.answerer.context_budget == 3000  # never lowered: an LLM answerer's is refused instead
    from librarian_jax import config_validation as cv
    from librarian_jax.agents.runtime import Role

    with pytest.raises(cv.ConfigError, match=r"config\.rollout\.answerer\.context_budget.*never clamped"):
        cv.check_budgets(model, {Role.BUILDER: 1000, Role.ANSWERER: 1000})
    # the scripted navigator runs on no engine: the budget it was given is the one it reads with
    scripted = AnswererConfig(kind="scripted", context_budget=3000)
    assert fit_to_engines(RolloutConfig(answerer=scripted), engines).answerer.context_budget == 3000
    unset = dataclasses.replace(scripted, context_budget=0)
    assert fit_to_engines(RolloutConfig(answerer=unset), engines).answerer.context_budget == 1000


def test_a_reward_over_hidden_and_reuse_questions_asks_both_and_evaluation_the_hidden_ones():
    """`terminal_questions="hidden+reuse"` (the noisy preset's denser reward): the terminal reward is the mean
    over the hidden and the reuse questions; evaluation's rollout config (`cluster.mode_rollout`) asks the
    hidden ones, as every report does."""
    from librarian_jax.cluster import Mode, mode_rollout
    from librarian_jax.rollout.jobs import questions_of

    def eval_config(c):
        return mode_rollout(c, Mode.EVAL)

    hidden, reuse = TASK.questions
    task = dataclasses.replace(TASK, questions=(hidden,), reuse_questions=(reuse,))
    script = [format_call("create_file", {"title": "Capital notes", "input_paths": [RAW[0]]}),
              format_call("stop")]
    terminal = {}
    for which in ("hidden", "reuse", "hidden+reuse", "reuse_if_any"):
        (rec,), _, _ = run(config(terminal_questions=which, max_probes=0), script=script, tasks=(task,))
        terminal[which] = rec.terminal_reward
    # the workspace answers the capital (hidden) and not the sky's colour (reuse)
    assert terminal == {"hidden": 1.0, "reuse": 0.0, "hidden+reuse": 0.5, "reuse_if_any": 0.0}
    evaluated = eval_config(config(terminal_questions="hidden+reuse"))
    assert evaluated.terminal_questions == "hidden" and questions_of(task, evaluated) == (hidden,)
    assert eval_config(config(terminal_questions="reuse_if_any")).terminal_questions == "reuse_if_any"


def test_batch_probes_are_batched_and_records_are_exact(tmp_path):
    tasks = [TASK, CorpusTask("t1", DOCS, TASK.questions)]
    recs, policy, frozen = run(config(), tasks=tasks, group=3)
    assert [(r.task_id, r.group_id, r.episode_index) for r in recs] == [
        ("t0", 0, 0),
        ("t0", 0, 1),
        ("t0", 0, 2),
        ("t1", 1, 0),
        ("t1", 1, 1),
        ("t1", 1, 2),
    ]
    # all 6 episodes probe after the same turns: 6 episodes x 2 questions x R=2 answerer turns per step (a
    # listing, then the answer), twice; the final evaluation 6 x 2 x 3 repeats
    assert frozen.batch_sizes == [24, 24, 24, 24, 36, 36] and policy.batch_sizes == [6] * 6
    builder_sessions = [s for s in policy.sessions]
    for r, s in zip(recs, builder_sessions, strict=True):
        r.check()
        (seg,) = r.segments
        assert np.array_equal(seg.tokens, np.asarray(s.tokens))
        assert np.array_equal(seg.loss_mask, np.asarray(s.mask))
        assert np.all(seg.logprobs[seg.loss_mask > 0] == np.float32(-0.5))
        # each turn's sampled ids decode to the scripted reply, ending with the end-of-turn id
        for t in range(r.num_turns):
            ids = seg.tokens[seg.turn_index == t]
            assert ids[-1] == IM_END and TOK.decode(ids[:-1]) == SCRIPT[t]
        assert r.total_reward == pytest.approx(1.9)
    path = tmp_path / "ep" / "step_0.jsonl"
    assert write_jsonl(path, recs) == 6
    back = read_jsonl(path)
    for a, b in zip(recs, back, strict=True):
        assert a.to_dict() == b.to_dict()
        assert isinstance(b, EpisodeRecord) and b.segments[0].tokens.dtype == np.int32


def test_writes_in_one_turn_run_their_executors_together_then_in_call_order():
    x, y = "cluster_0001__alpha.txt", "cluster_0002__beta.txt"
    script = [
        format_call("create_file", {"title": "Alpha", "input_paths": [RAW[0]]})
        + format_call("create_file", {"title": "Beta", "input_paths": [RAW[1]]})
        + format_call("merge_files", {"title": "Both", "child_paths": [x, y]})
        + format_call("read_file", {"path": "merge_0001__both/summary.txt"}),
        format_call("stop"),
    ]
    recs, policy, frozen = run(config(builder={"executor": "model"}, probe_min_gap=100), script=script)
    (r,) = recs
    assert [(c["name"], c["ok"]) for c in r.tool_calls[0]] == [
        ("create_file", True),
        ("create_file", True),
        ("merge_files", True),
        ("read_file", True),
    ]
    # the two creates were written in one step; the merge (whose children did not exist yet) in a later one
    assert frozen.batch_sizes[:2] == [2, 1]
    final = Workspace.from_dict(r.workspace_snapshots["final"], docs=DOCS)
    assert {n.body for n in final.active_nodes()} == {"EXECUTOR WROTE THIS."}
    obs = TOK.decode(r.segments[0].tokens)
    assert "EXECUTOR WROTE THIS." in obs.split("merge_0001__both/summary.txt")[-1]
    assert r.token_counts["executor_generated"] == 3 * (len("EXECUTOR WROTE THIS.") + 1)


def test_the_builder_writes_a_files_text_itself_only_when_write_text_is_on():
    """`builder.write_text` (the paper preset's): create/merge take `text`, stored as written with no
    executor paid; a write without it goes to the executor. Off (the default): `text` is an unknown
    argument."""
    x = "cluster_0001__alpha.txt"
    script = [
        format_call("create_file", {"title": "Alpha", "input_paths": [RAW[0]], "text": "Paris, my words."})
        + format_call("create_file", {"title": "Beta", "input_paths": [RAW[1]]})
        + format_call("merge_files", {"title": "Both", "child_paths": [x], "text": "By the builder."}),
        format_call("stop"),
    ]
    recs, _, frozen = run(config(builder={"executor": "model", "write_text": True}, probe_min_gap=100),
                          script=script)
    (r,) = recs
    assert [(c["name"], c["ok"]) for c in r.tool_calls[0]] == [("create_file", True)] * 2 + [
        ("merge_files", True)]
    final = Workspace.from_dict(r.workspace_snapshots["final"], docs=DOCS)
    assert {n.title: n.body for n in final.active_nodes()} == {
        "Alpha": "Paris, my words.", "Beta": "EXECUTOR WROTE THIS.", "Both": "By the builder."}
    assert frozen.batch_sizes[0] == 1  # only Beta paid for an executor
    assert r.token_counts["executor_generated"] == len("EXECUTOR WROTE THIS.") + 1
    assert "text: str" in TOK.decode(r.segments[0].tokens)  # the tool's signature in the system prompt
    recs, _, frozen = run(config(builder={"executor": "model"}, probe_min_gap=100), script=script)
    errors = recs[0].tool_errors[0]
    assert [e["code"] for e in errors] == ["unknown_argument"] * 2  # Alpha's and Both's calls, not run
    assert [c["name"] for c in recs[0].tool_calls[0]] == ["create_file"]  # Beta alone


def test_invalid_writes_are_refused_before_the_executor_runs():
    script = [
        format_call("create_file", {"title": "Alpha", "input_paths": [RAW[0]], "parent_path": "no_such_dir"})
        + format_call("merge_files", {"title": "Raw merge", "child_paths": [RAW[0], RAW[1]]})
        + format_call("create_file", {"title": "Beta", "input_paths": [RAW[1]]}),
        format_call("stop"),
    ]
    recs, policy, frozen = run(config(builder={"executor": "model"}, probe_min_gap=100), script=script)
    (r,) = recs
    calls = r.tool_calls[0]
    assert [(c["name"], c["ok"]) for c in calls] == [
        ("create_file", False), ("merge_files", False), ("create_file", True)]
    assert calls[0]["code"] == "parent_not_found"
    # only the valid write paid for an executor
    assert frozen.batch_sizes[0] == 1
    assert r.token_counts["executor_generated"] == len("EXECUTOR WROTE THIS.") + 1


def test_list_files_continues_a_long_listing_from_start():
    # A cut listing tells the model to go on with list_files(path, start=N): the tool takes that argument.
    script = [format_call("list_files", {"path": "raw_docs", "start": 2}), format_call("stop")]
    recs, _, _ = run(config(probe_min_gap=100), script=script)
    (r,) = recs
    assert [(c["name"], c["ok"]) for c in r.tool_calls[0]] == [("list_files", True)]
    obs = TOK.decode(r.segments[0].tokens).split("<tool_response>")[-1]
    assert RAW[1].split("/")[-1] in obs and RAW[0].split("/")[-1] not in obs


def test_model_judge_only_when_exact_match_fails():
    def frozen(s):
        text = s.text()
        if "Predicted answer:" in text:
            return answerer_policy(s)
        return format_call("answer", {"text": "the city of light"})

    cfg = config(use_model_judge=True, terminal_repeats=1)
    recs, _, eng = run(cfg, script=[format_call("stop")], frozen_policy=frozen)
    (r,) = recs
    assert [a["correct"] for a in r.answers] == [1.0, 0.0]  # q1 judged correct; q2 judged wrong
    assert sum("Predicted answer:" in s.text() for s in eng.sessions) == 2


def test_compaction_starts_a_segment_whose_prompt_is_exactly_what_the_model_saw():
    script = [
        format_call("list_files", {"path": "raw_docs"}),
        format_call("create_file", {"title": "Capital notes", "input_paths": [RAW[0]]}),
        format_call("read_file", {"path": RAW[1]}),
        format_call("stop"),
    ]
    from librarian_jax.agents.builder import BuilderAgent

    ctx = AgentContext(TOK, TPL, {POLICY: ScriptedEngine(TOK, None), FROZEN: None})
    prompt_len = len(BuilderAgent(ctx, Workspace.from_documents(list(DOCS)), BuilderConfig(), num_docs=2).log)
    global_turn = {"n": 0}

    def policy(s):
        global_turn["n"] += 1
        return script[global_turn["n"] - 1]

    pol = ScriptedEngine(TOK, policy)
    cfg = config(
        builder={"compaction": "deterministic", "compaction_budget": prompt_len + 150}, probe_min_gap=100
    )
    recs = run_batch(
        [TASK], 1, {POLICY: pol, FROZEN: ScriptedEngine(TOK, answerer_policy)}, TOK, cfg, 0, template=TPL
    )
    (r,) = recs
    r.check()
    assert r.num_turns == 4 and r.stopped and r.compactions >= 1
    assert len(r.segments) == r.compactions + 1 == len(pol.sessions)
    first, second = r.segments[0], r.segments[1]
    # the first segment ends where its session ended; the second's prompt is exactly its session's prompt
    assert np.array_equal(first.tokens, pol.sessions[0].tokens)
    head = TOK.decode(second.tokens[: np.argmax(second.loss_mask > 0)])
    assert "Actions so far:\nturn 1: list_files" in head and "(no synthetic files yet)" in head
    # the last assistant turn before compaction is carried over as the exact sampled ids, now unmasked
    last_turn = first.tokens[first.turn_index == first.turn_index.max()]
    pos = second.tokens.tolist()
    start = next(i for i in range(len(pos)) if pos[i : i + len(last_turn)] == last_turn.tolist())
    assert np.all(second.loss_mask[start : start + len(last_turn)] == 0)
    assert sorted(set(np.concatenate([s.turn_index for s in r.segments]).tolist()) - {-1}) == [0, 1, 2, 3]


def test_model_compaction_uses_the_frozen_engine():
    script = [format_call("list_files"), format_call("list_files"), format_call("stop")]
    n = {"k": 0}

    def policy(s):
        n["k"] += 1
        return script[n["k"] - 1]

    def frozen(s):
        return "SUMMARY: listed twice." if "Summarise what the librarian" in s.text() else answerer_policy(s)

    cfg = config(builder={"compaction": "model", "compaction_budget": 10}, probe_min_gap=100)
    recs = run_batch(
        [TASK],
        1,
        {POLICY: ScriptedEngine(TOK, policy), FROZEN: ScriptedEngine(TOK, frozen)},
        TOK,
        cfg,
        0,
        template=TPL,
    )
    (r,) = recs
    assert r.compactions == 2 and "SUMMARY: listed twice." in TOK.decode(r.segments[-1].tokens)
    assert r.token_counts["summary_tokens"] > 0


def _compacting_run(script, frozen=answerer_policy, **builder):
    n = {"k": 0}

    def policy(s):
        n["k"] += 1
        return script[min(n["k"], len(script)) - 1]

    cfg = config(builder=builder, probe_min_gap=100)
    frozen_eng = ScriptedEngine(TOK, frozen)
    (r,) = run_batch([TASK], 1, {POLICY: ScriptedEngine(TOK, policy), FROZEN: frozen_eng}, TOK, cfg, 0,
                     template=TPL)
    return r, frozen_eng


def test_reasoning_does_not_make_compaction_fire_every_turn():
    """The trigger measures the visible history (the replies' reasoning excluded, as a chat API drops it):
    a builder that thinks 600 characters before each call is compacted exactly when one that does not is."""
    from librarian_jax.agents.builder import BuilderAgent

    ctx = AgentContext(TOK, TPL, {POLICY: ScriptedEngine(TOK, None), FROZEN: None})
    prompt_len = len(BuilderAgent(ctx, Workspace.from_documents(list(DOCS)), BuilderConfig(), num_docs=2).log)
    calls = [format_call("read_file", {"path": RAW[i % 2]}) for i in range(6)] + [format_call("stop")]
    think = "<think>" + "I should look at the documents carefully. " * 14 + "</think>"
    budget = prompt_len + 900
    plain, _ = _compacting_run(calls, compaction="deterministic", compaction_budget=budget, max_turns=7)
    thinking, _ = _compacting_run([think + c for c in calls], compaction="deterministic",
                                  compaction_budget=budget, max_turns=7)
    assert 1 <= plain.compactions < 6  # the budget is passed now and then, not on every turn
    assert thinking.compactions == plain.compactions


def test_model_compaction_reads_what_the_builder_read_and_wrote():
    calls = [format_call("read_file", {"path": RAW[0]}),
             "<think>SECRET REASONING</think>I will note the capital. " + format_call("list_files"),
             format_call("list_files"), format_call("stop")]

    def frozen(s):
        return "SUMMARY." if "Summarise what the librarian" in s.text() else answerer_policy(s)

    r, eng = _compacting_run(calls, frozen, compaction="model", compaction_budget=10, max_turns=4)
    prompts = [x.text() for x in eng.sessions if "Summarise what the librarian" in x.text()]
    assert r.compactions >= 1 and prompts
    seen = "\n".join(prompts)
    assert "Paris is the capital of France" in prompts[0]  # what read_file returned
    assert "I will note the capital." in seen and "SECRET REASONING" not in seen  # its reply, no reasoning


def test_transcript_keeps_the_latest_blocks_within_its_budget():
    from librarian_jax.agents import compaction

    msgs = [{"role": "assistant", "content": f"reply {i} " + "x" * 50} for i in range(10)]
    text = compaction.transcript(msgs, max_chars=200)
    assert "reply 9" in text and "reply 0" not in text and text.startswith("[... ")
    assert len(text) < 300


def test_random_replies_never_raise_and_cost_their_penalties():
    rng = random.Random(1)

    def noise(s):
        kind = rng.randrange(4)
        if kind == 0:
            return [rng.randrange(TOK.vocab_size) for _ in range(rng.randrange(1, 300))]
        if kind == 1:
            full = format_call("create_file", {"title": "T" * rng.randrange(1, 300), "input_paths": RAW})
            return full[: rng.randrange(len(full))]
        if kind == 2:
            return "<tool_call>" + "x" * 30_000 + "</tool_call>"
        return format_call(
            rng.choice(["list_files", "read_file", "delete", "merge_files", "nope"]),
            {"path": rng.choice(["..", "/etc/passwd", RAW[0], 7]), "target_paths": RAW},
        )

    cfg = config(builder={"max_turns": 12, "max_new_tokens": 200}, probe_min_gap=1, max_probes=4)
    recs, _, _ = run(cfg, tasks=[TASK], group=4, frozen_policy=noise, policy_fn=noise)
    for r in recs:
        r.check()
        assert not r.stopped and r.num_turns == 12
        for t, errs in enumerate(r.tool_errors):
            expect = -0.05 * len(errs) - (0.1 if t == 11 else 0.0)
            if t not in r.probe_turns:
                assert r.turn_rewards[t] == pytest.approx(expect)
        assert any(r.tool_errors)


def test_answerer_forced_answer_and_word_cut():
    def looping(s):
        if "You have no more turns" in s.text():
            return "Paris " + "and more " * 100
        return format_call("read_file", {"path": RAW[0]})

    eng = ScriptedEngine(TOK, looping)
    ctx = AgentContext(TOK, TPL, {FROZEN: eng})
    cfg = AnswererConfig(max_turns=3, forced_max_new_tokens=4000)
    gen = answer_question(ctx, Workspace.from_documents(list(DOCS)), "Capital?", cfg)
    (out,) = Scheduler({FROZEN: eng}).run([gen])
    assert out.forced and out.turns == 4 and len(out.answer.split()) == 128 and out.answer.startswith("Paris")
    text = eng.sessions[0].text()
    assert text.count("Paris is the capital") == 3  # three reads were answered
    assert out.prompt_tokens + out.generated_tokens == len(eng.sessions[0].tokens)


def test_greedy_repeats_deduplicated_give_the_same_rewards():
    recs, _, frozen = run(config(repeat_mode="greedy_once"))
    (r,) = recs
    assert r.turn_rewards == pytest.approx([0.0, 0.5, -0.05, 0.45, 0.0, 0.0]) and r.terminal_reward == 1.0
    assert r.token_counts["answerer_runs"] == 6 and len(r.answers) == 14  # 2+2+2 runs, recorded R times
    assert frozen.batch_sizes == [2, 2, 2, 2, 2, 2]


def test_malformed_replies_become_the_documented_observations():
    huge = format_call("create_file", {"title": "t", "input_paths": RAW, "instructions": "x" * 25_000})
    script = [
        [7, 255, 256, 3, 259, 12],  # raw ids: bytes and stray markers
        '<tool_call>{"name": "read_file", "arguments": {"path": "raw',
        huge,
        format_call("summon", {"x": 1}) + format_call("read_file", {"path": 3}),
        format_call("read_file", {"path": "../../etc/passwd"}),
        format_call("stop"),
    ]
    recs, _, _ = run(config(probe_min_gap=100, builder={"max_new_tokens": 40_000}), script=script)
    (r,) = recs
    codes = [[e["code"] for e in errs] for errs in r.tool_errors]
    assert codes == [
        ["no_tool_call"],
        ["unterminated_call"],
        ["call_too_large"],
        ["unknown_tool", "invalid_argument_type"],
        [],
        [],
    ]
    assert r.turn_rewards == pytest.approx([-0.05, -0.05, -0.05, -0.1, 0.0, 0.0])
    text = TOK.decode(r.segments[0].tokens)
    for code in (
        "no_tool_call",
        "unterminated_call",
        "call_too_large",
        "unknown_tool",
        "invalid_argument_type",
    ):
        assert f"status: error {code}" in text
    # a valid call the workspace refuses is an ordinary observation (its code), with no penalty
    assert r.tool_calls[4][0]["code"] == "path_escape" and "status: error path_escape" in text


def test_one_engine_can_serve_every_role():
    def both(s):
        return builder_policy(SCRIPT)(s) if "You are the librarian" in s.text() else answerer_policy(s)

    eng = ScriptedEngine(TOK, both)
    recs = run_batch([TASK], 2, eng, TOK, config(), 0, template=TPL)
    assert [r.total_reward for r in recs] == pytest.approx([1.9, 1.9])
    assert max(eng.batch_sizes) == 12  # the final evaluation: 2 episodes x 2 questions x 3 repeats


def test_answerer_forced_by_its_context_budget_cuts_the_observation_to_fit():
    long_doc = Document("d9", "Paris. " + "Filler sentence about nothing at all. " * 200, title="Long")

    def reader(s):
        if "You have no more turns" in s.text():
            return format_call("answer", {"text": "Paris"})
        return format_call("read_file", {"path": "raw_docs/raw_0001__long.txt"})

    eng = ScriptedEngine(TOK, reader)
    ctx = AgentContext(TOK, TPL, {FROZEN: eng})
    ws = Workspace.from_documents([long_doc])
    probe = ScriptedEngine(TOK, lambda s: "x")
    Scheduler({FROZEN: probe}).run(
        [answer_question(AgentContext(TOK, TPL, {FROZEN: probe}), ws, "Q?", AnswererConfig(max_turns=0))]
    )
    prompt_len = len(probe.sessions[0].tokens) - 2  # the forced reply "x" and its end id
    cfg = AnswererConfig(
        max_turns=5, max_new_tokens=200, forced_max_new_tokens=100, context_budget=prompt_len + 2000
    )
    (out,) = Scheduler({FROZEN: eng}).run([answer_question(ctx, ws, "Q?", cfg)])
    assert out.forced and out.answer == "Paris" and out.turns == 2
    text = eng.sessions[0].text()
    assert "[... cut to fit the context]" in text and "You have no more turns" in text
    assert len(eng.sessions[0].tokens) <= cfg.context_budget


def test_builder_observations_are_cut_to_fit_the_policy_engine():
    long_doc = Document("d9", "Paris. " + "Filler sentence about nothing at all. " * 300, title="Long")
    task = CorpusTask("t9", (long_doc,), TASK.questions)
    reads = "".join(format_call("read_file", {"path": "raw_docs/raw_0001__long.txt"}) for _ in range(8))
    script = [reads, format_call("stop")]
    from librarian_jax.agents.builder import BuilderAgent

    ctx = AgentContext(TOK, TPL, {POLICY: ScriptedEngine(TOK, None), FROZEN: None})
    prompt_len = len(BuilderAgent(ctx, Workspace.from_documents([long_doc]), BuilderConfig(), num_docs=1).log)
    pol = ScriptedEngine(TOK, builder_policy(script), max_seq_len=prompt_len + 8000)
    cfg = config(builder={"max_new_tokens": 1000}, probe_min_gap=100)
    (r,) = run_batch(
        [task], 1, {POLICY: pol, FROZEN: ScriptedEngine(TOK, answerer_policy)}, TOK, cfg, 0, template=TPL
    )
    assert r.stopped and r.num_turns == 2 and r.turn_rewards == [0.0, 0.0]
    seg = r.segments[0]
    first = np.nonzero(seg.turn_index == 0)[0][-1]
    second = np.nonzero(seg.turn_index == 1)[0][0]
    assert second - first - 1 <= (prompt_len + 8000 - 1000) // 2 + 20  # the observation turn (+ headers)
    assert "observation cut to fit the context" in TOK.decode(seg.tokens[first:second])
