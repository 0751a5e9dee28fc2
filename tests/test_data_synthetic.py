"""The synthetic world: determinism, and that its questions are answerable, multi-hop and distracted."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from librarian_jax.data import CorpusTask, WorldConfig, generate_task, generate_world, world_texts


def _digest(tasks: list[CorpusTask]) -> str:
    return hashlib.sha256(json.dumps([t.to_dict() for t in tasks], sort_keys=True).encode()).hexdigest()


def _edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


@pytest.fixture(scope="module")
def world() -> list[CorpusTask]:
    return generate_world(11, 24)


def test_same_seed_same_world_in_any_process():
    a = generate_world(3, 4)
    assert _digest(a) == _digest(generate_world(3, 4))
    assert _digest(generate_world(3, 6)[:4]) == _digest(a)  # task i does not depend on num_tasks
    assert generate_task(3, 2).to_dict() == a[2].to_dict()
    assert _digest(generate_world(4, 4)) != _digest(a)
    code = (
        "import hashlib, json; from librarian_jax.data.synthetic import generate_world; "
        "print(hashlib.sha256(json.dumps([t.to_dict() for t in generate_world(3, 4)], "
        "sort_keys=True).encode()).hexdigest())"
    )
    for hash_seed in ("0", "987"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == _digest(a)


def test_default_sizes_suit_a_tiny_model(world):
    for t in world:
        assert len(t.documents) == 8 and len(t.questions) == 4 and len(t.reuse_questions) == 4
        assert len({d.doc_id for d in t.documents}) == 8
        for d in t.documents:
            assert 60 <= len(d.text.split()) <= 160, (t.task_id, d.doc_id, len(d.text.split()))
        ids = [q.question_id for q in (*t.questions, *t.reuse_questions)]
        texts = [q.question for q in (*t.questions, *t.reuse_questions)]
        assert len(set(ids)) == len(ids) and len(set(texts)) == len(texts)
    kinds = [q.question_type for t in world for q in (*t.questions, *t.reuse_questions)]
    assert kinds.count("multi_hop") >= len(kinds) // 3 and kinds.count("single_hop") >= len(kinds) // 3


def test_every_answer_follows_from_the_corpus_facts(world):
    """Each (subject, relation) is stated once; following a question's relations from its subject through the
    documents' facts gives its gold answer, which appears verbatim in the last support document."""
    for t in world:
        facts: dict[tuple[str, str], tuple[str, str]] = {}
        by_id = {d.doc_id: d for d in t.documents}
        for d in t.documents:
            for subject, relation, obj in d.meta["facts"]:
                assert (subject, relation) not in facts, (t.task_id, subject, relation)
                facts[(subject, relation)] = (obj, d.doc_id)
                assert subject in d.text and obj in d.text  # the fact is really in the text
        for q in (*t.questions, *t.reuse_questions):
            node, docs = q.meta["subject"], []
            assert node in q.question
            for relation in q.meta["relations"]:
                node, doc_id = facts[(node, relation)]
                docs.append(doc_id)
            assert node == q.gold_answer, (t.task_id, q.question)
            assert list(dict.fromkeys(docs)) == q.meta["support_doc_ids"]
            assert q.gold_answer in by_id[docs[-1]].text
            assert q.aliases and all(a != q.gold_answer for a in q.aliases) or q.gold_answer.isdigit()


def test_multi_hop_questions_need_two_documents(world):
    multi = [
        (t, q) for t in world for q in (*t.questions, *t.reuse_questions) if q.question_type == "multi_hop"
    ]
    assert multi and any(q.meta["hops"] == 3 for _, q in multi)
    for t, q in multi:
        assert q.meta["hops"] == len(q.meta["relations"]) >= 2
        where = {(s, r): (o, d.doc_id) for d in t.documents for s, r, o in d.meta["facts"]}
        node, homes = q.meta["subject"], set()
        for relation in q.meta["relations"]:
            node, doc_id = where[(node, relation)]
            homes.add(doc_id)
        assert len(homes) >= 2, (t.task_id, q.question)  # no one document states the whole chain
        # and the question does not give its answer away
        assert node not in q.question


def test_distractors_look_like_real_entities_but_differ(world):
    for t in world:
        distractors = [d for d in t.documents if d.meta["distractor"]]
        assert distractors, t.task_id
        real = {
            d.meta["subject"]: d
            for d in t.documents
            if d.meta["kind"] in ("profile", "org_profile", "report")
        }
        for d in distractors:
            name = d.meta["subject"]
            assert name not in real
            twin = min(real, key=lambda r: _edit_distance(r, name))
            a, b = twin.split(), name.split()  # a look-alike: one word changed (slightly, or an org's kind)
            assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1, (twin, name)
            assert not (name.lower() in twin.lower() or twin.lower() in name.lower())
            assert d.title.startswith(("Profile: ", "About the ", "Report: "))
            twin_facts = {}
            for doc in t.documents:
                twin_facts.update({r: o for s, r, o in doc.meta["facts"] if s == twin})
            differ = [twin_facts.get(r) != o for _, r, o in d.meta["facts"]]
            assert d.meta["facts"] and all(differ), (name, twin)
        questions = [q.question for q in (*t.questions, *t.reuse_questions)]
        assert not any(d.meta["subject"] in q for d in distractors for q in questions)


def test_sizes_are_configurable_and_checked():
    big = generate_world(
        0,
        1,
        docs_per_task=60,
        min_words=30,
        max_words=50,
        questions_per_task=12,
        reuse_questions_per_task=6,
        multi_hop_fraction=1.0,
    )[0]
    assert len(big.documents) == 60 and len(big.questions) == 12 and len(big.reuse_questions) == 6
    assert all(q.question_type == "multi_hop" for q in big.questions)
    assert sum(d.meta["distractor"] for d in big.documents) >= 5
    single = generate_world(0, 2, WorldConfig(max_hops=1, docs_per_task=4))
    assert all(q.meta["hops"] == 1 for t in single for q in t.questions)
    tiny = generate_world(0, 1, docs_per_task=1)[0]  # too small for 4 + 4 questions: fewer, still valid
    assert len(tiny.documents) == 1 and 0 < len(tiny.questions) <= 4
    with pytest.raises(ValueError, match="max_words"):
        generate_world(0, 1, min_words=50, max_words=10)
    with pytest.raises(TypeError):
        generate_world(0, 1, words=10)


def test_world_texts_cover_documents_and_questions(world):
    texts = world_texts(world[:2])
    joined = "\n".join(texts)
    for t in world[:2]:
        assert all(d.text in texts for d in t.documents)
        assert all(q.question in joined and q.gold_answer in joined for q in t.questions)
