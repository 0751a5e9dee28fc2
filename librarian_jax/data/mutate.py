"""Seeded mutations of embedded-world corpora, for incremental updates (issue 42): a fraction of the documents
removed, changed (one fact's object rewritten) and added (documents of another world), with the questions
asked again from the NEW corpus.

    m = mutate_task(task, seed=0, fraction=0.25)
    m.task          # the new corpus (same task_id + "~m<seed>") with regenerated questions
    m.changed, m.removed, m.added   # doc_ids

Questions are regenerated from the facts the new documents state (`synthetic.statement_spans`), in the
world's own question forms (`synthetic.QUESTION_FORMS`, chained by `DESCRIBE_FORMS`, one or two hops), so the
scripted navigator and the exact-match judge read them as they read the generator's. A (subject, relation)
stated with two different objects anywhere in the new corpus is never asked. Each question's meta says
whether it is `touched` (a supporting document was changed or added) so accuracy can be split; by default
half of the questions are touched, when there are enough.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from librarian_jax.data import synthetic as S
from librarian_jax.data.schema import CorpusTask, Document, Question

_REWRITABLE = ("city", "org", "person", "year")  # object kinds a change rewrites (roles need an article)


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A mutated corpus: the new `task` and which doc_ids were changed, removed and added."""

    task: CorpusTask
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    added: tuple[str, ...]


def _facts(docs: list[Document]) -> dict[tuple[str, str], tuple[str, list[str]]]:
    """(subject, relation) -> (object, supporting doc_ids), for the pairs stated with one object only."""
    seen: dict[tuple[str, str], tuple[set[str], list[str]]] = {}
    for d in docs:
        for (s, rel, o), _, _ in S.statement_spans(d.text):
            objs, support = seen.setdefault((s, rel), (set(), []))
            objs.add(o)
            if d.doc_id not in support:
                support.append(d.doc_id)
    return {k: (next(iter(objs)), support) for k, (objs, support) in seen.items() if len(objs) == 1}


def _phrase(name: str, relation: str) -> str:
    return f"the {name}" if S.RELATIONS[relation][0] == "org" else name


def _aliases(obj: str, relation: str) -> tuple[str, ...]:
    kind = S.RELATIONS[relation][1]
    if kind == "org":
        return (f"the {obj}",)
    if kind == "city":
        return (f"the city of {obj}",)
    if kind == "role":
        return (("an " if obj[0] in "aeiou" else "a ") + obj,)
    if kind == "person" and " " in obj:
        first, last = obj.split(" ", 1)
        return (f"{last}, {first}",)
    return ()


def questions_from(docs: list[Document], touched_docs: set[str], n: int, rng: random.Random,
                   prefix: str, touched_fraction: float = 0.5) -> tuple[Question, ...]:
    """`n` questions over what `docs` state (single and two-hop), `touched_fraction` of them (when there are
    enough) supported by a document in `touched_docs`; seeded by `rng`."""
    facts = _facts(docs)
    cands: list[dict[str, Any]] = []
    for (s, rel), (o, support) in facts.items():
        cands.append({"q": S.QUESTION_FORMS[rel].format(S=_phrase(s, rel)), "gold": o, "rel": rel,
                      "support": support, "hops": 1, "subject": s})
        if rel in S.DESCRIBE_FORMS:
            for (s2, rel2), (o2, support2) in facts.items():
                if s2 == o and o2 != s:
                    np = S.DESCRIBE_FORMS[rel].format(S=_phrase(s, rel))
                    cands.append({"q": S.QUESTION_FORMS[rel2].format(S=np), "gold": o2, "rel": rel2,
                                  "support": list(dict.fromkeys(support + support2)), "hops": 2,
                                  "subject": s})
    unique: dict[str, dict[str, Any]] = {}
    for c in cands:  # a question text asked of two chains with different answers is never asked
        if c["q"] in unique and unique[c["q"]]["gold"] != c["gold"]:
            unique[c["q"]]["gold"] = None
        else:
            unique.setdefault(c["q"], c)
    pool = [c for c in unique.values() if c["gold"] is not None and S.parse_question(c["q"]) is not None]
    touched = [c for c in pool if set(c["support"]) & touched_docs]
    rest = [c for c in pool if not set(c["support"]) & touched_docs]
    rng.shuffle(touched)
    rng.shuffle(rest)
    k = min(len(touched), round(n * touched_fraction))
    chosen = touched[:k] + rest[: n - k]
    chosen += touched[k : k + n - len(chosen)]
    return tuple(
        Question(f"{prefix}{j}", c["q"], c["gold"], _aliases(c["gold"], c["rel"]),
                 "single_hop" if c["hops"] == 1 else "multi_hop",
                 {"hops": c["hops"], "support_doc_ids": c["support"], "subject": c["subject"],
                  "touched": bool(set(c["support"]) & touched_docs)})
        for j, c in enumerate(chosen)
    )


def _change(doc: Document, others: list[Document], pool: dict[str, list[str]],
            rng: random.Random) -> Document | None:
    """`doc` with one fact's object rewritten: a fact whose (subject, relation) no other document states,
    its object replaced by another of the same kind from the corpus (a year: moved by 1-30 years)."""
    elsewhere = {(s, rel) for d in others for (s, rel, _), _, _ in S.statement_spans(d.text)}
    spans = [x for x in S.statement_spans(doc.text)
             if S.RELATIONS[x[0][1]][1] in _REWRITABLE and (x[0][0], x[0][1]) not in elsewhere]
    rng.shuffle(spans)
    for (s, rel, o), start, end in spans:
        kind = S.RELATIONS[rel][1]
        if kind == "year":
            new = str(int(o) + rng.randint(1, 30))
        else:
            options = sorted(set(pool.get(kind, [])) - {o, s})
            if not options:
                continue
            new = rng.choice(options)
        text = doc.text[:start] + new + doc.text[end:]
        if (s, rel, new) in S.extract_facts(text):
            return dataclasses.replace(doc, text=text)
    return None


def mutate_task(task: CorpusTask, seed: int, fraction: float = 0.25, num_questions: int | None = None,
                touched_fraction: float = 0.5, world: S.WorldConfig | None = None) -> Mutation:
    """`task` with `max(1, round(fraction * n))` documents removed, as many changed and as many added (from
    another world of the same sizes, new doc_ids `u000`...), and `num_questions` (default: as many as the
    task had) questions regenerated from the new corpus. Deterministic in (task_id, seed)."""
    if not 0.0 < fraction <= 0.5:
        raise ValueError(f"fraction must be in (0, 0.5], got {fraction}")
    rng = random.Random(f"librarian-mutate:{seed}:{task.task_id}")
    docs = list(task.documents)
    k = max(1, round(fraction * len(docs)))
    removed = set(rng.sample([d.doc_id for d in docs], k))
    kept = [d for d in docs if d.doc_id not in removed]
    pool: dict[str, list[str]] = {}
    for d in docs:
        for s, rel, o in S.extract_facts(d.text):
            pool.setdefault(S.RELATIONS[rel][1], []).append(o)
            pool.setdefault(S.RELATIONS[rel][0], []).append(s)
    changed: list[str] = []
    order = list(range(len(kept)))
    rng.shuffle(order)
    for i in order:
        if len(changed) == k:
            break
        new = _change(kept[i], [d for j, d in enumerate(kept) if j != i], pool, rng)
        if new is not None:
            kept[i] = new
            changed.append(new.doc_id)
    cfg = world or S.WorldConfig(docs_per_task=max(2 * k, 4))
    donor = S.generate_task(10_007 + seed, int(task.meta.get("index", 0)) if task.meta else 0, cfg)
    extra = [d for d in donor.documents if S.extract_facts(d.text)][:k]
    added = [dataclasses.replace(d, doc_id=f"u{j:03d}", url="", meta={**d.meta, "added": True})
             for j, d in enumerate(extra)]
    new_docs = kept + added
    touched = set(changed) | {d.doc_id for d in added}
    n = len(task.questions) if num_questions is None else num_questions
    new_id = f"{task.task_id}~m{seed}"
    questions = questions_from(new_docs, touched, n, rng, f"{new_id}/q", touched_fraction)
    meta = {**(task.meta or {}), "mutation": {"seed": seed, "fraction": fraction, "changed": changed,
                                              "removed": sorted(removed), "added": [d.doc_id for d in added]}}
    new_task = CorpusTask(new_id, tuple(new_docs), questions, (), meta)
    return Mutation(new_task, tuple(changed), tuple(sorted(removed)), tuple(d.doc_id for d in added))
