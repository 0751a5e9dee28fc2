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
    tasks, tok, _, policy, frozen = world
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
    a, b, verdict, (summary, used) = Scheduler({"frozen": frozen}).run(gens)
    assert max(s.active_slots for s in frozen.stats[before:]) == 4  # four different agents, one decode loop
    assert a == b  # temperature 0: the same prompt writes the same text
    assert 0 < a.generated_tokens <= 12 and a.prompt_tokens > len(tok.encode(ex.text))
    # batching with three other agents in one decode loop does not change what the executor writes
    (alone,) = Scheduler({"frozen": frozen}).run([executor.write(
        ctx, "People", "list the people", excerpt_sources(ex), ex.text, kind="model", max_new_tokens=12)])
    assert alone == a
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
        answerer=AnswererConfig(max_turns=1, max_new_tokens=8, forced_max_new_tokens=8),
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
