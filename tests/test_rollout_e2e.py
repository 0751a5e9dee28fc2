"""End to end: a batch of builder episodes with the tiny random model, the real engine and a real
SentencePiece tokenizer trained on the synthetic world. Probes are batched into the frozen engine's decode
loop, and the records hold exactly the ids the engine sampled and was given, with the sampler's log-probs."""

from __future__ import annotations

import forward
import jax
import numpy as np
import pytest
from flax import nnx

from librarian_jax.agents import (
    AgentContext,
    AnswererConfig,
    BuilderConfig,
    compaction,
    executor,
    vocabulary,
)
from librarian_jax.agents.builder import excerpt_sources
from librarian_jax.agents.judge import judge_answer
from librarian_jax.agents.protocol import format_call
from librarian_jax.data.synthetic import generate_world, world_texts
from librarian_jax.engine import Engine
from librarian_jax.models import Transformer, get_preset
from librarian_jax.rollout import RolloutConfig, Scheduler, run_batch
from librarian_jax.testing import ScriptedEngine
from librarian_jax.tokenizers import cached_tokenizer, chat_template
from librarian_jax.workspace import Workspace

MAX_NEW = 24


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tasks = generate_world(0, 2, questions_per_task=2, reuse_questions_per_task=0)
    tok = cached_tokenizer(world_texts(tasks) + vocabulary.all_texts(), tmp_path_factory.mktemp("tok"), 2048)
    model = Transformer(get_preset("tiny"), rngs=nnx.Rngs(0))
    policy = Engine(model, num_slots=4, max_seq_len=1536, round_steps=16)
    frozen = Engine(model, num_slots=16, max_seq_len=1024, round_steps=16)
    return tasks, tok, model, policy, frozen


def test_batch_of_episodes_with_the_tiny_model(world):
    tasks, tok, model, policy, frozen = world
    cfg = RolloutConfig(
        builder=BuilderConfig(max_turns=2, max_new_tokens=MAX_NEW, executor="model"),
        answerer=AnswererConfig(max_turns=1, max_new_tokens=8, forced_max_new_tokens=8),
        probe_repeats=2,
        repeat_mode="sample",  # sampled repeats: all R runs are made (greedy ones would be run once)
        probe_at_start=True,
        terminal_repeats=1,
        terminal_questions="hidden",
        use_model_judge=False,
    )
    sched = Scheduler({"policy": policy, "frozen": frozen})
    made = []  # every builder session the engine opened, to compare with the records
    open_session = policy.new_session
    policy.new_session = lambda ids: made.append(open_session(ids)) or made[-1]
    try:
        records = run_batch(tasks, 2, {"policy": policy, "frozen": frozen}, tok, cfg, 0, scheduler=sched)
    finally:
        del policy.new_session
    assert [(r.group_id, r.episode_index) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(made) == 4 and all(m.status == "closed" for m in made)
    # every builder turn of the 4 episodes decoded together; each probe's 4 x 2 x 2 answerer runs together
    assert max(s.active_slots for s in policy.stats) == 4
    assert max(s.active_slots for s in frozen.stats) == 16
    assert max(sched.stats.inflight_per_step["frozen"]) == 16
    tpl = chat_template(tok)
    stops = set(tpl.stop_ids)
    for r in records:
        r.check()
        assert r.num_turns == len(r.turn_rewards) == 2
        assert len([a for a in r.answers if a["phase"] == "start"]) == 4
        assert len([a for a in r.answers if a["phase"] == "final"]) == 2
        assert r.token_counts["answerer_runs"] == 6 and r.reading_tokens > 0
        assert all(a["status"] == "ok" for a in r.answers)  # no answerer session outgrew its engine
        expect_penalty = [-0.05 * len(e) for e in r.tool_errors]
        expect_penalty[-1] -= 0.0 if r.stopped else 0.1
        assert r.turn_rewards == pytest.approx(expect_penalty)  # no write succeeded: no probe after turns
        (seg,) = r.segments
        # tokens, mask and log-probs are exactly the engine's record of what it sampled and was appended
        (same,) = [m.record() for m in made if np.array_equal(m.record().tokens, seg.tokens)]
        assert np.array_equal(same.loss_mask, seg.loss_mask) and np.array_equal(same.logprobs, seg.logprobs)
        # the prompt is exactly the builder's first prompt; each turn's sampled ids end at a stop id or budget
        assert seg.tokens[: len(tpl.start())].tolist() == tpl.start()
        for t in range(r.num_turns):
            ids = seg.tokens[seg.turn_index == t]
            assert 0 < len(ids) <= MAX_NEW
            assert ids[-1] in stops or len(ids) == MAX_NEW
        assert np.array_equal(seg.loss_mask > 0, seg.turn_index >= 0)
    # the sampler's log-probs are the model's log_softmax at exactly these ids (temperature 1)
    seg = records[0].segments[0]
    logits = forward.logits(model, jax.numpy.asarray(seg.tokens[None, :-1]))
    lp = jax.nn.log_softmax(logits[0].astype(jax.numpy.float32), axis=-1)
    picked = np.asarray(lp[np.arange(len(seg.tokens) - 1), seg.tokens[1:]])
    sampled = seg.loss_mask[1:] > 0
    np.testing.assert_allclose(seg.logprobs[1:][sampled], picked[sampled], atol=2e-3)


def test_model_executor_judge_and_summary_share_the_frozen_engine(world):
    """Four agents in one decode loop of the frozen engine; the executor's text is exactly the model's greedy
    continuation of its prompt (a full forward's argmax), batched or alone."""
    tasks, tok, model, policy, frozen = world
    ctx = AgentContext(tok, chat_template(tok), {"policy": policy, "frozen": frozen})
    ws = Workspace.from_documents(list(tasks[0].documents))
    ex = ws.source_excerpts([d.path for d in ws.raw_docs[:2]])
    gens = [
        executor.write(
            ctx, "People", "list the people", excerpt_sources(ex), ex.text, kind="model", max_new_tokens=12
        )
        for _ in range(2)
    ]
    gens.append(judge_answer(ctx, "Who?", "wrong", ["right"], use_model_judge=True, max_new_tokens=8))
    gens.append(compaction.model_summary(ctx, ["turn 1: list_files {} -> ok"], ws.tree(), 8))
    before = len(frozen.stats)
    opened = []  # every session the four agents open on the frozen engine, in the order they start
    open_session = frozen.new_session
    frozen.new_session = lambda ids: opened.append(open_session(ids)) or opened[-1]
    try:
        a, b, verdict, (summary, used) = Scheduler({"frozen": frozen}).run(gens)
        # the same executor call alone, in a decode loop of its own
        (alone,) = Scheduler({"frozen": frozen}).run([executor.write(
            ctx, "People", "list the people", excerpt_sources(ex), ex.text, kind="model", max_new_tokens=12)])
    finally:
        del frozen.new_session
    assert max(s.active_slots for s in frozen.stats[before:]) == 4  # four different agents, one decode loop
    assert 0 < a.generated_tokens <= 12 and a.prompt_tokens > len(tok.encode(ex.text))
    records = [s.record() for s in opened]
    assert len(records) == 5
    for executor_call, rec in ((a, records[0]), (b, records[1]), (alone, records[4])):
        sampled = rec.tokens[rec.loss_mask > 0]
        assert executor_call.prompt_tokens == len(rec.tokens) - len(sampled)
        assert executor_call.generated_tokens == len(sampled)
        # the executor's text is the model's sampled ids decoded or, only when they decode to nothing (this
        # random model's 12 ids do), the extractive text, marked as a fallback: so the text equalities the
        # test used to check compared two fallbacks; the ids below are what the model wrote
        wrote = ctx.decode_new(sampled.tolist()).strip()
        assert executor_call.fallback == (not wrote)
        assert executor_call.text == (wrote or executor.clean_content(executor.extractive_text(
            "People", "list the people", excerpt_sources(ex))))
        # greedy (the executor samples at temperature 0): every sampled id is the argmax of the model's full
        # forward over the ids before it, whichever agents shared its decode loop
        logits = forward.logits(model, jax.numpy.asarray(rec.tokens[None, :-1]))[0]
        first = len(rec.tokens) - len(sampled)
        np.testing.assert_array_equal(sampled, np.asarray(logits[first - 1:].argmax(-1)))
    assert verdict in (0.0, 1.0) and summary.strip() and used > 0


def test_scripted_builder_writes_with_the_real_frozen_engine(world):
    """A scripted builder (test double) that does write, so the model executor and a probe after a write run
    on the real frozen engine, batched across episodes."""
    tasks, tok, _, _, frozen = world
    tpl = chat_template(tok)
    task = tasks[0]
    raw = [d.path for d in Workspace.from_documents(list(task.documents)).raw_docs]
    script = [format_call("create_file", {"title": "People", "input_paths": raw[:2]}), format_call("stop")]
    builder = ScriptedEngine(tok, lambda s: script[min(s.turns, 1)], end_id=tpl.stop_ids[0])
    cfg = RolloutConfig(
        builder=BuilderConfig(max_turns=3, executor="model", executor_max_new_tokens=12),
        # a budget the frozen engine holds: one above it is refused, never lowered (`check_budgets`)
        answerer=AnswererConfig(max_turns=1, max_new_tokens=8, forced_max_new_tokens=8,
                                context_budget=frozen.max_seq_len),
        probe_repeats=1,
        probe_min_gap=1,
        terminal_repeats=1,
        terminal_questions="hidden",
        use_model_judge=False,
    )
    before = len(frozen.stats)
    records = run_batch([task], 2, {"policy": builder, "frozen": frozen}, tok, cfg, 0, template=tpl)
    for r in records:
        r.check()
        assert r.num_turns == 2 and r.stopped and r.probe_turns == [0] and len(r.probe_scores) == 1
        assert 0 < r.token_counts["executor_generated"] <= 12
        (node,) = Workspace.from_dict(r.workspace_snapshots["final"], docs=task.documents).active_nodes()
        assert node.title == "People" and node.body.strip()
        assert r.turn_rewards[1] == 0.0 and r.replies == script
    # the two episodes' executor writes decoded together, then their 2 x 2 probe answerer runs together
    assert [s.active_slots for s in frozen.stats[before:] if s.decode_steps][:2] == [2, 4]
