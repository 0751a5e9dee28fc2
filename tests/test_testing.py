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
