"""Where every answerer starts (the frozen model's `agents.answerer`, the scripted `agents.navigator`): its
tools, budgets (`AnswererConfig`), first prompt (README, root listing, preloaded root files, the question) and
the record of one run (`AnswerOutcome`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from librarian_jax.agents import prompt_text
from librarian_jax.agents.builder import render_result
from librarian_jax.agents.protocol import LIST_FILES_TOOL, READ_FILE_TOOL, Param, ToolSpec, render_tools
from librarian_jax.agents.runtime import AgentContext

ANSWERER_TOOLS: tuple[ToolSpec, ...] = (
    LIST_FILES_TOOL,
    READ_FILE_TOOL,
    ToolSpec("answer", (Param("text", "str", max_chars=4000),), "give your final answer (short)"),
)

# Agentic RAG's tool (eval method `agentic`): retrieval over the corpus's raw documents beside list/read.
SEARCH_TOOL = ToolSpec(
    "search",
    (Param("query", "str", max_chars=1000), Param("k", "int", False, 5, min_value=1, max_value=20)),
    "search the raw documents: the k best passages for `query`, each with its document's path (read_file it)",
)
SEARCH_ANSWERER_TOOLS: tuple[ToolSpec, ...] = (*ANSWERER_TOOLS[:2], SEARCH_TOOL, ANSWERER_TOOLS[2])


class Hit(Protocol):
    """One passage a search returns (`eval.retrieval.Passage`): its document's path, a label, its text."""

    path: str
    text: str

    @property
    def label(self) -> str: ...


Search = Callable[[str, int], Sequence[Hit]]  # (query, k) -> hits, best first


def render_hits(query: str, hits: Sequence[Hit]) -> str:
    """A search's observation text: one `[i] path (words a-b): text` line per passage."""
    if not hits:
        return f"No passage matches {query!r}."
    return "\n".join([f"{len(hits)} passages for {query!r}:"]
                     + [f"[{i + 1}] {h.label}: {h.text}" for i, h in enumerate(hits)])


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
    passages_read: int = 0  # passages it read (retrieved into its first prompt, or returned by search calls)

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
                "tokens_read": self.tokens_read, "passages_read": int(self.passages_read)}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cut_words(text: str, max_words: int) -> str:
    words = text.split()
    return " ".join(words[:max_words])


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
    ctx: AgentContext, workspace: Any, question: str, config: AnswererConfig, *, preamble: str = "",
    search: bool = False,
) -> tuple[str, str, list[str]]:
    """(system text, first user text, root files preloaded): where every answerer (model, scripted) starts;
    `search`: its tools include `search` (agentic RAG)."""
    budget = config.preload_max_tokens or max(config.context_budget // 2, 0)
    readme, listing, preloaded = starting_context(
        workspace, budget if config.preload_root_files else None, lambda text: len(ctx.encode(text))
    )
    user = prompt_text.render("answerer_user", readme=readme, listing=listing, question=question)
    if preamble:
        user = preamble.rstrip() + "\n\n" + user
    return answerer_system(search=search), user, preloaded


def first_prompt_ids(template: Any, system: str, user: str, question: str) -> list[int]:
    """The ids an answerer's session starts with (`first_prompt`'s texts): the system turn, the user turn,
    the assistant's opening. The user turn's text before its question is the same for every question of a
    workspace (README, listing, preloaded files), so it is encoded apart from the question, once
    (`ChatTemplate.turn_joined`; the same ids as encoding the turn whole)."""
    at = max(user.rfind(" " + question), 0) if question else 0
    return (template.start(system) + template.turn_joined("user", user[:at], user[at:])
            + template.open_turn("assistant"))


def answerer_system(*, search: bool = False) -> str:
    """The answerer's system text (instructions and tools; `search`: with the search tool)."""
    return prompt_text.render("answerer_system",
                              tools=render_tools(SEARCH_ANSWERER_TOOLS if search else ANSWERER_TOOLS))


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
