"""Tokenizers: SentencePiece and Hugging Face `tokenizer.json` behind one interface, and chat templates.

    tok = load_tokenizer("path/to/tokenizer.model" | "path/to/tokenizer.json" | "path/to/folder")
    ids = tok.encode("<|im_start|>user\\nhi<|im_end|>\\n")       # special tokens become their single ids
    chat = chat_template(tok)                       # "chatml", "gemma" or "llama3", detected from the vocab
    prompt = chat.start(system="...") + chat.turn("user", "hi") + chat.open_turn("assistant")
    # ... sample ids until one of chat.stop_ids, then append chat.close_turn() after the sampled ids.
"""

from librarian_jax.tokenizers.chat import STYLES, ChatTemplate, chat_template, detect_style
from librarian_jax.tokenizers.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)
from librarian_jax.tokenizers.training import (
    BOS_ID,
    DEFAULT_SPECIAL_TOKENS,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    cached_tokenizer,
    tokenizer_cache_key,
    train_sentencepiece,
)

__all__ = [
    "BOS_ID",
    "DEFAULT_SPECIAL_TOKENS",
    "EOS_ID",
    "PAD_ID",
    "STYLES",
    "UNK_ID",
    "ChatTemplate",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "cached_tokenizer",
    "chat_template",
    "detect_style",
    "load_tokenizer",
    "tokenizer_cache_key",
    "train_sentencepiece",
]
