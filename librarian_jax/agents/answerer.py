"""The answerer: a frozen model that navigates a workspace (snapshot) to answer one question.

Protocol (one of the options the design allowed, chosen so every agent speaks `agents.protocol`): the answer
is a tool call, `answer(text)`, like `list_files(path=".")` and `read_file(path, start_line=1,
num_lines=100)`. One call per reply (`max_calls_per_turn`, default 1; more are `too_many_calls` errors and
not run). Malformed replies get the protocol's error observation (no reward is involved here).

The first prompt is where the authors' answerer starts: the workspace README, the root listing, and the
contents of every root-level file (`preload_root_files`, in listing order, while they fit in
`preload_max_tokens`, default: half of `context_budget`; files that do not fit are named so the answerer can
read them), then the question. Raw documents stay reachable (`raw_docs/` is part of every workspace), so the
answerer can always fall back on them. Observations are tool-response turns of the role's chat template
(`template.observation_role`: "tool" for Qwen3.5, whose template renders them as `<tool_response>` blocks).

Records (`AnswerOutcome`): `files_read` (every successful read_file path, in order, with repeats),
`files_preloaded` (root-level files placed in the first prompt), `files_opened` (distinct files read or
preloaded) and `tokens_read` (= `prompt_tokens`: every token the model read, prompt and observations), so
"files and tokens read per query" can be computed from answer records.

Budgets: at most `max_turns` replies (default 32) of at most `max_new_tokens` each; when the turns are
spent or another regular turn would not fit in `context_budget` tokens (set it at most the frozen engine's
`max_seq_len`), the last observation (cut to fit when needed) ends with the forced-answer request
(`prompts/answerer_forced.txt`) and one more reply (<= `forced_max_new_tokens`) must answer. If that reply
holds no valid `answer` call, its text (tool-call markup removed) is taken as the answer. Answers are cut to
`answer_max_words` (128) words.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from librarian_jax.agents import prompt_text
from librarian_jax.agents.builder import render_result
from librarian_jax.agents.protocol import (
    LIST_FILES_TOOL,
    READ_FILE_TOOL,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Param,
    ProtocolConfig,
    ToolSpec,
    parse_tool_calls,
    render_error,
    render_response,
    render_tools,
)
from librarian_jax.agents.runtime import ANSWERER, AgentContext, AgentGen, Sampling, SessionLog

ANSWERER_TOOLS: tuple[ToolSpec, ...] = (
    LIST_FILES_TOOL,
    READ_FILE_TOOL,
    ToolSpec("answer", (Param("text", "str", max_chars=4000),), "give your final answer (short)"),
)

_MARKUP = re.compile(re.escape(TOOL_CALL_OPEN) + "|" + re.escape(TOOL_CALL_CLOSE))


@dataclasses.dataclass(frozen=True)
class AnswererConfig:
    """Answerer budgets; defaults follow the paper (32 turns, temperature 0, 128-word answers)."""

    max_turns: int = 32
    max_new_tokens: int = 1024
    forced_max_new_tokens: int = 128
    temperature: float = 0.0
    max_calls_per_turn: int = 1
    context_budget: int = 32_768
    observation_max_chars: int = 16_000
    answer_max_words: int = 128
    kind: str = "model"  # "model": the frozen LLM; "scripted": `agents.navigator` (embedded world, CPU)
    max_reads: int = 0  # scripted navigator: read_file calls allowed (0 = max_turns)
    preload_root_files: bool = True  # README + every root-level file in the first prompt (authors' code)
    preload_max_tokens: int = 0  # tokens the preloaded files may take; 0 = half of context_budget


@dataclasses.dataclass
class AnswerOutcome:
    answer: str
    turns: int
    forced: bool
    prompt_tokens: int  # tokens the model read (prompt + observations)
    generated_tokens: int
    actions: list[str]
    status: str = "ok"  # "ok" | "cache_full"
    files_read: list[str] = dataclasses.field(default_factory=list)  # paths it read (in order, with repeats)
    files_preloaded: list[str] = dataclasses.field(default_factory=list)  # root files in its first prompt

    @property
    def tokens_read(self) -> int:
        """Every token the answerer read: its prompt (preloaded files included) and observations."""
        return self.prompt_tokens

    @property
    def files_opened(self) -> list[str]:
        """The distinct files it had in context (preloaded or read), in first-seen order."""
        return list(dict.fromkeys([*self.files_preloaded, *self.files_read]))

    def record(self) -> dict[str, Any]:
        """The answer record's reading fields: files opened and read, tokens read."""
        return {"files_read": list(self.files_read), "files_preloaded": list(self.files_preloaded),
                "files_opened": self.files_opened, "num_files_opened": len(self.files_opened),
                "tokens_read": self.tokens_read}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cut_words(text: str, max_words: int) -> str:
    words = text.split()
    return " ".join(words[:max_words])


def _forced_observation(ctx: AgentContext, obs: str, used: int, cfg: AnswererConfig) -> list[int]:
    """The last observation plus the forced-answer request, its observation text cut so that the forced reply
    still fits in `context_budget` (a few tries: token counts of cut text are not linear)."""
    forced = "\n\n" + prompt_text.render("answerer_forced")
    room = cfg.context_budget - used - cfg.forced_max_new_tokens - 8  # 8: the reply's header and close
    tpl = ctx.template_for(ANSWERER)
    role = getattr(tpl, "observation_role", "user")
    ids = tpl.turn(role, obs + forced)
    for _ in range(4):
        if len(ids) <= room or not obs:
            break
        keep = max(0, int(len(obs) * max(room, 0) / len(ids)) - 64)
        obs = obs[:keep] + ("\n[... cut to fit the context]" if keep else "")
        ids = tpl.turn(role, obs + forced)
    return ids


ANSWERER_KINDS = ("model", "scripted")


def root_files(workspace: Any) -> list[str]:
    """Paths of the entries at the workspace root other than the README, in listing order (directories
    included: `preload_text` keeps only what `read_file` reads)."""
    try:
        listing = workspace.list_dir(".", max_chars=1 << 30)
    except TypeError:  # a workspace double without max_chars
        listing = workspace.list_dir(".")
    data = getattr(listing, "data", None) or {}
    entries = data.get("entries", []) if isinstance(data, dict) else []
    return [str(p) for p in entries if str(p).rstrip("/").lower() not in ("readme.md", "readme")]


def preload_text(ctx: AgentContext, workspace: Any, budget_tokens: int) -> tuple[str, list[str]]:
    """The contents of the workspace's root-level files, in listing order, while their tokens fit in
    `budget_tokens`; files that do not fit are named at the end. Returns (text, paths preloaded)."""
    return preload_files(workspace, budget_tokens, lambda text: len(ctx.encode(text)))


def preload_files(workspace: Any, budget: int, count: Callable[[str], int]) -> tuple[str, list[str]]:
    """`preload_text` with any measure: the root-level files while `count` of their blocks fits in `budget`
    (the answerer counts tokens; the MCP server, which has no tokenizer, characters)."""
    parts: list[str] = []
    loaded: list[str] = []
    skipped: list[str] = []
    used = 0
    for path in root_files(workspace):
        r = workspace.read_file(path)  # the first window (<= 100 lines, 16,000 chars), footer says the rest
        if not getattr(r, "ok", False):
            continue  # a directory, or not readable
        block = f"=== {path} ===\n{render_result(r)}"
        n = count(block)
        if skipped or used + n > budget:
            skipped.append(path)
            continue
        parts.append(block)
        loaded.append(path)
        used += n
    if skipped:
        parts.append("Root-level files not shown here (read them with read_file): " + ", ".join(skipped))
    return "\n\n".join(parts), loaded


def first_prompt(
    ctx: AgentContext, workspace: Any, question: str, config: AnswererConfig, *, preamble: str = ""
) -> tuple[str, str, list[str]]:
    """(system text, first user text, root files preloaded): where every answerer (model, scripted) starts."""
    budget = config.preload_max_tokens or max(config.context_budget // 2, 0)
    readme, listing, preloaded = starting_context(
        workspace, budget if config.preload_root_files else None, lambda text: len(ctx.encode(text))
    )
    user = prompt_text.render("answerer_user", readme=readme, listing=listing, question=question)
    if preamble:
        user = preamble.rstrip() + "\n\n" + user
    return answerer_system(), user, preloaded


def answerer_system() -> str:
    """The answerer's system text (instructions and tools)."""
    return prompt_text.render("answerer_system", tools=render_tools(ANSWERER_TOOLS))


def starting_context(
    workspace: Any, budget: int | None, count: Callable[[str], int]
) -> tuple[str, str, list[str]]:
    """(README text, root listing followed by the root-level files preloaded while `count` of them fits in
    `budget` (None: no file preloaded), paths preloaded): what the answerer reads before its question."""
    readme = workspace.readme()
    listing = render_result(workspace.list_dir("."))
    preloaded: list[str] = []
    if budget is not None:
        files, preloaded = preload_files(workspace, budget, count)
        if files:
            listing = listing + "\n\nRoot-level files:\n\n" + files
    return readme if isinstance(readme, str) else render_result(readme), listing, preloaded


def answer_question(
    ctx: AgentContext, workspace: Any, question: str, config: AnswererConfig, *, preamble: str = ""
) -> AgentGen:
    """Generator: one answerer run on `workspace`; returns an `AnswerOutcome`.

    `preamble`: text placed in the first prompt before the question (e.g. BM25 passages for the retrieval
    baseline); it counts as read. `config.kind == "scripted"` runs `agents.navigator` instead of the model.
    """
    if config.kind == "scripted":
        from librarian_jax.agents import navigator

        return (yield from navigator.navigate(ctx, workspace, question, config, preamble=preamble))
    if config.kind != "model":
        raise ValueError(f"AnswererConfig.kind must be one of {ANSWERER_KINDS}, got {config.kind!r}")
    cfg = config
    tpl = ctx.template_for(ANSWERER)
    obs_role = getattr(tpl, "observation_role", "user")
    proto = ProtocolConfig(max_calls=cfg.max_calls_per_turn)
    system, user, preloaded = first_prompt(ctx, workspace, question, cfg, preamble=preamble)
    log = SessionLog(ctx, ANSWERER, tpl.start(system) + tpl.turn("user", user) + tpl.open_turn("assistant"))
    actions: list[str] = []
    files_read: list[str] = []
    turns = 0
    forced = cfg.max_turns <= 0 or len(log) + cfg.max_new_tokens >= cfg.context_budget
    try:
        while True:
            turns += 1
            max_new = cfg.forced_max_new_tokens if forced else cfg.max_new_tokens
            result = yield from log.generate(max_new, Sampling(cfg.temperature, seed=ctx.next_seed()))
            gen = [int(x) for x in result.tokens]
            text = ctx.decode_new(gen)
            parsed = parse_tool_calls(text, ANSWERER_TOOLS, proto)
            answers = [c.arguments["text"] for c in parsed.calls if c.name == "answer"]
            status = "cache_full" if result.status == "cache_full" else "ok"
            if answers or forced:
                # A forced reply without a valid answer call: its text (markup removed) is the answer.
                answer = answers[0] if answers else _MARKUP.sub(" ", text).strip()
                actions.append("forced_answer" if forced else "answer")
                return AnswerOutcome(
                    cut_words(answer, cfg.answer_max_words),
                    turns,
                    forced,
                    log.num_observed,
                    log.num_generated,
                    actions,
                    status,
                    files_read,
                    preloaded,
                )
            if status == "cache_full":
                return AnswerOutcome(
                    "", turns, False, log.num_observed, log.num_generated, actions, status, files_read,
                    preloaded,
                )
            responses = {e.index: render_error(e) for e in parsed.errors}
            for call in parsed.calls:
                a = call.arguments
                if call.name == "list_files":
                    r = workspace.list_dir(a["path"], start=a["start"])
                else:
                    r = workspace.read_file(a["path"], start_line=a["start_line"], num_lines=a["num_lines"])
                    if r.ok:
                        files_read.append(str(a["path"]))
                actions.append(f"{call.name} {a.get('path', '')}")
                responses[call.index] = render_response(call.name, r.ok, render_result(r), r.code)
            obs = "\n".join(responses[i] for i in sorted(responses))
            if len(obs) > cfg.observation_max_chars:
                obs = obs[: cfg.observation_max_chars] + "\n[... observation truncated]"
            obs_ids = tpl.turn(obs_role, obs)
            # the next regular turn needs room for the observation and its reply
            need = len(log) + len(obs_ids) + cfg.max_new_tokens
            forced = turns >= cfg.max_turns or need >= cfg.context_budget
            if forced:
                obs_ids = _forced_observation(ctx, obs, len(log), cfg)
            log.append(log.close_turn_ids(gen) + obs_ids + tpl.open_turn("assistant"))
    finally:
        log.close()
