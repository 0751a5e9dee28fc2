"""The builder agent: turns a raw corpus into a workspace of source-linked synthetic files, turn by turn.

It sees the corpus listing and its own workspace, never the questions. Tools (protocol: `agents.protocol`):

    list_files(path=".")                                   a directory listing
    read_file(path, start_line=1, num_lines=100)           a numbered window (<= 8 reads per reply)
    create_file(title, input_paths, instructions="", parent_path=null)
    merge_files(title, child_paths, instructions="", parent_path=null)
    delete(target_paths, reason)
    stop()                                                 ends the episode after this reply's other calls

Calls of one reply run in order. Consecutive create/merge calls are written by the executor *together* (one
`Parallel` of executor writes, batched into the frozen engine) and then applied in call order; a write whose
sources are not there yet (e.g. it merges files created earlier in the same reply) or any other tool call
first flushes the pending writes, so the order of effects is the reply's order.

One builder turn = one sampled reply (<= `max_new_tokens`), then one observation turn (the tool responses, in
call order, as a `user` turn) and the next assistant header. The episode's last reply (stop or the turn limit)
gets no observation. Token in, token out: the session keeps exactly the sampled ids; replies are decoded only
to parse them.

History compaction (`agents.compaction`): before a turn, when the visible context is longer than
`compaction_budget` tokens (the session's tokens less the reasoning of the replies in it, `<think>` ... up to
`</think>`: the history a chat API shows, which drops earlier turns' reasoning, so a thinking builder is not
compacted on every turn), the session is closed as one training segment and a new one starts whose prompt is
the system prompt, a summary turn (actions so far + a snapshot of the workspace) and the exact ids of the last
assistant turn and its observation.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from librarian_jax.agents import compaction as compaction_lib
from librarian_jax.agents import executor as executor_lib
from librarian_jax.agents import prompt_text
from librarian_jax.agents.protocol import (
    LIST_FILES_TOOL,
    READ_FILE_TOOL,
    THINK_CLOSE,
    CallError,
    Param,
    ParsedTurn,
    ProtocolConfig,
    ToolCall,
    ToolSpec,
    parse_tool_calls,
    render_error,
    render_response,
    render_tools,
    turn_penalty,
)
from librarian_jax.agents.runtime import (
    POLICY,
    AgentContext,
    AgentGen,
    Parallel,
    Sampling,
    SessionLog,
)
from librarian_jax.segment import Segment
from librarian_jax.workspace import ActionResult

WRITE_TOOLS = ("create_file", "merge_files")
RAW_DIR = "raw_docs"

BUILDER_TOOLS: tuple[ToolSpec, ...] = (
    LIST_FILES_TOOL,
    READ_FILE_TOOL,
    ToolSpec(
        "create_file",
        (
            Param("title", "str", max_chars=200),
            Param("input_paths", "list[str]"),
            Param("instructions", "str", False, ""),
            Param("parent_path", "str", False, None),
        ),
        "write a new synthetic file from these sources (raw or synthetic), optionally inside a directory",
    ),
    ToolSpec(
        "merge_files",
        (
            Param("title", "str", max_chars=200),
            Param("child_paths", "list[str]"),
            Param("instructions", "str", False, ""),
            Param("parent_path", "str", False, None),
        ),
        "group synthetic files into a new directory with a summary written from them",
    ),
    ToolSpec(
        "delete",
        (Param("target_paths", "list[str]"), Param("reason", "str")),
        "deactivate synthetic files (raw documents cannot be deleted)",
    ),
    ToolSpec("stop", (), "finish: the workspace is done"),
)
# `BuilderConfig.write_text`: create_file / merge_files also take an optional `text`, the file's text (or the
# directory's summary) as the builder wrote it, stored as it is; without it the executor writes, as always.
# The authors' tools have this argument (`create_cluster(..., cluster_text?)`, `merge_clusters(...,
# merge_summary_text?)`).
TEXT_PARAM = Param("text", "str", False, "", max_chars=16_000)
BUILDER_TEXT_TOOLS: tuple[ToolSpec, ...] = tuple(
    dataclasses.replace(
        t, params=(*t.params[:3], TEXT_PARAM, *t.params[3:]),
        description=t.description + " (`text`: write it yourself; without it the executor writes it)")
    if t.name in WRITE_TOOLS else t
    for t in BUILDER_TOOLS
)



@dataclasses.dataclass(frozen=True)
class BuilderConfig:
    """Builder limits; defaults are the paper's main run (H = 32 turns, <= 4096 new tokens per turn)."""

    max_turns: int = 32
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_reads_per_turn: int = 8
    max_calls_per_turn: int = 16
    observation_max_chars: int = 48_000
    # tokens one session may hold: the builder engine's context (rollout.max_seq_len), set by
    # `cluster.mode_rollout` / `scheduler.fit_to_engines`, never a config key; 0: no limit
    context_budget: int = 0
    executor: str = "model"  # agents.executor.EXECUTOR_KINDS: "model", or the model-free "extractive",
    # "focused" (on what the title names), "statements" (focused, on the sentences stating something about it)
    executor_max_new_tokens: int = 512
    executor_max_words: int = 360  # extractive executor output budget
    excerpt_max_lines: int = 100
    excerpt_max_chars: int = 16_000
    compaction: str = "deterministic"  # "deterministic" | "model" | "none"
    compaction_budget: int = 3000
    compaction_summary_tokens: int = 256
    compaction_input_chars: int = 12_000  # the turns' content a model summary reads (the latest kept)
    malformed_penalty: float = 0.05
    # the system prompt's file in agents/prompts/: "builder_system" (the paper's), or "builder_system_compact"
    # (the same tools and rules in a quarter of the tokens: the embedded world's tiny model)
    system_prompt: str = "builder_system"
    # how the first message lists the raw documents: "full" (their raw_docs/ listing: path, title, doc_id,
    # size, hash) or "compact" (one `doc_id "title" (N chars)` line each, and that raw_docs names them all)
    raw_listing: str = "full"
    # create_file / merge_files take an optional `text` the builder writes itself (the executor writes the
    # file when it is absent or empty), as the authors' tools allow (`BUILDER_TEXT_TOOLS`)
    write_text: bool = False
    # a create_file / merge_files title, or a merge_files child path, that is a raw document's doc_id stands
    # for that document's title (`resolve_doc_ids`): "d003" titles the file "Miothand Works" and, as a child,
    # names the synthetic file titled so. A small model names the entity of a listed page by its short id
    # instead of spelling its name (docs/world.md, the noisy preset's).
    doc_id_titles: bool = False

    def protocol(self) -> ProtocolConfig:
        return ProtocolConfig(malformed_penalty=self.malformed_penalty, max_calls=self.max_calls_per_turn)


def builder_tools(config: BuilderConfig) -> tuple[ToolSpec, ...]:
    """The builder's tools under `config` (with `write_text`, the write tools take `text`)."""
    return BUILDER_TEXT_TOOLS if config.write_text else BUILDER_TOOLS


@dataclasses.dataclass
class CallRecord:
    """What one call did (for records and the action log)."""

    index: int
    name: str
    arguments: dict[str, Any]
    ok: bool
    code: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TurnOutcome:
    """One builder turn: the reply, its calls (valid ones with results, malformed ones with errors)."""

    turn: int  # 0-based
    text: str
    status: str  # engine status of the reply: "stop" | "length" | "cache_full"
    calls: list[CallRecord]
    errors: list[dict[str, Any]]
    penalty: float
    successful_writes: int
    stopped: bool
    ended: bool  # the episode cannot go on (stopped, turn limit, or the context is full)
    generated_tokens: int = 0
    executor_prompt_tokens: int = 0
    executor_generated_tokens: int = 0


def _short_args(args: dict[str, Any], n: int = 200) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in args.items():
        if isinstance(v, str) and len(v) > n:
            v = v[:n] + "..."
        elif isinstance(v, list):
            v = [x[:n] if isinstance(x, str) else x for x in v[:16]]
        out[k] = v
    return out


def excerpt_sources(result: Any) -> list[tuple[str, str]]:
    """(path, excerpt text) per source of a `Workspace.source_excerpts` result, from its structured
    `data["sources"]` (never by re-parsing the rendered text, where a document line can look like a source
    header); each text is the source's `TITLE:` line and its excerpt. A result without them is one source."""
    data = getattr(result, "data", None) or {}
    sources = data.get("sources") if isinstance(data, dict) else None
    if not sources or not all(isinstance(s, dict) and "excerpt" in s for s in sources):
        return [("sources", getattr(result, "text", "") or "")]
    return [(s["path"], f"TITLE: {s['title']}\n{s['excerpt']}".strip()) for s in sources]


def render_result(result: Any) -> str:
    render = getattr(result, "render", None)
    if render is not None:
        return render()
    return result.text or result.message if result.ok else f"ERROR [{result.code}]: {result.message}"


RAW_LISTINGS = ("full", "compact")  # BuilderConfig.raw_listing
_COMPACT_HEAD = "(doc_id, title, size; name a source by its doc_id, or every document as raw_docs)"
# the compact listing's head with `BuilderConfig.doc_id_titles`
_COMPACT_HEAD_IDS = ("(doc_id, title, size; name a source by its doc_id, or every document as raw_docs; "
                     "a title or child path that is a doc_id stands for that document's title)")


def resolve_doc_ids(call: ToolCall, titles: dict[str, str]) -> ToolCall:
    """`call` with each doc_id of `titles` ({doc_id: the raw document's title}) that stands as a create_file /
    merge_files `title` or a merge_files child path replaced by that title (`BuilderConfig.doc_id_titles`);
    any other call, or argument, as it is. A child path names a synthetic file by its title (the workspace
    resolves titles), so ``child_paths: ["d003"]`` is the file titled after d003."""
    if call.name not in WRITE_TOOLS:
        return call
    a = dict(call.arguments)
    if isinstance(a.get("title"), str) and a["title"].strip() in titles:
        a["title"] = titles[a["title"].strip()]
    if call.name == "merge_files" and isinstance(a.get("child_paths"), list):
        a["child_paths"] = [titles.get(p.strip(), p) if isinstance(p, str) else p for p in a["child_paths"]]
    return dataclasses.replace(call, arguments=a)


def first_observation(workspace: Any, num_docs: int, update: dict[str, str] | None = None,
                      listing: str = "full", doc_id_titles: bool = False) -> str:
    """The builder's first user message: the collection's size, the root listing and the raw documents (their
    `raw_docs/` listing, or with `listing="compact"` one line each: `raw_listing`); for an update episode
    (`update`: `workspace.UpdateStart.prompt_fields()`) instead what changed, the stale synthetic files and
    the new and changed documents (`prompts/builder_update.txt`), not the listings. `doc_id_titles`: the
    compact listing's head says that a doc_id stands for its title (`BuilderConfig.doc_id_titles`)."""
    if update is not None:
        return prompt_text.render("builder_update", num_docs=num_docs, **update)
    compact = listing == "compact"
    return prompt_text.render("builder_user", num_docs=num_docs,
                              listing=render_result(workspace.list_dir(".")),
                              raw_listing=(_COMPACT_HEAD_IDS if doc_id_titles else _COMPACT_HEAD) + "\n"
                              + raw_listing(workspace) if compact
                              else render_result(workspace.list_dir(RAW_DIR)))


def raw_listing(workspace: Any) -> str:
    """The raw documents as the builder's first message lists them: one `doc_id "title" (N chars)` line
    each, in listing order. A source is named by its doc_id (or all of them as `raw_docs`), so the file
    names `list_files("raw_docs")` shows are left out: a corpus of 50 documents costs the builder's context
    a third of the tokens its listing would."""
    return "\n".join(f'{d.doc_id}  "{d.title or d.doc_id}" ({len(d.text):,} chars)'
                     for d in workspace.raw_docs)


class BuilderAgent:
    """One builder episode's agent state: workspace, policy session(s), action log. Drive it with `turn()`."""

    def __init__(self, ctx: AgentContext, workspace: Any, config: BuilderConfig, *, num_docs: int,
                 update: dict[str, str] | None = None, max_turns: int | None = None):
        self.ctx = ctx
        self.ws = workspace
        self.cfg = config
        # an update episode's own turn budget (`workspace.UpdateStart.max_turns`), else the config's
        self.max_turns = config.max_turns if max_turns is None else int(max_turns)
        self.num_docs = num_docs
        self.turn_no = 0
        self.segments: list[Segment] = []
        self.actions: list[str] = []
        self.system_ids = ctx.template.start(self.system_prompt())
        user = first_observation(workspace, num_docs, update, config.raw_listing, config.doc_id_titles)
        # {doc_id: title} of the raw documents, for `resolve_doc_ids` (`BuilderConfig.doc_id_titles`)
        self._doc_titles = ({d.doc_id: d.title for d in workspace.raw_docs if d.title}
                            if config.doc_id_titles else {})
        prompt = self.system_ids + ctx.template.turn("user", user)
        # The text of every turn, one conversation per training segment (a compaction starts the next): the
        # episode as chat messages, e.g. for supervised data (`rl.sft` encodes them back to these exact ids).
        self.conversations: list[list[dict[str, str]]] = [
            [{"role": "system", "content": self.system_prompt()}, {"role": "user", "content": user}]
        ]
        # tool responses come back in the template's observation turn ("tool" for Qwen3.5, else "user")
        self.observation_role = getattr(ctx.template, "observation_role", "user")
        self._open_pos = len(prompt)  # where the coming assistant turn's header starts
        self._prev_open_pos: int | None = None
        self.log = SessionLog(ctx, POLICY, prompt + ctx.template.open_turn("assistant"))
        self.compactions = 0
        self.summary_tokens = 0  # frozen-model tokens spent on model compaction summaries
        self.reasoning_in_log = 0  # reasoning tokens of the replies in the session (not visible history)
        self._last_reasoning = 0  # the last reply's (carried over by a compaction)

    def system_prompt(self) -> str:
        return prompt_text.render(
            self.cfg.system_prompt,
            tools=render_tools(builder_tools(self.cfg)),
            max_reads=self.cfg.max_reads_per_turn,
            max_turns=self.max_turns,
        )

    # -- one turn -------------------------------------------------------------------------------------------
    def turn(self) -> AgentGen:
        """Generator: one builder turn; returns its `TurnOutcome`."""
        t = self.turn_no
        self.turn_no += 1
        if (
            self.cfg.compaction != "none"
            and self.visible_tokens() > self.cfg.compaction_budget
            and self._prev_open_pos is not None
        ):
            yield from self._compact()
        sampling = Sampling(self.cfg.temperature, self.cfg.top_p, self.cfg.top_k, self.ctx.next_seed())
        result = yield from self.log.generate(self.cfg.max_new_tokens, sampling, turn=t)
        gen = [int(x) for x in result.tokens]
        text = self.ctx.decode_new(gen)
        self._last_reasoning = self._reasoning_tokens(gen, text)
        self.reasoning_in_log += self._last_reasoning
        self.conversations[-1].append({"role": "assistant", "content": text})
        parsed = parse_tool_calls(text, builder_tools(self.cfg), self.cfg.protocol())
        outcome = TurnOutcome(
            t,
            text,
            str(result.status),
            [],
            [e.to_dict() for e in parsed.errors],
            turn_penalty(parsed, self.cfg.protocol()),
            0,
            False,
            False,
            len(gen),
        )
        responses = yield from self._execute(parsed, outcome)
        outcome.stopped = any(c.name == "stop" for c in parsed.calls)
        last = outcome.stopped or self.turn_no >= self.max_turns or result.status == "cache_full"
        outcome.ended = last
        if not last:
            obs = "\n".join(responses[i] for i in sorted(responses))
            if len(obs) > self.cfg.observation_max_chars:
                obs = obs[: self.cfg.observation_max_chars] + "\n[... observation truncated]"
            close = self.log.close_turn_ids(gen)
            self.log.append(close)
            self._prev_open_pos = self._open_pos
            user_ids, obs = self._fit_observation(obs)
            self.conversations[-1].append({"role": self.observation_role, "content": obs})
            self._open_pos = len(self.log) + len(user_ids)
            self.log.append(user_ids + self.ctx.template.open_turn("assistant"))
        return outcome

    def visible_tokens(self) -> int:
        """The session's tokens less its replies' reasoning: what the compaction trigger measures."""
        return len(self.log) - self.reasoning_in_log

    def _reasoning_tokens(self, gen: list[int], text: str) -> int:
        """The reply's ids up to and including its `</think>` (0 without one: an unclosed span counts as
        visible, so the trigger errs toward compacting)."""
        if THINK_CLOSE not in text:
            return 0
        close = self.ctx.encode(THINK_CLOSE)
        if len(close) == 1 and close[0] in gen:
            return gen.index(close[0]) + 1
        return min(len(gen), len(self.ctx.encode(text[: text.find(THINK_CLOSE) + len(THINK_CLOSE)])))

    def _fit_observation(self, obs: str) -> tuple[list[int], str]:
        """The observation turn's ids and text, the text cut (a few tries) to at most half of what
        `context_budget` leaves after one reply, so that after a compaction the carried-over turn fits."""
        role = self.observation_role
        ids = self.ctx.template.turn(role, obs)
        if self.cfg.context_budget <= 0:
            return ids, obs
        cap = max(64, (self.cfg.context_budget - self.cfg.max_new_tokens) // 2)
        for _ in range(4):
            if len(ids) <= cap or not obs:
                break
            keep = max(0, int(len(obs) * cap / len(ids)) - 64)
            obs = obs[:keep] + "\n[... observation cut to fit the context; read less at once]"
            ids = self.ctx.template.turn(role, obs)
        return ids, obs

    def _execute(self, parsed: ParsedTurn, outcome: TurnOutcome) -> AgentGen:
        """Runs the reply's calls in order; returns {call index: rendered response}."""
        responses: dict[int, str] = {}
        for err in parsed.errors:
            responses[err.index] = render_error(err)
        pending: list[tuple[ToolCall, list[tuple[str, str]], str]] = []
        reads = 0
        t = outcome.turn

        def log_call(call: ToolCall, ok: bool, code: str, message: str, body: str) -> None:
            outcome.calls.append(
                CallRecord(call.index, call.name, _short_args(call.arguments), ok, code, message)
            )
            responses[call.index] = render_response(call.name, ok, body, code)
            short = json.dumps(_short_args(call.arguments, 60))
            self.actions.append(f"turn {t + 1}: {call.name} {short} -> {'ok' if ok else 'error ' + code}")

        def flush() -> AgentGen:
            if not pending:
                return
            gens = [
                executor_lib.given(c.arguments["text"]) if c.arguments.get("text", "").strip()
                else executor_lib.write(
                    self.ctx,
                    c.arguments["title"],
                    c.arguments["instructions"],
                    srcs,
                    txt,
                    kind=self.cfg.executor,
                    max_new_tokens=self.cfg.executor_max_new_tokens,
                    max_words=self.cfg.executor_max_words,
                )
                for c, srcs, txt in pending
            ]
            outs = yield Parallel(gens)
            for (c, _, _), out in zip(pending, outs, strict=True):
                outcome.executor_prompt_tokens += out.prompt_tokens
                outcome.executor_generated_tokens += out.generated_tokens
                a = c.arguments
                if c.name == "create_file":
                    r = self.ws.create_file(
                        a["title"], a["input_paths"], out.text, parent_path=a["parent_path"], turn=t
                    )
                else:
                    r = self.ws.merge_files(
                        a["title"], a["child_paths"], out.text, parent_path=a["parent_path"], turn=t
                    )
                if r.ok:
                    outcome.successful_writes += 1
                log_call(c, r.ok, r.code, r.message, render_result(r))
            pending.clear()

        def validate(call: ToolCall) -> ActionResult:
            """The workspace's own checks of a write (title, sources, parent, cycles), then the source
            excerpts: an invalid write is refused before any executor is paid for it."""
            a = call.arguments
            if call.name == "create_file":
                chk = self.ws.check_create(a["title"], a["input_paths"], a["parent_path"], t)
                paths = a["input_paths"]
            else:
                chk = self.ws.check_merge(a["title"], a["child_paths"], a["parent_path"], t)
                paths = a["child_paths"]
            if not chk.ok:
                return chk
            return self.ws.source_excerpts(
                paths, max_lines=self.cfg.excerpt_max_lines, max_chars=self.cfg.excerpt_max_chars
            )

        for call in parsed.calls:
            if self._doc_titles:
                call = resolve_doc_ids(call, self._doc_titles)
            a = call.arguments
            if call.name in WRITE_TOOLS:
                ex = validate(call)
                if not ex.ok and pending:  # it may name a write still pending in this reply
                    yield from flush()
                    ex = validate(call)
                if not ex.ok:
                    log_call(call, False, ex.code, ex.message, render_result(ex))
                    continue
                pending.append((call, excerpt_sources(ex), ex.text))
                continue
            yield from flush()
            if call.name == "list_files":
                r = self.ws.list_dir(a["path"], start=a["start"])
            elif call.name == "read_file":
                reads += 1
                if reads > self.cfg.max_reads_per_turn:
                    msg = f"at most {self.cfg.max_reads_per_turn} reads per reply; read {a['path']} next turn"
                    log_call(call, False, "too_many_reads", msg, msg)
                    continue
                r = self.ws.read_file(a["path"], start_line=a["start_line"], num_lines=a["num_lines"])
            elif call.name == "delete":
                r = self.ws.delete(a["target_paths"], a["reason"], turn=t)
            else:  # stop
                log_call(call, True, "ok", "stopping", "stopping")
                continue
            log_call(call, r.ok, r.code, r.message, render_result(r))
        yield from flush()
        return responses

    # -- compaction ------------------------------------------------------------------------------------------
    def _compact(self) -> AgentGen:
        assert self._prev_open_pos is not None
        tail = self.log.tokens[self._prev_open_pos :]
        tree = compaction_lib.workspace_tree(self.ws)
        if self.cfg.compaction == "model":
            turns = compaction_lib.transcript(self.conversations[-1][2:], self.cfg.compaction_input_chars)
            summary, used = yield from compaction_lib.model_summary(
                self.ctx, self.actions, tree, self.cfg.compaction_summary_tokens, turns=turns
            )
            self.summary_tokens += used
        else:
            summary = compaction_lib.deterministic_summary(self.actions)
        user = prompt_text.render("builder_compacted", num_docs=self.num_docs, actions=summary, tree=tree)
        head = self.system_ids + self.ctx.template.turn("user", user)
        carried = self.conversations[-1][-2:]  # the last reply and its observation, kept as exact ids
        self.conversations.append(
            [{"role": "system", "content": self.system_prompt()}, {"role": "user", "content": user}, *carried]
        )
        self.segments.append(self.log.segment())
        self.log.close()
        self.log = SessionLog(self.ctx, POLICY, head + tail)
        self._open_pos = len(head) + (self._open_pos - self._prev_open_pos)
        self._prev_open_pos = None
        self.reasoning_in_log = self._last_reasoning  # the carried-over reply's
        self.compactions += 1

    def finish(self) -> list[Segment]:
        """Closes the session; returns every training segment of the episode."""
        if not self.log.closed:
            self.segments.append(self.log.segment())
            self.log.close()
        return self.segments


__all__ = [
    "BUILDER_TOOLS",
    "BuilderAgent",
    "BuilderConfig",
    "CallError",
    "CallRecord",
    "TurnOutcome",
    "excerpt_sources",
    "render_result",
    "resolve_doc_ids",
]
