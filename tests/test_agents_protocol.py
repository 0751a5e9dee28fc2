"""The tool-call protocol (parsing is total), the judge, the extractive executor and the prompt files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from librarian_jax.agents import prompt_text
from librarian_jax.agents.answerer import ANSWERER_TOOLS
from librarian_jax.agents.builder import BUILDER_TOOLS, excerpt_sources
from librarian_jax.agents.executor import extractive_text, split_sentences
from librarian_jax.agents.judge import exact_match, normalize_answer, parse_verdict
from librarian_jax.agents.protocol import (
    ProtocolConfig,
    format_call,
    parse_tool_calls,
    render_error,
    turn_penalty,
)

CODES = {
    "no_tool_call",
    "unterminated_call",
    "call_too_large",
    "invalid_json",
    "invalid_call",
    "unknown_tool",
    "missing_argument",
    "unknown_argument",
    "invalid_argument_type",
    "too_many_calls",
}


def test_several_calls_in_order_with_defaults_filled():
    text = (
        "I will look first. "
        + format_call("list_files", {"path": "raw_docs"})
        + " then "
        + format_call("read_file", {"path": "a.txt", "start_line": "3"})
        + format_call("stop")
    )
    p = parse_tool_calls(text, BUILDER_TOOLS)
    assert p.errors == ()
    assert [c.name for c in p.calls] == ["list_files", "read_file", "stop"]
    assert p.calls[1].arguments == {"path": "a.txt", "start_line": 3, "num_lines": 100}
    assert [c.index for c in p.calls] == [0, 1, 2]


def test_lenient_coercions_are_exactly_the_documented_ones():
    p = parse_tool_calls(
        '<tool_call>{"name": "create_file", "arguments": '
        '"{\\"title\\": \\"T\\", \\"input_paths\\": \\"x\\"}"}</tool_call>',
        BUILDER_TOOLS,
    )
    assert p.errors == () and p.calls[0].arguments["input_paths"] == ["x"]
    assert p.calls[0].arguments["parent_path"] is None
    p = parse_tool_calls(format_call("read_file", {"path": "a", "num_lines": 5.0}), BUILDER_TOOLS)
    assert p.calls[0].arguments["num_lines"] == 5


@pytest.mark.parametrize(
    "text,code",
    [
        ("just thinking, no call", "no_tool_call"),
        ('<tool_call>{"name": "list_files", "argu', "unterminated_call"),
        ('<tool_call>{"name": "list_files", "arguments": {}</tool_call>', "invalid_json"),
        ("<tool_call>[1, 2]</tool_call>", "invalid_call"),
        ('<tool_call>{"name": "list_files", "arguments": [1]}</tool_call>', "invalid_call"),
        ('<tool_call>{"name": "list_files", "extra": 1}</tool_call>', "invalid_call"),
        (format_call("rm_rf", {"path": "/"}), "unknown_tool"),
        (format_call("read_file", {}), "missing_argument"),
        (format_call("read_file", {"path": "a", "colour": "red"}), "unknown_argument"),
        (format_call("read_file", {"path": 7}), "invalid_argument_type"),
        (format_call("read_file", {"path": "a", "num_lines": 1000}), "invalid_argument_type"),
        (format_call("read_file", {"path": "a", "start_line": True}), "invalid_argument_type"),
        (format_call("delete", {"target_paths": [1, 2], "reason": "x"}), "invalid_argument_type"),
        ("<tool_call>" + "[" * 5000 + "</tool_call>", "invalid_json"),
        (
            format_call("create_file", {"title": "t", "input_paths": ["a"], "instructions": "x" * 30000}),
            "call_too_large",
        ),
    ],
)
def test_each_malformation_is_one_documented_error(text, code):
    p = parse_tool_calls(text, BUILDER_TOOLS)
    assert [e.code for e in p.errors] == [code]
    assert p.calls == ()
    obs = render_error(p.errors[0])
    assert f"error {code}" in obs and obs.startswith("<tool_response>")
    assert turn_penalty(p) == pytest.approx(-0.05)
    assert turn_penalty(p, ProtocolConfig(malformed_penalty=0.2)) == pytest.approx(-0.2)


def test_too_many_calls_are_not_run_and_errors_name_the_tool():
    text = "".join(format_call("list_files") for _ in range(5))
    p = parse_tool_calls(text, ANSWERER_TOOLS, ProtocolConfig(max_calls=2))
    assert len(p.calls) == 2 and [e.code for e in p.errors] == ["too_many_calls"] * 3
    p = parse_tool_calls(format_call("answer", {"txt": "x"}), ANSWERER_TOOLS)
    assert p.errors[0].tool == "answer" and "answer(text: str)" in p.errors[0].message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=400).map(lambda b: b.decode("utf-8", errors="replace")),
        st.text(max_size=300),
        st.lists(
            st.sampled_from(
                [
                    "<tool_call>",
                    "</tool_call>",
                    "{",
                    "}",
                    '"name"',
                    ":",
                    '"read_file"',
                    ",",
                    '"arguments"',
                    '"path"',
                    "[",
                    "]",
                    "1",
                    "null",
                    '"x"',
                    "\\",
                    " ",
                ]
            ),
            max_size=60,
        ).map("".join),
    )
)
def test_parsing_is_total(text):
    for tools in (BUILDER_TOOLS, ANSWERER_TOOLS):
        p = parse_tool_calls(text, tools)
        assert {e.code for e in p.errors} <= CODES
        for c in p.calls:
            assert c.name in {t.name for t in tools}
        for e in p.errors:
            render_error(e)


def test_truncations_of_a_valid_call_never_raise():
    full = format_call(
        "create_file",
        {
            "title": "Kestrel people",
            "input_paths": ["raw_docs/a.txt", "b"],
            "instructions": "list every person",
        },
    )
    for cut in range(len(full) + 1):
        p = parse_tool_calls(full[:cut], BUILDER_TOOLS)
        assert (len(p.calls), len(p.errors)) in ((1, 0), (0, 1))
        assert (len(p.calls) == 1) == (cut == len(full))


def test_normalised_exact_match():
    assert normalize_answer("  The  Kestrel-Lab, Inc. ") == "kestrellab inc"
    assert exact_match("the Orlen Vask.", ["Orlen Vask"])
    assert exact_match("Vask", ["Orlen Vask", "vask"])
    assert not exact_match("Orlen", ["Orlen Vask"])
    assert not exact_match("", ["", "a"])
    assert not exact_match("the", ["a"])  # both normalise to empty: never a match
    assert parse_verdict('{"correct": 1}') == 1 and parse_verdict('{"correct":0}') == 0
    assert parse_verdict("garbage") == 0


def test_extractive_executor_is_deterministic_and_relevant():
    src = [
        (
            "raw_docs/a.txt",
            "TITLE: A\nOrlen Vask founded Kestrel. The weather was mild. Vask's lab is in "
            "Tarn City. Lunch was soup.",
        ),
        ("raw_docs/b.txt", "Project Kestrel began in 2019. It studies birds."),
    ]
    a = extractive_text("Orlen Vask lab city", "where is the lab", src, max_words=30)
    assert a == extractive_text("Orlen Vask lab city", "where is the lab", src, max_words=30)
    assert a.splitlines()[0] == "Orlen Vask lab city"
    assert "Tarn City" in a and "From raw_docs/b.txt:" in a
    assert "soup" not in a  # irrelevant, over budget
    assert split_sentences("TITLE: x\n# Head\nOne. Two!") == ["One.", "Two!"]
    assert extractive_text("T", "", []) == "T"


def test_remembered_readings_hand_out_fresh_values():
    """`split_sentences` and `content_words` remember texts (up to READ_MEMO_MAX_CHARS), yet a caller that
    changes what it got changes nothing for the next one; longer texts read the same."""
    from librarian_jax.agents import executor

    text = "Orlen Vask founded the lab. It moved to Tarn City!\nTITLE: skipped"
    first = split_sentences(text)
    first.append("changed")
    assert split_sentences(text) == ["Orlen Vask founded the lab.", "It moved to Tarn City!"]
    words = executor.content_words(text)
    words.add("changed")
    assert executor.content_words(text) == {"orlen", "vask", "founded", "lab", "moved", "tarn", "city",
                                            "title", "skipped"}
    long = "x" * executor.READ_MEMO_MAX_CHARS + ". Orlen Vask."
    before = executor._split_sentences.cache_info().currsize
    assert split_sentences(long) == ["x" * executor.READ_MEMO_MAX_CHARS + ".", "Orlen Vask."]
    assert executor.content_words(long) == {"x" * executor.READ_MEMO_MAX_CHARS, "orlen", "vask"}
    assert executor._split_sentences.cache_info().currsize == before  # not remembered


def test_excerpt_sources_come_from_the_structured_source_list():
    from librarian_jax.data.schema import Document
    from librarian_jax.workspace import Workspace

    ws = Workspace.from_documents([Document("a", "body a", title="A"), Document("c", "body c", title="C")])
    ex = ws.source_excerpts(["raw_0001", "raw_0002"])
    assert excerpt_sources(ex) == [
        ("raw_docs/raw_0001__a.txt", "TITLE: A\nbody a"),
        ("raw_docs/raw_0002__c.txt", "TITLE: C\nbody c"),
    ]

    class R:  # no structured list: the whole text is one source, never split on look-alike headers
        text = "=== SOURCE 1: raw_docs/a.txt ===\nTITLE: A\nbody a"

    assert excerpt_sources(R()) == [("sources", R.text)]


def test_prompts_load_and_fill():
    # Every prompt file shipped is a known prompt and every known prompt has a file.
    shipped = {p.stem for p in (Path(prompt_text.__file__).parent / "prompts").glob("*.txt")}
    assert shipped == set(prompt_text.PROMPT_NAMES)
    for name in prompt_text.PROMPT_NAMES:
        assert prompt_text.load(name).strip()
    s = prompt_text.render("judge", question="Q?", gold="a | b", prediction='{"x": 1}')
    assert "Q?" in s and '{"correct": 1}' in s
    with pytest.raises(KeyError, match=r"judge.txt needs a value for \$prediction"):
        prompt_text.render("judge", question="q", gold="g")


def test_random_json_calls_never_raise():
    rng = random.Random(0)
    values = [None, True, 3, -1, 2.5, "x", "", [], ["a"], [1], {}, {"a": 1}, "9" * 30]
    names = [t.name for t in BUILDER_TOOLS] + ["nope", ""]
    for _ in range(300):
        spec = rng.choice(BUILDER_TOOLS)
        args = {
            rng.choice([p.name for p in spec.params] + ["zz"]): rng.choice(values)
            for _ in range(rng.randint(0, 4))
        }
        text = "<tool_call>" + json.dumps({"name": rng.choice(names), "arguments": args}) + "</tool_call>"
        p = parse_tool_calls(text, BUILDER_TOOLS)
        assert len(p.calls) + len(p.errors) == 1


def test_calls_inside_thinking_are_not_calls():
    call = format_call("list_files")
    p = parse_tool_calls(f"<think>maybe {format_call('stop')}?</think> ok {call}", BUILDER_TOOLS)
    assert [c.name for c in p.calls] == ["list_files"] and p.errors == ()
    p = parse_tool_calls(
        f"{format_call('stop')} then </think>{call}", BUILDER_TOOLS
    )  # think opened in prompt
    assert [c.name for c in p.calls] == ["list_files"]
    p = parse_tool_calls(f"{call}<think>I could {call} but ran out", BUILDER_TOOLS)
    assert len(p.calls) == 1
    p = parse_tool_calls(f"<think>{call}", BUILDER_TOOLS)
    assert [e.code for e in p.errors] == ["no_tool_call"]


def test_short_texts_remembers_short_texts_only():
    """`text_memo.short_texts`: a text up to max_chars is computed once, a longer one every time."""
    from librarian_jax import text_memo

    calls = []

    @text_memo.short_texts(entries=2, max_chars=5)
    def upper(text: str) -> str:
        calls.append(text)
        return text.upper()

    assert [upper(t) for t in ("ab", "ab", "abcdef", "abcdef")] == ["AB", "AB", "ABCDEF", "ABCDEF"]
    assert calls == ["ab", "abcdef", "abcdef"]
    assert upper.cache_info().currsize == 1 and upper.__name__ == "upper"
    upper("cd"), upper("ef"), upper("ab")  # two entries: "ab" was pushed out
    assert calls[-1] == "ab" and upper.cache_info().currsize == 2
