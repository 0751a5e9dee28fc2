"""Chat templates that produce token ids directly: ChatML (Qwen), Gemma, and Llama 3.

    chatml:  [BOS if the tokenizer adds one]<|im_start|>system\\n{system}<|im_end|>\\n
             <|im_start|>{role}\\n{content}<|im_end|>\\n ...   (roles system/user/assistant; a "tool" turn is
             written as Qwen's template writes a tool result:
             <|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n)
    gemma:   <bos><start_of_turn>user\\n{content}<end_of_turn>\\n
             <start_of_turn>model\\n{content}<end_of_turn>\\n ...   (roles user/model; "assistant" -> "model",
             "tool" -> "user"; content stripped of surrounding whitespace, as Gemma's own template does).
             Gemma has no system role: by default the system prompt is a user turn of its own right after
             BOS; with `fold_system=True` it is folded into the first turn as `{system}\\n\\n{content}`,
             exactly as Gemma's template does.
    llama3:  <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|> ...
             (roles system/user/assistant, "tool" -> "ipython"; content stripped, as Llama's template does;
             the date lines Llama 3.1+'s template adds to the system turn are not added)

Every piece of a conversation is encoded once, where it enters the conversation; a turn boundary is always an
atomic turn marker, so the ids built turn by turn equal `tokenizer.encode(template.render(messages))`. Model
output is appended as the sampled ids between `open_turn` and `close_turn`, never decoded and re-encoded.

A ChatTemplate is stateless: one serves every conversation at once, and `start()`'s ids can be reused (a
compacted history starts again from them). With `fold_system=True` (Gemma) the system prompt has no turn of
its own, so `start(system)` returns a `FoldedStart`: a list of the start ids (BOS) that also carries the
system prompt, and `start(system) + turn(role, content)` (or `+ open_turn(role)`) folds it into that turn.
The fold lives in the value, never in the template, so concurrent conversations cannot take each other's
system prompt. Adding anything but a turn of the same template to a `FoldedStart` raises ValueError (the
system prompt would be lost silently). `turn(..., system=...)` / `open_turn(..., system=...)` fold
explicitly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from librarian_jax.tokenizers.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class _Style:
    markers: tuple[str, ...]  # atomic tokens the vocabulary must have (detection looks for these)
    open: str  # text that opens a turn, formatted with {role}
    close: str  # text that closes a turn; starts with the end-of-turn token
    roles: dict[str, str]  # accepted role -> role as written
    assistant: str  # the role a model's own turns are written with
    has_system: bool  # whether the style has a system role (Gemma does not)
    trim: bool  # whether turn content is stripped of surrounding whitespace
    extra_stops: tuple[str, ...] = ()  # more tokens that end a generated turn, when the vocab has them


_STYLES: dict[str, _Style] = {
    "chatml": _Style(
        markers=("<|im_start|>", "<|im_end|>"),
        open="<|im_start|>{role}\n",
        close="<|im_end|>\n",
        roles={"system": "system", "user": "user", "assistant": "assistant", "tool": "user"},
        assistant="assistant",
        has_system=True,
        trim=False,
        extra_stops=("<|endoftext|>",),  # Qwen base models end documents with it
    ),
    "qwen3_5": _Style(
        markers=("<|im_start|>", "<|im_end|>"),
        open="<|im_start|>{role}\n",
        close="<|im_end|>\n",
        roles={"system": "system", "user": "user", "assistant": "assistant", "tool": "user"},
        assistant="assistant",
        has_system=True,
        trim=True,
        extra_stops=("<|endoftext|>",),
    ),
    "gemma": _Style(
        markers=("<start_of_turn>", "<end_of_turn>"),
        open="<start_of_turn>{role}\n",
        close="<end_of_turn>\n",
        roles={"user": "user", "model": "model", "assistant": "model", "tool": "user"},
        assistant="model",
        has_system=False,
        trim=True,
    ),
    "llama3": _Style(
        markers=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        open="<|start_header_id|>{role}<|end_header_id|>\n\n",
        close="<|eot_id|>",
        roles={"system": "system", "user": "user", "assistant": "assistant", "tool": "ipython"},
        assistant="assistant",
        has_system=True,
        trim=True,
        extra_stops=("<|eom_id|>",),
    ),
}
STYLES = tuple(_STYLES)


class TurnIds(list):
    """The ids of one turn (`turn` / `open_turn` of a `fold_system` template) that can be rebuilt with a
    system prompt folded in; otherwise a plain list of ids."""

    def __init__(self, ids: Sequence[int], refold: Callable[[str], list[int]]):
        super().__init__(ids)
        self.refold = refold


class FoldedStart(list):
    """`ChatTemplate.start(system)` of a `fold_system` template: the start ids, plus the system prompt that
    `+ template.turn(...)` / `+ template.open_turn(...)` folds into that turn (a plain list results)."""

    def __init__(self, ids: Sequence[int], system: str):
        super().__init__(ids)
        self.system = system

    def __add__(self, other: object) -> list[int]:  # type: ignore[override]
        if isinstance(other, list) and not other:
            return FoldedStart(self, self.system)  # nothing added: the system prompt still waits
        if not isinstance(other, TurnIds):
            raise ValueError(
                "a FoldedStart (start(system) of a fold_system template) must be followed by a turn() or "
                "open_turn() of the same template, which takes the system prompt; got "
                f"{type(other).__name__}"
            )
        return list(self) + other.refold(self.system)

    def __iadd__(self, other: object) -> list[int]:  # type: ignore[override,misc]
        return self.__add__(other)


class ChatTemplate:
    """Builds the ids of a conversation turn by turn for one tokenizer and style.

    Attributes:
      style: "chatml", "gemma" or "llama3".
      add_bos: whether `start()` begins with BOS.
      fold_system: (Gemma) whether the system prompt is folded into the first turn.
      stop_ids: ids that end a generated turn (the end-of-turn token first, then EOS and the like).
      open_marker, close_marker: the tokens that open and close a turn.
    """

    def __init__(
        self, tokenizer: Tokenizer, style: str, *, add_bos: bool | None = None, fold_system: bool = False,
        thinking: bool | None = None,
    ) -> None:
        if thinking is not None and style != "qwen3_5":
            raise ValueError(f"thinking= is a switch of the qwen3_5 template, not of {style!r}")
        if style not in _STYLES:
            raise ValueError(f"unknown chat template style {style!r}; expected one of {STYLES}")
        spec = _STYLES[style]
        if fold_system and spec.has_system:
            raise ValueError(f"fold_system=True is for styles without a system role (gemma), not {style!r}")
        atomic = tokenizer.atomic_tokens
        missing = [m for m in spec.markers if m not in atomic]
        if missing:
            raise ValueError(
                f"chat style {style!r} needs special tokens {missing} that {tokenizer.path} lacks (they must "
                "be added/special tokens or user-defined pieces, so text never merges across them)"
            )
        self.tokenizer = tokenizer
        self.style = style
        self.fold_system = fold_system
        self.thinking = (True if thinking is None else bool(thinking)) if style == "qwen3_5" else False
        # the role agents send tool results (observations) with
        self.observation_role = "tool" if style == "qwen3_5" else "user"
        self._spec = spec
        self.open_marker = spec.markers[0]
        self.close_marker = next(m for m in spec.markers if spec.close.startswith(m))
        if add_bos is None:
            add_bos = tokenizer.add_bos if style in ("chatml", "qwen3_5") else tokenizer.bos_id is not None
        if add_bos and tokenizer.bos_id is None:
            raise ValueError(f"add_bos=True but {tokenizer.path} has no BOS token")
        self.add_bos = add_bos
        end_id = atomic[self.close_marker]
        extra = [atomic.get(t) for t in spec.extra_stops] + [tokenizer.eos_id]
        more = [i for i in dict.fromkeys(extra) if i is not None and i != end_id]
        self.stop_ids: tuple[int, ...] = (end_id, *more)

    # ---- text pieces (each starts at an atomic token, so encoding them one by one is exact) --------------
    def _role(self, role: str) -> str:
        if role not in self._spec.roles:
            raise ValueError(f"unknown {self.style} role {role!r}; expected one of {tuple(self._spec.roles)}")
        return self._spec.roles[role]

    def _bos_text(self) -> str:
        if not self.add_bos:
            return ""
        assert self.tokenizer.bos_id is not None
        return self.tokenizer.id_to_token(self.tokenizer.bos_id)

    def _open_text(self, role: str, system: str | None = None) -> str:
        text = self._spec.open.format(role=self._role(role))
        if self.style == "qwen3_5" and role == "assistant":
            text += "<think>\n" if self.thinking else "<think>\n\n</think>\n\n"
        return text if system is None else text + system + "\n\n"

    def _turn_text(self, role: str, content: str, system: str | None = None) -> str:
        if self.style == "qwen3_5" and role == "assistant":  # a closed assistant turn after the query
            reasoning, content = _split_think(content.strip())
            return f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}{self._spec.close}"
        if self.style in ("chatml", "qwen3_5") and role == "tool":
            content = content.strip() if self._spec.trim else content
            content = f"<tool_response>\n{content}\n</tool_response>"
        elif self._spec.trim:
            content = content.strip()
        return self._open_text(role, system) + content + self._spec.close

    def _system_text(self, system: str) -> str:
        """The system prompt's own turn (a user turn where the style has no system role)."""
        return self._turn_text("system" if self._spec.has_system else "user", system)

    def _pieces(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> list[str]:
        system, rest = _split_system(messages)
        pieces = [self._bos_text()] if self.add_bos else []
        pending = None
        if system is not None:
            if self.fold_system:
                pending = system
            else:
                pieces.append(self._system_text(system))
        if self.style == "qwen3_5":
            return pieces + self._qwen3_5_pieces(rest, add_generation_prompt)
        for m in rest:
            pieces.append(self._turn_text(m["role"], m["content"], pending))
            pending = None
        if add_generation_prompt:
            pieces.append(self._open_text(self._spec.assistant, pending))
        return pieces

    def _qwen3_5_pieces(self, rest: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> list[str]:
        """Qwen3.5's template after the system turn: assistant turns after the last user query keep a think
        block, earlier ones lose it; consecutive tool results share one user turn."""
        last_query = -1
        for i, m in enumerate(rest):
            c = m["content"].strip()
            wrapped = c.startswith("<tool_response>") and c.endswith("</tool_response>")
            if m["role"] == "user" and not wrapped:
                last_query = i
        pieces: list[str] = []
        for i, m in enumerate(rest):
            role, content = m["role"], m["content"]
            if role == "assistant" and i < last_query:
                pieces.append(f"<|im_start|>assistant\n{_split_think(content.strip())[1]}{self._spec.close}")
            elif role == "tool" and i > 0 and rest[i - 1]["role"] == "tool":
                # joins the previous tool turn: reopen it by dropping that turn's close
                prev = pieces.pop()
                body = f"\n<tool_response>\n{content.strip()}\n</tool_response>"
                pieces.append(prev[: -len(self._spec.close)] + body + self._spec.close)
            else:
                pieces.append(self._turn_text(role, content))
        if add_generation_prompt:
            pieces.append(self._open_text(self._spec.assistant))
        return pieces

    # ---- ids -----------------------------------------------------------------------------------------------
    def start(self, system: str | None = None) -> list[int]:
        """Ids that begin a conversation: BOS (when the model uses one) and the system prompt's turn.

        With `fold_system=True` (Gemma) and a system prompt, a `FoldedStart` (BOS only) that folds the system
        prompt into the turn added to it. Nothing is held by the template.
        """
        ids: list[int] = [self.tokenizer.bos_id] if self.add_bos else []  # type: ignore[list-item]
        if system is None:
            return ids
        if self.fold_system:
            return FoldedStart(ids, system)
        return ids + self.tokenizer.encode(self._system_text(system))

    def _ids(self, text_of: Callable[[str | None], str], system: str | None) -> list[int]:
        if system is not None:
            if self.fold_system:
                return self.tokenizer.encode(text_of(system))
            return self.tokenizer.encode(self._system_text(system)) + self.tokenizer.encode(text_of(None))
        ids = self.tokenizer.encode(text_of(None))
        if self.fold_system:
            return TurnIds(ids, lambda folded: self.tokenizer.encode(text_of(folded)))
        return ids

    def turn(self, role: str, content: str, *, system: str | None = None) -> list[int]:
        """A closed turn: its opening (marker and role), the content, and its closing. With `system`, the
        system prompt comes first: folded into this turn (`fold_system`) or as its own turn."""
        self._role(role)
        return self._ids(lambda sys: self._turn_text(role, content, sys), system)

    def turn_joined(self, role: str, head: str, tail: str) -> list[int]:
        """`turn(role, head + tail)`, the same ids, with the turn's text encoded by
        `Tokenizer.encode_joined` at the end of `head`: many turns that start alike (an answerer's first
        prompt for each of a corpus's questions) encode their common start once. A template that folds a
        system prompt into its first turn, or that changes the content (trimming it, wrapping a tool
        result), encodes the whole turn."""
        content = head + tail
        if self.fold_system:
            return self.turn(role, content)
        opening = self._open_text(role)
        text = self._turn_text(role, content)
        if not text.startswith(opening + content):
            return self.turn(role, content)
        self._role(role)
        cut = len(opening) + len(head)
        return self.tokenizer.encode_joined(text[:cut], text[cut:])

    def open_turn(self, role: str, *, system: str | None = None) -> list[int]:
        """The prefix a model continues from (e.g. `<|im_start|>assistant\\n`); `system` as in `turn`."""
        self._role(role)
        return self._ids(lambda sys: self._open_text(role, sys), system)

    def close_turn(self) -> list[int]:
        """Ids that close a turn opened with `open_turn`, after its content (e.g. `<|im_end|>\\n`)."""
        return self.tokenizer.encode(self._spec.close)

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text (`messages`: dicts with "role" and "content", system first if any)."""
        return "".join(self._pieces(messages, add_generation_prompt))

    def encode_messages(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False
    ) -> list[int]:
        """The ids of `render(messages)`, built turn by turn."""
        ids: list[int] = []
        for piece in self._pieces(messages, add_generation_prompt):
            ids += self.tokenizer.encode(piece)
        return ids

    def __repr__(self) -> str:
        return (
            f"ChatTemplate(style={self.style!r}, add_bos={self.add_bos}, fold_system={self.fold_system}, "
            f"stop_ids={self.stop_ids})"
        )


def _split_think(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message as Qwen3.5's template splits it at `</think>`."""
    if "</think>" not in content:
        return "", content
    head = content.split("</think>")[0]
    tail = content.split("</think>")[-1]
    return head.rstrip("\n").split("<think>")[-1].lstrip("\n").strip(), tail.lstrip("\n")


def _split_system(messages: Sequence[Mapping[str, str]]) -> tuple[str | None, list[Mapping[str, str]]]:
    for k, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"message {k} needs 'role' and 'content' keys, got {sorted(m)}")
        if m["role"] == "system" and k > 0:
            raise ValueError(f"message {k}: a system message may only come first")
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], list(messages[1:])
    return None, list(messages)


def detect_style(tokenizer: Tokenizer) -> str:
    """The chat style whose turn markers the vocabulary has (checked in the order of STYLES)."""
    atomic = tokenizer.atomic_tokens
    for style, spec in _STYLES.items():
        if all(m in atomic for m in spec.markers):
            return style
    wanted = "; ".join(f"{s}: {list(spec.markers)}" for s, spec in _STYLES.items())
    raise ValueError(
        f"cannot detect a chat style for {tokenizer.path}: it has the turn markers of none of ({wanted}); "
        "pass style= explicitly after adding the markers"
    )


def chat_template(
    tokenizer: Tokenizer, style: str | None = None, *, add_bos: bool | None = None, fold_system: bool = False,
    thinking: bool | None = None,
) -> ChatTemplate:
    """A ChatTemplate for `tokenizer`; `style` is one of STYLES, or None to detect it from the vocab
    (detection never picks "qwen3_5": a Qwen3.5 vocabulary looks like ChatML, so ask for it).

    `add_bos` defaults to `tokenizer.add_bos` for ChatML (Qwen has no BOS) and to True otherwise.
    `fold_system` (Gemma only) folds the system prompt into the first turn; see the module docstring.
    `thinking` (qwen3_5 only; default True as the checkpoint's template) opens assistant turns with an open
    think block, or with an empty closed one when False.
    """
    return ChatTemplate(tokenizer, style or detect_style(tokenizer), add_bos=add_bos, fold_system=fold_system,
                        thinking=thinking)
