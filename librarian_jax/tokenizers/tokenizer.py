"""One tokenizer interface over SentencePiece (`tokenizer.model`) and Hugging Face (`tokenizer.json`) files.

Both backends share one rule for special tokens: the text is first split on the tokenizer's *atomic* tokens
(control and user-defined pieces of a SentencePiece model, added tokens of a `tokenizer.json`, and the
special tokens `tokenizer_config.json` names); each atomic token becomes its single id and every plain
segment between them is encoded on its own by the backend. So `encode(a + b) == encode(a) + encode(b)`
whenever `b` starts (or `a` ends) with an atomic token, which is what lets a chat template build a
conversation's ids turn by turn that equal the encoding of the whole rendered text. Like Hugging Face's
default, a special-token string written in the text (e.g. `<|im_end|>`) becomes that token. `decode` mirrors
this: atomic ids are rendered as their text and the plain runs between them are decoded by the backend, so
`decode(encode(text)) == text` for any text a byte-fallback (SentencePiece) or byte-level (BPE) vocabulary
can represent.
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from absl import logging

# Atomic pieces of a SentencePiece model that count as *special* for `decode(..., skip_special=True)` even
# though they are user-defined pieces (control pieces and <unk> always count): the turn markers. Tool-call
# markers are deliberately not special, as in Qwen's tokenizer, so skipping specials keeps tool calls.
TURN_MARKERS = frozenset(
    {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>"}
)

# Names tried, in order, for bos / eos / pad / unk when a tokenizer.json has no tokenizer_config.json.
_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")
_UNK_NAMES = ("<unk>", "[UNK]")


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable, or inconsistent (the message names the file)."""


def _trie_regex(tokens: Iterable[str]) -> re.Pattern[str] | None:
    """A regex matching any of `tokens`, longest first, built as a trie so thousands of tokens stay fast."""
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = True
    if not trie:
        return None

    def build(node: dict[str, Any]) -> str:
        ends = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch != ""]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Alternatives are tried greedily, so a longer token wins over its own prefix.
        return f"(?:{body})?" if ends else body

    return re.compile(build(trie))


ENCODE_MEMO_ENTRIES = 8192  # texts whose ids `Tokenizer.encode` keeps
ENCODE_MEMO_MAX_CHARS = 65536  # longer texts are encoded each time


class Tokenizer(abc.ABC):
    """Text <-> token ids. Subclasses provide the plain-text backend; this class handles atomic tokens.

    Attributes:
      path: the file this tokenizer was loaded from.
      bos_id, eos_id, pad_id, unk_id: ids of those tokens, or None when the vocabulary has none.
      add_bos: whether sequences of this model start with BOS (False for e.g. Qwen, which has no BOS).
      special_ids: ids skipped by `decode(..., skip_special=True)`.
    """

    def __init__(
        self,
        path: str,
        *,
        atomic: dict[str, int],
        special_ids: Iterable[int],
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        unk_id: int | None,
        add_bos: bool | None = None,
    ) -> None:
        self.path = path
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.add_bos = (bos_id is not None) if add_bos is None else (add_bos and bos_id is not None)
        self._atomic = {tok: i for tok, i in atomic.items() if tok}
        self._atomic_text = {i: tok for tok, i in self._atomic.items()}
        self._atomic_re = _trie_regex(self._atomic)
        self.special_ids = frozenset(special_ids)
        self._encoded: dict[str, tuple[int, ...]] = {}  # `encode`'s memo (see there)

    # ---- backend hooks -------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (the model's embedding may be larger)."""

    @abc.abstractmethod
    def _encode_plain(self, segments: list[str]) -> list[list[int]]:
        """Encodes segments that contain no atomic token, each on its own."""

    @abc.abstractmethod
    def _decode_plain(self, ids: list[int]) -> str:
        """Decodes a run of ids that contains no atomic token."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (a piece/token string, not text), or None if absent."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of an id. Raises IndexError for ids outside [0, vocab_size)."""

    # ---- shared logic --------------------------------------------------------------------------------------
    @property
    def atomic_tokens(self) -> dict[str, int]:
        """Token text -> id for every token matched as a whole in text (copy)."""
        return dict(self._atomic)

    def split_atomic(self, text: str) -> list[str | int]:
        """Splits `text` into plain segments (str) and atomic token ids (int), in order; no empty segments."""
        if self._atomic_re is None:
            return [text] if text else []
        parts: list[str | int] = []
        pos = 0
        for m in self._atomic_re.finditer(text):
            if m.end() == m.start():
                continue
            if m.start() > pos:
                parts.append(text[pos : m.start()])
            parts.append(self._atomic[m.group()])
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added); special-token strings in the text become their ids.

        Remembered: agents encode the same texts again and again (the scripted answerer counts the tokens of
        every file it reads, for each of a corpus's questions, in each episode of a group), so the ids of up
        to `ENCODE_MEMO_ENTRIES` texts of at most `ENCODE_MEMO_MAX_CHARS` characters are kept; a fresh list
        is returned each time."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._encoded.get(text)
        if ids is None:
            ids = tuple(self._encode_uncached(text))
            if len(text) <= ENCODE_MEMO_MAX_CHARS:
                if len(self._encoded) >= ENCODE_MEMO_ENTRIES:
                    self._encoded.clear()  # full: start over (atomic, so threads may share a tokenizer)
                self._encoded[text] = ids
        return list(ids)

    def encode_joined(self, head: str, tail: str) -> list[int]:
        """`encode(head + tail)`, made of `encode(head)` and `encode(tail)` (each remembered) where no token
        can span the end of `head` (`splits_between`), else of the whole text: prompts that differ only in
        their ends (a corpus's questions after the same README, listing and preloaded files) encode their
        shared head once."""
        if self.splits_between(head, tail):
            return self.encode(head) + self.encode(tail)
        return self.encode(head + tail)

    def splits_between(self, head: str, tail: str) -> bool:
        """Whether `encode(head + tail) == encode(head) + encode(tail)` is certain from how the backend
        segments text (not from trying it). The base class knows no such place: False."""
        return False

    def _encode_uncached(self, text: str) -> list[int]:
        parts = self.split_atomic(text)
        plain = [p for p in parts if isinstance(p, str)]
        encoded = iter(self._encode_plain(plain)) if plain else iter(())
        ids: list[int] = []
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(next(encoded))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False, strict: bool = False) -> str:
        """Text of `ids`. Atomic tokens are written as their text unless `skip_special` drops special ones.

        Ids outside [0, vocab_size) (a model's padded embedding rows can be sampled) decode to nothing, as in
        Hugging Face's tokenizers; with `strict=True` they raise ValueError instead.
        """
        size = self.vocab_size
        out: list[str] = []
        run: list[int] = []
        for raw in ids:
            i = int(raw)
            if not 0 <= i < size:
                if strict:
                    raise ValueError(f"token id {i} is outside the vocabulary [0, {size}) of {self.path}")
                continue
            if i in self._atomic_text or i in self.special_ids:
                if run:
                    out.append(self._decode_plain(run))
                    run = []
                if not (skip_special and i in self.special_ids):
                    out.append(self._atomic_text.get(i, ""))
            else:
                run.append(i)
        if run:
            out.append(self._decode_plain(run))
        return "".join(out)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickled as its path (e.g. for data-loader worker processes); the file is read again on unpickling.
        return (type(self), (self.path,))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `tokenizer.model` (Gemma, Llama 2, and this project's own trained tokenizers)."""

    def __init__(self, path: str) -> None:
        import sentencepiece as spm

        try:
            with open(path, "rb") as f:
                proto = f.read()
            sp = spm.SentencePieceProcessor()
            sp.LoadFromSerializedProto(proto)
        except OSError as e:
            raise TokenizerError(f"cannot read SentencePiece model {path}: {e}") from e
        except Exception as e:  # sentencepiece raises RuntimeError/OSError/ValueError for a bad proto
            raise TokenizerError(f"{path} is not a valid SentencePiece model: {e}") from e
        if sp.get_piece_size() == 0:
            raise TokenizerError(f"{path} is not a valid SentencePiece model: it has no pieces")
        self._sp = sp
        model = _sp_model_proto(proto)
        user_defined = _sp_user_defined_ids(model, sp)
        self._space_starts_word = _sp_space_starts_word(model)

        def maybe(i: int) -> int | None:
            return i if i >= 0 else None

        atomic: dict[str, int] = {}
        special: set[int] = set()
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if sp.is_control(i) or sp.is_unknown(i):
                special.add(i)
                atomic.setdefault(piece, i)
            elif i in user_defined and "\u2581" not in piece:
                # SentencePiece matches user-defined pieces in raw text itself; splitting on them too keeps
                # concatenation exact for models that add a dummy-prefix space to every segment.
                atomic.setdefault(piece, i)
                if piece in TURN_MARKERS:
                    special.add(i)
        super().__init__(
            path,
            atomic=atomic,
            special_ids=special,
            bos_id=maybe(sp.bos_id()),
            eos_id=maybe(sp.eos_id()),
            pad_id=maybe(sp.pad_id()),
            unk_id=maybe(sp.unk_id()),
        )

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def _encode_plain(self, segments: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.encode(segments, out_type=int)]

    def splits_between(self, head: str, tail: str) -> bool:
        """True where `tail` starts with a space and `head` ends with a character that is not whitespace,
        for a model that starts a word at such a space and has no piece across one
        (`_sp_space_starts_word`): SentencePiece then segments the words on either side apart. (Special
        tokens hold no whitespace, so none spans that space either.)"""
        return self._space_starts_word and tail[:1] == " " and head[-1:].strip() != ""

    def _decode_plain(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        if i == self._sp.unk_id() and token != self._sp.id_to_piece(i):
            return None
        return i

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} is outside [0, {self.vocab_size}) of {self.path}")
        return self._sp.id_to_piece(token_id)


def _sp_model_proto(proto: bytes) -> Any:
    """The parsed SentencePiece `ModelProto` of a model file's bytes, or None without protobuf."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # pragma: no cover - protobuf is normally present
        return None
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    return model


def _sp_space_starts_word(model: Any) -> bool:
    """Whether a space after a non-space character always starts a new word that no piece reaches across,
    so that `encode(a + b) == encode(a) + encode(b)` when `b` starts with such a space: a BPE model trained
    with `split_by_whitespace` and the space as a word's prefix ("▁"), text normalised by "identity" only
    (each space is one "▁", none added, removed or merged: no dummy prefix, no extra-whitespace removal),
    and no piece holding a "▁" after another character (checked on the vocabulary itself; whitespace-only
    pieces such as "▁▁" only begin a word). This project's `tokenizers.training` models are such; without
    protobuf (`model` None), or for any other model, False (the whole text is encoded)."""
    if model is None:  # pragma: no cover - protobuf is normally present
        return False
    t, n = model.trainer_spec, model.normalizer_spec
    if (t.model_type != t.BPE or not t.split_by_whitespace or t.treat_whitespace_as_suffix
            or n.name != "identity" or n.add_dummy_prefix or n.remove_extra_whitespaces
            or not n.escape_whitespaces):
        return False
    return not any("\u2581" in p.piece.lstrip("\u2581") for p in model.pieces)


def _sp_user_defined_ids(model: Any, sp: Any) -> set[int]:
    """Ids of USER_DEFINED pieces, read from the parsed model proto (heuristic fallback without protobuf:
    `model` None)."""
    if model is not None:
        return {i for i, p in enumerate(model.pieces) if p.type == p.USER_DEFINED}
    # without protobuf (normally present): user-defined pieces score 0, learned pieces below 0
    return {  # pragma: no cover
        i
        for i in range(sp.get_piece_size())
        if sp.get_score(i) == 0.0
        and not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
    }


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (Qwen, Llama 3, Gemma's fast tokenizer, ...).

    Reads `tokenizer_config.json` beside it when present for bos/eos/pad/unk and extra special tokens.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HFTok

        try:
            self._tok = _HFTok.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for bad JSON or an unknown model
            if not os.path.exists(path):
                raise TokenizerError(f"tokenizer file {path} does not exist") from e
            raise TokenizerError(f"{path} is not a valid tokenizer.json: {e}") from e
        config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.exists(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot parse {config_path}: {e}") from e
            if not isinstance(config, dict):
                raise TokenizerError(f"{config_path} must hold a JSON object, got {type(config).__name__}")

        atomic: dict[str, int] = {}
        special: set[int] = set()
        for i, added in self._tok.get_added_tokens_decoder().items():
            atomic[added.content] = i
            if added.special:
                special.add(i)
        for name in _config_special_tokens(config):
            i = self._tok.token_to_id(name)
            if i is None:
                logging.warning("%s names special token %r, which %s lacks; ignored", config_path, name, path)
                continue
            atomic.setdefault(name, i)
            special.add(i)

        def role(key: str, fallbacks: tuple[str, ...]) -> int | None:
            if key in config:
                name = _token_content(config[key])
                if name is None:
                    return None
                i = self._tok.token_to_id(name)
                if i is None:
                    raise TokenizerError(f"{config_path}: {key}={name!r} is not in the vocabulary of {path}")
                return i
            for name in fallbacks:
                i = self._tok.token_to_id(name)
                if i is not None:
                    return i
            return None

        ids = {
            "bos": role("bos_token", _BOS_NAMES),
            "eos": role("eos_token", _EOS_NAMES),
            "pad": role("pad_token", _PAD_NAMES),
            "unk": role("unk_token", _UNK_NAMES),
        }
        special.update(i for i in ids.values() if i is not None)
        add_bos = config.get("add_bos_token")
        super().__init__(
            path,
            atomic=atomic,
            special_ids=special,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["pad"],
            unk_id=ids["unk"],
            add_bos=None if add_bos is None else bool(add_bos),
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _encode_plain(self, segments: list[str]) -> list[list[int]]:
        # One by one: the few segments of a text are not worth encode_batch's thread pool, which also makes
        # `tokenizers` warn (and disable itself) in data-loader processes forked afterwards.
        return [self._tok.encode(segment, add_special_tokens=False).ids for segment in segments]

    def _decode_plain(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if token is None:
            raise IndexError(f"token id {token_id} is outside [0, {self.vocab_size}) of {self.path}")
        return token


def _token_content(value: Any) -> str | None:
    """A token named in tokenizer_config.json: a string or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _config_special_tokens(config: dict[str, Any]) -> list[str]:
    """Every token tokenizer_config.json marks special (named roles, extra lists, added_tokens_decoder)."""
    names: list[str] = []
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"):
        if (name := _token_content(config.get(key))) is not None:
            names.append(name)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key) or []
        values = value.values() if isinstance(value, dict) else value
        names.extend(n for v in values if (n := _token_content(v)) is not None)
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and entry.get("special") and (n := _token_content(entry)) is not None:
            names.append(n)
    return names


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Loads a `tokenizer.model` (SentencePiece), a `tokenizer.json` (Hugging Face), or a folder holding one.

    A folder holding both is read through its `tokenizer.json` (with `tokenizer_config.json`), as Hugging
    Face's fast tokenizers do. Raises FileNotFoundError or TokenizerError naming the path.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return load_tokenizer(candidate)
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in folder {path}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    if path.endswith(".json"):
        return HFTokenizer(path)
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return HFTokenizer(path) if head.startswith(b"{") else SentencePieceTokenizer(path)
