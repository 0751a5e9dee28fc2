"""The one tool-call protocol every agent (builder, answerer) and every model family uses.

Convention (Qwen's): a model calls tools by writing, anywhere in its reply, one or more blocks

    <tool_call>{"name": "read_file", "arguments": {"path": "raw_docs/raw_0001__a.txt"}}</tool_call>

Several blocks in one reply are several calls, run in order. Text outside the blocks is free reasoning and is
ignored, and so are blocks inside `<think>...</think>` reasoning spans (Qwen3 style, see `strip_thinking`).
Parsing works on the TEXT decoded from the newly generated ids only; the ids themselves stay exactly as
sampled in the training record (nothing is decoded and re-encoded into the history).

Parsing is total: any string (random bytes, truncated JSON, huge arguments, unknown tools, wrong argument
types) gives a `ParsedTurn`; nothing raises. Each malformed call becomes a `CallError` with one of the codes

    no_tool_call          the reply holds no <tool_call> block at all (and the agent needed one)
    unterminated_call     a <tool_call> opened and never closed (e.g. the turn hit its token budget)
    call_too_large        the block is longer than `max_call_chars`
    invalid_json          the block is not one JSON value (trailing text, truncation, bad escapes, too deep)
    invalid_call          the JSON is not an object with a string "name" and an object "arguments"
    unknown_tool          "name" is not one of the agent's tools
    missing_argument      a required argument is absent
    unknown_argument      an argument the tool does not take
    invalid_argument_type an argument of the wrong type (or out of range)
    too_many_calls        calls beyond `max_calls` in one reply (they are not run)

and is rendered back to the model as an observation naming the code, what was wrong and the tool's
signature. Every malformed call costs `ProtocolConfig.malformed_penalty` (0.05 by default) on that turn's
reward. Errors raised by a *valid* call against the workspace (a missing path...) are ordinary observations
and cost nothing.

Lenient, documented coercions (the only ones): `"arguments"` may be a JSON string holding the object
(OpenAI style) and may be left out for a call without arguments (`{"name": "stop"}`); an `int` argument
accepts an integral float or a string of at most 12 ASCII digits; a `list[str]` argument accepts a single
string as a one-element list; an optional argument given as null takes its default. Nothing else is
guessed: an `"arguments"` string that is not valid JSON is `invalid_json`, and `"arguments"` that is not an
object (null, `""`, a list, a JSON string holding a list) is `invalid_call`, so a broken call is never run
as a different one (a truncated `list_files` never lists the root, a garbled `stop` is never a free stop).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_TYPES = ("str", "int", "list[str]")
_MAX_JSON_DEPTH = 32
_MAX_INT = 2**53  # an int argument beyond this is out of range (as an integral float beyond it is)
_INT_TEXT = re.compile(r"\s*-?[0-9]{1,12}\s*", re.ASCII)  # ASCII digits only: never "²" or "٣"


@dataclasses.dataclass(frozen=True)
class Param:
    """One tool argument: `type` is `"str" | "int" | "list[str]"`; `required=False` uses `default`.

    `min_value`/`max_value` bound ints; `max_items` bounds lists; `max_chars` bounds strings (and each item).
    """

    name: str
    type: str
    required: bool = True
    default: Any = None
    description: str = ""
    min_value: int | None = None
    max_value: int | None = None
    max_items: int = 64
    max_chars: int = 4000

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise ValueError(f"Param {self.name!r}: type {self.type!r} is not one of {_TYPES}")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool's name, arguments and one-line description (rendered into the system prompt)."""

    name: str
    params: tuple[Param, ...] = ()
    description: str = ""

    def signature(self) -> str:
        parts = []
        for p in self.params:
            parts.append(f"{p.name}: {p.type}" + ("" if p.required else f" = {json.dumps(p.default)}"))
        return f"{self.name}({', '.join(parts)})"


# The two read tools every agent shares (builder and answerer), defined once.
LIST_FILES_TOOL = ToolSpec(
    "list_files",
    (Param("path", "str", False, "."), Param("start", "int", False, 1, min_value=1)),
    "list a directory of the workspace (a long listing says which `start` entry to continue from)",
)
READ_FILE_TOOL = ToolSpec(
    "read_file",
    (
        Param("path", "str"),
        Param("start_line", "int", False, 1, min_value=1),
        Param("num_lines", "int", False, 100, min_value=1, max_value=100),
    ),
    "read up to 100 numbered lines of a file",
)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: validated, coerced arguments (every param present, defaults filled in)."""

    name: str
    arguments: dict[str, Any]
    index: int  # position among the reply's <tool_call> blocks

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "index": self.index}


@dataclasses.dataclass(frozen=True)
class CallError:
    """A malformed call: a code from the module docstring, a message for the model, the tool if known."""

    code: str
    message: str
    index: int
    tool: str | None = None
    raw: str = ""  # the block's text, cut to 200 chars (for records)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "index": self.index,
            "tool": self.tool,
            "raw": self.raw,
        }


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """Everything parsed out of one reply: valid calls and errors, both in reply order."""

    calls: tuple[ToolCall, ...]
    errors: tuple[CallError, ...]
    text: str

    @property
    def num_malformed(self) -> int:
        return len(self.errors)


@dataclasses.dataclass(frozen=True)
class ProtocolConfig:
    """Limits of the protocol. `malformed_penalty` is subtracted per malformed call."""

    malformed_penalty: float = 0.05
    max_calls: int = 8
    max_call_chars: int = 20_000
    require_call: bool = True  # a reply with no block at all is a `no_tool_call` error


def _json_depth_ok(s: str) -> bool:
    """Cheap pre-check so pathological nesting never reaches the JSON parser's recursion."""
    depth = 0
    in_str = False
    esc = False
    for ch in s:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > _MAX_JSON_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _coerce(param: Param, value: Any) -> tuple[Any, str | None]:
    """Returns (value, None) or (None, message)."""
    if value is None and not param.required:
        return param.default, None
    if param.type == "str":
        if not isinstance(value, str):
            return None, f"argument {param.name!r} must be a string, got {type(value).__name__}"
        if len(value) > param.max_chars:
            return None, f"argument {param.name!r} is {len(value)} chars; at most {param.max_chars}"
        return value, None
    if param.type == "int":
        out: int | None = None
        if isinstance(value, bool):
            out = None
        elif isinstance(value, int):
            out = value
        elif isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            out = int(value)
        elif isinstance(value, str) and _INT_TEXT.fullmatch(value):
            out = int(value)
        if out is None:
            return None, f"argument {param.name!r} must be an integer, got {type(value).__name__}"
        if abs(out) > _MAX_INT:
            return None, f"argument {param.name!r} is out of range (more than {_MAX_INT} in size)"
        if param.min_value is not None and out < param.min_value:
            return None, f"argument {param.name!r} = {out} is below {param.min_value}"
        if param.max_value is not None and out > param.max_value:
            return None, f"argument {param.name!r} = {out} is above {param.max_value}"
        return out, None
    # list[str]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None, f"argument {param.name!r} must be a list of strings"
    if len(value) > param.max_items:
        return None, f"argument {param.name!r} has {len(value)} items; at most {param.max_items}"
    if any(len(v) > param.max_chars for v in value):
        return None, f"argument {param.name!r} has an item longer than {param.max_chars} chars"
    return list(value), None


def _validate(spec: ToolSpec, args: dict[str, Any], index: int, raw: str) -> ToolCall | CallError:
    known = {p.name for p in spec.params}
    unknown = sorted(k for k in args if k not in known)
    if unknown:
        return CallError(
            "unknown_argument",
            f"{spec.name} takes no argument {unknown[0]!r}; signature: {spec.signature()}",
            index,
            spec.name,
            raw,
        )
    out: dict[str, Any] = {}
    for p in spec.params:
        if p.name not in args:
            if p.required:
                return CallError(
                    "missing_argument",
                    f"{spec.name} needs argument {p.name!r}; signature: {spec.signature()}",
                    index,
                    spec.name,
                    raw,
                )
            out[p.name] = p.default
            continue
        value, err = _coerce(p, args[p.name])
        if err is not None:
            return CallError(
                "invalid_argument_type",
                f"{spec.name}: {err}; signature: {spec.signature()}",
                index,
                spec.name,
                raw,
            )
        out[p.name] = value
    return ToolCall(spec.name, out, index)


def validate_arguments(spec: ToolSpec, arguments: dict[str, Any]) -> ToolCall | CallError:
    """One call's `arguments` checked and coerced exactly as a model's call of `spec` would be (defaults
    filled in): a `ToolCall`, or a `CallError` with the protocol's code and message. For other front ends to
    the same tools (the MCP server, `librarian_jax.serve`), so their limits and messages stay these."""
    return _validate(spec, arguments, 0, "")


def _parse_block(
    body: str, index: int, tools: dict[str, ToolSpec], cfg: ProtocolConfig
) -> ToolCall | CallError:
    raw = body[:200]
    if len(body) > cfg.max_call_chars:
        return CallError(
            "call_too_large",
            f"tool call {index} is {len(body)} chars; at most {cfg.max_call_chars}",
            index,
            None,
            raw,
        )
    s = body.strip()
    if not _json_depth_ok(s):
        return CallError(
            "invalid_json", f"tool call {index} nests JSON deeper than {_MAX_JSON_DEPTH}", index, None, raw
        )
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError) as e:
        return CallError(
            "invalid_json", f"tool call {index} is not valid JSON ({str(e)[:120]})", index, None, raw
        )
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError(
            "invalid_call",
            f'tool call {index} must be {{"name": <tool>, "arguments": {{...}}}}',
            index,
            None,
            raw,
        )
    name = obj["name"]
    extra = sorted(k for k in obj if k not in ("name", "arguments"))
    if extra:
        return CallError(
            "invalid_call",
            f'tool call {index} has unexpected key {extra[0][:50]!r}; only "name" and "arguments"',
            index,
            name[:50],
            raw,
        )
    spec = tools.get(name)
    if spec is None:
        return CallError(
            "unknown_tool",
            f"unknown tool {name[:80]!r}; tools: {', '.join(sorted(tools))}",
            index,
            name[:80],
            raw,
        )
    args = obj.get("arguments", {})
    if isinstance(args, str):
        if not _json_depth_ok(args):
            return CallError(
                "invalid_json",
                f'tool call {index}: "arguments" nests JSON deeper than {_MAX_JSON_DEPTH}',
                index,
                name,
                raw,
            )
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            return CallError(
                "invalid_json",
                f'tool call {index}: the "arguments" string is not valid JSON ({str(e)[:120]}); '
                f"signature: {spec.signature()}",
                index,
                name,
                raw,
            )
    if not isinstance(args, dict):
        return CallError(
            "invalid_call",
            f'tool call {index}: "arguments" must be an object; signature: {spec.signature()}',
            index,
            name,
            raw,
        )
    return _validate(spec, args, index, raw)


def strip_thinking(text: str) -> str:
    """`text` without its `<think>...</think>` spans (Qwen3-style reasoning): calls written while thinking are
    not calls. An unclosed `<think>` hides the rest of the reply; a stray `</think>` hides what precedes it
    (templates that open the think block in the prompt)."""
    if THINK_CLOSE in text and (THINK_OPEN not in text or text.find(THINK_CLOSE) < text.find(THINK_OPEN)):
        text = text[text.find(THINK_CLOSE) + len(THINK_CLOSE) :]
    out = []
    pos = 0
    while True:
        start = text.find(THINK_OPEN, pos)
        if start < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:
            break
        pos = end + len(THINK_CLOSE)
    return "".join(out)


def parse_tool_calls(
    text: str, tools: Sequence[ToolSpec] | dict[str, ToolSpec], config: ProtocolConfig | None = None
) -> ParsedTurn:
    """Parses every `<tool_call>` block of `text`. Total: never raises for any `str` input.

    Args:
      text: the decoded reply (only the newly generated ids).
      tools: the agent's tools.
      config: limits and whether a reply without any block is an error.
    """
    cfg = config or ProtocolConfig()
    table = tools if isinstance(tools, dict) else {t.name: t for t in tools}
    if not isinstance(text, str):  # defensive: bytes from a broken decoder
        text = (
            bytes(text).decode("utf-8", errors="replace")
            if isinstance(text, (bytes, bytearray))
            else str(text)
        )
    text = strip_thinking(text)
    calls: list[ToolCall] = []
    errors: list[CallError] = []
    pos = 0
    index = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            break
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            errors.append(
                CallError(
                    "unterminated_call",
                    f"tool call {index} opened with {TOOL_CALL_OPEN} but never closed with {TOOL_CALL_CLOSE}",
                    index,
                    None,
                    text[body_start : body_start + 200],
                )
            )
            index += 1
            break
        body = text[body_start:end]
        pos = end + len(TOOL_CALL_CLOSE)
        if index >= cfg.max_calls:
            errors.append(
                CallError(
                    "too_many_calls",
                    f"tool call {index} is beyond the limit of "
                    f"{cfg.max_calls} calls per reply; it was not run",
                    index,
                    None,
                    body[:200],
                )
            )
        else:
            result = _parse_block(body, index, table, cfg)
            (calls if isinstance(result, ToolCall) else errors).append(result)
        index += 1
    if index == 0 and cfg.require_call:
        errors.append(
            CallError(
                "no_tool_call",
                f"no {TOOL_CALL_OPEN} block found; call a tool as "
                f'{TOOL_CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}',
                0,
                None,
                text[:200],
            )
        )
    return ParsedTurn(tuple(calls), tuple(errors), text)


def format_call(name: str, arguments: dict[str, Any] | None = None) -> str:
    """The canonical text of one call (what a well-behaved model writes; used by prompts and test doubles)."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments or {}})}{TOOL_CALL_CLOSE}"


def render_tools(tools: Sequence[ToolSpec]) -> str:
    """One line per tool: signature and description (goes into system prompts)."""
    return "\n".join(f"- {t.signature()}: {t.description}" for t in tools)


def render_response(tool: str | None, ok: bool, body: str, code: str = "") -> str:
    """One observation block: a status line then the body."""
    status = "ok" if ok else f"error {code}"
    return f"{TOOL_RESPONSE_OPEN}\ntool: {tool or '?'} | status: {status}\n{body}\n{TOOL_RESPONSE_CLOSE}"


def render_error(err: CallError) -> str:
    return render_response(err.tool, False, err.message, err.code)


def turn_penalty(parsed: ParsedTurn, config: ProtocolConfig | None = None) -> float:
    """The (non-positive) reward term of one reply's malformed calls."""
    cfg = config or ProtocolConfig()
    return -cfg.malformed_penalty * parsed.num_malformed
