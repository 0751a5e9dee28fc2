"""librarian_jax.agents: the tool-call protocol, builder / answerer / executor / compaction / judge, prompts.

Agents are generators driven by `librarian_jax.rollout.scheduler` (see `agents.runtime`).
"""

from librarian_jax.agents.answerer import ANSWERER_TOOLS, AnswererConfig, AnswerOutcome, answer_question
from librarian_jax.agents.builder import BUILDER_TOOLS, BuilderAgent, BuilderConfig, TurnOutcome
from librarian_jax.agents.executor import ExecutorOutput, extractive_text
from librarian_jax.agents.judge import exact_match, judge_answer, normalize_answer
from librarian_jax.agents.protocol import (
    CallError,
    ParsedTurn,
    ProtocolConfig,
    ToolCall,
    ToolSpec,
    format_call,
    parse_tool_calls,
)
from librarian_jax.agents.runtime import FROZEN, POLICY, AgentContext, Generate, Parallel, Sampling
from librarian_jax.segment import Segment

__all__ = [
    "ANSWERER_TOOLS",
    "BUILDER_TOOLS",
    "FROZEN",
    "POLICY",
    "AgentContext",
    "AnswerOutcome",
    "AnswererConfig",
    "BuilderAgent",
    "BuilderConfig",
    "CallError",
    "ExecutorOutput",
    "Generate",
    "Parallel",
    "ParsedTurn",
    "ProtocolConfig",
    "Sampling",
    "Segment",
    "ToolCall",
    "ToolSpec",
    "TurnOutcome",
    "answer_question",
    "exact_match",
    "extractive_text",
    "format_call",
    "judge_answer",
    "normalize_answer",
    "parse_tool_calls",
]
