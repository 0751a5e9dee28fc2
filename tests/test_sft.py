"""Supervised warm start: demonstrations through the real protocol, conversation encoding, rows, the SFT loop
with its Orbax checkpoint as a GRPO start."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import sft as sft_configs
from librarian_jax import models
from librarian_jax.agents.answerer import AnswererConfig
from librarian_jax.agents.builder import BuilderConfig
from librarian_jax.data import synthetic
from librarian_jax.rl import sft
from librarian_jax.rollout import RolloutConfig
from librarian_jax.testing import ByteTokenizer, chat_template
from librarian_jax.warm_start import demos
from librarian_jax.warm_start import sft as supervised

TOK = ByteTokenizer()
TPL = chat_template(TOK)
TASKS = synthetic.generate_world(5, 3, docs_per_task=6, min_words=30, max_words=50, questions_per_task=2)
CFG = RolloutConfig(builder=BuilderConfig(max_turns=3, max_new_tokens=4000, executor="extractive",
                                          compaction="none"),
                    answerer=AnswererConfig(kind="scripted", max_turns=2, context_budget=100_000,
                                            preload_root_files=False),
                    probe_repeats=1, max_probes=1, probe_min_gap=1, terminal_repeats=1, use_model_judge=False)


def test_demonstration_styles_through_the_protocol_and_their_quality_order():
    out = demos.make_demonstrations(TASKS, TOK, CFG, mix={s: 1.0 for s in demos.STYLES}, per_task=4,
                                    calls_per_turn=3, template=TPL)
    assert {d["style"] for d in out} == set(demos.STYLES)
    by = {s: np.mean([d["terminal"] for d in out if d["style"] == s]) for s in demos.STYLES}
    assert by["entities"] > by["own_doc"] and by["entities"] > by["early_stop"], by
    for d in out:
        roles = [m["role"] for m in d["messages"]]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        # the builder never sees a question or an answer of its task
        task = next(t for t in TASKS if t.task_id == d["task_id"])
        text = "\n".join(m["content"] for m in d["messages"])
        for q in (*task.questions, *task.reuse_questions):
            assert q.question not in text
        # token in, token out: the conversation encodes to exactly the session's ids and loss mask
        ex = sft.encode_conversation(d["messages"], TPL, TOK)
        seg = d["_segment"]
        np.testing.assert_array_equal(ex.tokens, seg.tokens)
        np.testing.assert_array_equal(ex.loss_mask, seg.loss_mask)
        if d["style"] == "entities":  # every scripted call is valid: no error observation
            assert "status: error" not in text


def test_style_counts_and_unknown_style():
    assert demos.style_counts(10, {"entities": 0.4, "own_doc": 0.3, "generic": 0.15, "early_stop": 0.15}) \
        == {"entities": 4, "own_doc": 3, "generic": 2, "early_stop": 1}
    with pytest.raises(ValueError, match="unknown style 'perfect'"):
        demos.style_counts(3, {"perfect": 1.0})


def test_conversation_file_errors_name_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    p.write_text(json.dumps(good) + "\n" + "{not json\n")
    with pytest.raises(sft.ConversationError, match=r"c\.jsonl:2: not a JSON object"):
        sft.load_conversations(str(p))
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(sft.ConversationError, match=r":1: no assistant message"):
        sft.load_conversations(str(p))
    p.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(sft.ConversationError, match=r":1: messages\[0\] must be"):
        sft.load_conversations(str(p))
    p.write_text(json.dumps(good) + "\n")
    assert sft.load_conversations(str(p)) == [good]


def test_loss_only_on_assistant_content_and_its_end_of_turn():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "AB"}, {"role": "user", "content": "R"}]
    ex = sft.encode_conversation(msgs, TPL, TOK)
    learned = TOK.decode([int(t) for t, m in zip(ex.tokens, ex.loss_mask, strict=True) if m])
    assert learned == "AB<|im_end|>"
    assert TOK.decode(ex.tokens.tolist()) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    last = sft.encode_conversation(msgs[:3], TPL, TOK)  # a final reply ends on its end-of-turn id
    assert TOK.decode(last.tokens.tolist()).endswith("AB<|im_end|>")


def test_rows_cut_and_pack():
    a = sft.Example(np.arange(1, 11, dtype=np.int32), np.ones(10, np.float32))
    b = sft.Example(np.arange(1, 5, dtype=np.int32), np.ones(4, np.float32))
    tokens, valid, mask, counts = sft.make_rows([a, b], max_row_len=8, packing="none", multiple=4)
    assert tokens.shape == (2, 8) and counts["cut_loss_tokens"] == 2 and valid.sum() == 12
    tokens, valid, mask, counts = sft.make_rows([b, b, a], max_row_len=12, packing="concat", multiple=4)
    assert counts["rows"] == 2 and valid[0].sum() == 8 and valid[1].sum() == 10
    with pytest.raises(ValueError, match="packing"):
        sft.make_rows([a], 8, packing="zip")


def test_row_stream_resumes_where_it_stopped():
    s = sft.RowStream(5, 3, seed=1)
    first = [s.next().tolist() for _ in range(2)]
    state = s.get_state()
    later = [s.next().tolist() for _ in range(3)]
    r = sft.RowStream(5, 3, seed=1)
    r.set_state(state)
    assert [r.next().tolist() for _ in range(3)] == later
    assert sorted(first[0] + first[1][:2]) == [0, 1, 2, 3, 4]  # an epoch is a permutation


def test_row_stream_groups_rows_of_similar_length():
    lengths = np.random.default_rng(0).integers(100, 1200, size=64)
    grouped = sft.RowStream(64, 4, seed=3, lengths=lengths, group=4)
    plain = sft.RowStream(64, 4, seed=3)
    g = [grouped.next() for _ in range(16)]  # one epoch
    p = [plain.next() for _ in range(16)]
    assert sorted(np.concatenate(g).tolist()) == list(range(64))  # still every row once an epoch
    # each window of 4 batches is sorted by length, so a batch's rows are close in length ...
    assert sum(np.ptp(lengths[b]) for b in g) < 0.5 * sum(np.ptp(lengths[b]) for b in p)
    # ... and padding each batch to its own longest row costs far less than the plain order does
    assert sum(lengths[b].max() for b in g) < 0.9 * sum(lengths[b].max() for b in p)
    # the batch order is shuffled, not the sorted windows one after the other
    assert [lengths[b].max() for b in g] != sorted(lengths[b].max() for b in g)
    state = grouped.get_state()
    later = [grouped.next().tolist() for _ in range(5)]
    again = sft.RowStream(64, 4, seed=3, lengths=lengths, group=4)
    again.set_state(state)
    assert [again.next().tolist() for _ in range(5)] == later
    with pytest.raises(ValueError, match="lengths"):
        sft.RowStream(64, 4, seed=3, group=2)


def test_batch_seq_pads_a_batch_to_its_longest_row():
    valid = np.zeros((3, 1152), bool)
    valid[0, :500], valid[1, :700], valid[2, :10] = True, True, True
    assert sft.batch_seq(valid) == 768
    assert sft.batch_seq(valid[2:]) == 128
    valid[1, :1100] = True
    assert sft.batch_seq(valid) == 1152  # never wider than the rows


def _sft_config(workdir: str, steps: int):
    c = sft_configs.get_config("embedded")
    c.workdir = workdir
    c.model.preset = "tiny"
    c.model.tokenizer_vocab_size = 2048
    c.data.update(num_tasks=4, docs_per_task=4, min_words=20, max_words=30, questions_per_task=1,
                  heldout_fraction=0.25)
    c.rollout.builder.update(max_turns=2, max_new_tokens=160)
    c.train.update(num_steps=steps, batch_rows=4, learning_rate=3e-3, warmup_steps=0, log_every=5,
                   max_row_len=1024)
    c.demos.update(num_tasks=6, per_task=1, calls_per_turn=2)
    c.checkpoint.update(every=4, keep=2, async_save=False)
    return c


def test_sft_learns_resumes_and_is_a_grpo_start(tmp_path):
    work = str(tmp_path / "sft")
    out = supervised.main(_sft_config(work, 8))
    assert out["last_step"] == 8 and out["last_loss"] < out["first_loss"] - 1.0, out
    assert os.path.exists(os.path.join(work, "demos.jsonl"))
    # resume: asking for more steps continues from step 8, not from scratch
    more = supervised.main(_sft_config(work, 10))
    assert more["start_step"] == 8 and more["last_step"] == 10
    # the checkpoint is a valid model.init="orbax" start: cluster.initial_model restores it, and it is
    # trained (differs from the random init it started from, seed 0)
    from librarian_jax import cluster
    from librarian_jax.tokenizers import load_tokenizer

    c = _sft_config(work, 10)
    c.model.update(init="orbax", path=os.path.join(work, "checkpoints"))
    tok_dir = os.path.join(work, "tokenizer")
    tok = load_tokenizer(os.path.join(tok_dir, sorted(os.listdir(tok_dir))[0]))
    restored = nnx.state(cluster.initial_model(supervised.validate(c), None, tok), nnx.Param)
    init = nnx.state(models.Transformer(models.get_preset("tiny"), rngs=nnx.Rngs(0)), nnx.Param)
    diffs = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(init), strict=True)]
    assert min(diffs) > 0.0


def test_warm_start_tokenizer_and_demonstrations_do_not_depend_on_the_runs_tasks(tmp_path):
    # trained on the demonstrations' worlds only: no held-out text reaches the warm start, and runs that
    # differ only in their world size, split or reward questions (the reuse questions a noisy run's reward
    # asks) share one tokenizer and one set of demonstrations
    out = []
    for i, (num_tasks, heldout, reuse) in enumerate(((4, 0.25, 0), (9, 0.5, 0), (4, 0.25, 6))):
        c = _sft_config(str(tmp_path / f"w{i}"), 1)
        c.data.update(num_tasks=num_tasks, heldout_fraction=heldout, reuse_questions_per_task=reuse)
        convs, tok = supervised.embedded_demonstrations(supervised.validate(c))
        out.append((os.path.basename(tok.path), [cv["messages"] for cv in convs]))
    assert out[0] == out[1] == out[2]


def test_the_warm_start_runs_the_sft_steps_a_grpo_run_asks_for(tmp_path):
    """`warm_start.sft_steps` sets the warm start's SFT steps (and so where its schedule ends); 0 keeps the
    preset's; a negative count names the key."""
    from configs import grpo
    from librarian_jax import config_validation

    c = grpo.get_config("noisy")
    c.workdir = str(tmp_path / "run")
    assert supervised.warm_start_config(config_validation.validate(c, num_devices=1)).train.num_steps == 150
    c.warm_start.sft_steps = 80
    sft_settings = supervised.warm_start_config(config_validation.validate(c, num_devices=1))
    assert sft_settings.train.num_steps == 80 and sft_settings.workdir == str(tmp_path / "run" / "warm_start")
    c.warm_start.sft_steps = -1
    with pytest.raises(config_validation.ConfigError, match=r"config\.warm_start\.sft_steps: must be >= 0"):
        config_validation.validate(c, num_devices=1)


def test_sft_config_errors_name_the_key(tmp_path):
    from librarian_jax.config_validation import ConfigError

    c = _sft_config(str(tmp_path / "x"), 1)
    c.data.packing = "zip"
    with pytest.raises(ConfigError, match=r"config\.data\.packing"):
        supervised.validate(c)
    c = _sft_config(str(tmp_path / "x"), 1)
    c.data.path = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"config\.data\.path"):
        supervised.validate(c)


def test_nll_loss_is_the_mean_negative_log_likelihood_of_the_loss_tokens():
    import jax.numpy as jnp

    from librarian_jax.rl import losses

    lp = jnp.array([[0.0, -1.0, -2.0, -3.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 0.0]])
    total, count, sums = losses.get_loss_fn("nll")(
        lp, lp, jnp.zeros_like(lp), jnp.full_like(lp, 5.0), mask, jnp.ones(1),
        config=losses.LossConfig(name="nll", tis_cap=2.0))
    assert float(total / count) == 1.5 and float(sums["tis"]) == 2.0  # advantages and TIS play no part


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
_VALID_CONVERSATION = st.tuples(
    st.one_of(st.none(), _TEXT),
    st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=3),
).map(lambda c: {"messages": ([{"role": "system", "content": c[0]}] if c[0] is not None else [])
                 + [m for u, a in c[1] for m in ({"role": "user", "content": u},
                                                 {"role": "assistant", "content": a})]})


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(_VALID_CONVERSATION, min_size=1, max_size=4))
def test_well_formed_conversation_files_always_load(tmp_path_factory, convs):
    """The other half of the hostile-file property below (which a loader refusing everything would pass):
    every file of well-formed conversations loads, each conversation as written, and encodes."""
    p = tmp_path_factory.mktemp("conv") / "c.jsonl"
    p.write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    loaded = sft.load_conversations(str(p))
    assert loaded == convs
    for c in loaded:
        sft.encode_conversation(c["messages"], TPL, TOK)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.one_of(
    st.binary(max_size=40),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
                     ["messages", "role", "content", "x"]), c, max_size=3), max_leaves=8
                 ).map(lambda o: json.dumps(o).encode()),
    st.sampled_from([b"[" * 5000, b"1" * 5000, b"\xff\xfe", b'{"messages": [{"role": "user"}]}']),
), min_size=1, max_size=4))
def test_hostile_conversation_files_load_or_raise_conversation_error(tmp_path_factory, lines):
    p = tmp_path_factory.mktemp("conv") / "c.jsonl"
    p.write_bytes(b"\n".join(lines))
    try:
        convs = sft.load_conversations(str(p))
    except sft.ConversationError as e:
        assert str(p) in str(e)
        return
    for c in convs:  # what loads encodes
        sft.encode_conversation(c["messages"], TPL, TOK)
