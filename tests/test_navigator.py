"""The scripted navigator (answerer.kind="scripted") and the synthetic world's reading helpers.

The navigator must (a) learn only from what its tools returned, (b) account tokens like an LLM answerer, and
(c) answer better on a workspace that gathers each entity's scattered facts than on the raw documents, under
the same turn budget: the effect the embedded default trains a builder to produce.
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import numpy as np

from librarian_jax.agents import navigator
from librarian_jax.agents.answerer import AnswererConfig, answer_question
from librarian_jax.agents.executor import extractive_text
from librarian_jax.agents.runtime import AgentContext
from librarian_jax.data import synthetic
from librarian_jax.testing import ByteTokenizer, chat_template, returned
from librarian_jax.workspace import Workspace

TOK = ByteTokenizer()
TPL = chat_template(TOK)
WORLD = synthetic.generate_world(3, 12, docs_per_task=6, min_words=40, max_words=80, questions_per_task=4)
# every statement form of the world, filled in, and some of its other sentences: pieces of random texts
_OBJECTS = {"role": "nurse", "year": "1999"}
SENTENCES = [t.format(S="Ann Lee", O=_OBJECTS.get(synthetic.RELATIONS[rel][1], "Ola Ny"), A="an engineer")
             for rel, forms in synthetic._STATEMENTS.items() for t in forms]
SENTENCES += sorted({s.strip() + ". " for d in WORLD[0].documents for s in d.text.split(". ")})[:20]


def _ctx() -> AgentContext:
    return AgentContext(TOK, TPL, {})


def _run(ws: Workspace, question: str, **cfg) -> object:
    cfg = AnswererConfig(**{"kind": "scripted", "max_turns": 2, "context_budget": 100_000,
                            "preload_root_files": False, **cfg})
    return returned(answer_question(_ctx(), ws, question, cfg))  # the navigator never yields (no engine)


def _entity_workspace(task, own_only: bool = False) -> Workspace:
    """One synthetic file per entity page, written (extractively) from every document or its own page."""
    ws = Workspace.from_documents(list(task.documents))
    for d in task.documents:
        name = d.meta["subject"]
        if not name or d.meta["kind"] == "meeting":
            continue
        docs = [d] if own_only else list(task.documents)
        text = extractive_text(name, "", [(x.doc_id, x.text) for x in docs], max_words=360)
        r = ws.create_file(name, [x.doc_id for x in docs], text)
        assert r.ok, r.message
    return ws


def test_question_forms_parse_back_to_their_chain():
    n = 0
    for task in WORLD:
        for q in task.questions + task.reuse_questions:
            assert synthetic.parse_question(q.question) == (q.meta["subject"], q.meta["relations"])
            n += 1
    assert n > 40
    assert synthetic.parse_question("What is the airspeed of an unladen swallow?") is None


def test_facts_extracted_from_documents_are_exactly_the_stated_facts():
    for task in WORLD:
        for d in task.documents:
            assert set(synthetic.extract_facts(d.text)) == {tuple(f) for f in d.meta["facts"]}
    # remembered per text, yet each caller gets its own list
    text = WORLD[0].documents[0].text
    first = synthetic.extract_facts(text)
    first.clear()
    assert synthetic.extract_facts(text) == list(synthetic._extract_facts.__wrapped__(text)) != []


def _facts_of_whole_text(text: str) -> list[tuple[str, str, str]]:
    """`extract_facts` as it was written first: every statement regex over the whole text, in order of
    appearance, duplicates removed (no line split, no anchor test, no cache)."""
    found = [(m.start(), (m.group("S"), rel, m.group("O")))
             for rel, rx in synthetic._STATEMENT_RES for m in rx.finditer(text)]
    found.sort(key=lambda x: x[0])
    return list(dict.fromkeys(f for _, f in found))


NOISY = synthetic.generate_world(5, 3, synthetic.WORLDS["noisy"], questions_per_task=8)


def test_facts_line_by_line_equal_those_of_the_whole_text():
    """The scripted answerer's texts (documents, files, a prompt of a question then preloaded files) give the
    same facts in the same order read line by line with the anchors as read whole."""
    for task in (*WORLD, *NOISY):
        docs = [d.text for d in task.documents]
        # one line per document, then every document on one line (longer than the cached lines)
        for text in (*docs, "\n".join(docs), " ".join(docs),
                     "\n\n".join(f"## {d.title}\n{d.text}" for d in task.documents),
                     task.questions[0].question + "\n\n" + "\n".join(reversed(docs)),
                     extractive_text(task.documents[0].title, "",
                                     [(d.doc_id, d.text) for d in task.documents], focus=True)):
            assert synthetic.extract_facts(text) == _facts_of_whole_text(text), text[:200]
            assert synthetic._extract_facts.__wrapped__(text) == tuple(_facts_of_whole_text(text))
    # a text longer than the memo keeps (65,536 characters): the same facts, read each time, not remembered
    long = "\n".join(d.text for t in (*WORLD, *NOISY) for d in t.documents)
    long = "\n".join([long] * (65_536 // len(long) + 1))
    before = synthetic._extract_facts.cache_info().currsize
    assert len(long) > 65_536 and synthetic.extract_facts(long) == _facts_of_whole_text(long)
    assert synthetic._extract_facts.cache_info().currsize == before


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.sampled_from([*SENTENCES, "\n", " ", "\n\n", "x", "Ann", ". ", "Ola Ny"]),
                           max_size=25))
def test_facts_of_any_text_line_by_line_equal_those_of_the_whole_text(pieces):
    text = "".join(pieces)
    assert list(synthetic._extract_facts.__wrapped__(text)) == _facts_of_whole_text(text)


def test_navigator_reads_only_through_tools_and_counts_tokens():
    task = WORLD[0]
    ws = Workspace.from_documents(list(task.documents))
    q = task.questions[0]
    out = _run(ws, q.question, max_turns=3)
    assert out.turns <= 3 + 1 and len(out.files_read) <= 3
    assert all(p.startswith("raw_docs/") for p in out.files_read)
    # every read file is one it could have seen listed; tokens are those of prompt + observations
    assert out.prompt_tokens > len(TOK.encode(q.question))
    assert out.actions[-1] == "answer"
    # no turns: it answers from the first prompt only (nothing read)
    none = _run(ws, q.question, max_turns=0)
    assert none.files_read == [] and none.prompt_tokens < out.prompt_tokens


def _accuracy(make_ws, turns: int = 2) -> float:
    scores = []
    for task in WORLD:
        ws = make_ws(task)
        for q in task.questions:
            scores.append(float(_run(ws, q.question, max_turns=turns).answer in q.answers))
    return float(np.mean(scores))


def test_a_workspace_that_gathers_facts_beats_raw_navigation_and_a_wrong_grouping():
    raw = _accuracy(lambda t: Workspace.from_documents(list(t.documents)))
    own = _accuracy(lambda t: _entity_workspace(t, own_only=True))
    good = _accuracy(_entity_workspace)
    assert good >= 0.8, good  # two reads: a hop's file holds the facts naming its entity, not the next hop's
    assert good > own + 0.2 and good > raw + 0.3, (good, own, raw)
    # with enough turns raw navigation finds the answers too: the budget is what makes structure matter
    assert _accuracy(lambda t: Workspace.from_documents(list(t.documents)), turns=12) >= 0.9


def test_navigator_on_a_question_outside_the_world_answers_nothing():
    ws = Workspace.from_documents(list(WORLD[0].documents))
    assert _run(ws, "Who wrote Hamlet?").answer == ""


def test_a_preamble_counts_as_read():
    task = WORLD[1]
    ws = Workspace.from_documents(list(task.documents))
    q = next(q for q in task.questions if q.meta["hops"] == 1)
    support = [d.text for d in task.documents if d.doc_id in q.meta["support_doc_ids"]]
    gen = answer_question(_ctx(), ws, q.question,
                          dataclasses.replace(AnswererConfig(kind="scripted", preload_root_files=False),
                                              max_turns=0), preamble="\n".join(support))
    assert returned(gen).answer in q.answers
    assert navigator._names("About the Thaetrax Collective", "Thaetrax Collective")
    assert not navigator._names("About the Thaetrax Collectives", "Thaetrax Collective")


def test_a_summary_is_read_before_the_originals():
    task = WORLD[2]
    ws = Workspace.from_documents(list(task.documents))
    docs = list(task.documents)
    text = extractive_text("Notes", "", [(d.doc_id, d.text) for d in docs], max_words=600)
    assert ws.create_file("Notes", [d.doc_id for d in docs], text).ok
    q = task.questions[0]
    out = _run(ws, q.question, max_turns=1)
    assert out.files_read and not out.files_read[0].startswith("raw_docs/")


def test_first_prompt_encodes_the_text_before_its_question_apart_with_the_same_ids(tmp_path, monkeypatch):
    """Every question's first prompt after the same README, listing and preloaded files: encoded in two
    parts (the part before the question once per workspace) on a SentencePiece model that splits words at
    spaces, giving the ids (and the navigator's token counts) of the whole text."""
    from librarian_jax.agents.answer_start import first_prompt, first_prompt_ids
    from librarian_jax.tokenizers import chat_template as make_template
    from librarian_jax.tokenizers import load_tokenizer, train_sentencepiece

    task = WORLD[0]
    texts = [d.text for t in WORLD for d in t.documents] + [q.question for t in WORLD for q in t.questions]
    tok = load_tokenizer(train_sentencepiece(texts, tmp_path / "sp.model", vocab_size=700))
    tpl = make_template(tok)
    ctx = AgentContext(tok, tpl, {})
    ws = _entity_workspace(task)
    cfg = AnswererConfig(kind="scripted", max_turns=2, context_budget=4000, preload_root_files=True)
    joins = []
    real = type(tok).splits_between
    monkeypatch.setattr(type(tok), "splits_between",
                        lambda self, h, t: joins.append(real(self, h, t)) or joins[-1])
    counted = []
    for q in task.questions:
        system, user, preloaded = first_prompt(ctx, ws, q.question, cfg)
        assert preloaded  # the shared head holds files, not only the listing
        whole = tpl.start(system) + tpl.turn("user", user) + tpl.open_turn("assistant")
        assert first_prompt_ids(tpl, system, user, q.question) == whole
        counted.append(returned(answer_question(ctx, ws, q.question, cfg)).prompt_tokens)
    assert joins and all(joins)  # each question's prompt was joined, not encoded whole
    monkeypatch.setattr(type(tok), "splits_between", lambda self, h, t: False)
    tok._encoded.clear()
    assert counted == [returned(answer_question(ctx, ws, q.question, cfg)).prompt_tokens
                       for q in task.questions]
