"""The executor: writes a synthetic file's text from its sources and the builder's title and instructions.

Executors with one interface (`write(...)`, a generator returning an `ExecutorOutput`), a model and three
model-free extracts:

- `"model"`: a frozen model, run as an engine session on the frozen engine: prompt `prompts/executor.txt`
  (title, instructions, source excerpts = the first lines of each source, capped in total), temperature 0,
  at most `max_new_tokens` (512) output tokens. An empty reply falls back to the extractive text (flagged).
- `"extractive"`: model-free and deterministic. From each source it keeps the lead sentence plus the
  sentences sharing the most content words with the title and instructions (in source order), under a word
  budget split evenly over the sources, each block headed by its source path. For tests and cheap runs.
- `"focused"`: the extract, focused on what the title names (every sentence naming it, from every source).
- `"statements"`: focused, and of those sentences only the ones that state something about it in the
  synthetic world's statement forms (`data.synthetic.extract_facts`): a sentence that only mentions the
  entity ("Orlen Vask gave a short talk on mill wheels") is left out, as a frozen model writing a file about
  Orlen Vask would leave it out. The embedded noisy world's stand-in for the model executor, as the scripted
  navigator is for the answerer; it knows the world's sentence forms, not which file a builder should write.

Either way the text returned has been through `workspace.clean_content` (NUL removed, lone surrogates
replaced, length capped): what `create_file` / `merge_files` would refuse is taken out on this side, so a
source holding such characters can still be summarised.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from librarian_jax import text_memo
from librarian_jax.agents import prompt_text
from librarian_jax.agents.runtime import EXECUTOR, AgentContext, AgentGen, Sampling, SessionLog
from librarian_jax.data.synthetic import extract_facts
from librarian_jax.workspace import clean_content

# `BuilderConfig.executor`: an LLM on the executor's engine, or the model-free extract (focused or not)
EXECUTOR_KINDS = ("model", "extractive", "focused", "statements")
# the model-free ones, and the sentences each keeps in a focused file (None: every sentence naming the title)
_EXTRACTIVE: dict[str, tuple[bool, Callable[[str], bool] | None]] = {
    "extractive": (False, None),
    "focused": (True, None),
    "statements": (True, lambda sentence: bool(extract_facts(sentence))),
}

_WORD = re.compile(r"[a-z0-9]+")
_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
_HEADER_LINE = re.compile(r"^\s*(#+ |[A-Z][A-Z_ ]{1,40}:)")
_STOP = frozenset(
    "a an the and or of to in on for with by at from as is are was were be been it its this that these those "
    "into about over under than then there their his her our your my we you they he she i not no do does did "
    "file files summary summarise summarize write about all each".split()
)


@dataclasses.dataclass(frozen=True)
class ExecutorOutput:
    text: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    fallback: bool = False


# The extractive executor reads the same sources and sentences again for every file a builder writes from
# them (every episode of a group, every demonstration), so both readings below are remembered: up to this many
# texts each, of at most this many characters (longer ones are read each time).
READ_MEMO_ENTRIES = 32_768
READ_MEMO_MAX_CHARS = 16_384


def content_words(text: str) -> set[str]:
    """The lower-cased words of `text` (letters and digits) but stop words and single characters."""
    return set(_content_words(text))


@text_memo.short_texts(READ_MEMO_ENTRIES, READ_MEMO_MAX_CHARS)
def _content_words(text: str) -> frozenset[str]:
    return frozenset(w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 1)


def split_sentences(text: str) -> list[str]:
    """Sentences of a source body, skipping header lines (`TITLE: ...`, markdown headings) and blanks."""
    return list(_split_sentences(text))


@text_memo.short_texts(READ_MEMO_ENTRIES, READ_MEMO_MAX_CHARS)
def _split_sentences(text: str) -> tuple[str, ...]:
    out = []
    for piece in _SENT_SPLIT.split(text):
        piece = piece.strip()
        if piece and not _HEADER_LINE.match(piece):
            out.append(" ".join(piece.split()))
    return tuple(out)


def extractive_text(
    title: str, instructions: str, sources: Sequence[tuple[str, str]], *, max_words: int = 360,
    focus: bool = False, keep: Callable[[str], bool] | None = None,
) -> str:
    """Deterministic extractive summary of `sources` ((path, text) pairs) for a file titled `title`.

    With `focus` (the `"focused"` executor), when some sentence of the sources holds every content word of
    the title (the title names something they mention: "Orlen Vask", "Kestrel Institute"), the text is
    *focused*: every such sentence, over all sources, in source order, each source that has one a block, under
    `max_words` in all ("Orlen Vask" keeps the sentences naming Orlen Vask, not those naming a look-alike
    "Orlen Vasko"); with `keep` too, only those of them `keep(sentence)` accepts (the `"statements"`
    executor: the ones stating a fact). Otherwise (without `focus`, or a title like "Notes, part 1" that names
    nothing in them) each source gets an even share of the budget: its lead sentence, then the sentences
    sharing most content words with the title and instructions."""
    query = content_words(title + " " + (instructions or ""))
    lines = [title.strip() or "Untitled"]
    sources = [(p, t) for p, t in sources if t and t.strip()]
    if not sources:
        return lines[0]
    named = content_words(title) if focus else set()
    focused = [(p, [x for x in split_sentences(t) if named and named <= content_words(x)
                    and (keep is None or keep(x))]) for p, t in sources]
    if any(kept for _, kept in focused):
        words = 0
        for path, kept in focused:
            if not kept or words >= max_words:
                continue
            body = " ".join(kept).split()[: max_words - words]
            words += len(body)
            lines.append(f"From {path}: {' '.join(body)}{' ...' if words >= max_words else ''}")
        return "\n".join(lines)
    budget = max(12, max_words // len(sources))
    for path, text in sources:
        sents = split_sentences(text)
        if not sents:
            continue
        scored = sorted(range(len(sents)), key=lambda i: (-len(query & content_words(sents[i])), i))
        chosen = {0}
        words = len(sents[0].split())
        for i in scored:
            if words >= budget:
                break
            if i in chosen:
                continue
            n = len(sents[i].split())
            if words + n > budget and len(chosen) > 0:
                continue
            chosen.add(i)
            words += n
        body = " ".join(sents[i] for i in sorted(chosen))
        body_words = body.split()
        if len(body_words) > budget:
            body = " ".join(body_words[:budget]) + " ..."
        lines.append(f"From {path}: {body}")
    return "\n".join(lines)


def given(text: str) -> AgentGen:
    """Generator (it never yields): the text a builder wrote itself (`BuilderConfig.write_text`), cleaned as
    an executor's is; it costs no executor token."""
    if False:  # pragma: no cover - makes this a generator, like `write`
        yield None
    return ExecutorOutput(clean_content(text))


def write(
    ctx: AgentContext | None,
    title: str,
    instructions: str,
    sources: Sequence[tuple[str, str]],
    excerpt_text: str,
    *,
    kind: str = "extractive",
    max_new_tokens: int = 512,
    max_words: int = 360,
) -> AgentGen:
    """Generator returning the `ExecutorOutput` for one create/merge.

    Args:
      ctx: agent context (needed for `kind="model"`).
      title, instructions: the builder's arguments.
      sources: (path, excerpt text) per source, for the extractive executor.
      excerpt_text: the rendered excerpts the model executor reads (workspace.source_excerpts text).
      kind: `"model"`, `"extractive"`, `"focused"` (extractive, focused on what the title names) or
        `"statements"` (focused, on the sentences stating something about it).
    """
    if kind in _EXTRACTIVE:
        focus, keep = _EXTRACTIVE[kind]
        return ExecutorOutput(clean_content(extractive_text(title, instructions, sources, max_words=max_words,
                                                            focus=focus, keep=keep)))
    if kind != "model":
        raise ValueError(f"executor kind must be one of {EXECUTOR_KINDS}, got {kind!r}")
    if ctx is None:
        raise ValueError("the model executor needs an AgentContext")
    tpl = ctx.template_for(EXECUTOR)
    user = prompt_text.render(
        "executor", title=title, instructions=instructions or "(none)", excerpts=excerpt_text
    )
    prompt = (
        tpl.start(prompt_text.render("executor_system")) + tpl.turn("user", user) + tpl.open_turn("assistant")
    )
    log = SessionLog(ctx, EXECUTOR, prompt)
    try:
        result = yield from log.generate(max_new_tokens, Sampling(temperature=0.0, seed=0))
        text = ctx.decode_new(result.tokens).strip()
    finally:
        log.close()
    text = clean_content(text).strip()
    if not text:
        return ExecutorOutput(
            clean_content(extractive_text(title, instructions, sources, max_words=max_words)),
            len(prompt),
            len(result.tokens),
            fallback=True,
        )
    return ExecutorOutput(text, len(prompt), len(result.tokens))
