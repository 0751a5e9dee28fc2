"""History compaction for the builder: summaries that replace all but the last assistant turn.

`deterministic_summary(actions)` lists the actions so far (one line each: turn, tool, arguments, outcome),
keeping the first and the most recent lines when there are more than `max_lines` (the embedded world's
default: no model). `model_summary` asks the compaction role's model (`agents.runtime.COMPACTION`; the paper
presets' `builder.compaction = "model"`) for a summary that keeps what the builder has read and decided and
what remains, as the authors' compaction prompt asks (`prompts/compaction.txt`), with thinking off when the
role's template has a switch. It reads the action log and the turns' content since the last compaction
(`transcript`: each reply without its reasoning, each observation, the latest kept when they exceed the
budget), so it can keep what the builder read and decided, not only which tools it called. Either way the
compacted prompt also holds `workspace_tree(ws)`: a snapshot of the synthetic part of the workspace. The
builder then starts a new training segment whose prompt is exactly those ids (see `agents.builder`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from librarian_jax.agents import prompt_text
from librarian_jax.agents.protocol import strip_thinking
from librarian_jax.agents.runtime import COMPACTION, AgentContext, AgentGen, Sampling, SessionLog


def deterministic_summary(actions: Sequence[str], max_lines: int = 60) -> str:
    """The action log as text; with more than `max_lines` lines, the first 10 and the latest ones."""
    if not actions:
        return "(no actions yet)"
    lines = list(actions)
    if len(lines) > max_lines:
        head, tail = lines[:10], lines[-(max_lines - 11) :]
        lines = head + [f"... {len(actions) - len(head) - len(tail)} earlier actions omitted ..."] + tail
    return "\n".join(lines)


def transcript(messages: Sequence[Mapping[str, str]], max_chars: int = 12_000) -> str:
    """The turns' content for a summary: each assistant reply (its `<think>` reasoning removed) and each
    observation as a block, oldest first; over `max_chars` the oldest blocks go first (a note says how many).

    `messages`: chat messages ({"role", "content"}) after the segment's system prompt and first user turn."""
    blocks = []
    for m in messages:
        if m["role"] == "assistant":
            text = strip_thinking(m["content"]).strip()
            blocks.append(f"[librarian]\n{text or '(reasoning only)'}")
        else:
            blocks.append(f"[tools returned]\n{m['content'].strip()}")
    kept: list[str] = []
    used = 0
    for b in reversed(blocks):
        if used + len(b) > max_chars:
            if not kept:  # the latest block alone is too long: its end
                kept.append("[...]" + b[-max_chars:])
            break
        kept.append(b)
        used += len(b) + 2
    dropped = len(blocks) - len(kept)
    head = [f"[... {dropped} earlier blocks omitted ...]"] if dropped else []
    return "\n\n".join(head + kept[::-1]) if blocks else "(no turns yet)"


def _render(result: Any) -> str:
    if isinstance(result, str):
        return result
    render = getattr(result, "render", None)
    if render is not None:
        return render()
    return getattr(result, "text", "") or getattr(result, "message", "") or str(result)


def workspace_tree(ws: Any, max_chars: int = 6000) -> str:
    """A snapshot of the workspace: its tree rendering when it has one, else its README and root listing."""
    tree = getattr(ws, "tree", None)
    if callable(tree):
        text = _render(tree())
    else:
        readme = ws.readme()
        text = (readme if isinstance(readme, str) else _render(readme)) + "\n\n" + _render(ws.list_dir("."))
    if len(text) > max_chars:
        text = text[:max_chars] + "\n[... tree truncated]"
    return text


def model_summary(
    ctx: AgentContext, actions: Sequence[str], tree: str, max_new_tokens: int = 256, *, turns: str = ""
) -> AgentGen:
    """Generator: the compaction model's summary of the actions and of `turns` (`transcript`: what the
    builder read and wrote since the last compaction); returns (summary text, tokens used).

    Falls back to the deterministic summary when the model writes nothing.
    """
    tpl = ctx.template_for(COMPACTION)
    user = prompt_text.render("compaction", actions=deterministic_summary(actions), tree=tree,
                              turns=turns or "(not given)")
    log = SessionLog(ctx, COMPACTION, tpl.start() + tpl.turn("user", user) + tpl.open_turn("assistant"))
    try:
        result = yield from log.generate(max_new_tokens, Sampling(temperature=0.0, seed=0))
        text = ctx.decode_new(result.tokens).strip()
    finally:
        log.close()
    return (text or deterministic_summary(actions)), len(log)
