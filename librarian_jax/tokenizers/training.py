"""Training this project's own SentencePiece tokenizer (the tiny preset's), deterministically and fast.

Layout of a trained vocabulary (fixed, whatever the text):

    id 0 <pad>   id 1 </s> (EOS)   id 2 <s> (BOS)   id 3 <unk>
    ids 4 .. 4+len(special_tokens)-1: the special tokens, in order (by default 4 <|im_start|>, 5 <|im_end|>,
        6 <tool_call>, 7 </tool_call>, 8 <tool_response>, 9 </tool_response>: Qwen's chat and tool markers),
        each a user-defined piece so it is one token wherever it appears
    the next 256 ids: byte-fallback pieces <0x00> .. <0xFF>, so any text round-trips exactly
    then BPE pieces learned from the text, and, when the text is too small to learn that many, unused
        pieces <unused_0>, <unused_1>, ... (never produced by encoding) so the vocabulary has exactly
        `vocab_size` entries, matching the model's embedding

The text is used as is (identity normalization, no dummy prefix, whitespace kept), so
`decode(encode(text)) == text`.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence

from absl import logging

from librarian_jax.tokenizers.tokenizer import Tokenizer, TokenizerError, load_tokenizer

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

# SentencePiece skips sentences longer than `max_sentence_length` bytes, so lines longer than this many
# characters (<= 4 bytes each) are cut at spaces into chunks of at most this size before training.
_CHUNK_CHARS = 1024
# Bumped whenever the trainer options below change, so cached files trained with old options are not reused.
_FORMAT_VERSION = 3


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    """Non-blank lines of every text, long lines cut at spaces into chunks SentencePiece accepts."""
    for k, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{k}] is {type(text).__name__}, expected str")
        for line in text.splitlines():
            start = 0
            while len(line) - start > _CHUNK_CHARS:
                cut = line.rfind(" ", start + 1, start + _CHUNK_CHARS)
                cut = cut if cut > start else start + _CHUNK_CHARS
                if line[start:cut].strip():
                    yield line[start:cut]
                start = cut
            if line[start:].strip():
                yield line[start:]


def train_sentencepiece(
    texts: Iterable[str],
    out_path: str | os.PathLike[str],
    vocab_size: int = 2048,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    seed: int = 0,
    *,
    max_sentences: int = 200_000,
) -> str:
    """Trains a byte-fallback BPE SentencePiece model on `texts` and writes it to `out_path` (returned).

    Deterministic: the same texts and arguments give a byte-identical file (one thread, fixed seed).
    At most `max_sentences` lines are sampled for training (SentencePiece's `input_sentence_size`).
    """
    import sentencepiece as spm

    out_path = os.fspath(out_path)
    specials = list(dict.fromkeys(special_tokens))
    reserved = {"<pad>", "</s>", "<s>", "<unk>"}
    if bad := [t for t in specials if not t or t in reserved or any(c.isspace() for c in t)]:
        raise ValueError(f"special_tokens {bad}: empty, with whitespace, or one of {sorted(reserved)}")
    minimum = 4 + len(specials) + 256 + 1
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: 4 reserved + {len(specials)} special + 256 byte pieces "
            f"need at least {minimum}"
        )
    sentences = list(_sentences(texts))
    if not sentences:
        raise ValueError("train_sentencepiece got no text to train on (all texts empty or blank)")
    buffer = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=buffer,
            model_type="bpe",
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            bos_id=BOS_ID,
            unk_id=UNK_ID,
            pad_piece="<pad>",
            eos_piece="</s>",
            bos_piece="<s>",
            unk_piece="<unk>",
            user_defined_symbols=specials,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            max_sentence_length=_CHUNK_CHARS * 4,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training for {out_path} failed: {e}") from e
    model = _pad_vocab(buffer.getvalue(), vocab_size)
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    # Write atomically so concurrent processes sharing a cache never read a half-written model.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".model")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    logging.info(
        "trained SentencePiece model %s from %d lines (vocab <= %d)", out_path, len(sentences), vocab_size
    )
    return out_path


def _pad_vocab(model: bytes, vocab_size: int) -> bytes:
    """Appends UNUSED pieces so a model trained with a soft vocab limit has exactly `vocab_size` pieces."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    missing = vocab_size - len(proto.pieces)
    if missing <= 0:
        return model
    existing = {p.piece for p in proto.pieces}
    k = 0
    for _ in range(missing):
        while f"<unused_{k}>" in existing:
            k += 1
        piece = proto.pieces.add()
        piece.piece = f"<unused_{k}>"
        piece.type = sentencepiece_model_pb2.ModelProto.SentencePiece.UNUSED
        piece.score = 0.0
        k += 1
    logging.info("the text gave %d pieces; padded with %d unused ones", vocab_size - missing, missing)
    return proto.SerializeToString()


def tokenizer_cache_key(
    texts: Sequence[str],
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    seed: int = 0,
) -> str:
    """A hex digest of everything that determines a trained tokenizer (texts, options, library versions)."""
    import sentencepiece as spm

    h = hashlib.sha256()
    header = f"v{_FORMAT_VERSION}|spm{spm.__version__}|vocab{vocab_size}|seed{seed}|{list(special_tokens)!r}"
    h.update(header.encode())
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def cached_tokenizer(
    texts: Iterable[str],
    cache_dir: str | os.PathLike[str],
    vocab_size: int = 2048,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    seed: int = 0,
) -> Tokenizer:
    """Loads the tokenizer trained on exactly these inputs from `cache_dir`, training it first if absent.

    The file is `cache_dir/sp-v{vocab_size}-{hash}.model`, keyed by `tokenizer_cache_key`; an unreadable
    cached file is retrained.
    """
    texts = list(texts)
    key = tokenizer_cache_key(texts, vocab_size, special_tokens, seed)
    path = os.path.join(os.fspath(cache_dir), f"sp-v{vocab_size}-{key[:20]}.model")
    if os.path.isfile(path):
        try:
            return load_tokenizer(path)
        except TokenizerError as e:
            logging.warning("cached tokenizer %s is unreadable (%s); retraining", path, e)
    train_sentencepiece(texts, path, vocab_size, special_tokens, seed)
    return load_tokenizer(path)
