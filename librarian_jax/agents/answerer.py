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

import re
from typing import Any

from librarian_jax.agents import navigator, prompt_text
from librarian_jax.agents.answer_start import (  # noqa: F401 - the answerer's names, re-exported
    ANSWERER_KINDS,
    ANSWERER_TOOLS,
    SEARCH_ANSWERER_TOOLS,
    SEARCH_TOOL,
    AnswererConfig,
    AnswerOutcome,
    Search,
    answerer_system,
    cut_words,
    first_prompt,
    first_prompt_ids,
    preload_files,
    preload_text,
    render_hits,
    root_files,
    starting_context,
)
from librarian_jax.agents.builder import render_result
from librarian_jax.agents.protocol import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ProtocolConfig,
    parse_tool_calls,
    render_error,
    render_response,
)
from librarian_jax.agents.runtime import ANSWERER, AgentContext, AgentGen, Sampling, SessionLog

_MARKUP = re.compile(re.escape(TOOL_CALL_OPEN) + "|" + re.escape(TOOL_CALL_CLOSE))


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


def answer_question(
    ctx: AgentContext, workspace: Any, question: str, config: AnswererConfig, *, preamble: str = "",
    preamble_passages: int = 0, search: Search | None = None,
) -> AgentGen:
    """Generator: one answerer run on `workspace`; returns an `AnswerOutcome`.

    `preamble`: text placed in the first prompt before the question (e.g. BM25 passages for the retrieval
    baseline); it counts as read, and so do its `preamble_passages` passages. `search`: agentic RAG, the
    `search(query, k)` tool beside list/read (`SEARCH_TOOL`; each call one turn, its passages read).
    `config.kind == "scripted"` runs `agents.navigator` instead of the model.
    """
    if config.kind == "scripted":
        return (yield from navigator.navigate(ctx, workspace, question, config, preamble=preamble,
                                              preamble_passages=preamble_passages, search=search))
    if config.kind != "model":
        raise ValueError(f"AnswererConfig.kind must be one of {ANSWERER_KINDS}, got {config.kind!r}")
    cfg = config
    tpl = ctx.template_for(ANSWERER)
    obs_role = getattr(tpl, "observation_role", "user")
    proto = ProtocolConfig(max_calls=cfg.max_calls_per_turn)
    tools = SEARCH_ANSWERER_TOOLS if search is not None else ANSWERER_TOOLS
    system, user, preloaded = first_prompt(ctx, workspace, question, cfg, preamble=preamble,
                                           search=search is not None)
    log = SessionLog(ctx, ANSWERER, first_prompt_ids(tpl, system, user, question))
    actions: list[str] = []
    files_read: list[str] = []
    passages = int(preamble_passages)
    turns = 0
    forced = cfg.max_turns <= 0 or len(log) + cfg.max_new_tokens >= cfg.context_budget
    try:
        while True:
            turns += 1
            max_new = cfg.forced_max_new_tokens if forced else cfg.max_new_tokens
            result = yield from log.generate(max_new, Sampling(cfg.temperature, seed=ctx.next_seed()))
            gen = [int(x) for x in result.tokens]
            text = ctx.decode_new(gen)
            parsed = parse_tool_calls(text, tools, proto)
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
                    passages,
                )
            if status == "cache_full":
                return AnswerOutcome(
                    "", turns, False, log.num_observed, log.num_generated, actions, status, files_read,
                    preloaded, passages,
                )
            responses = {e.index: render_error(e) for e in parsed.errors}
            for call in parsed.calls:
                a = call.arguments
                if call.name == SEARCH_TOOL.name and search is not None:
                    hits = list(search(a["query"], a["k"]))
                    passages += len(hits)
                    actions.append(f"search {a['query'][:60]}")
                    responses[call.index] = render_response(call.name, True, render_hits(a["query"], hits))
                    continue
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
