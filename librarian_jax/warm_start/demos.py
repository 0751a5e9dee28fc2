"""Demonstrations for the embedded world: scripted builders of varied quality, run through the real tool
protocol, whose transcripts become supervised (SFT) data that teaches a small model the protocol.

Each style is a policy over what the builder's prompt shows (the raw listing: titles and doc ids), replayed
through the real `BuilderAgent`, executor, workspace and scheduler by a `testing.ScriptedEngine`, so
the transcript is exactly what the protocol produces; the episode is scored by the same probes and terminal
evaluation as training (with the run's answerer), and that score is kept with each demonstration.

Styles (`STYLES`, named by `config_schema`, which checks a mix against them); with the embedded answerer
(`agents.navigator`, which reads files whose titles name its entity first, then other summaries, then
originals) the first two organise well, the last two poorly:
- `entities`: one file per entity named in the listing (people, organisations, projects), each written from
  every document, so the file gathers the entity's facts scattered over the corpus; then stop.
- `by_kind`: the same entity files (from `raw_docs`, every document), then one directory per kind of entity
  ("People", "Organisations", "Projects", `KIND_DIRS`) merging them: a two-level hierarchy (the noisy world's
  good style, docs/world.md).
- `generic`: files over runs of documents with titles that name no entity ("Notes, part 1"): fewer, denser
  files, one read covers several documents.
- `own_doc`: entity titles, each written from the entity's own page only (a wrong grouping: facts stated
  elsewhere are missing, and the file's title promises them, so a read is wasted).
- `early_stop`: stop at once (raw navigation).
The default mixture (`DEFAULT_MIX`, the classic world's; the noisy preset adds `by_kind`) makes the
warm-started policy a mixture of these that GRPO can sharpen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from librarian_jax.agents.builder import RAW_DIR, first_observation, render_result
from librarian_jax.agents.protocol import render_response
from librarian_jax.config_schema import DEMO_MIX as DEFAULT_MIX
from librarian_jax.config_schema import DEMO_STYLES as STYLES
from librarian_jax.data.synthetic import entity_of_title
from librarian_jax.rollout import run_batch
from librarian_jax.testing import FakeSession, ScriptedEngine
from librarian_jax.workspace import Workspace

# a raw document's line in the builder's first message (`agents.builder.raw_listing`) or in a listing of
# raw_docs/ (the update prompt's new documents)
_RAW_LINE = re.compile(r'^(?:(?P<id>[^\s"]+)\s+"(?P<title1>[^"]*)"\s+\([\d,]+ chars\)$'
                       r'|\S+\s+\[raw\]\s+"(?P<title>[^"]*)"\s+\(doc_id=(?P<doc>[^,]+),)', re.M)
# the directory a `by_kind` builder gathers each kind of entity file in (the navigator lists a directory whose
# title names the kind it looks for: `agents.navigator.KIND_WORDS`)
KIND_DIRS = {"person": "People", "org": "Organisations", "project": "Projects"}


@dataclasses.dataclass(frozen=True)
class ListedDoc:
    doc_id: str
    title: str
    entity: str  # the entity the title names ("" for e.g. meeting notes)
    group: str = ""  # the directory a `by_kind` builder puts its file in (`KIND_DIRS`)
    compact: bool = False  # listed by the compact listing, which names every document `raw_docs`


def listed_docs(prompt_text: str) -> list[ListedDoc]:
    """The raw documents as the builder's prompt lists them (title, doc id, the entity the title names)."""
    out = []
    for m in _RAW_LINE.finditer(prompt_text):
        doc, title = ((m.group("id"), m.group("title1")) if m.group("id")
                      else (m.group("doc"), m.group("title")))
        name, kind = entity_of_title(title)
        out.append(ListedDoc(doc, title, name, KIND_DIRS.get(kind, ""), bool(m.group("id"))))
    return out


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def style_calls(style: str, docs: Sequence[ListedDoc], doc_ids: bool = False) -> list[str]:
    """Every tool call (rendered) a builder of `style` makes over `docs`, stop included. A file written from
    every document names them `raw_docs` where the compact listing says so, else by their doc ids. With
    `doc_ids` (`BuilderConfig.doc_id_titles`) an entity's file is titled, and named as a merge's child, by
    its page's doc_id ("d003"), which the builder resolves to the page's title."""
    ids = [d.doc_id for d in docs]
    every = [RAW_DIR] if docs and docs[0].compact else ids

    def name(d: ListedDoc) -> str:
        return d.doc_id if doc_ids else d.entity

    if style == "entities":
        calls = [_call("create_file", title=name(d), input_paths=every) for d in docs if d.entity]
    elif style == "by_kind":  # the entity files, then one directory per kind of entity holding them
        entities = [d for d in docs if d.entity]
        calls = [_call("create_file", title=name(d), input_paths=[RAW_DIR]) for d in entities]
        for group in dict.fromkeys(d.group for d in entities):
            # a child named by its file's title ("Orlen Vask" finds cluster_0003__orlen_vask.txt)
            calls.append(_call("merge_files", title=group,
                               child_paths=[name(d) for d in entities if d.group == group]))
    elif style == "own_doc":
        calls = [_call("create_file", title=name(d), input_paths=[d.doc_id]) for d in docs if d.entity]
    elif style == "generic":
        calls = [_call("create_file", title=f"Notes, part {i // 3 + 1}", input_paths=ids[i : i + 3])
                 for i in range(0, len(ids), 3)]
    elif style == "early_stop":
        calls = []
    else:
        raise ValueError(f"unknown demonstration style {style!r}; known: {STYLES}")
    return [*calls, _call("stop")]


def plan_replies(style: str, docs: Sequence[ListedDoc], calls_per_turn: int, max_turns: int,
                 max_tokens: int = 0, count: Callable[[str], int] | None = None,
                 doc_ids: bool = False) -> list[str]:
    """The replies of a builder of `style`, in order: each holds at most `calls_per_turn` calls (0: any
    number) and, given `count` (text -> tokens), at most `max_tokens` tokens (so a reply is never cut off);
    the last one ends with stop. Calls that do not fit in `max_turns` replies are dropped, stop kept.
    `doc_ids`: as in `style_calls`."""
    calls = style_calls(style, docs, doc_ids)
    body, stop = calls[:-1], calls[-1]
    per = calls_per_turn if calls_per_turn > 0 else len(calls)

    def fits(reply: list[str]) -> bool:
        return len(reply) <= per and (count is None or not max_tokens
                                      or count("\n".join(reply)) + 1 <= max_tokens)

    replies: list[list[str]] = [[]]
    for c in body:
        if not fits([*replies[-1], c]) and replies[-1]:
            replies.append([])
        replies[-1].append(c)
    turns = max(1, max_turns)
    replies = replies[:turns]
    if fits([*replies[-1], stop]) or not replies[-1]:
        replies[-1].append(stop)
    elif len(replies) < turns:
        replies.append([stop])
    else:  # the last reply gives up calls until stop fits
        while replies[-1] and not fits([*replies[-1], stop]):
            replies[-1].pop()
        replies[-1].append(stop)
    return ["\n".join(r) for r in replies]


def scripted_builder(style: str, calls_per_turn: int, max_turns: int, max_tokens: int = 0,
                     doc_ids: bool = False) -> Any:
    """A `ScriptedEngine` policy: reply k of the episode whose prompt the session holds, for `style`
    (`plan_replies`, replies of at most `max_tokens` tokens of the engine's tokenizer when > 0; `doc_ids`:
    entity files titled by doc_id, `style_calls`)."""

    plans: dict[int, list[str]] = {}

    def policy(session: FakeSession) -> str:
        key = id(session)
        if key not in plans:
            count = (lambda text: len(session.engine.tok.encode(text))) if max_tokens else None
            plans[key] = plan_replies(style, listed_docs(session.text()), calls_per_turn, max_turns,
                                      max_tokens, count, doc_ids)
        k = min(session.turns, len(plans[key]) - 1)
        return plans[key][k]

    return policy


def tool_call_texts(tasks: Sequence[Any], styles: Sequence[str] = STYLES, compact: bool = False,
                    doc_ids: bool = False) -> list[str]:
    """The tool calls each of `styles` would write for these tasks (from their documents' titles and ids;
    `doc_ids`: as in `style_calls`), one text per task and style: what the warm start's tokenizer should
    encode compactly."""
    out = []
    for t in tasks:
        docs = []
        for d in t.documents:
            name, kind = entity_of_title(d.title or "")
            docs.append(ListedDoc(d.doc_id, d.title or "", name, KIND_DIRS.get(kind, ""), compact))
        out += ["\n".join(style_calls(s, docs, doc_ids)) for s in styles]
    return out


def tokenizer_texts(tasks: Sequence[Any], listing: str = "full", doc_ids: bool = False) -> list[str]:
    """What the warm start's tokenizer should encode compactly besides the documents: the tool calls every
    style writes (`tool_call_texts`) and the builder's first message for each task (the root and raw-document
    listings as the real workspace renders them: the largest part of a builder episode after the documents,
    and text the documents alone do not teach a small tokenizer). With the compact raw listing
    (`BuilderConfig.raw_listing`, the noisy preset's) also the `by_kind` style's calls, the `raw_docs/`
    listing raw navigation reads and what an answerer reads of a `by_kind` workspace; with the full one the
    texts the classic world's warm start was made with. `doc_ids`: the calls and first message of
    `BuilderConfig.doc_id_titles` (`style_calls`)."""
    compact = listing == "compact"
    out = tool_call_texts(tasks, STYLES if compact else [s for s in STYLES if s != "by_kind"], compact,
                          doc_ids)
    for t in tasks:
        ws = Workspace.from_documents(list(t.documents))
        out.append(first_observation(ws, len(t.documents), listing=listing, doc_id_titles=doc_ids))
        if compact:
            out.append(render_result(ws.list_dir(RAW_DIR)))  # what raw navigation lists
            out += _answerer_views(ws, listed_docs(out[-2]))
    return out


def _answerer_views(ws: Workspace, docs: Sequence[ListedDoc]) -> list[str]:
    """What an answerer reads of a `by_kind` workspace of these documents (files with empty bodies: only the
    listings, the README and the headers matter here): the README, the root and each directory's listing."""
    entities = [d for d in docs if d.entity]
    results = []
    for d in entities:
        r = ws.create_file(d.entity, [RAW_DIR], "-")
        results.append(render_response("create_file", r.ok, render_result(r), r.code))
    out = [ws.readme_text(), render_result(ws.list_dir(".")), "\n".join(results)]
    for group in dict.fromkeys(d.group for d in entities):
        r = ws.merge_files(group, [d.entity for d in entities if d.group == group], "-")
        out.append(render_response("merge_files", r.ok, render_result(r), r.code))
        if r.ok:
            out.append(render_result(ws.list_dir(r.data["path"])))
    return out


def style_counts(num: int, mix: Mapping[str, float]) -> dict[str, int]:
    """`num` demonstrations split over the styles of `mix` (largest remainders; deterministic)."""
    bad = sorted(set(mix) - set(STYLES))
    if bad:
        raise ValueError(f"demonstration mix: unknown style {bad[0]!r}; known: {STYLES}")
    total = sum(mix.values())
    raw = {s: num * w / total for s, w in mix.items() if w > 0}
    counts = {s: int(v) for s, v in raw.items()}
    for s in sorted(raw, key=lambda s: counts[s] - raw[s])[: num - sum(counts.values())]:
        counts[s] += 1
    return counts


def make_demonstrations(
    tasks: Sequence[Any],
    tokenizer: Any,
    rollout_config: Any,
    *,
    mix: Mapping[str, float] | None = None,
    per_task: int = 2,
    calls_per_turn: int = 3,
    seed: int = 0,
    template: Any,
) -> list[dict[str, Any]]:
    """Runs `per_task` scripted builders per task (styles drawn from `mix`, seeded) through the real protocol.

    Returns one record per conversation: `{"messages": [...], "style", "task_id", "reward", "terminal"}`.
    The rollout config should be the training run's (its answerer scores each demonstration at the end:
    `"terminal"`; probes are skipped, since they never change what the builder sees, so `"reward"` is the
    terminal reward plus the turn penalties). Each record
    also holds `"_segment"`: the builder session's own training segment (ids and loss mask as the scripted
    engine held them), which `write_jsonl` leaves out and tests compare with `rl.sft.encode_conversation`.
    `template` is the builder's chat template of the run's protocol (`cluster.role_templates`).
    """
    mix = dict(mix or DEFAULT_MIX)
    cfg = dataclasses.replace(rollout_config, record_conversations=True, record_snapshots=False, max_probes=0,
                              probe_at_start=False)
    counts = style_counts(len(tasks) * per_task, mix)
    order = np.random.default_rng(seed).permutation([s for s in STYLES for _ in range(counts.get(s, 0))])
    jobs: dict[str, list[Any]] = {}
    for i, style in enumerate(order):
        jobs.setdefault(str(style), []).append(tasks[i % len(tasks)])
    out: list[dict[str, Any]] = []
    for style, style_tasks in jobs.items():
        engine = ScriptedEngine(
            tokenizer,
            scripted_builder(style, calls_per_turn, cfg.builder.max_turns, cfg.builder.max_new_tokens,
                             cfg.builder.doc_id_titles),
            end_id=template.stop_ids[0],
        )
        records = run_batch(style_tasks, 1, {"policy": engine, "frozen": engine}, tokenizer, cfg, rng=seed,
                            template=template)
        for task, rec in zip(style_tasks, records, strict=True):
            for conv, seg in zip(rec.meta["conversations"], rec.segments, strict=True):
                out.append({"messages": conv, "style": style, "task_id": task.task_id,
                            "reward": rec.total_reward, "terminal": rec.terminal_reward, "_segment": seg})
    return out


def write_jsonl(path: str, demos: Sequence[Mapping[str, Any]]) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for d in demos:
            f.write(json.dumps({k: v for k, v in d.items() if not k.startswith("_")}) + "\n")
    os.replace(tmp, path)
    return path


def cached_demonstrations(path: str, key: Mapping[str, Any], make: Any) -> str:
    """`path` (JSONL) made once by `make() -> demos` for this `key` (a dict of everything they depend on);
    remade when the key changes. Returns the path."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    stamp = path + ".key"
    if os.path.exists(path) and os.path.exists(stamp) and open(stamp).read().strip() == digest:
        logging.info("demonstrations: cached %s", path)
        return path
    demos = make()
    write_jsonl(path, demos)
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    by_style: dict[str, list[float]] = {}
    for d in demos:
        by_style.setdefault(d["style"], []).append(d["terminal"])
    logging.info("demonstrations: %d conversations -> %s; terminal accuracy by style: %s", len(demos), path,
                 {s: round(float(np.mean(v)), 3) for s, v in sorted(by_style.items())})
    return path
