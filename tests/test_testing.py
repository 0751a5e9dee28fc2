"""The doubles module: the byte tokenizer is a real `Tokenizer`, and `testing.chat_template` is the real chat
template of every style over it (Gemma's system fold included), not a re-implementation."""

from __future__ import annotations

import pickle

import pytest

from librarian_jax import testing
from librarian_jax.tokenizers import STYLES

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wo ist Zürich?"},
            {"role": "assistant", "content": '<tool_call>{"name": "stop"}</tool_call>'},
            {"role": "tool", "content": "ok"}]


def test_byte_tokenizer_round_trips_text_and_special_tokens():
    tok = testing.ByteTokenizer()
    text = "<|im_start|>user\nZürich <tool_call>x</tool_call><|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == 256 and testing.IM_END in ids and tok.decode(ids) == text
    assert tok.decode(tok.encode("a") + [testing.EOS], skip_special=True) == "a"
    assert pickle.loads(pickle.dumps(tok)).encode(text) == ids


@pytest.mark.parametrize("style", STYLES)
def test_every_real_template_runs_over_the_byte_tokenizer(style):
    tpl = testing.chat_template(style=style)
    msgs = MESSAGES if style != "gemma" else [m for m in MESSAGES if m["role"] != "system"]
    assert tpl.encode_messages(msgs) == tpl.tokenizer.encode(tpl.render(msgs))
    assert tpl.stop_ids[0] == tpl.tokenizer.atomic_tokens[tpl.close_marker]


def test_gemma_folds_the_system_prompt_into_the_first_turn():
    tpl = testing.chat_template(style="gemma", fold_system=True)
    ids = tpl.start("Be brief.") + tpl.turn("user", "Hi")
    assert tpl.tokenizer.decode(ids) == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
    with pytest.raises(ValueError, match="FoldedStart"):
        tpl.start("Be brief.") + [1, 2]


def test_returned_gives_a_model_free_generators_value_and_refuses_one_that_asks_for_an_engine():
    from librarian_jax.testing import returned

    def model_free():
        return "done"
        yield  # a generator function, as the agents' are

    def asks():
        yield "a request for the engine"
        return "never"

    assert returned(model_free()) == "done"
    with pytest.raises(AssertionError, match="asked for an engine: 'a request for the engine'"):
        returned(asks())


# (prompt length, max_new_tokens, stop on the free run's 3rd token): the engine's every way to end a turn
ENDINGS = [(4, 5, False), (4, 100, False), (4, 28, False), (4, 100, True), (31, 100, False), (32, 100, False),
           (4, 0, False)]


def test_scripted_engine_ends_turns_where_the_real_engine_does():
    """The scripted engine replaying a real engine's greedy tokens ends each turn at the same token with the
    same status (stop id, budget, a full cache, a turn refused at admission), as the agents see it."""
    from librarian_jax.engine import Engine

    max_len = 32
    engine = Engine(testing.tiny_model(vocab_size=64, scale=4.0), num_slots=1, max_seq_len=max_len,
                    round_steps=8, prefill_buckets=(32,))
    got: list[tuple[list[int], str]] = []
    want: list[tuple[list[int], str]] = []
    for n, budget, stop in ENDINGS:
        prompt = [(7 * i + 1) % 64 for i in range(n)]
        free = engine.new_session(prompt)  # what the model writes from this prompt until the cache is full
        req = engine.submit(free, max_len)
        engine.run_until_done()
        tokens = list(req.result.tokens)
        stops = tokens[2:3] if stop else []
        real = engine.new_session(prompt)
        req = engine.submit(real, budget, stop_ids=stops)
        engine.run_until_done()
        want.append((list(req.result.tokens), req.result.status))
        engine.close(free)
        engine.close(real)
        scripted = testing.ScriptedEngine(testing.ByteTokenizer(), lambda s, t=tokens: list(t),
                                          max_seq_len=max_len)
        session = scripted.new_session(prompt)
        scripted.submit(session, budget, None, stops)
        (result,) = scripted.step()
        got.append((result.tokens, result.status))
    assert [s for _, s in want] == ["length", "cache_full", "length", "stop", "cache_full", "cache_full",
                                    "length"]
    assert got == want
