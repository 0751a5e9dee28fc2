"""Hostile model output (issue 17): tool calls the protocol must refuse with their penalty, and the long-run
state of a run (engine stats, chat templates shared by concurrent episodes)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from librarian_jax import models, testing
from librarian_jax.agents.builder import BUILDER_TOOLS
from librarian_jax.agents.protocol import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ProtocolConfig,
    parse_tool_calls,
    turn_penalty,
)
from librarian_jax.engine.engine import Engine, StepStats
from librarian_jax.tokenizers import chat_template, load_tokenizer, train_sentencepiece

PENALTY = ProtocolConfig().malformed_penalty


def _block(obj: object) -> str:
    return TOOL_CALL_OPEN + (obj if isinstance(obj, str) else json.dumps(obj)) + TOOL_CALL_CLOSE


# ------------------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (_block({"name": "stop", "arguments": "garbage"}), "invalid_json"),
        (_block({"name": "stop", "arguments": "{"}), "invalid_json"),
        (_block({"name": "list_files", "arguments": '{"path": "raw_do'}), "invalid_json"),
        (_block({"name": "list_files", "arguments": "[]"}), "invalid_call"),
        (_block({"name": "list_files", "arguments": '"raw_docs"'}), "invalid_call"),
        (_block({"name": "stop", "arguments": ""}), "invalid_json"),
        (_block({"name": "stop", "arguments": None}), "invalid_call"),
        (
            _block({"name": "read_file", "arguments": {"path": "a", "start_line": "²"}}),
            "invalid_argument_type",
        ),
        (
            _block({"name": "read_file", "arguments": {"path": "a", "start_line": "٣"}}),
            "invalid_argument_type",
        ),
        (_block({"name": "list_files", "arguments": {"start": 10**30}}), "invalid_argument_type"),
    ],
)
def test_a_malformed_call_is_never_run_and_always_costs_its_penalty(reply: str, code: str) -> None:
    p = parse_tool_calls(reply, BUILDER_TOOLS)
    assert p.calls == ()
    assert [e.code for e in p.errors] == [code] and p.errors[0].message
    assert turn_penalty(p) == pytest.approx(-PENALTY)


def test_the_documented_lenient_forms_still_parse() -> None:
    for reply in (
        _block({"name": "stop"}),
        _block({"name": "stop", "arguments": {}}),
        _block({"name": "stop", "arguments": "{}"}),
        _block({"name": "list_files", "arguments": '{"path": "raw_docs", "start": " 2 "}'}),
    ):
        p = parse_tool_calls(reply, BUILDER_TOOLS)
        assert p.errors == () and len(p.calls) == 1, reply


# ---------------------------------------------------------------------------------------- property tests
def _not_an_object_string(s: str) -> bool:
    try:
        return not isinstance(json.loads(s), dict)
    except (ValueError, RecursionError):
        return True


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))
hostile_arguments = st.one_of(
    st.text(max_size=30).filter(_not_an_object_string),  # a string that is not a JSON object
    st.sampled_from(['{"path": "raw', '{"path": 1', "{}}", "[{}]", '"{}"', "null", "{'a': 1}", "{" * 40]),
    json_scalar,
    st.lists(json_scalar, max_size=3),
)
tool_names = st.sampled_from([t.name for t in BUILDER_TOOLS])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(tool_names, hostile_arguments), min_size=1, max_size=4), st.text(max_size=20))
def test_calls_whose_arguments_are_not_an_object_are_errors(
    calls: list[tuple[str, object]], noise: str
) -> None:
    reply = noise.replace("<", "") + "".join(_block({"name": n, "arguments": a}) for n, a in calls)
    p = parse_tool_calls(reply, BUILDER_TOOLS)
    assert p.calls == ()
    assert len(p.errors) == len(calls) and all(e.code and e.message for e in p.errors)
    assert turn_penalty(p) == pytest.approx(-PENALTY * len(calls))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(
        st.one_of(st.text(max_size=40), st.sampled_from([TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "{", '"'])),
        max_size=12,
    )
)
def test_every_block_is_one_call_or_one_error(pieces: list[str]) -> None:
    reply = "".join(pieces)
    p = parse_tool_calls(reply, BUILDER_TOOLS)
    assert turn_penalty(p) == pytest.approx(-PENALTY * len(p.errors))
    assert all(e.code and e.message for e in p.errors)
    opened = reply.count(TOOL_CALL_OPEN)
    if opened:
        assert len(p.calls) + len(p.errors) <= opened and (p.calls or p.errors)


# ----------------------------------------------------------------------------------------- long-run state
def _idle_engine(window: int) -> Engine:
    """A real Engine (a 1-layer tiny model) with no session: its step() admits, prefills and decodes
    nothing, so only its bookkeeping runs."""
    model = testing.tiny_model(models.get_preset("tiny", num_layers=1))
    return Engine(model, 2, 64, stats_window=window)


def test_engine_stats_stay_bounded_over_a_long_run() -> None:
    e = _idle_engine(window=50)
    t = time.perf_counter()
    for _ in range(5000):
        e.step()
    assert len(e.stats) == 50 and e.total_steps == 5000
    assert all(isinstance(s, StepStats) for s in e.stats)
    assert time.perf_counter() - t < 5


GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")


@pytest.fixture(scope="module")
def gemma_tok(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    texts = ["the librarian files every ledger by river and by year"] * 20 + [
        "system prompt one two three"
    ] * 5
    path = train_sentencepiece(texts, tmp_path_factory.mktemp("g") / "tokenizer.model", 300, GEMMA_MARKERS)
    return load_tokenizer(path)


def test_one_folding_template_serves_concurrent_episodes_and_compaction(gemma_tok) -> None:  # noqa: ANN001
    chat = chat_template(gemma_tok, "gemma", fold_system=True)
    head_a = chat.start("system one")
    head_b = chat.start("system two")  # another episode starts on the same template
    want_a = [gemma_tok.bos_id, *gemma_tok.encode("<start_of_turn>user\nsystem one\n\nfirst<end_of_turn>\n")]
    assert head_a + chat.turn("user", "first") == want_a
    again = [gemma_tok.bos_id, *gemma_tok.encode("<start_of_turn>user\nsystem one\n\nlater<end_of_turn>\n")]
    assert head_a + chat.turn("user", "later") == again  # a compaction restarts from the same head
    assert (head_b + chat.turn("user", "x"))[1:] == gemma_tok.encode(
        "<start_of_turn>user\nsystem two\n\nx<end_of_turn>\n"
    )
    assert not hasattr(chat, "_pending_system")
