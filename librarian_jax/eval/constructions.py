"""The baselines that construct a workspace without the builder: GraphRAG and AutoCompaction.

Both are written by the run's executor role (`rollout.builder.executor`: "model" = the frozen executor LLM on
its engine, "extractive" = the model-free stand-in of the embedded world) and land in a real `Workspace`
through `create_file`, so every file names its raw sources with their hashes, and the answerer reads them
as it reads a builder's files (the root-level files preloaded, the rest through list/read).

GraphRAG (`graphrag`):
1. Entities and relations per document. "model": the executor reads the document (cut to
   `extract_max_tokens` tokens) and writes one `entity | relation | entity` line per relation. "extractive":
   `cooccurrence_relations`, a deterministic stand-in and not an LLM extraction: the capitalised name spans of
   each sentence are its entities, and consecutive names of a sentence are related by that sentence.
2. A weighted entity graph (an edge per related pair, weight = how often) and its communities by networkx's
   Louvain (`louvain_communities`, seeded, `resolution`).
3. One summary per community by the executor (`executor.write`: its create prompt with the community's
   relations and sentences as the excerpts, or the extractive summary), created as a root-level file
   "Community <i>: <its main entities>" citing the documents its entities come from.
Construction tokens: the executor's prompt and generated tokens of every extraction and summary (0 with the
extractive stand-in).

AutoCompaction (`autocompaction`): the corpus (documents in order, cut into `chunk_tokens` pieces) is folded
into one notes text: notes <- executor(notes, next piece), each result held to `budget_tokens`; the last notes
are one root-level file citing every document. Construction tokens: the executor's tokens of every step
(0 extractive: `extractive_step` keeps the sentences of the notes and of the piece that fit, half the budget
each).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx
from absl import logging

from librarian_jax.agents import executor as executor_lib
from librarian_jax.agents.runtime import EXECUTOR, AgentContext, AgentGen, Parallel, Sampling, SessionLog
from librarian_jax.workspace import Workspace

GRAPH_EXTRACTION = ("Extract the named entities of the document below and the relations between them. "
                    "Write one relation per line as: entity | relation | entity\nWrite nothing else.\n\n"
                    "Document {path}:\n{text}")
COMPACTION_SYSTEM = "You compact a collection of documents into one notes file that answers questions."
COMPACTION_STEP = ("Notes so far:\n{notes}\n\nNext part of the collection ({where}):\n{text}\n\n"
                   "Rewrite the notes so that they keep every fact of both that could answer a question "
                   "about the collection (names, numbers, dates, who relates to whom), in at most {words} "
                   "words. Reply with the notes only.")
_NAME = re.compile(r"\b[A-Z][A-Za-z'\-]+(?:\s+[A-Z][A-Za-z'\-]+)*")
_NOT_NAMES = frozenset(
    "a an the this that these those it its he she they we you i in on at by for from of to as is are was "
    "there here when where what who which how why if but and or so then also after before during earlier "
    "later visitors by profession".split()
)


@dataclasses.dataclass
class Construction:
    """A baseline's workspace for one corpus and what writing it cost."""

    workspace: Any
    prompt_tokens: int = 0
    generated_tokens: int = 0
    calls: int = 0  # executor calls (extractive: 0)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def construction_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


def _executor_call(ctx: AgentContext, system: str, user: str, max_new_tokens: int) -> AgentGen:
    """Generator: one greedy executor turn; returns (text, prompt tokens, generated tokens)."""
    tpl = ctx.template_for(EXECUTOR)
    prompt = tpl.start(system) + tpl.turn("user", user) + tpl.open_turn("assistant")
    log = SessionLog(ctx, EXECUTOR, prompt)
    try:
        result = yield from log.generate(max_new_tokens, Sampling(temperature=0.0, seed=0))
    finally:
        log.close()
    return ctx.decode_new(result.tokens).strip(), len(prompt), len(result.tokens)


def _cut_tokens(ctx: AgentContext, text: str, n: int) -> str:
    ids = ctx.encode(text)
    return text if len(ids) <= n else ctx.tokenizer.decode(ids[: max(n, 0)])


# ------------------------------------------------------------------------------------------- GraphRAG


def _names(sentence: str) -> list[str]:
    out = []
    for m in _NAME.finditer(sentence):
        words = m.group(0).split()
        while words and words[0].lower() in _NOT_NAMES:  # a capitalised sentence opener is not a name
            words = words[1:]
        name = " ".join(words)
        if name and name.lower() not in _NOT_NAMES:
            out.append(name)
    return out


def cooccurrence_relations(text: str) -> list[tuple[str, str, str]]:
    """The extractive stand-in for entity/relation extraction (not an LLM): (name, sentence, next name) for
    each pair of consecutive capitalised name spans of a sentence. Deterministic."""
    out = []
    for sent in executor_lib.split_sentences(text):
        names = list(dict.fromkeys(_names(sent)))
        out.extend((a, sent, b) for a, b in zip(names, names[1:], strict=False))
    return out


def parse_relations(text: str) -> list[tuple[str, str, str]]:
    """`entity | relation | entity` lines of an executor's reply (other lines ignored)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip(" -*\t") for p in line.split("|")]
        if len(parts) == 3 and all(parts):
            out.append((parts[0], parts[1], parts[2]))
    return out


def communities(relations: Sequence[tuple[str, str, str, str]], *, seed: int, resolution: float
                ) -> list[list[str]]:
    """Louvain communities (networkx, seeded) of the entity graph of `relations` ((a, rel, b, path)): an
    edge per related pair weighted by how often; largest community first, entities sorted by degree."""
    g = nx.Graph()
    for a, _, b, _ in relations:
        if a == b:
            g.add_node(a)
            continue
        w = g.get_edge_data(a, b, {"weight": 0})["weight"]
        g.add_edge(a, b, weight=w + 1)
    if g.number_of_nodes() == 0:
        return []
    found = nx.community.louvain_communities(g, weight="weight", resolution=resolution, seed=seed)
    deg = dict(g.degree(weight="weight"))
    ranked = [sorted(c, key=lambda e: (-deg[e], e)) for c in found]
    return sorted(ranked, key=lambda c: (-len(c), c[0]))


def graphrag(ctx: AgentContext, task: Any, *, executor: str, seed: int = 0, resolution: float = 1.0,
             extract_max_tokens: int = 2048, extract_max_new_tokens: int = 512, summary_words: int = 200,
             summary_max_new_tokens: int = 512, title_entities: int = 6) -> AgentGen:
    """Generator: GraphRAG's workspace for `task` (module docstring); returns a `Construction`."""
    ws = Workspace.from_documents(list(task.documents))
    docs = [(ws.path_of(d.doc_id), d.text) for d in task.documents]
    cost = Construction(ws)
    if executor == "model":
        gens = [_executor_call(ctx, "You extract knowledge graphs from documents.",
                               GRAPH_EXTRACTION.format(path=p, text=_cut_tokens(ctx, t, extract_max_tokens)),
                               extract_max_new_tokens) for p, t in docs]
        replies = (yield Parallel(gens)) if gens else []
        per_doc = []
        for (path, _), (text, pt, gt) in zip(docs, replies, strict=True):
            per_doc.append([(a, r, b, path) for a, r, b in parse_relations(text)])
            cost.prompt_tokens += pt
            cost.generated_tokens += gt
            cost.calls += 1
    elif executor == "extractive":
        per_doc = [[(a, r, b, p) for a, r, b in cooccurrence_relations(t)] for p, t in docs]
    else:
        raise ValueError(f"executor must be 'model' or 'extractive', got {executor!r}")
    relations = [r for rs in per_doc for r in rs]
    found = communities(relations, seed=seed, resolution=resolution)
    writes, plans = [], []
    for i, members in enumerate(found):
        inside = set(members)
        rels = [r for r in relations if r[0] in inside or r[2] in inside]
        paths = list(dict.fromkeys(r[3] for r in rels))[:64]  # a file names at most 64 sources
        shown = members[:title_entities]
        title = f"Community {i + 1}: " + ", ".join(shown) + (f" and {len(members) - len(shown)} more"
                                                             if len(members) > len(shown) else "")
        title = title[:200]
        by_path: dict[str, list[str]] = {p: [] for p in paths}
        for a, r, b, p in rels:
            if p in by_path:
                line = r if executor == "extractive" else f"{a} | {r} | {b}"
                if line not in by_path[p]:
                    by_path[p].append(line)
        sources = [(p, " ".join(lines) if executor == "extractive" else "\n".join(lines))
                   for p, lines in by_path.items()]
        excerpts = "\n\n".join(f"--- {p} ---\n{text}" for p, text in sources)
        instructions = ("Summarise this community of the corpus's knowledge graph: its entities "
                        f"({', '.join(members[:40])}) and every relation between them.")
        writes.append(executor_lib.write(ctx, title, instructions, sources, excerpts, kind=executor,
                                         max_new_tokens=summary_max_new_tokens, max_words=summary_words))
        plans.append((title, paths))
    outs = (yield Parallel(writes)) if writes else []
    for (title, paths), out in zip(plans, outs, strict=True):
        cost.prompt_tokens += out.prompt_tokens
        cost.generated_tokens += out.generated_tokens
        cost.calls += int(executor == "model")
        r = ws.create_file(title, paths, out.text or title)
        if not r.ok:
            logging.warning("graphrag %s: %s not created (%s)", task.task_id, title, r.message)
    cost.info = {"entities": len({e for a, _, b, _ in relations for e in (a, b)}),
                 "relations": len(relations), "communities": len(found)}
    return cost


# ------------------------------------------------------------------------------------------- AutoCompaction


def compaction_pieces(ctx: AgentContext, task: Any, chunk_tokens: int) -> list[tuple[str, str]]:
    """(where, text) pieces of the corpus in document order, each at most `chunk_tokens` tokens."""
    ws = Workspace.from_documents(list(task.documents))
    out = []
    for d in task.documents:
        ids = ctx.encode(d.text)
        path = ws.path_of(d.doc_id)
        for i in range(0, max(len(ids), 1), chunk_tokens):
            piece = ctx.tokenizer.decode(ids[i : i + chunk_tokens])
            out.append((f"{path}, part {i // chunk_tokens + 1}", piece))
    return out


def extractive_step(notes: str, piece: str, words: int) -> str:
    """The extractive stand-in of one compaction step: the budget split evenly between the notes and the new
    piece, each keeping its sentences in order while they fit (so older notes thin out step by step)."""
    parts = [t for t in (notes, piece) if t.strip()]
    budget = max(words // max(len(parts), 1), 1)
    out = []
    for text in parts:
        used = 0
        for s in executor_lib.split_sentences(text):
            n = len(s.split())
            if used + n <= budget:
                out.append(s)
                used += n
    return " ".join(out)


def autocompaction(ctx: AgentContext, task: Any, *, executor: str, budget_tokens: int = 2000,
                   chunk_tokens: int = 2000) -> AgentGen:
    """Generator: AutoCompaction's workspace for `task` (module docstring); returns a `Construction`."""
    ws = Workspace.from_documents(list(task.documents))
    cost = Construction(ws)
    words = max(budget_tokens * 3 // 4, 1)  # ~0.75 words a token, as the executor is asked in words
    notes = ""
    pieces = compaction_pieces(ctx, task, chunk_tokens)
    for where, text in pieces:
        if executor == "model":
            user = COMPACTION_STEP.format(notes=notes or "(none yet)", where=where, text=text, words=words)
            reply, pt, gt = yield from _executor_call(ctx, COMPACTION_SYSTEM, user, budget_tokens)
            cost.prompt_tokens += pt
            cost.generated_tokens += gt
            cost.calls += 1
            notes = reply or notes
        elif executor == "extractive":
            notes = extractive_step(notes, text, words)
        else:
            raise ValueError(f"executor must be 'model' or 'extractive', got {executor!r}")
        notes = _cut_tokens(ctx, notes, budget_tokens)
    paths = [ws.path_of(d.doc_id) for d in task.documents]
    # a file names at most 64 sources: a larger corpus's notes cite its first 64 documents
    r = ws.create_file("Corpus notes (AutoCompaction)", paths[:64], notes or "(empty)")
    if not r.ok:
        logging.warning("autocompaction %s: notes not created (%s)", task.task_id, r.message)
    cost.info = {"steps": len(pieces), "notes_tokens": len(ctx.encode(notes))}
    return cost


CONSTRUCTIONS: dict[str, Callable[..., AgentGen]] = {"graphrag": graphrag, "autocompaction": autocompaction}
