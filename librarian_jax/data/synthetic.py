"""A seeded synthetic world: small corpora of invented people, organisations, cities and projects.

Each task is a self-contained world. Entities have attributes (a person's profession, birthplace and employer;
an organisation's lab city, founding year and founder; a project's leader, launch year and funder), and every
such fact is stated in exactly one document, but the facts of one entity are spread over several documents:
a profile, an organisation page, a project report, meeting notes that mention several entities. Distractor
documents describe look-alike entities ("Orlen Vasko" next to "Orlen Vask", "Project Kestrin" next to
"Project Kestrel") with different facts. Questions are single-hop ("In which city was Orlen Vask born?") or
multi-hop chains whose facts sit in at least two documents ("In which city is the lab of the organisation
that employs the person who leads Project Kestrel?"), with short gold answers and aliases. A workspace that
links an entity's scattered facts (and keeps look-alikes apart) genuinely shortens the answerer's path.

Everything is drawn from `random.Random` seeded by `(seed, task index)` strings, so a task is identical for
the same seed whatever the Python hash seed and whatever `num_tasks` is. Names come from syllable tables.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Iterable
from typing import Any

from absl import logging

from librarian_jax import text_memo
from librarian_jax.data.schema import CorpusTask, Document, Question

# ----------------------------------------------------------------------------------------------------------
# Tables.

_ONSETS = (
    "b",
    "br",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "st",
    "t",
    "tr",
    "v",
    "z",
    "th",
    "sh",
    "c",
    "j",
    "w",
)
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ae", "io", "ai", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "k", "th", "m", "nd", "st", "x", "v", "rn", "sk")
_CITY_ENDINGS = ("", "", "", "vik", "holm", "ford", "mere", "ton", "wick", "dal", "burg", "stead")
_ORG_KINDS = (
    "Institute",
    "Laboratory",
    "Foundation",
    "Observatory",
    "Works",
    "Collective",
    "Academy",
    "Bureau",
    "Society",
    "Trust",
)
_ROLES = (
    "hydrologist",
    "archivist",
    "structural engineer",
    "botanist",
    "cartographer",
    "geologist",
    "statistician",
    "glassmaker",
    "marine chemist",
    "astronomer",
    "economist",
    "architect",
    "epidemiologist",
    "linguist",
    "metallurgist",
    "ornithologist",
    "surveyor",
    "acoustician",
)
_TOPICS = (
    "river levels",
    "old maps",
    "harbour tides",
    "soil samples",
    "glass furnaces",
    "bridge loads",
    "orchard pests",
    "mill wheels",
    "canal locks",
    "lighthouse lenses",
    "bird counts",
    "salt marshes",
    "weather logs",
    "copper alloys",
    "city archives",
    "printing presses",
    "wind gauges",
    "seed banks",
)
_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)

# Relations: name -> (subject kind, object kind). Object kinds "role" and "year" are literals.
RELATIONS: dict[str, tuple[str, str]] = {
    "role": ("person", "role"),
    "born_in": ("person", "city"),
    "works_at": ("person", "org"),
    "lab_city": ("org", "city"),
    "founded_year": ("org", "year"),
    "founded_by": ("org", "person"),
    "led_by": ("project", "person"),
    "launch_year": ("project", "year"),
    "funded_by": ("project", "org"),
}

_STATEMENTS: dict[str, tuple[str, ...]] = {
    "role": ("{S} is {A} by training.", "{S} works as {A}.", "By profession, {S} is {A}."),
    "born_in": ("{S} was born in {O}.", "{S} was born in the city of {O}."),
    "works_at": ("{S} works at {O}.", "{S} is on the staff of {O}.", "{O} employs {S}."),
    "lab_city": (
        "{S} keeps its main lab in {O}.",
        "The lab of {S} is in {O}.",
        "{S} runs its lab out of {O}.",
    ),
    "founded_year": ("{S} was founded in {O}.", "{S} was established in {O}."),
    "founded_by": ("{S} was founded by {O}.", "{O} founded {S}."),
    "led_by": ("{S} is led by {O}.", "{O} leads {S}.", "{O} heads {S}."),
    "launch_year": ("{S} was launched in {O}.", "{S} started in {O}."),
    "funded_by": ("{S} is funded by {O}.", "{O} funds {S}.", "{O} pays for {S}."),
}

# Questions: {S} is the subject's name or a noun phrase that describes it.
_QUESTIONS: dict[str, str] = {
    "role": "What is the profession of {S}?",
    "born_in": "In which city was {S} born?",
    "works_at": "Which organisation employs {S}?",
    "lab_city": "In which city is the lab of {S}?",
    "founded_year": "In which year was {S} founded?",
    "founded_by": "Who founded {S}?",
    "led_by": "Who leads {S}?",
    "launch_year": "In which year was {S} launched?",
    "funded_by": "Which organisation funds {S}?",
}
# Counting questions over one relation's facts whose object is the named entity (the subject kind's plural).
_AGGREGATES: dict[str, str] = {
    "works_at": "How many people does {S} employ?",
    "funded_by": "How many projects does {S} fund?",
}
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve")
# Noun phrases naming a relation's object through its subject (only relations whose object has relations).
_DESCRIBE: dict[str, str] = {
    "works_at": "the organisation that employs {S}",
    "founded_by": "the founder of {S}",
    "led_by": "the person who leads {S}",
    "funded_by": "the organisation that funds {S}",
}

_NOTE_LEADS = (
    "It was noted that ",
    "The group confirmed that ",
    "For the record, ",
    "Someone pointed out that ",
)

_FILLER: tuple[str, ...] = (
    "The text was checked by the records office before it was filed.",
    "Questions about this page can be sent to the editors.",
    "{X} gave a short talk on {T} and {T2}.",
    "{X} once attended a public lecture in {C}.",
    "{X} and {Y} have worked together on a study of {T}.",
    "Plans for a workshop in {C} were discussed but not settled.",
    "A copy of this page is kept in the shared archive.",
    "The schedule for the coming season did not change.",
    "Visitors often ask about {T}, which remains a popular subject.",
    "{X} has written several notes on {T}.",
    "The weather during the last field visit was cold and wet.",
    "Earlier drafts of this text mentioned {T} in more detail.",
    "Photographs from the visit to {C} are stored with the originals.",
    "{X} wants to compare the findings with older records on {T}.",
    "No decision was taken on the budget for {T}.",
    "The next review is expected before the end of the year.",
)
# Filler that names organisations and projects without stating a fact about them (`mention_noise`): a search
# for an organisation's or a project's name finds these passages too.
_MENTION_FILLER: tuple[str, ...] = (
    "{O} hosted a seminar on {T} last spring.",
    "A team from {O} toured {C} to look at {T}.",
    "{X} visited {O} to talk about {T}.",
    "{J} came up briefly during a talk on {T}.",
    "The newsletter of {O} printed a note on {T}.",
    "Someone compared {J} with older work on {T}.",
    "{X} asked how {J} handles {T}.",
    "The archive of {O} holds old records on {T}.",
)
_MEETING_FILLER: tuple[str, ...] = (
    "The minutes of the previous meeting were approved without changes.",
    "Action item: {X} will circulate a summary on {T}.",
    "{X} asked for more time to finish the notes on {T}.",
    "The meeting closed with a short discussion of {T}.",
    "{X} and {Y} agreed to meet again in {C}.",
)


# ----------------------------------------------------------------------------------------------------------
# World state.


@dataclasses.dataclass
class _Entity:
    key: str
    kind: str  # person | org | city | project
    name: str
    first: str = ""
    last: str = ""
    distractor_of: str | None = None


@dataclasses.dataclass
class _Fact:
    subject: str  # entity key
    relation: str
    obj: str  # entity key, or a literal (role, year)
    home: int = -1  # index of the one document that states it


@dataclasses.dataclass
class _Doc:
    kind: str  # profile | org_profile | report | meeting | distractor
    subject: str | None
    title: str
    lead: str
    facts: list[int] = dataclasses.field(default_factory=list)
    mentions: list[str] = dataclasses.field(default_factory=list)


class _Names:
    """Invents pronounceable names from syllables, never repeating one (case-insensitively) in a world."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        """Open syllables (onset + vowel) with one optional closing consonant: "Orlen", "Kestavo", "Brisk"."""
        r = self.rng
        while True:
            parts = []
            for i in range(syllables):
                onset = "" if i == 0 and r.random() < 0.2 else r.choice(_ONSETS)
                parts.append(onset + r.choice(_VOWELS))
            w = "".join(parts) + r.choice(_CODAS)
            if len(w) >= 3:
                return w[:1].upper() + w[1:]

    def fresh(self, make: Any) -> str:
        for _ in range(1000):
            name = make()
            if name.lower() not in self.used and len(name) >= 3:
                self.used.add(name.lower())
                return name
        raise RuntimeError("name space exhausted")  # practically unreachable: ~10^7 names per pattern

    def claim(self, name: str) -> bool:
        if name.lower() in self.used:
            return False
        self.used.add(name.lower())
        return True


def _mutate(word: str, rng: random.Random) -> str:
    """A look-alike of `word`: one vowel or consonant changed, or a letter added or dropped at the end."""
    vowels, consonants = "aeiou", "bdgklmnprstvz"
    choice = rng.randrange(4)
    if choice == 0:
        positions = [i for i, c in enumerate(word) if c.lower() in vowels]
        i = rng.choice(positions)  # every generated word has a vowel
        new = rng.choice([v for v in vowels if v != word[i].lower()])
        return word[:i] + (new.upper() if word[i].isupper() else new) + word[i + 1 :]
    if choice == 1:
        positions = [i for i, c in enumerate(word) if i > 0 and c in consonants]
        if positions:
            i = rng.choice(positions)
            return word[:i] + rng.choice([c for c in consonants if c != word[i]]) + word[i + 1 :]
    if choice == 2 or len(word) <= 3:
        return word + (rng.choice("aeio") if word[-1] not in vowels else rng.choice("nrs"))
    return word[:-1]


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


# ----------------------------------------------------------------------------------------------------------
# Generation.


TITLE_STYLES = ("labelled", "plain")
DOC_ORDERS = ("shuffled", "by_type")
_TYPE_RANK = {"person": 0, "org": 1, "project": 2}
_LABELS = {"person": ("Profile: {}", "This profile describes {}."),
           "org": ("About the {}", "This page introduces the {}."),
           "project": ("Report: {}", "This report covers {}.")}
_LABELLED = re.compile(r"^(?P<label>Profile: |About the |Report: )(?P<name>.+)$")
_LABEL_KINDS = {"Profile: ": "person", "About the ": "org", "Report: ": "project"}


def entity_of_title(title: str) -> tuple[str, str]:
    """(entity name, kind) of a synthetic document's title, in either title style; ("", "") for a page that
    is no entity's own (meeting notes). Plain titles are read by the name's shape: "Project ..." is a
    project, a name ending in an organisation kind ("... Institute") an organisation, the rest people."""
    m = _LABELLED.match(title)
    if m:
        return m.group("name"), _LABEL_KINDS[m.group("label")]
    if not title or title.startswith("Meeting notes"):
        return "", ""
    if title.startswith("Project "):
        return title, "project"
    if title.rsplit(" ", 1)[-1] in _ORG_KINDS:
        return title, "org"
    return title, "person"


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    """Sizes of each synthetic task. The defaults suit a tiny CPU model (8 documents of 60-120 words)."""

    docs_per_task: int = 8
    min_words: int = 60
    max_words: int = 120
    questions_per_task: int = 4
    reuse_questions_per_task: int = 4
    multi_hop_fraction: float = 0.5
    max_hops: int = 3
    distractor_fraction: float = 0.125
    spread_probability: float = 0.5
    task_prefix: str = "synth"
    # Counting questions over facts spread across the corpus ("How many people does the Kestrel Institute
    # employ?"): this fraction of each task's questions, where the world has such facts.
    aggregate_fraction: float = 0.0
    # Chance that a filler sentence names an organisation or a project (look-alikes included) instead of
    # stating nothing about them: lexical noise for retrieval.
    mention_noise: float = 0.0
    # Shares of the non-distractor documents that are person / organisation / project pages (the rest:
    # meeting notes). Fewer organisations than people means more people per organisation.
    layout: tuple[float, float, float] = (0.35, 0.25, 0.2)
    # How an entity's own page is titled: "labelled" ("Profile: Orlen Vask", "About the Kestrel Institute",
    # "Report: Project Kestrel") or "plain" (the entity's name: what a builder titles the entity's file, so a
    # small model copies it from the listing token for token; `entity_of_title` reads either back).
    titles: str = "labelled"
    # The order of a corpus's documents (and so of their doc ids): "shuffled", or "by_type": people's pages,
    # then organisations', then projects' (look-alikes among their kind's pages), then meeting notes, each
    # group shuffled within; a corpus exported by category, as a wiki's or a CRM's often is.
    doc_order: str = "shuffled"

    def validate(self) -> None:
        checks = [
            ("docs_per_task", self.docs_per_task >= 1, ">= 1"),
            ("min_words", self.min_words >= 1, ">= 1"),
            ("max_words", self.max_words >= self.min_words, f">= min_words ({self.min_words})"),
            ("questions_per_task", self.questions_per_task >= 0, ">= 0"),
            ("reuse_questions_per_task", self.reuse_questions_per_task >= 0, ">= 0"),
            ("multi_hop_fraction", 0.0 <= self.multi_hop_fraction <= 1.0, "in [0, 1]"),
            ("max_hops", self.max_hops >= 1, ">= 1"),
            ("distractor_fraction", 0.0 <= self.distractor_fraction < 1.0, "in [0, 1)"),
            ("spread_probability", 0.0 <= self.spread_probability <= 1.0, "in [0, 1]"),
            ("aggregate_fraction", 0.0 <= self.aggregate_fraction <= 1.0, "in [0, 1]"),
            ("titles", self.titles in TITLE_STYLES, f"one of {TITLE_STYLES}"),
            ("doc_order", self.doc_order in DOC_ORDERS, f"one of {DOC_ORDERS}"),
            ("mention_noise", 0.0 <= self.mention_noise <= 1.0, "in [0, 1]"),
            ("layout", len(self.layout) == 3 and all(x >= 0 for x in self.layout) and sum(self.layout) <= 1,
             "three non-negative shares summing to <= 1"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"WorldConfig.{name} must be {want}, got {getattr(self, name)!r}")


# Named worlds (`data.world`); a task's sizes (`docs_per_task`, words, questions) are set on top.
# - "classic": a handful of documents, single- and multi-hop questions; retrieval of one or two passages
#   finds most answers (`configs/grpo.py:embedded`).
# - "noisy": docs/world.md. Tens of documents, a quarter of them near-duplicate look-alikes; most facts stated
#   away from their entity's page; filler that names organisations and projects; multi-hop questions whose
#   later hops the question does not name, and counting questions over facts spread across the corpus.
WORLDS: dict[str, WorldConfig] = {
    "classic": WorldConfig(),
    "noisy": WorldConfig(docs_per_task=20, min_words=50, max_words=100, multi_hop_fraction=0.7, max_hops=3,
                         distractor_fraction=0.15, spread_probability=0.7, aggregate_fraction=0.25,
                         mention_noise=0.3, layout=(0.2, 0.1, 0.1), titles="plain", doc_order="by_type"),
}


class _World:
    def __init__(self, rng: random.Random, cfg: WorldConfig):
        self.rng, self.cfg = rng, cfg
        self.names = _Names(rng)
        self.entities: dict[str, _Entity] = {}
        self.facts: list[_Fact] = []
        self.docs: list[_Doc] = []
        self.counts: dict[str, int] = {}
        self.by_kind: dict[tuple[str, bool], list[_Entity]] = {}
        self._filler: tuple[list[str], list[str]] | None = None
        self.lower_names: dict[str, set[str]] = {}  # kind -> lower-cased names, for look-alike checks
        self._joined: dict[str, str] = {}

    # -- entities --------------------------------------------------------------------------------------------
    def add(self, kind: str, **fields: Any) -> _Entity:
        e = _Entity(key=f"{kind}:{self.counts.get(kind, 0)}", kind=kind, **fields)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.entities[e.key] = e
        self.by_kind.setdefault((kind, e.distractor_of is None), []).append(e)
        self.lower_names.setdefault(kind, set()).add(e.name.lower())
        self._joined.pop(kind, None)
        return e

    def new_person(self) -> _Entity:
        n = self.names
        while True:
            first = n.word(2)
            last = n.word(self.rng.choice((1, 1, 2)))
            if first.lower() != last.lower() and n.claim(f"{first} {last}"):
                return self.add("person", name=f"{first} {last}", first=first, last=last)

    def new_org(self) -> _Entity:
        kind = self.rng.choice(_ORG_KINDS)
        return self.add(
            "org", name=self.names.fresh(lambda: f"{self.names.word(self.rng.choice((2, 3)))} {kind}")
        )

    def new_city(self) -> _Entity:
        n = self.names
        return self.add(
            "city", name=n.fresh(lambda: n.word(self.rng.choice((1, 2))) + self.rng.choice(_CITY_ENDINGS))
        )

    def new_project(self) -> _Entity:
        return self.add("project", name=self.names.fresh(lambda: f"Project {self.names.word(2)}"))

    def look_alike(self, e: _Entity) -> _Entity:
        for _ in range(100):
            if e.kind == "person":
                first, last = e.first, e.last
                if self.rng.random() < 0.5:
                    last = _mutate(last, self.rng)
                else:
                    first = _mutate(first, self.rng)
                name = f"{first} {last}"
                if self._unconfusable(name, "person") and self.names.claim(name):
                    return self.add("person", name=name, first=first, last=last, distractor_of=e.key)
            else:
                head, _, tail = e.name.partition(" ")
                if e.kind == "project":
                    name = f"{head} {_mutate(tail, self.rng)}"
                elif self.rng.random() < 0.5:
                    name = f"{_mutate(head, self.rng)} {tail}"
                else:
                    name = f"{head} {self.rng.choice([k for k in _ORG_KINDS if k != tail])}"
                if self._unconfusable(name, e.kind) and self.names.claim(name):
                    return self.add(e.kind, name=name, distractor_of=e.key)
        raise RuntimeError(f"no look-alike name for {e.name}")

    def _unconfusable(self, name: str, kind: str) -> bool:
        """A look-alike must not contain, or be contained in, the name of an entity of its kind
        ("Project Kestre" in "Project Kestrel"): a search for one must not find the other."""
        low = name.lower()
        names = self.lower_names.setdefault(kind, set())
        if kind not in self._joined:
            self._joined[kind] = "\n".join(names)
        if low in self._joined[kind]:  # the look-alike inside another name
            return False
        # another name inside the look-alike: one of its substrings
        return not any(low[i:j] in names for i in range(len(low)) for j in range(i + 1, len(low) + 1))

    def of_kind(self, kind: str, *, real: bool = True) -> list[_Entity]:
        return self.by_kind.get((kind, real), [])

    def filler_names(self) -> tuple[list[str], list[str]]:
        """(all person names, look-alikes included; all city names), built once the world is complete."""
        if self._filler is None:
            people = [e.name for e in self.of_kind("person") + self.of_kind("person", real=False)]
            self._filler = (people, [e.name for e in self.of_kind("city")])
        return self._filler

    def mention_names(self) -> tuple[list[str], list[str]]:
        """(organisation names, project names), look-alikes included: what noisy filler names."""
        return ([e.name for e in self.of_kind("org") + self.of_kind("org", real=False)],
                [e.name for e in self.of_kind("project") + self.of_kind("project", real=False)])

    def surface(self, value: str) -> str:
        e = self.entities.get(value)
        return e.name if e is not None else value

    # -- facts -----------------------------------------------------------------------------------------------
    def draw_object(self, relation: str, subject: _Entity) -> str | None:
        kind = RELATIONS[relation][1]
        if kind == "role":
            return self.rng.choice(_ROLES)
        if kind == "year":
            return str(
                self.rng.randint(1890, 1990) if relation == "founded_year" else self.rng.randint(1995, 2024)
            )
        pool = self.of_kind(kind)
        if not pool or (len(pool) == 1 and pool[0].key == subject.key):
            return None
        while True:
            pick = self.rng.choice(pool)
            if pick.key != subject.key:
                return pick.key

    def attributes(self, e: _Entity) -> list[_Fact]:
        facts = []
        for relation, (subject_kind, _) in RELATIONS.items():
            if subject_kind != e.kind:
                continue
            obj = self.draw_object(relation, e)
            if obj is not None:
                facts.append(_Fact(e.key, relation, obj))
        return facts


def _layout(k: int, distractor_fraction: float,
            shares: tuple[float, float, float] = (0.35, 0.25, 0.2)) -> tuple[int, int, int, int, int]:
    """(people, orgs, projects, meetings, distractors) documents for a corpus of `k` documents."""
    n_dis = 0 if k < 4 else max(1, int(k * distractor_fraction + 0.5)) if distractor_fraction > 0 else 0
    r = k - n_dis
    people = max(1, math.ceil(shares[0] * r))
    orgs = int(shares[1] * r + 0.5)
    projects = int(shares[2] * r + 0.5)
    while people + orgs + projects > r:
        if projects > 0:
            projects -= 1
        elif orgs > 0:
            orgs -= 1
        else:
            people -= 1
    return people, orgs, projects, r - people - orgs - projects, n_dis


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(2000, 2024)}"


def _build_world(rng: random.Random, cfg: WorldConfig) -> _World:
    w = _World(rng, cfg)
    n_people, n_orgs, n_projects, n_meetings, n_dis = _layout(cfg.docs_per_task, cfg.distractor_fraction,
                                                               tuple(cfg.layout))
    people = [w.new_person() for _ in range(n_people)]
    orgs = [w.new_org() for _ in range(n_orgs)]
    projects = [w.new_project() for _ in range(n_projects)]
    for _ in range(max(2, n_orgs + 1 + n_people // 3)):
        w.new_city()

    # One primary document per real entity, then meeting notes.
    primary: dict[str, int] = {}
    def page(e: _Entity) -> tuple[str, str]:
        title, lead = _LABELS[e.kind]
        return (title.format(e.name) if cfg.titles == "labelled" else e.name), lead.format(e.name)

    for e in people:
        primary[e.key] = len(w.docs)
        w.docs.append(_Doc("profile", e.key, *page(e)))
    for e in orgs:
        primary[e.key] = len(w.docs)
        w.docs.append(_Doc("org_profile", e.key, *page(e)))
    for e in projects:
        primary[e.key] = len(w.docs)
        w.docs.append(_Doc("report", e.key, *page(e)))
    meetings = []
    for _ in range(n_meetings):
        date = _date(rng)
        meetings.append(len(w.docs))
        w.docs.append(_Doc("meeting", None, f"Meeting notes, {date}", f"Notes from the meeting of {date}."))

    # Facts about real entities: each lands in exactly one document, often not the subject's own page.
    for e in [*people, *orgs, *projects]:
        for fact in w.attributes(e):
            home = primary[e.key]
            others = list(meetings)
            if fact.relation in ("works_at", "funded_by", "founded_by") and fact.obj in primary:
                others.append(primary[fact.obj])
            if (
                fact.relation not in ("role", "born_in", "lab_city", "led_by")
                and others
                and rng.random() < cfg.spread_probability
            ):
                home = rng.choice(others)
            fact.home = home
            w.docs[home].facts.append(len(w.facts))
            w.facts.append(fact)

    facts_of: dict[str, list[_Fact]] = {}
    for f in w.facts:
        facts_of.setdefault(f.subject, []).append(f)
    # Distractors: look-alikes of real entities, each with its own page of different facts.
    real = [*people, *orgs, *projects]
    for target in rng.sample(real, min(n_dis, len(real))) + [
        rng.choice(real) for _ in range(n_dis - len(real))
    ]:
        twin = w.look_alike(target)
        doc = len(w.docs)
        w.docs.append(_Doc("distractor", twin.key, *page(twin)))
        original = {f.relation: f.obj for f in facts_of.get(target.key, ())}
        for fact in w.attributes(twin):
            for _ in range(20):  # keep the look-alike's facts different from its original's (where possible)
                if fact.obj != original.get(fact.relation):
                    break
                fact.obj = w.draw_object(fact.relation, twin) or fact.obj
            fact.home = doc
            w.docs[doc].facts.append(len(w.facts))
            w.facts.append(fact)

    # Meeting attendees: a few people, look-alikes included.
    everyone = w.of_kind("person") + w.of_kind("person", real=False)
    for i in meetings:
        w.docs[i].mentions = [e.key for e in rng.sample(everyone, min(len(everyone), rng.randint(2, 4)))]
    return w


def _render(w: _World, doc: _Doc, target_words: int) -> str:
    rng = w.rng
    sentences: list[str] = []
    for fi in doc.facts:
        f = w.facts[fi]
        obj = w.surface(f.obj)
        s = rng.choice(_STATEMENTS[f.relation]).format(S=w.surface(f.subject), O=obj, A=_article(obj))
        if doc.kind == "meeting":
            s = rng.choice(_NOTE_LEADS) + (s[0].lower() + s[1:] if s.startswith("The ") else s)
        sentences.append(s)
    rng.shuffle(sentences)
    head = [doc.lead]
    if doc.kind == "meeting" and doc.mentions:
        names = [w.surface(k) for k in doc.mentions]
        attendees = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        head.append(f"Attendees: {attendees}.")
    people, cities = w.filler_names()
    table = list(_FILLER + (_MEETING_FILLER if doc.kind == "meeting" else ()))
    unused: list[str] = []
    body = list(sentences)
    words = sum(len(s.split()) for s in head + body)
    while words < target_words:
        if not unused:  # each filler template once per document until all are used
            unused = rng.sample(table, len(table))
        x, y = rng.sample(people, 2) if len(people) >= 2 else (people[0], people[0])
        if doc.subject is not None and w.entities[doc.subject].kind == "person" and rng.random() < 0.5:
            x = w.entities[doc.subject].name
        t, t2 = rng.sample(_TOPICS, 2)
        template = unused.pop()
        if w.cfg.mention_noise > 0 and rng.random() < w.cfg.mention_noise:
            orgs, projects = w.mention_names()
            template = rng.choice(_MENTION_FILLER)
            if not projects:
                template = template.replace("{J}", "{O}")
            s = template.format(X=x, O=rng.choice(orgs) if orgs else x, J=rng.choice(projects) if projects
                                else x, T=t, C=rng.choice(cities))
        else:
            s = template.format(X=x, Y=y, T=t, T2=t2, C=rng.choice(cities))
        body.insert(rng.randint(0, len(body)), s)
        words += len(s.split())
    return " ".join(head + body)


def _answer(w: _World, value: str) -> tuple[str, tuple[str, ...]]:
    e = w.entities.get(value)
    if e is None:
        return (value, ()) if value.isdigit() else (value, (_article(value),))
    if e.kind == "person":
        return e.name, (f"{e.last}, {e.first}",)
    if e.kind == "org":
        return e.name, (f"the {e.name}",)
    if e.kind == "city":
        return e.name, (f"the city of {e.name}",)
    return e.name, ()


def _candidates(w: _World, doc_ids: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Single-hop and multi-hop question candidates over real facts."""
    by_subject: dict[str, dict[str, int]] = {}
    for i, f in enumerate(w.facts):
        if w.entities[f.subject].distractor_of is None:
            by_subject.setdefault(f.subject, {})[f.relation] = i

    def phrase(e: _Entity) -> str:
        return f"the {e.name}" if e.kind == "org" else e.name

    singles, multis = [], []
    for subject, rels in by_subject.items():
        for relation, fi in rels.items():
            singles.append(
                {"chain": [fi], "text": _QUESTIONS[relation].format(S=phrase(w.entities[subject]))}
            )

    def extend(chain: list[int], np: str, visited: set[str]) -> None:
        last = w.facts[chain[-1]]
        for relation, fi in by_subject.get(last.obj, {}).items():
            f = w.facts[fi]
            if f.obj in visited:
                continue
            new = [*chain, fi]
            homes = {w.facts[c].home for c in new}
            if len(homes) >= 2:
                multis.append({"chain": new, "text": _QUESTIONS[relation].format(S=np)})
            if relation in _DESCRIBE and len(new) < w.cfg.max_hops:
                extend(new, _DESCRIBE[relation].format(S=np), visited | {f.obj})

    if w.cfg.max_hops >= 2:
        for subject, rels in by_subject.items():
            for relation, fi in rels.items():
                if relation in _DESCRIBE:
                    np = _DESCRIBE[relation].format(S=phrase(w.entities[subject]))
                    extend([fi], np, {subject, w.facts[fi].obj})
    for c in singles + multis:
        c["support"] = list(dict.fromkeys(doc_ids[w.facts[i].home] for i in c["chain"]))
    return singles, multis


def _aggregates(w: _World, doc_ids: list[str]) -> list[dict[str, Any]]:
    """Counting candidates: for each real entity that is the object of an `_AGGREGATES` relation at least
    twice, the facts (of any subject, look-alikes included: they are in the corpus too) that the count rests
    on. Each needs every one of those facts, stated over several documents."""
    by_object: dict[tuple[str, str], list[int]] = {}
    for i, f in enumerate(w.facts):
        if f.relation in _AGGREGATES and f.obj in w.entities:
            by_object.setdefault((f.obj, f.relation), []).append(i)
    out = []
    for (obj, relation), facts in by_object.items():
        e = w.entities[obj]
        subjects = {w.facts[i].subject for i in facts}
        if e.distractor_of is not None or len(subjects) < 2:
            continue
        name = f"the {e.name}" if e.kind == "org" else e.name
        out.append({"chain": facts, "text": _AGGREGATES[relation].format(S=name), "count": len(subjects),
                    "object": e.name, "relation": relation,
                    "support": list(dict.fromkeys(doc_ids[w.facts[i].home] for i in facts))})
    return out


def _make_questions(
    w: _World, cands: tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]], n: int,
    prefix: str,
) -> list[Question]:
    singles, multis, aggregates = cands
    n_agg = min(len(aggregates), int(n * w.cfg.aggregate_fraction + 0.5))
    n_multi = min(len(multis), int((n - n_agg) * w.cfg.multi_hop_fraction + 0.5))
    n_single = min(len(singles), n - n_agg - n_multi)
    n_multi = min(len(multis), n - n_agg - n_single)  # top up with multi-hop if single-hop ran out
    chosen = ([multis.pop() for _ in range(n_multi)] + [singles.pop() for _ in range(n_single)]
              + [aggregates.pop() for _ in range(n_agg)])
    w.rng.shuffle(chosen)
    out = []
    for j, c in enumerate(chosen):
        if "count" in c:
            count = int(c["count"])
            words = (_NUMBER_WORDS[count],) if count < len(_NUMBER_WORDS) else ()
            out.append(Question(
                question_id=f"{prefix}{j}", question=c["text"], gold_answer=str(count), aliases=words,
                question_type="aggregate",
                meta={"hops": 1, "support_doc_ids": c["support"], "relations": [c["relation"]],
                      "subject": c["object"], "count": count}))
            continue
        last = w.facts[c["chain"][-1]]
        gold, aliases = _answer(w, last.obj)
        hops = len(c["chain"])
        out.append(
            Question(
                question_id=f"{prefix}{j}",
                question=c["text"],
                gold_answer=gold,
                aliases=aliases,
                question_type="single_hop" if hops == 1 else "multi_hop",
                meta={
                    "hops": hops,
                    "support_doc_ids": c["support"],
                    "relations": [w.facts[i].relation for i in c["chain"]],
                    "subject": w.surface(w.facts[c["chain"][0]].subject),
                },
            )
        )
    return out


def generate_task(seed: int, index: int, config: WorldConfig | None = None) -> CorpusTask:
    """Task `index` of the world seeded by `seed` (what `generate_world` returns at that position)."""
    cfg = config or WorldConfig()
    cfg.validate()
    rng = random.Random(f"librarian-synthetic:{seed}:{index}")
    task_id = f"{cfg.task_prefix}-{seed}-{index:05d}"
    w = _build_world(rng, cfg)
    order = list(range(len(w.docs)))
    rng.shuffle(order)
    if cfg.doc_order == "by_type":
        def rank(i: int) -> int:
            subject = w.docs[i].subject
            return _TYPE_RANK.get(w.entities[subject].kind, 3) if subject else 3

        order.sort(key=rank)
    width = max(3, len(str(len(order) - 1)))
    doc_ids = [""] * len(order)
    for pos, i in enumerate(order):
        doc_ids[i] = f"d{pos:0{width}d}"
    documents = []
    for i in order:
        doc = w.docs[i]
        text = _render(w, doc, rng.randint(cfg.min_words, cfg.max_words))
        facts = [
            [w.surface(w.facts[f].subject), w.facts[f].relation, w.surface(w.facts[f].obj)] for f in doc.facts
        ]
        documents.append(
            Document(
                doc_id=doc_ids[i],
                text=text,
                title=doc.title,
                url=f"synthetic://{task_id}/{doc_ids[i]}",
                meta={
                    "kind": doc.kind,
                    "distractor": doc.kind == "distractor",
                    "subject": w.surface(doc.subject) if doc.subject else "",
                    "facts": facts,
                },
            )
        )
    singles, multis = _candidates(w, doc_ids)
    rng.shuffle(singles)
    rng.shuffle(multis)
    aggregates = _aggregates(w, doc_ids) if cfg.aggregate_fraction > 0 else []
    rng.shuffle(aggregates)
    cands = (singles, multis, aggregates)
    hidden = _make_questions(w, cands, cfg.questions_per_task, f"{task_id}/q")
    reuse = _make_questions(w, cands, cfg.reuse_questions_per_task, f"{task_id}/r")
    if len(hidden) < cfg.questions_per_task or len(reuse) < cfg.reuse_questions_per_task:
        logging.warning(
            "task %s: only %d hidden and %d reuse questions fit %d documents (asked for %d and %d)",
            task_id,
            len(hidden),
            len(reuse),
            cfg.docs_per_task,
            cfg.questions_per_task,
            cfg.reuse_questions_per_task,
        )
    return CorpusTask(
        task_id=task_id,
        documents=tuple(documents),
        questions=tuple(hidden),
        reuse_questions=tuple(reuse),
        meta={
            "source": "synthetic",
            "seed": seed,
            "index": index,
            "num_entities": sum(e.distractor_of is None for e in w.entities.values()),
            "num_distractors": sum(e.distractor_of is not None for e in w.entities.values()),
        },
    )


def generate_world(
    seed: int, num_tasks: int, config: WorldConfig | None = None, **overrides: Any
) -> list[CorpusTask]:
    """`num_tasks` synthetic tasks; the same `seed` (and sizes) always gives identical tasks.

    Sizes come from `config` (a `WorldConfig`) and/or keyword overrides of its fields, e.g.
    `generate_world(0, 100, docs_per_task=40, max_words=300)`.
    """
    if num_tasks < 0:
        raise ValueError(f"num_tasks must be >= 0, got {num_tasks}")
    cfg = dataclasses.replace(config or WorldConfig(), **overrides)
    cfg.validate()
    return [generate_task(seed, i, cfg) for i in range(num_tasks)]


def world_texts(tasks: Iterable[CorpusTask]) -> list[str]:
    """Every text of the tasks (document titles and bodies, questions, answers and aliases): the training set
    of the tiny tokenizer."""
    out: list[str] = []
    for t in tasks:
        for d in t.documents:
            if d.title:
                out.append(d.title)
            out.append(d.text)
        for q in (*t.questions, *t.reuse_questions):
            out.append(q.question)
            out.extend(q.answers)
    return out


# ----------------------------------------------------------------------------------------------------------
# Reading the world's text back: what a reader (the scripted navigator) can learn from text it has read.

_NAME = r"[A-Z][A-Za-z]*(?: [A-Z][A-Za-z]*)*"
_ROLE = r"[a-z]+(?: [a-z]+)*"


def _statement_regex(template: str, relation: str) -> re.Pattern[str]:
    obj = {"role": _ROLE, "year": r"\d{4}"}.get(RELATIONS[relation][1], _NAME)
    pattern = re.escape(template)
    for key, group in (("{S}", f"(?P<S>{_NAME})"), ("{O}", f"(?P<O>{obj})"), ("{A}", f"an? (?P<O>{obj})")):
        pattern = pattern.replace(re.escape(key), group)
    return re.compile(r"(?<![A-Za-z])" + pattern)


_STATEMENT_RES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (rel, _statement_regex(t, rel)) for rel, templates in _STATEMENTS.items() for t in templates
)
# Each statement regex's longest literal run (a match contains it, so a line without it has no match), in
# `_STATEMENT_RES`' order. No statement form spans a line: names, roles and years hold no newline.
_STATEMENT_ANCHORS: tuple[str, ...] = tuple(
    max(re.split(r"\{[SOA]\}", t), key=len) for templates in _STATEMENTS.values() for t in templates
)


def statement_spans(text: str) -> list[tuple[tuple[str, str, str], int, int]]:
    """Each statement of the world's forms in `text`: `((subject, relation, object), start, end)` with the
    object's character span, in order of appearance (what `data.mutate` rewrites)."""
    found = [((m.group("S"), rel, m.group("O")), m.start("O"), m.end("O"))
             for rel, rx in _STATEMENT_RES for m in rx.finditer(text)]
    return sorted(found, key=lambda x: x[1])


# The question forms and the noun phrases that chain them (`data.mutate` asks new questions in them).
QUESTION_FORMS = _QUESTIONS
DESCRIBE_FORMS = _DESCRIBE


def extract_facts(text: str) -> list[tuple[str, str, str]]:
    """Every `(subject, relation, object)` the text states in one of the world's statement forms (names as
    written, an article-less role, a year), in order of appearance, duplicates removed. Works on any text a
    reader got: raw documents, synthetic files written from them, retrieved passages. Remembered for the
    last 8,192 texts of up to 65,536 characters, and line by line for the last 32,768 lines of up to 2,048
    characters (`text_memo.short_texts`: bounded whatever a model writes): the scripted answerer reads the
    same files for every question of a corpus, and its first prompt (the question, then the preloaded
    files) differs only in the question's line."""
    return list(_extract_facts(text))


@text_memo.short_texts(entries=8192, max_chars=65536)
def _extract_facts(text: str) -> tuple[tuple[str, str, str], ...]:
    # a statement never spans a line, so the text's facts are its lines' in order (first occurrence kept)
    if "\n" not in text:
        return _line_facts(text)
    return tuple(dict.fromkeys(f for line in text.split("\n") for f in _line_facts(line)))


@text_memo.short_texts(entries=32768, max_chars=2048)  # <= 64 MiB of lines, whatever a model writes
def _line_facts(line: str) -> tuple[tuple[str, str, str], ...]:
    found: list[tuple[int, tuple[str, str, str]]] = []
    for (rel, rx), anchor in zip(_STATEMENT_RES, _STATEMENT_ANCHORS, strict=True):
        if anchor in line:
            for m in rx.finditer(line):
                found.append((m.start(), (m.group("S"), rel, m.group("O"))))
    found.sort(key=lambda x: x[0])
    return tuple(dict.fromkeys(f for _, f in found))


def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{S}"), "(?P<S>.+)") + "$")


_QUESTION_RES = tuple((rel, _template_regex(t)) for rel, t in _QUESTIONS.items())
_DESCRIBE_RES = tuple((rel, _template_regex(t)) for rel, t in _DESCRIBE.items())


_AGGREGATE_RES = tuple((rel, _template_regex(t)) for rel, t in _AGGREGATES.items())


def parse_aggregate(text: str) -> tuple[str, str] | None:
    """A counting question as `(object name, relation)`: "How many people does the Kestrel Institute
    employ?" -> ("Kestrel Institute", "works_at"); its answer is the number of distinct subjects S with
    `(S, relation, object)`. None for any other question."""
    text = " ".join(text.split())
    for rel, rx in _AGGREGATE_RES:
        m = rx.match(text)
        if m is not None:
            name = m.group("S")
            name = name[4:] if name.startswith("the ") else name
            if re.fullmatch(_NAME, name):
                return name, rel
    return None


def parse_question(text: str) -> tuple[str, list[str]] | None:
    """A synthetic-world question as `(subject name, relation chain)`, innermost relation first:
    "In which city is the lab of the organisation that employs Orlen Vask?" -> ("Orlen Vask",
    ["works_at", "lab_city"]). None for a question not in the world's forms."""
    text = " ".join(text.split())
    for rel, rx in _QUESTION_RES:
        m = rx.match(text)
        if m is None:
            continue
        chain = [rel]
        phrase = m.group("S")
        while True:
            for inner, drx in _DESCRIBE_RES:
                dm = drx.match(phrase)
                if dm is not None:
                    chain.append(inner)
                    phrase = dm.group("S")
                    break
            else:
                break
        name = phrase[4:] if phrase.startswith("the ") else phrase
        if re.fullmatch(_NAME, name):
            return name, chain[::-1]
    return None
