"""Retrieval for the baselines: passages of a corpus, a BM25 index, an embedding model and index, a reranker.

    chunks = passages(task, passage_words=120)           # word windows of the raw documents, with their paths
    bm25 = BM25Index(chunks)                             # bm25s over the passages; costs no model tokens
    embedder = Embedder(model, tokenizer, pooling="last", instruction="Given a question, ...")
    dense = EmbeddingIndex(chunks, embedder)             # every passage embedded once, batched, on the mesh
    hits = dense.search("Who employs Orlen Vask?", k=3)   # [(passage index, score)], best first
    reranker = Reranker(model, tokenizer, template)      # Qwen3-Reranker: logit("yes") - logit("no")
    hits = reranker.rerank(question, chunks, bm25.search(question, 20), k=3)

Every model forward pass (passages and queries embedded, (query, passage) pairs scored) adds its real tokens
(padding excluded) to the object's `tokens` counter: the report's "tokens embedded", kept apart from the LLM
tokens of construction and answering.

The embedding model and the reranker are our own model families (`models.load_hf` of a Qwen3 checkpoint,
`Transformer.hidden`): Qwen3-Embedding is a Qwen3 decoder whose embedding is the final-norm hidden state of
the last token (an end-of-text token appended) with an instruction before each query ("Instruct:
...\\nQuery:..."), documents without one; `pooling="mean"` averages the hidden states of the real tokens
instead. Embeddings are L2-normalised; the score is the dot product. Qwen3-Reranker reads a judging prompt
(system: answer only "yes" or "no"; user: `<Instruct>`, `<Query>`, `<Document>`; the assistant turn opened,
thinking left empty) and scores a pair by the probability of "yes" against "no" at the next token (a
softmax over those two logits; ranking by it equals ranking by logit("yes") - logit("no")).

Batches are padded to a power-of-two length and a fixed batch size (a few compiled programs per model), with
their rows split over the mesh's data axes when the batch divides.
"""

from __future__ import annotations

import dataclasses
import logging as py_logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from librarian_jax.config_schema import POOLINGS
from librarian_jax.config_schema import RETRIEVAL_INSTRUCTION as DEFAULT_INSTRUCTION
from librarian_jax.workspace import Workspace

RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct '
                 'provided. Note that the answer can only be "yes" or "no".')


@dataclasses.dataclass(frozen=True)
class Passage:
    """A window of `passage_words` words of one raw document: its workspace path and word range."""

    doc_id: str
    path: str  # the document's path in the workspace (raw_docs/...), for read_file
    first_word: int  # 1-based, inclusive
    last_word: int
    text: str

    @property
    def label(self) -> str:
        return f"{self.path} (words {self.first_word}-{self.last_word})"


def passages(task: Any, passage_words: int) -> list[Passage]:
    """The corpus's raw documents cut into windows of `passage_words` words (document order)."""
    ws = Workspace.from_documents(list(task.documents))
    out = []
    for d in task.documents:
        words = d.text.split()
        path = ws.path_of(d.doc_id)
        for i in range(0, max(len(words), 1), passage_words):
            out.append(Passage(d.doc_id, path, i + 1, min(i + passage_words, len(words)),
                               " ".join(words[i : i + passage_words])))
    return out


def render_passages(chunks: Sequence[Passage], hits: Sequence[tuple[int, float]], header: str) -> str:
    """Retrieved passages as the answerer reads them: a header line, then `[i] path (words a-b): text`."""
    lines = [header]
    lines += [f"[{i + 1}] {chunks[j].label}: {chunks[j].text}" for i, (j, _) in enumerate(hits)]
    return "\n".join(lines)


class BM25Index:
    """bm25s (Lucene BM25, English stopwords) over passages. `tokens` stays 0: no model reads anything."""

    def __init__(self, chunks: Sequence[Passage]):
        # imported here, not with this module: importing bm25s runs a jitted `top_k`, which starts the JAX
        # backend and compiles, and every command imports this module before it checks its config
        import bm25s

        py_logging.getLogger("bm25s").setLevel(py_logging.WARNING)
        self.chunks = list(chunks)
        self.tokens = 0
        self._tokenize = bm25s.tokenize
        self._bm25 = bm25s.BM25()
        self._bm25.index(self._tokenize([c.text for c in self.chunks], stopwords="en", show_progress=False),
                         show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The top-`k` passages for `query`: (passage index, BM25 score), best first."""
        k = min(int(k), len(self.chunks))
        if k <= 0:
            return []
        docs, scores = self._bm25.retrieve(self._tokenize([query], stopwords="en", show_progress=False),
                                           k=k, show_progress=False)
        return [(int(j), float(s)) for j, s in zip(docs[0], scores[0], strict=True)]


# ------------------------------------------------------------------------------------------- forward passes


def _bucket(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@nnx.jit(static_argnames=("pooling",))
def _pooled(model: Any, tokens: jax.Array, lengths: jax.Array, pooling: str) -> jax.Array:
    """tokens int32 `[b, s]` right-padded, lengths int32 `[b]` -> L2-normalised float32 `[b, hidden]`."""
    mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    h, _ = model.hidden(tokens, mask=mask)
    h = h.astype(jnp.float32)
    if pooling == "last":
        pooled = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    else:
        m = mask[..., None].astype(jnp.float32)
        pooled = (h * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


@nnx.jit
def _last_logits(model: Any, tokens: jax.Array, lengths: jax.Array, ids: jax.Array) -> jax.Array:
    """tokens int32 `[b, s]` right-padded, lengths `[b]`, ids int32 `[n]` -> float32 `[b, n]`: the logits of
    `ids` at each row's last real position (only those positions are projected)."""
    mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    h, _ = model.hidden(tokens, mask=mask)
    last = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return model.project(last)[:, ids]


class _Batcher:
    """Pads token lists into fixed-size batches `[batch_size, bucket]` placed on the mesh (rows over the data
    axes when they divide the batch), and counts the real tokens."""

    def __init__(self, model: Any, batch_size: int, max_tokens: int, mesh: Any = None):
        self.model, self.mesh = model, mesh
        self.batch_size, self.max_tokens = int(batch_size), int(max_tokens)
        self.tokens = 0

    def _place(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        axes = tuple(a for a in ("data", "fsdp") if a in self.mesh.shape and self.mesh.shape[a] > 1)
        rows = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        spec = P(axes or None) if axes and x.shape[0] % rows == 0 else P()
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def batches(self, seqs: Sequence[Sequence[int]]) -> Any:
        """Yields (start, tokens `[batch_size, bucket]`, lengths `[batch_size]`) over `seqs` (each cut to
        `max_tokens` from its end, so a last-token pooling keeps its final token)."""
        seqs = [list(s)[-self.max_tokens :] or [0] for s in seqs]
        for start in range(0, len(seqs), self.batch_size):
            chunk = seqs[start : start + self.batch_size]
            width = min(_bucket(max(len(s) for s in chunk)), _bucket(self.max_tokens))
            toks = np.zeros((self.batch_size, width), np.int32)
            lens = np.ones((self.batch_size,), np.int32)
            for i, s in enumerate(chunk):
                toks[i, : len(s)] = s
                lens[i] = len(s)
            self.tokens += sum(len(s) for s in chunk)
            yield start, len(chunk), self._place(toks), self._place(lens)


class Embedder:
    """An embedding model of our families: `embed(texts, query=...)` -> float32 `[n, hidden]`, L2-normalised.

    Queries get `instruction` ("Instruct: {instruction}\\nQuery:{text}", Qwen3-Embedding's form; "" = none);
    every text gets the tokenizer's end-of-text id appended (the token whose state last pooling takes)."""

    def __init__(self, model: Any, tokenizer: Any, *, pooling: str = "last", instruction: str = "",
                 batch_size: int = 16, max_tokens: int = 512, mesh: Any = None):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.tokenizer, self.pooling, self.instruction = tokenizer, pooling, instruction
        self._batcher = _Batcher(model, batch_size, max_tokens, mesh)

    @property
    def tokens(self) -> int:
        """Tokens embedded so far (real tokens of every forward pass)."""
        return self._batcher.tokens

    def ids(self, text: str, *, query: bool = False) -> list[int]:
        if query and self.instruction:
            text = f"Instruct: {self.instruction}\nQuery:{text}"
        eos = self.tokenizer.eos_id
        ids = self.tokenizer.encode(text)[: self._batcher.max_tokens - 1]  # room for the end-of-text id
        return ids + ([int(eos)] if eos is not None else [])

    def embed(self, texts: Sequence[str], *, query: bool = False) -> np.ndarray:
        out = []
        for _, n, toks, lens in self._batcher.batches([self.ids(t, query=query) for t in texts]):
            out.append(np.asarray(_pooled(self._batcher.model, toks, lens, self.pooling))[:n])
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


class EmbeddingIndex:
    """Every passage embedded once (batched); `search` embeds the query and ranks by dot product."""

    def __init__(self, chunks: Sequence[Passage], embedder: Embedder):
        self.chunks, self.embedder = list(chunks), embedder
        before = embedder.tokens
        self.vectors = embedder.embed([c.text for c in self.chunks])  # [n_passages, hidden]
        self.index_tokens = embedder.tokens - before
        self.tokens = self.index_tokens
        logging.info("embedding index: %d passages, %d tokens embedded", len(self.chunks), self.index_tokens)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        before = self.embedder.tokens
        q = self.embedder.embed([query], query=True)[0]  # [hidden]
        self.tokens += self.embedder.tokens - before
        scores = self.vectors @ q
        order = np.argsort(-scores, kind="stable")[: min(int(k), len(self.chunks))]
        return [(int(j), float(scores[j])) for j in order]


class Reranker:
    """A cross-encoder LLM of our families scoring (query, passage) pairs the Qwen3-Reranker way."""

    def __init__(self, model: Any, tokenizer: Any, template: Any, *, instruction: str = DEFAULT_INSTRUCTION,
                 batch_size: int = 16, max_tokens: int = 1024, mesh: Any = None):
        self.tokenizer, self.template, self.instruction = tokenizer, template, instruction
        self._batcher = _Batcher(model, batch_size, max_tokens, mesh)
        self.label_ids = np.asarray([self._label_id("yes"), self._label_id("no")], np.int32)

    def _label_id(self, word: str) -> int:
        """The id of `word` as the model writes it first (a single token in Qwen's vocabulary; a tokenizer
        that splits it: its first piece)."""
        lookup = getattr(self.tokenizer, "token_to_id", None)
        tid = lookup(word) if lookup is not None else None
        return int(tid) if tid is not None else int(self.tokenizer.encode(word)[0])

    @property
    def tokens(self) -> int:
        return self._batcher.tokens

    def prompt(self, query: str, document: str, max_doc_tokens: int) -> list[int]:
        """The judging prompt's ids, the document cut so the prompt fits in `max_tokens`."""
        tpl = self.template
        doc_ids = self.tokenizer.encode(document)[: max(max_doc_tokens, 0)]
        user = (f"<Instruct>: {self.instruction}\n<Query>: {query}\n"
                f"<Document>: {self.tokenizer.decode(doc_ids)}")
        # Qwen3-Reranker's assistant prefix closes an empty thinking span before the yes/no token
        think = "<think>" in getattr(self.tokenizer, "atomic_tokens", {}) and tpl.style != "qwen3_5"
        tail = self.tokenizer.encode("<think>\n\n</think>\n\n") if think else []
        return [*tpl.start(RERANK_SYSTEM), *tpl.turn("user", user), *tpl.open_turn("assistant"), *tail]

    def scores(self, query: str, documents: Sequence[str]) -> np.ndarray:
        """float32 `[n]`: P("yes") against "no" for each document."""
        base = len(self.prompt(query, "", 0))
        room = self._batcher.max_tokens - base
        seqs = [self.prompt(query, d, room) for d in documents]
        out = []
        ids = jnp.asarray(self.label_ids)
        for _, n, toks, lens in self._batcher.batches(seqs):
            logits = np.asarray(_last_logits(self._batcher.model, toks, lens, ids))[:n]  # [n, 2]
            out.append(np.asarray(jax.nn.softmax(logits, axis=-1)[:, 0]))
        return np.concatenate(out) if out else np.zeros((0,), np.float32)

    def rerank(self, query: str, chunks: Sequence[Passage], candidates: Sequence[tuple[int, float]],
               k: int) -> list[tuple[int, float]]:
        """The `k` best of `candidates` (first-stage hits) by the reranker's score, best first."""
        if not candidates:
            return []
        s = self.scores(query, [chunks[j].text for j, _ in candidates])
        order = np.argsort(-s, kind="stable")[:k]
        return [(int(candidates[i][0]), float(s[i])) for i in order]
