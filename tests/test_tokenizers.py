"""Tokenizers: both backends (SentencePiece, tokenizer.json), special tokens, chat templates, training.

Every tokenizer here is built by the test itself: SentencePiece models trained with `train_sentencepiece` (and
one Llama-2-style model trained directly with sentencepiece), tokenizer.json files trained with `tokenizers`.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFRaw

from librarian_jax.tokenizers import (
    BOS_ID,
    DEFAULT_SPECIAL_TOKENS,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    cached_tokenizer,
    chat_template,
    detect_style,
    load_tokenizer,
    train_sentencepiece,
)
from librarian_jax.tokenizers import training as training_mod

GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")

CORPUS = [
    "The archive of the northern library holds 1,842 scrolls on river trade.\n"
    "Each scroll names its merchant, the city council that taxed it, and the year it was copied.",
    "Merchants travelled north along the river; the council recorded every ledger in the catalog.\n\n"
    "  Indented line with    extra spaces and a tab\there.",
    "def answer(question):\n    return lookup(question)  # reads the workspace\n",
    "Café owners in Zürich wrote to the archive in 1903 about naïve catalog numbers: 12345, 67890.",
] * 8

TEXTS = [
    "hello world",
    " leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "unicode: é ü ß 中文 日本語 😀 🚀",
    'a tool call: <tool_call>{"name": "read_file", "arguments": {"path": "raw/a.txt"}}</tool_call> done',
    "markers inline <|im_start|>user\nhi<|im_end|>\n and <s> </s> <pad>",
    "",
    "x",
]


# ---- fixtures: one tokenizer of each kind, built once per module -----------------------------------------
@pytest.fixture(scope="module")
def sp_chatml(tmp_path_factory) -> SentencePieceTokenizer:
    path = train_sentencepiece(CORPUS, tmp_path_factory.mktemp("sp") / "tokenizer.model", vocab_size=600)
    tok = load_tokenizer(path)
    assert isinstance(tok, SentencePieceTokenizer)
    return tok


@pytest.fixture(scope="module")
def sp_gemma(tmp_path_factory) -> SentencePieceTokenizer:
    specials = (*GEMMA_MARKERS, "<tool_call>", "</tool_call>")
    path = train_sentencepiece(CORPUS, tmp_path_factory.mktemp("spg") / "tokenizer.model", 600, specials)
    tok = load_tokenizer(path)
    assert isinstance(tok, SentencePieceTokenizer)
    return tok


def _train_hf(texts: list[str], pre, dec, specials: list[str], model) -> HFRaw:
    tok = HFRaw(model)
    tok.pre_tokenizer = pre
    tok.decoder = dec
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre, pre_tokenizers.ByteLevel) else []
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=alphabet, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_qwen_dir(tmp_path_factory) -> str:
    """A Qwen-like byte-level BPE tokenizer.json with tokenizer_config.json (no BOS, eos=<|im_end|>)."""
    d = tmp_path_factory.mktemp("hfq")
    raw = _train_hf(
        CORPUS,
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        decoders.ByteLevel(),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        models.BPE(),
    )
    raw.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    raw.save(str(d / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": {"content": "<|endoftext|>", "special": True},
        "unk_token": None,
        "add_bos_token": False,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


@pytest.fixture(scope="module")
def hf_qwen(hf_qwen_dir) -> HFTokenizer:
    tok = load_tokenizer(hf_qwen_dir)
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def hf_gemma(tmp_path_factory) -> HFTokenizer:
    """A Gemma-like Metaspace BPE tokenizer.json without tokenizer_config.json (roles found by name)."""
    d = tmp_path_factory.mktemp("hfg")
    raw = _train_hf(
        CORPUS + [m["content"] for m in CONVERSATION],
        pre_tokenizers.Metaspace(prepend_scheme="always"),
        decoders.Metaspace(prepend_scheme="always"),
        ["<pad>", "<eos>", "<bos>", "<unk>", *GEMMA_MARKERS],
        models.BPE(unk_token="<unk>"),
    )
    raw.save(str(d / "tokenizer.json"))
    tok = load_tokenizer(d / "tokenizer.json")
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> HFTokenizer:
    """A Llama-3-like byte-level BPE tokenizer.json with header/eot special tokens."""
    d = tmp_path_factory.mktemp("hfl")
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
    specials.append("<|eot_id|>")
    raw = _train_hf(
        CORPUS, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), specials, models.BPE()
    )
    raw.save(str(d / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(d)
    assert isinstance(tok, HFTokenizer)
    return tok


# ---- SentencePiece backend -------------------------------------------------------------------------------
def test_trained_sentencepiece_layout(sp_chatml):
    tok = sp_chatml
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (PAD_ID, EOS_ID, BOS_ID, UNK_ID)
    assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)
    for k, special in enumerate(DEFAULT_SPECIAL_TOKENS):
        assert tok.token_to_id(special) == 4 + k
        assert tok.id_to_token(4 + k) == special
    assert tok.id_to_token(4 + len(DEFAULT_SPECIAL_TOKENS)) == "<0x00>"
    assert tok.vocab_size == 600
    assert tok.token_to_id("definitely-not-a-piece") is None
    assert tok.add_bos
    with pytest.raises(IndexError, match="600|outside"):
        tok.id_to_token(tok.vocab_size)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_round_trip_and_matches_native(sp_chatml, text):
    ids = sp_chatml.encode(text)
    assert sp_chatml.decode(ids) == text
    if not any(m in text for m in ("<s>", "</s>", "<pad>")):
        # Without control-token strings in the text, our encoding is sentencepiece's own.
        native = spm.SentencePieceProcessor(model_file=sp_chatml.path)
        assert ids == native.encode(text)


@pytest.mark.parametrize("backend", ["sp_chatml", "hf_qwen"])
def test_byte_fallback_and_byte_level_round_trip_any_text(request, backend):
    tok = request.getfixturevalue(backend)

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.text(max_size=40))
    def check(text):
        assert tok.decode(tok.encode(text)) == text

    check()


def test_special_tokens_are_single_ids_sentencepiece(sp_chatml):
    tok = sp_chatml
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    call, end_call = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    ids = tok.encode("x<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>")
    for special in (im_start, im_end, call, end_call):
        assert ids.count(special) == 1
    # Control tokens (not matched by sentencepiece itself) are matched too.
    assert tok.encode("<s>") == [BOS_ID]
    assert tok.encode("a</s>") == [*tok.encode("a"), EOS_ID]
    # Concatenation is exact at atomic boundaries.
    a, b = "some text before", "<|im_end|>\nafter"
    assert tok.encode(a + b) == tok.encode(a) + tok.encode(b)


def test_decode_skip_special_keeps_tool_calls(sp_chatml, hf_qwen):
    for tok in (sp_chatml, hf_qwen):
        text = "<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>\n"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special=True) == "assistant\n<tool_call>x</tool_call>\n"
        with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is outside"):
            tok.decode([tok.vocab_size], strict=True)
        assert tok.decode([*ids, tok.vocab_size + 5, -1]) == text  # padded embedding rows: dropped


def test_dummy_prefix_sentencepiece_concatenates_exactly(tmp_path):
    """A Llama-2-style model (dummy-prefix space, control-symbol markers) still splits exactly on markers."""
    prefix = str(tmp_path / "llama")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(line for t in CORPUS for line in t.splitlines() if line.strip()),
        model_prefix=prefix,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        control_symbols=["<|im_start|>", "<|im_end|>"],
        num_threads=1,
        minloglevel=2,
    )
    tok = load_tokenizer(prefix + ".model")
    im_start = tok.token_to_id("<|im_start|>")
    # (Its default nmt_nfkc normalizer folds newlines and strips spaces around segments: this text has none.)
    text = "<|im_start|>user the river<|im_end|>north"
    ids = tok.encode(text)
    assert ids[0] == im_start and ids.count(tok.token_to_id("<|im_end|>")) == 1
    assert tok.decode(ids) == text
    chat = chat_template(tok)
    msgs = [{"role": "user", "content": "the river"}, {"role": "assistant", "content": "north"}]
    assert chat.encode_messages(msgs) == tok.encode(chat.render(msgs))


# ---- tokenizer.json backend ------------------------------------------------------------------------------
def test_hf_reads_tokenizer_config(hf_qwen):
    tok = hf_qwen
    assert tok.bos_id is None and not tok.add_bos
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert tok.unk_id is None
    assert tok.vocab_size == 402
    assert tok.id_to_token(tok.token_to_id("<tool_call>")) == "<tool_call>"
    assert tok.token_to_id("not-in-vocab") is None


def test_hf_roles_found_by_name_without_config(hf_gemma):
    tok = hf_gemma
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.add_bos


@pytest.mark.parametrize("text", TEXTS)
def test_hf_byte_level_round_trip_and_matches_native(hf_qwen, text):
    ids = hf_qwen.encode(text)
    assert hf_qwen.decode(ids) == text
    native = HFRaw.from_file(os.path.join(os.path.dirname(hf_qwen.path), "tokenizer.json"))
    assert ids == native.encode(text, add_special_tokens=False).ids


def test_special_tokens_are_single_ids_hf(hf_qwen, hf_gemma):
    ids = hf_qwen.encode("a<|im_start|>user\n<tool_call>{}</tool_call><|im_end|>")
    for name in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert ids.count(hf_qwen.token_to_id(name)) == 1
    text = "<bos><start_of_turn>user\nthe river<end_of_turn>\n"
    ids = hf_gemma.encode(text)
    assert ids[:2] == [hf_gemma.bos_id, hf_gemma.token_to_id("<start_of_turn>")]
    assert hf_gemma.decode(ids) == text  # Metaspace's per-segment prefix space is undone per segment


def _sentencepiece_as_tokenizer_json(sp_path: str, out_dir: Path) -> str:
    """The same vocabulary as a Gemma-style tokenizer.json (byte-fallback BPE, as transformers converts)."""
    sp = spm.SentencePieceProcessor(model_file=sp_path)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, rank in vocab.items():  # the merge that makes each piece, in the order of the pieces
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        local = [ab for ab in splits if ab[0] in vocab and ab[1] in vocab]
        merges += [(rank, ab) for ab in sorted(local, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))]
    merges.sort(key=lambda m: m[0])
    bpe = models.BPE(vocab, [ab for _, ab in merges], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    raw = HFRaw(bpe)
    raw.normalizer = normalizers.Replace(" ", "\u2581")
    raw.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    special = [i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    added = [*special, *range(4, 4 + len(DEFAULT_SPECIAL_TOKENS))]
    raw.add_tokens([AddedToken(sp.id_to_piece(i), special=i in special, normalized=False) for i in added])
    out_dir.mkdir()
    raw.save(str(out_dir / "tokenizer.json"))
    return str(out_dir / "tokenizer.json")


def test_same_vocabulary_gives_same_ids_through_both_backends(sp_chatml, tmp_path):
    hf = load_tokenizer(_sentencepiece_as_tokenizer_json(sp_chatml.path, tmp_path / "converted"))
    assert isinstance(hf, HFTokenizer) and hf.vocab_size == sp_chatml.vocab_size
    assert (hf.bos_id, hf.eos_id, hf.pad_id, hf.unk_id) == (BOS_ID, EOS_ID, PAD_ID, UNK_ID)
    for text in TEXTS:
        assert hf.encode(text) == sp_chatml.encode(text), text
        assert hf.decode(hf.encode(text)) == text
    conversation = chat_template(hf).encode_messages(CONVERSATION, add_generation_prompt=True)
    assert conversation == chat_template(sp_chatml).encode_messages(CONVERSATION, add_generation_prompt=True)

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(DEFAULT_SPECIAL_TOKENS)), max_size=6))
    def check(parts):
        text = "".join(parts)
        assert hf.encode(text) == sp_chatml.encode(text)

    check()


# ---- chat templates --------------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "You are a librarian. Keep answers short."},
    {"role": "user", "content": "Where are the river ledgers?"},
    {"role": "assistant", "content": '<tool_call>{"name": "list_files", "arguments": {}}</tool_call>'},
    {"role": "tool", "content": "raw/ledger_1842.txt\nraw/council.txt"},
    {"role": "user", "content": "  Café 1903?\n\n"},
    {"role": "assistant", "content": "The council ledger, 1903."},
]


@pytest.mark.parametrize(
    ("backend", "style", "fold"),
    [
        ("sp_chatml", "chatml", False),
        ("hf_qwen", "chatml", False),
        ("sp_gemma", "gemma", False),
        ("hf_gemma", "gemma", False),
        ("sp_gemma", "gemma", True),
        ("hf_gemma", "gemma", True),
        ("hf_llama", "llama3", False),
    ],
)
def test_turn_by_turn_ids_equal_encoding_of_rendered_text(request, backend, style, fold):
    tok = request.getfixturevalue(backend)
    chat = chat_template(tok, style, fold_system=fold)
    text = chat.render(CONVERSATION, add_generation_prompt=True)
    expected = tok.encode(text)
    # Built by hand, the way a rollout does it.
    ids = chat.start(system=CONVERSATION[0]["content"])
    for m in CONVERSATION[1:]:
        ids += chat.turn(m["role"], m["content"])
    ids += chat.open_turn("assistant")
    assert ids == expected
    assert chat.encode_messages(CONVERSATION, add_generation_prompt=True) == expected
    assert tok.decode(expected) == text
    end = tok.token_to_id(chat.close_marker)
    assert chat.stop_ids[0] == end and chat.close_turn()[0] == end
    # Sampled ids appended between open_turn and close_turn stay exactly as sampled.
    sampled = tok.encode("The council")
    history = chat.open_turn("assistant") + sampled + chat.close_turn()
    assert history[len(chat.open_turn("assistant")) :][: len(sampled)] == sampled


ALL_BACKENDS = ["sp_chatml", "sp_gemma", "hf_qwen", "hf_gemma", "hf_llama"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", *GEMMA_MARKERS, "<|eot_id|>"]
# Text drawn from the corpus's own characters plus some specials, so every backend can represent it.
corpus_text = st.text(alphabet=sorted(set("".join(CORPUS)) | set(" \n\t")), max_size=30)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_concatenation_is_exact_at_special_tokens(request, backend):
    tok = request.getfixturevalue(backend)
    specials = [t for t in SPECIALS if t in tok.atomic_tokens]

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(corpus_text, st.sampled_from(specials), corpus_text)
    def check(a, special, b):
        assert tok.encode(a + special + b) == tok.encode(a) + [tok.token_to_id(special)] + tok.encode(b)

    check()


@pytest.mark.parametrize(
    ("backend", "fold"), [(b, False) for b in ALL_BACKENDS] + [("sp_gemma", True), ("hf_gemma", True)]
)
def test_turn_by_turn_equality_on_random_conversations(request, backend, fold):
    tok = request.getfixturevalue(backend)
    chat = chat_template(tok, fold_system=fold)
    roles = ["user", "assistant", "tool"]
    message = st.fixed_dictionaries({"role": st.sampled_from(roles), "content": corpus_text})

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(st.one_of(st.none(), corpus_text), st.lists(message, max_size=5), st.booleans())
    def check(system, messages, prompt):
        msgs = ([{"role": "system", "content": system}] if system is not None else []) + messages
        ids = chat.encode_messages(msgs, add_generation_prompt=prompt)
        assert ids == tok.encode(chat.render(msgs, add_generation_prompt=prompt))
        by_hand = chat.start(system)
        for m in messages:
            by_hand += chat.turn(m["role"], m["content"])
        assert by_hand + (chat.open_turn("assistant") if prompt else []) == ids

    check()


# Text that mixes the corpus's characters with special-token strings, so joins fall next to them too.
joined_text = st.lists(st.one_of(corpus_text, st.sampled_from(SPECIALS)), max_size=4).map("".join)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_encode_joined_equals_the_whole_texts_encoding(request, backend):
    """`encode_joined(head, tail)` is `encode(head + tail)` wherever it is asked, and takes the halves'
    encodings exactly where `splits_between` says the tokenizer cannot merge across the join (our trained
    SentencePiece models: a space after a non-space character)."""
    tok = request.getfixturevalue(backend)
    split = []

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(joined_text, st.sampled_from(["", " ", "  ", " \n", "\n "]), joined_text)
    def check(head, glue, rest):
        tail = glue + rest
        if tok.splits_between(head, tail):
            split.append(1)
            assert tok.encode(head) + tok.encode(tail) == tok.encode(head + tail), (head, tail)
        assert tok.encode_joined(head, tail) == tok.encode(head + tail)

    check()
    if isinstance(tok, SentencePieceTokenizer):
        assert len(split) > 50  # the property above was exercised, not skipped
        assert tok.splits_between("Question:", " who") and not tok.splits_between("Question: ", " who")
        assert not tok.splits_between("Question:", "who") and not tok.splits_between("", " who")
    else:
        assert not split  # tokenizer.json backends claim no join: the whole text is encoded


def test_splits_between_needs_a_model_without_pieces_across_words(tmp_path):
    """A SentencePiece model whose pieces may cross a space (trained without splitting at whitespace), or
    that adds a dummy-prefix space, claims no join: its `encode_joined` encodes the whole text."""
    lines = [line for t in CORPUS for line in t.splitlines() if line.strip()]
    for name, extra in (("across", {"split_by_whitespace": False, "normalization_rule_name": "identity",
                                    "add_dummy_prefix": False, "remove_extra_whitespaces": False}),
                        ("dummy", {})):
        prefix = str(tmp_path / name)
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=400,
                                       model_type="bpe", byte_fallback=True, num_threads=1, minloglevel=2,
                                       **extra)
        tok = load_tokenizer(prefix + ".model")
        assert not tok.splits_between("the river", " north"), name
        assert tok.encode_joined("the river", " north") == tok.encode("the river north")


@pytest.mark.parametrize(("backend", "fold"), [("sp_chatml", False), ("sp_gemma", False), ("sp_gemma", True),
                                               ("hf_qwen", False)])
def test_turn_joined_equals_turn(request, backend, fold):
    tok = request.getfixturevalue(backend)
    chat = chat_template(tok, fold_system=fold)

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.sampled_from(["user", "assistant", "tool"]), corpus_text, corpus_text)
    def check(role, head, rest):
        assert chat.turn_joined(role, head, " " + rest) == chat.turn(role, head + " " + rest)

    check()


@pytest.mark.parametrize("backend", ["sp_chatml", "hf_qwen"])
def test_tokenizers_pickle_by_path(request, backend):
    tok = request.getfixturevalue(backend)
    clone = pickle.loads(pickle.dumps(tok))
    assert type(clone) is type(tok) and clone.path == tok.path
    assert clone.encode(TEXTS[4]) == tok.encode(TEXTS[4])


@pytest.mark.parametrize("backend", ["sp_chatml", "hf_qwen"])
def test_encode_remembers_texts_yet_hands_out_fresh_lists(request, backend, monkeypatch):
    """`encode`'s memo: the same ids as the backend's own encoding the second time, a list the caller may
    change without changing the next answer, at most ENCODE_MEMO_ENTRIES texts, long texts never kept."""
    from librarian_jax.tokenizers import tokenizer as tokenizer_mod

    tok = request.getfixturevalue(backend)
    text = TEXTS[4]
    first = tok.encode(text)
    assert first == tok._encode_uncached(text)
    first.append(-1)
    assert tok.encode(text) == tok._encode_uncached(text)
    monkeypatch.setattr(tokenizer_mod, "ENCODE_MEMO_ENTRIES", 3)
    monkeypatch.setattr(tokenizer_mod, "ENCODE_MEMO_MAX_CHARS", 40)
    tok._encoded.clear()
    for i in range(10):
        assert tok.encode(f"line {i} of a text") == tok._encode_uncached(f"line {i} of a text")
        assert len(tok._encoded) <= 3
    tok.encode("x" * 41)
    assert "x" * 41 not in tok._encoded


def test_chatml_text_format(hf_qwen):
    chat = chat_template(hf_qwen)
    assert chat.style == "chatml" and not chat.add_bos
    text = chat.render(CONVERSATION[:2], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a librarian. Keep answers short.<|im_end|>\n"
        "<|im_start|>user\nWhere are the river ledgers?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.stop_ids == (hf_qwen.token_to_id("<|im_end|>"), hf_qwen.token_to_id("<|endoftext|>"))
    # A tool result is a user turn wrapped in <tool_response>, as Qwen's own template writes it.
    assert chat.render([{"role": "tool", "content": "ok"}]) == (
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
    )


def test_gemma_text_format(sp_gemma):
    chat = chat_template(sp_gemma, "gemma")
    assert chat.add_bos and not chat.fold_system
    text = chat.render(CONVERSATION[:3], add_generation_prompt=True)
    assert text == (
        "<s><start_of_turn>user\nYou are a librarian. Keep answers short.<end_of_turn>\n"
        "<start_of_turn>user\nWhere are the river ledgers?<end_of_turn>\n"
        "<start_of_turn>model\n" + CONVERSATION[2]["content"] + "<end_of_turn>\n<start_of_turn>model\n"
    )
    assert chat.stop_ids == (sp_gemma.token_to_id("<end_of_turn>"), sp_gemma.eos_id)
    # Stateless: start()'s ids can be reused, and calls for other conversations in between change nothing.
    head = chat.start("sys")
    assert head == sp_gemma.encode("<s><start_of_turn>user\nsys<end_of_turn>\n")
    chat.start("another conversation's system prompt")
    assert chat.turn("user", "q") == sp_gemma.encode("<start_of_turn>user\nq<end_of_turn>\n")
    assert chat.turn("user", "  q \n") == chat.turn("user", "q")  # content is trimmed, as Gemma does


def test_gemma_fold_system_matches_gemmas_own_template(sp_gemma, sp_chatml):
    chat = chat_template(sp_gemma, "gemma", fold_system=True)
    text = chat.render(CONVERSATION[:3], add_generation_prompt=True)
    assert text == (
        "<s><start_of_turn>user\nYou are a librarian. Keep answers short.\n\nWhere are the river ledgers?"
        "<end_of_turn>\n<start_of_turn>model\n" + CONVERSATION[2]["content"] + "<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    # start() returns the system prompt with its ids; adding the next turn folds it in. The template holds
    # nothing: the head is reusable and other conversations' calls in between change nothing.
    head = chat.start("sys")
    assert head == [sp_gemma.bos_id]
    folded = sp_gemma.encode("<start_of_turn>user\nsys\n\nq<end_of_turn>\n")
    chat.start("another conversation's system prompt")
    assert head + chat.turn("user", " q") == [sp_gemma.bos_id, *folded]
    assert head + chat.turn("user", " q") == [sp_gemma.bos_id, *folded]
    assert chat.turn("user", " q", system="sys") == folded
    assert chat.turn("user", "q") == sp_gemma.encode("<start_of_turn>user\nq<end_of_turn>\n")
    opened = sp_gemma.encode("<start_of_turn>model\nsys\n\n")
    assert head + chat.open_turn("model") == [sp_gemma.bos_id, *opened]
    with pytest.raises(ValueError, match="FoldedStart"):
        head + [5]  # noqa: B018 (the system prompt would be lost)
    with pytest.raises(ValueError, match=r"fold_system=True is for styles without a system role \(gemma\)"):
        chat_template(sp_chatml, fold_system=True)


def test_llama3_text_format(hf_llama):
    chat = chat_template(hf_llama)
    assert chat.style == "llama3" and chat.add_bos
    text = chat.render(CONVERSATION[:4], add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a librarian. Keep answers "
        "short.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhere are the river ledgers?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n" + CONVERSATION[2]["content"] + "<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n" + CONVERSATION[3]["content"] + "<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert chat.stop_ids == (hf_llama.token_to_id("<|eot_id|>"),)
    assert chat.close_turn() == [hf_llama.token_to_id("<|eot_id|>")]


def test_style_detection(sp_chatml, sp_gemma, hf_gemma, tmp_path):
    assert detect_style(sp_chatml) == "chatml"
    assert detect_style(sp_gemma) == "gemma"
    assert detect_style(hf_gemma) == "gemma"
    plain = load_tokenizer(train_sentencepiece(CORPUS, tmp_path / "plain.model", 400, special_tokens=()))
    with pytest.raises(ValueError, match="cannot detect a chat style.*plain.model"):
        chat_template(plain)
    with pytest.raises(ValueError, match=r"<start_of_turn>.*tokenizer.model"):
        chat_template(sp_chatml, "gemma")
    with pytest.raises(ValueError, match="unknown chat template style 'llama'"):
        chat_template(sp_chatml, "llama")
    with pytest.raises(ValueError, match="unknown chatml role 'model'"):
        chat_template(sp_chatml).turn("model", "x")
    with pytest.raises(ValueError, match="message 1: a system message"):
        msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        chat_template(sp_chatml).render(msgs)


# ---- training and cache ----------------------------------------------------------------------------------
def test_training_is_deterministic(tmp_path, sp_chatml):
    again = train_sentencepiece(CORPUS, tmp_path / "again.model", vocab_size=600)
    with open(again, "rb") as f1, open(sp_chatml.path, "rb") as f2:
        assert f1.read() == f2.read()


def test_small_text_is_padded_to_the_exact_vocab_size(tmp_path):
    tok = load_tokenizer(train_sentencepiece(["the river", "a river"], tmp_path / "small.model", 400))
    assert tok.vocab_size == 400  # learned pieces, then unused ones: the model's embedding size
    first_unused = next(i for i in range(400) if tok.id_to_token(i).startswith("<unused_"))
    assert first_unused > 4 + len(DEFAULT_SPECIAL_TOKENS) + 256
    text = "the river <unused_3> runs north\n"
    ids = tok.encode(text)
    assert max(ids) < first_unused and tok.decode(ids) == text


def test_long_lines_are_cut_at_spaces_for_training():
    line = " ".join(f"word{k}" for k in range(3000)) + "x" * 3000
    chunks = list(training_mod._sentences(["short line", "  \n", line]))
    assert chunks[0] == "short line" and "".join(chunks[1:]) == line
    assert all(len(c) <= training_mod._CHUNK_CHARS for c in chunks)
    assert all(c.startswith(" ") for c in chunks[2:-3])  # cut before a space, not inside a word


def test_training_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no text"):
        train_sentencepiece(["", "  \n"], tmp_path / "x.model")
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_sentencepiece(CORPUS, tmp_path / "x.model", vocab_size=100)
    with pytest.raises(ValueError, match="special_tokens"):
        train_sentencepiece(CORPUS, tmp_path / "x.model", special_tokens=("<s>",))
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        train_sentencepiece(["a", b"b"], tmp_path / "x.model")  # type: ignore[list-item]


def test_cached_tokenizer_trains_once(tmp_path, monkeypatch):
    calls = []
    real = training_mod.train_sentencepiece

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(training_mod, "train_sentencepiece", counting)
    first = cached_tokenizer(CORPUS, tmp_path, vocab_size=500)
    second = cached_tokenizer(CORPUS, tmp_path, vocab_size=500)
    assert len(calls) == 1 and first.path == second.path
    assert first.encode("the river") == second.encode("the river")
    other = cached_tokenizer(CORPUS[:2], tmp_path, vocab_size=500)
    assert len(calls) == 2 and other.path != first.path
    with open(first.path, "wb") as f:  # a corrupt cached file is retrained
        f.write(b"garbage")
    cached_tokenizer(CORPUS, tmp_path, vocab_size=500)
    assert len(calls) == 3 and load_tokenizer(first.path).vocab_size == first.vocab_size


# ---- loading errors --------------------------------------------------------------------------------------
def test_load_errors_name_the_path(tmp_path, hf_qwen_dir):
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model in folder .*empty"):
        load_tokenizer(empty)
    bad_model = tmp_path / "bad.model"
    bad_model.write_bytes(b"\x00\x01 not a proto")
    with pytest.raises(TokenizerError, match="bad.model"):
        load_tokenizer(bad_model)
    bad_json = tmp_path / "bad" / "tokenizer.json"
    bad_json.parent.mkdir()
    bad_json.write_text('{"model": ')
    with pytest.raises(TokenizerError, match="bad/tokenizer.json"):
        load_tokenizer(bad_json.parent)
    broken = tmp_path / "broken"
    broken.mkdir()
    with open(os.path.join(hf_qwen_dir, "tokenizer.json")) as f:
        (broken / "tokenizer.json").write_text(f.read())
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="broken/tokenizer_config.json"):
        load_tokenizer(broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(TokenizerError, match="eos_token='<nope>'"):
        load_tokenizer(broken)
    with pytest.raises(TypeError, match="bytes"):
        load_tokenizer(hf_qwen_dir).encode(b"x")  # type: ignore[arg-type]


def test_folder_prefers_tokenizer_json(tmp_path, hf_qwen_dir, sp_chatml):
    d = tmp_path / "both"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(hf_qwen_dir, name)) as f:
            (d / name).write_text(f.read())
    with open(sp_chatml.path, "rb") as f:
        (d / "tokenizer.model").write_bytes(f.read())
    assert isinstance(load_tokenizer(d), HFTokenizer)
    os.remove(d / "tokenizer.json")
    assert isinstance(load_tokenizer(d), SentencePieceTokenizer)
