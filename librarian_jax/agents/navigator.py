"""The scripted navigator: a model-free answerer for the embedded synthetic world, so a CPU run can show the
effect of a workspace on an answerer (`AnswererConfig.kind = "scripted"`).

It is not an LLM, and it only works on the synthetic world's questions and statement forms
(`data.synthetic.parse_question` / `extract_facts`); on any other question it answers "" (wrong). It plays by
the LLM answerer's rules:
- it starts from exactly what the LLM answerer starts from (`answerer.first_prompt`: the workspace README,
  the root listing, the root-level files preloaded within their budget, the question, and a retrieval
  `preamble` when given) and learns only from text it read through the same
  `list_files` / `read_file` tools, rendered exactly as the LLM would see them;
- every call costs a turn (at most `max_turns`; `max_reads` caps read_file calls when > 0), and tokens are
  counted with the run's tokenizer and chat template as if an LLM had read the prompt and observations and
  written the calls (so "tokens read per query" compares with an LLM answerer's);
- when the turns or the `context_budget` run out, it answers with what it has (possibly nothing).

How it reads (one greedy policy, deterministic): the question is a chain of relations from a named subject
("the lab of the organisation that employs Orlen Vask" = works_at, then lab_city). For each hop it looks
for the fact among everything read so far; if missing, it opens the most promising unread file: first a
synthetic file whose title names the current entity, then a synthetic directory whose title names it (listed,
then its files), then `raw_docs/` (listed once), then a raw document whose title names the entity, then the
remaining raw documents in listing order. So a workspace with one file per entity that gathers the entity's
scattered facts answers a multi-hop question in one read per hop, while raw navigation must scan documents and
often runs out of turns; a file whose title promises an entity but lacks its facts costs a wasted turn.

With a `search` tool (agentic RAG, the eval method `agentic`), its search policy comes first: for each hop
whose fact it lacks, it searches once for "<entity> <relation words>" (`search_k` passages, the tool's
default k), learns what the passages say, and the documents they come from become the first files it reads
for that hop (before the listing order above). Each search is a turn, its passages count as read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from librarian_jax.agents.answer_start import (
    ANSWERER_TOOLS,
    SEARCH_ANSWERER_TOOLS,
    SEARCH_TOOL,
    AnswerOutcome,
    Search,
    cut_words,
    first_prompt,
    first_prompt_ids,
    render_hits,
)
from librarian_jax.agents.protocol import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, render_response
from librarian_jax.agents.runtime import ANSWERER, AgentContext, AgentGen
from librarian_jax.data.synthetic import RELATIONS, extract_facts, parse_aggregate, parse_question

_ENTRY = re.compile(r'^(?P<name>[^\s]+?)(?P<dir>/?)\s+\[(?P<kind>[a-z ]+)\]\s+"(?P<title>[^"]*)"', re.M)
_DIR_HEAD = re.compile(r"^Directory (?P<path>\S+?)/?: \d+ entries", re.M)


def _names(text: str, name: str) -> bool:
    """Whether `text` names the entity `name` (whole words, case-insensitive)."""
    return re.search(r"(?<![A-Za-z])" + re.escape(name.lower()) + r"(?![A-Za-z])", text.lower()) is not None


# Words a directory title may use for a kind of entity (a builder's "People/", "Organisations/", ...).
KIND_WORDS: dict[str, tuple[str, ...]] = {
    "person": ("people", "persons", "person", "profiles"),
    "org": ("organisations", "organizations", "organisation", "organization", "institutions"),
    "project": ("projects", "project", "reports"),
}


def _names_kind(title: str, kind: str) -> bool:
    """Whether a directory's `title` names the entity kind `kind` (one of its `KIND_WORDS`)."""
    return any(_names(title, w) for w in KIND_WORDS.get(kind, ()))


class _Reader:
    """The navigator's state: what it has seen (listings, facts) and what it has spent."""

    def __init__(self, ctx: AgentContext, workspace: Any, config: Any, search: Search | None = None):
        self.ctx, self.ws, self.cfg, self.search_fn = ctx, workspace, config, search
        template_for = getattr(ctx, "template_for", None)
        self.template = template_for(ANSWERER) if template_for is not None else ctx.template
        self.tools = SEARCH_ANSWERER_TOOLS if search is not None else ANSWERER_TOOLS
        self.priority: list[str] = []  # documents a search pointed to, read first
        self.searched: set[str] = set()
        self.failed: set[str] = set()  # paths a read_file refused (never retried)
        self.passages = 0
        self.entries: dict[str, tuple[str, str]] = {}  # path -> (kind, title), in the order first seen
        self.listed: set[str] = set()
        self.read: list[str] = []
        self.facts: dict[tuple[str, str], str] = {}  # (subject lower, relation) -> object
        self.triples: set[tuple[str, str, str]] = set()  # (subject lower, relation, object lower)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.turns = 0
        self.actions: list[str] = []

    # -- what it sees -------------------------------------------------------------------------------------
    def see(self, text: str) -> None:
        for s, rel, o in extract_facts(text):
            self.facts.setdefault((s.lower(), rel), o)
            self.triples.add((s.lower(), rel, o.lower()))
        head = _DIR_HEAD.search(text)
        base = ""
        if head is not None and not head.group("path").startswith("."):
            base = head.group("path").rstrip("/") + "/"
        for m in _ENTRY.finditer(text):
            path = base + m.group("name")
            if path not in self.entries:
                self.entries[path] = (m.group("kind").strip(), m.group("title"))

    def count_prompt(self, system: str, user: str, question: str = "") -> None:
        """Counts the first prompt's tokens (`first_prompt_ids`; `question`: the question ending `user`)."""
        self.prompt_tokens += len(first_prompt_ids(self.template, system, user, question))

    # -- acting ---------------------------------------------------------------------------------------------
    def room(self, reads: int) -> bool:
        cfg = self.cfg
        if self.turns >= cfg.max_turns:
            return False
        if cfg.max_reads > 0 and reads >= cfg.max_reads:
            return False
        return self.prompt_tokens + self.generated_tokens + cfg.max_new_tokens < cfg.context_budget

    def call(self, name: str, **args: Any) -> str:
        """Runs one tool call as an LLM would: its reply tokens and its observation tokens are counted."""
        reply = f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': args})}{TOOL_CALL_CLOSE}"
        self.generated_tokens += len(self.ctx.encode(reply)) + 1  # + the end-of-turn id
        if name == SEARCH_TOOL.name:
            hits = list(self.search_fn(args["query"], args["k"]))
            self.passages += len(hits)
            for h in hits:
                if h.path not in self.priority:
                    self.priority.append(h.path)
            text = render_hits(args["query"], hits)
            return self._observe(text, render_response(name, True, text), f"search {args['query']}")
        if name == "list_files":
            r = self.ws.list_dir(args["path"])
            self.listed.add(args["path"])
        else:
            r = self.ws.read_file(args["path"])
            if r.ok:
                self.read.append(args["path"])
            else:
                self.failed.add(args["path"])
        text = r.text or r.message if r.ok else f"ERROR [{r.code}]: {r.message}"
        obs = render_response(name, r.ok, text, r.code)
        if len(obs) > self.cfg.observation_max_chars:
            obs = obs[: self.cfg.observation_max_chars] + "\n[... observation truncated]"
        return self._observe(text, obs, f"{name} {args['path']}")

    def _observe(self, text: str, obs: str, action: str) -> str:
        """Counts one observation turn (its tokens as the answerer's template writes them), records the
        action and what the text shows; returns the text."""
        tpl = self.template
        role = getattr(tpl, "observation_role", "user")
        self.prompt_tokens += len(tpl.turn(role, obs) + tpl.open_turn("assistant"))
        self.turns += 1
        self.actions.append(action)
        self.see(text)
        return text

    def next_action(self, entity: str, kind: str = "") -> tuple[str, str] | None:
        """(tool, path) of the most promising unread file or unlisted directory for `entity` (of `kind`:
        person / org / project, "" when unknown)."""
        e = self.entries
        for p in self.priority:  # the documents a search for this hop returned, best first
            if p not in self.read and p not in self.failed:
                return "read_file", p
        unread = [p for p in e if p not in self.read]
        for kinds, tool in ((("file", "summary"), "read_file"), (("directory",), "list_files")):
            for p in unread:
                fresh = tool == "read_file" or p not in self.listed
                if e[p][0] in kinds and _names(e[p][1], entity) and fresh:
                    return tool, p
        for p in unread:  # a directory whose title names the entity's kind ("People" for a person)
            if e[p][0] == "directory" and p not in self.listed and _names_kind(e[p][1], kind):
                return "list_files", p
        for p in unread:  # then any other synthetic file: a summary before the originals
            if e[p][0] == "file":
                return "read_file", p
        if "raw_docs" not in self.listed:
            return "list_files", "raw_docs"
        raw = [p for p in unread if e[p][0] == "raw"]
        named = [p for p in raw if _names(e[p][1], entity)]
        return ("read_file", (named or raw)[0]) if raw else None


# The words a counting question's search adds to the entity's name (the verb of the question's form).
_AGGREGATE_QUERY = {"works_at": "employ staff works at", "funded_by": "funds pays for"}


def _count(reader: _Reader, entity: str, relation: str, *, search: Search | None, search_k: int) -> str:
    """A counting question ("How many people does the X Institute employ?"): reads what names the entity
    (a search first, when it has the tool) until it has read a synthetic file whose title names the entity
    (a workspace file about it is taken as complete) or its budget runs out; answers the number of distinct
    subjects it saw stated with `(subject, relation, entity)` ("" when none)."""
    key = entity.lower()
    if search is not None and reader.room(0):
        reader.call(SEARCH_TOOL.name, query=f"{entity} {_AGGREGATE_QUERY.get(relation, '')}".strip(),
                    k=int(search_k))
    while reader.room(len(reader.read)):
        if any(reader.entries.get(p, ("", ""))[0] in ("file", "summary")
               and _names(reader.entries[p][1], entity) for p in reader.read):
            break
        action = reader.next_action(entity, RELATIONS[relation][1])
        if action is None:
            break
        reader.call(action[0], path=action[1])
    n = len({s for s, rel, o in reader.triples if rel == relation and o == key})
    return str(n) if n else ""


def navigate(
    ctx: AgentContext, workspace: Any, question: str, config: Any, *, preamble: str = "",
    preamble_passages: int = 0, search: Search | None = None, search_k: int = SEARCH_TOOL.params[1].default,
) -> AgentGen:
    """Generator (it never yields: no engine is involved): one scripted answerer run; returns an
    `AnswerOutcome` like `answer_question` (`search`: the search policy of the module docstring)."""
    if False:  # pragma: no cover - makes this a generator, like every agent
        yield None
    reader = _Reader(ctx, workspace, config, search)
    reader.passages = int(preamble_passages)
    system, user, preloaded = first_prompt(ctx, workspace, question, config, preamble=preamble,
                                           search=search is not None)
    reader.count_prompt(system, user, question)
    reader.see(user)
    parsed = parse_question(question)
    aggregate = parse_aggregate(question) if parsed is None else None
    answer = ""
    if aggregate is not None:
        answer = _count(reader, *aggregate, search=search, search_k=search_k)
    if parsed is not None:
        entity, chain = parsed
        for relation in chain:
            reads = len(reader.read)
            query = f"{entity} {relation.replace('_', ' ')}"
            if (search is not None and (entity.lower(), relation) not in reader.facts
                    and query not in reader.searched and reader.room(reads)):
                reader.priority.clear()  # the last hop's documents are no longer the best bet
                reader.searched.add(query)
                reader.call(SEARCH_TOOL.name, query=query, k=int(search_k))
            while (entity.lower(), relation) not in reader.facts and reader.room(reads):
                action = reader.next_action(entity, RELATIONS[relation][0])
                if action is None:
                    break
                reader.call(action[0], path=action[1])
                reads = len(reader.read)
            entity = reader.facts.get((entity.lower(), relation), "")
            if not entity:
                break
        answer = entity
    call = json.dumps({"name": "answer", "arguments": {"text": answer}})
    reader.generated_tokens += len(ctx.encode(f"{TOOL_CALL_OPEN}{call}{TOOL_CALL_CLOSE}")) + 1
    reader.actions.append("answer")
    return AnswerOutcome(
        cut_words(answer, config.answer_max_words),
        reader.turns + 1,
        False,
        reader.prompt_tokens,
        reader.generated_tokens,
        reader.actions,
        "ok",
        list(reader.read),
        preloaded,
        reader.passages,
    )
