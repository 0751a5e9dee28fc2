"""One builder episode with its probes and rewards, as a generator for the scheduler.

    ws = Workspace.from_documents(task.documents)   (an update task: its carried-over workspace)
    [probe the raw workspace when probe_at_start]
    for each builder turn (<= H):
        the builder replies; its calls run (executor writes batched); malformed calls cost a penalty
        [probe a SNAPSHOT of the workspace when the schedule says so: R answerer runs per hidden question,
         all in one `Parallel`, so the scheduler batches them into the frozen engine's decode loop]
        stop, the turn limit or a full context ends the loop
    the builder's session is closed (its segments recorded) before the terminal evaluation
    terminal evaluation: R answerer runs per terminal question on a snapshot of the final workspace

Rewards and the schedule: `rollout.rewards`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from librarian_jax.agents.answerer import answer_question
from librarian_jax.agents.builder import BuilderAgent
from librarian_jax.agents.judge import judge_answer
from librarian_jax.agents.runtime import AgentContext, AgentGen, Parallel
from librarian_jax.rollout import rewards as R
from librarian_jax.rollout.records import EpisodeRecord
from librarian_jax.workspace import UPDATE_META, Workspace

REPLY_CHARS = 2000  # how much of each builder reply the record keeps for inspection


def answer_and_judge(
    ctx: AgentContext, ws: Any, question: Any, repeat: int, phase: str, config: R.RolloutConfig,
    temperature: float | None = None, preamble: str = "", preamble_passages: int = 0, search: Any = None,
) -> AgentGen:
    """Generator: one answerer run on `ws` (with `preamble` in its first prompt, e.g. `preamble_passages`
    retrieved passages; `search`: the agentic-RAG search tool, `agents.answer_start.Search`), judged; returns
    the answer record (correctness, utility, reading fields, tokens)."""
    acfg = config.answerer if temperature is None else dataclasses.replace(config.answerer,
                                                                           temperature=temperature)
    outcome = yield from answer_question(ctx, ws, question.question, acfg, preamble=preamble,
                                         preamble_passages=preamble_passages, search=search)
    correct = yield from judge_answer(
        ctx,
        question.question,
        outcome.answer,
        question.answers,
        use_model_judge=config.use_model_judge,
        max_new_tokens=config.judge_max_new_tokens,
    )
    reading = outcome.record() if hasattr(outcome, "record") else {"files_read": list(outcome.files_read)}
    files = reading.get("num_files_opened", len(reading["files_read"]))
    return {
        "phase": phase,
        "question_id": question.question_id,
        "repeat": repeat,
        "answer": outcome.answer,
        "correct": float(correct),
        "utility": R.answer_utility(float(correct), outcome.prompt_tokens, files, config),
        "turns": outcome.turns,
        "forced": outcome.forced,
        "prompt_tokens": outcome.prompt_tokens,
        "generated_tokens": outcome.generated_tokens,
        "status": outcome.status,
        "temperature": acfg.temperature,
        **reading,
    }


def evaluate(
    ctx: AgentContext, ws: Any, questions: Sequence[Any], repeats: int, phase: str, config: R.RolloutConfig,
    *, preambles: Mapping[str, str] | None = None, preamble_passages: int = 0, search: Any = None,
) -> AgentGen:
    """Generator: every (question, repeat) answerer run at once on `ws`; returns (score, answer dicts).

    The score is the mean utility (= mean correctness without cost terms). Repeats follow
    `config.repeat_mode` (`rollout.rewards`): a greedy answerer's R runs of a question would be identical, so
    one run is made and recorded R times (copies carry `"copy": True` and no tokens); `"sample"` samples R.
    `preambles` (question id -> text, `preamble_passages` passages each) and `search` (the agentic-RAG tool):
    the retrieval baselines' first prompt and tool (`answer_and_judge`).
    """
    runs, temperature = R.repeat_plan(repeats, config)
    dedupe = runs < repeats
    gens = [answer_and_judge(ctx, ws, q, r, phase, config, temperature,
                             preamble=(preambles or {}).get(q.question_id, ""),
                             preamble_passages=preamble_passages if preambles else 0, search=search)
            for q in questions for r in range(runs)]
    answers = (yield Parallel(gens)) if gens else []
    if dedupe:
        full = []
        for a in answers:
            full.append(a)
            for r in range(1, repeats):
                full.append({**a, "repeat": r, "copy": True, "prompt_tokens": 0, "generated_tokens": 0,
                             "tokens_read": 0})
        answers = full
    return R.mean_correct([a.get("utility", a["correct"]) for a in answers]), answers


def _snapshot(ws: Any, config: R.RolloutConfig) -> Any:
    """The workspace as JSON data; raw texts left out unless `snapshot_raw_text` (restore with
    `Workspace.from_dict(snapshot, docs=task.documents)`)."""
    return ws.to_dict(include_raw_text=config.snapshot_raw_text)


def run_episode(
    ctx: AgentContext,
    task: Any,
    config: R.RolloutConfig,
    *,
    group_id: int,
    episode_index: int,
    workspace: Any = None,
) -> AgentGen:
    """Generator: one builder episode on `task`; returns its `EpisodeRecord`.

    Args:
      ctx: engines ("policy": builder; "frozen": answerer/executor/judge), tokenizer, template, seeds.
      task: a `CorpusTask`.
      workspace: the initial workspace (default: `Workspace.from_documents(task.documents)`).

    An update task (`task.meta[workspace.UPDATE_META]`, a `workspace.UpdateStart`) starts from a copy of its
    carried-over workspace, with the update prompt (changes, stale files) and the update's turn budget.
    """
    start = (task.meta or {}).get(UPDATE_META)
    update_fields, max_turns = None, None
    if start is not None:
        if workspace is None:
            workspace = start.workspace.copy()
        update_fields, max_turns = start.prompt_fields(), start.max_turns
    if workspace is None:
        workspace = Workspace.from_documents(list(task.documents))
    ws = workspace
    rec = EpisodeRecord(
        task_id=task.task_id,
        group_id=group_id,
        episode_index=episode_index,
        segments=[],
        turn_rewards=[],
        terminal_reward=0.0,
        total_reward=0.0,
    )
    counts = dict.fromkeys(
        (
            "builder_prompt",
            "builder_generated",
            "executor_prompt",
            "executor_generated",
            "summary_tokens",
            "answerer_prompt",
            "answerer_generated",
            "answerer_runs",
        ),
        0,
    )

    def count_answers(answers: list[dict[str, Any]]) -> None:
        rec.answers.extend(answers)
        counts["answerer_prompt"] += sum(a["prompt_tokens"] for a in answers)
        counts["answerer_generated"] += sum(a["generated_tokens"] for a in answers)
        counts["answerer_runs"] += sum(1 for a in answers if not a.get("copy"))

    previous = 0.0
    if config.probe_at_start:
        previous, answers = yield from evaluate(
            ctx, ws.copy(), task.questions, config.probe_repeats, "start", config
        )
        count_answers(answers)
        if config.record_snapshots:
            rec.workspace_snapshots["start"] = _snapshot(ws, config)
    rec.initial_score = previous
    builder = BuilderAgent(ctx, ws, config.builder, num_docs=len(task.documents), update=update_fields,
                           max_turns=max_turns)
    last_probe_n = 0
    while True:
        out = yield from builder.turn()
        n = out.turn + 1
        reward = out.penalty
        if config.edit_cost:
            edits = sum(1 for c in out.calls if c.ok and c.name in ("create_file", "merge_files", "delete"))
            reward -= R.edit_penalty(edits, config)
        counts["executor_prompt"] += out.executor_prompt_tokens
        counts["executor_generated"] += out.executor_generated_tokens
        rec.tool_calls.append([c.to_dict() for c in out.calls])
        rec.tool_errors.append(out.errors)
        rec.replies.append(out.text if len(out.text) <= REPLY_CHARS else out.text[:REPLY_CHARS] + " [...]")
        if R.should_probe(n, out.successful_writes > 0, last_probe_n, len(rec.probe_scores), config):
            snap = ws.copy()
            score, answers = yield from evaluate(
                ctx, snap, task.questions, config.probe_repeats, f"probe_{out.turn}", config
            )
            count_answers(answers)
            reward += R.probe_reward(score, previous, config)
            previous = score
            last_probe_n = n
            rec.probe_scores.append(score)
            rec.probe_turns.append(out.turn)
            if config.record_snapshots:
                rec.workspace_snapshots[f"probe_{out.turn}"] = _snapshot(snap, config)
        if out.ended and not out.stopped:
            reward -= config.no_stop_penalty
        rec.turn_rewards.append(float(reward))
        if out.ended:
            rec.stopped = out.stopped
            break
    rec.segments = builder.finish()
    if config.record_conversations:
        rec.meta["conversations"] = builder.conversations
    rec.num_turns = len(rec.turn_rewards)
    rec.compactions = builder.compactions
    counts["summary_tokens"] += builder.summary_tokens
    for s in rec.segments:
        gen = int(s.loss_mask.sum())
        counts["builder_generated"] += gen
        counts["builder_prompt"] += int(s.tokens.shape[0]) - gen
    questions = R.terminal_question_set(task, config)
    terminal, answers = yield from evaluate(
        ctx, ws.copy(), questions, config.terminal_repeats, "final", config
    )
    count_answers(answers)
    rec.terminal_reward = float(terminal)
    rec.total_reward = float(sum(rec.turn_rewards) + rec.terminal_reward)
    if config.record_snapshots:
        rec.workspace_snapshots["final"] = _snapshot(ws, config)
    rec.token_counts = counts
    rec.meta["stats"] = ws.stats() if hasattr(ws, "stats") else {}
    return rec
