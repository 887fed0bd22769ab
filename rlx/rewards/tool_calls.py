"""Parser for Qwen/Hermes-format tool calls in assistant text (for tool environments and the call
reward, `rlx.rewards.bfcl`).

A call is a block `<tool_call>{"name": "...", "arguments": {...}}</tool_call>` (whitespace
around the JSON allowed); a turn may hold several. Each block becomes a `ToolCall` or, when it
cannot be used, a `ToolCallError` with a message for the model, in the order they appear:
bad JSON, a JSON value that is not an object, a missing or non-string "name", "arguments" that
is not an object (a JSON string holding an object is accepted, as some models write that), and
a block opened but never closed. A missing "arguments" means no arguments. Blocks beyond
`max_calls` are reported as errors. The parser never raises on model text.

Other shapes models write are accepted too:
- a JSON list of calls in one block (`<tool_call>[{"name": ...}, {...}]</tool_call>`, the format
  SmolLM2 was tuned on): one item per call, in order;
- OpenAI-style objects, `{"type": "function", "function": {"name": ..., "arguments": "<JSON
  string>"}}`, in a block or a list;
- without any `<tool_call>` block, a turn that is nothing but such JSON (an object with "name"
  and "arguments", a list of them, or `{"tool_calls": [...]}`, optionally in a ```json fence).
  Any other text is an answer, not a call.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
_MAX_ERROR_SNIPPET = 200


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call (arguments not yet checked against the tool's schema)."""

    name: str
    arguments: Mapping[str, Any]
    raw: str


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A block that is not a usable call, with the reason."""

    message: str
    raw: str


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """The calls of one assistant turn, in order, and the text outside the blocks."""

    items: tuple[ToolCall | ToolCallError, ...]
    text: str

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(i for i in self.items if isinstance(i, ToolCall))

    @property
    def errors(self) -> tuple[ToolCallError, ...]:
        return tuple(i for i in self.items if isinstance(i, ToolCallError))

    @property
    def has_tool_calls(self) -> bool:
        """Whether the turn tried to call anything (well-formed or not)."""
        return bool(self.items)


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _MAX_ERROR_SNIPPET else text[:_MAX_ERROR_SNIPPET] + "..."


def _json_problem(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return error.msg
    if isinstance(error, RecursionError):
        return "too deeply nested"
    return str(error).split(":")[0]  # "Exceeds the limit (4300 digits) for integer string ..."


def parse_block(body: str) -> ToolCall | ToolCallError:
    """One block's content as a call or an error (the first call of a list)."""
    return parse_block_calls(body)[0]


def parse_block_calls(body: str) -> list[ToolCall | ToolCallError]:
    """One block's content as calls or errors: one object, or a non-empty list of them."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:
        problem = _json_problem(e)
        return [ToolCallError(f"tool call is not valid JSON ({problem}): {_snippet(body)}", body)]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_call_of(v, json.dumps(v)) for v in value]
    return [_call_of(value, body)]


def _call_of(value: Any, body: str) -> ToolCall | ToolCallError:
    if isinstance(value, dict) and isinstance(value.get("function"), dict):  # OpenAI style
        value = value["function"]
    if not isinstance(value, dict):
        return ToolCallError("tool call must be a JSON object with \"name\" and \"arguments\"",
                             body)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("tool call has no \"name\" string", body)
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f"\"arguments\" of {name!r} must be a JSON object", body)
    return ToolCall(name, arguments, body)


def parse_tool_calls(text: str, max_calls: int = 8) -> ParsedTurn:
    """All tool-call blocks in `text` (or, without blocks, a turn that is only call JSON)."""
    items: list[ToolCall | ToolCallError] = []
    outside: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        outside.append(text[position:match.start()])
        position = match.end()
        body = match.group(1)
        if not match.group(0).endswith(CLOSE):
            items.append(ToolCallError(f"unterminated {OPEN} block: {_snippet(body)}", body))
        else:
            items += parse_block_calls(body)
    outside.append(text[position:])
    if not items:
        items = _bare_calls(text)
        outside = [] if items else outside
    if len(items) > max_calls:
        items[max_calls:] = [ToolCallError(f"more than {max_calls} tool calls in one turn", i.raw)
                             for i in items[max_calls:]]
    return ParsedTurn(tuple(items), "".join(outside))


_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)


def _bare_calls(text: str) -> list[ToolCall | ToolCallError]:
    """The OpenAI-style fallback: the whole turn is call JSON (else no calls)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1) if fenced else body
    if not body.startswith(("{", "[")):
        return []
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    values = value if isinstance(value, list) else [value]
    looks = lambda v: isinstance(v, dict) and (  # noqa: E731
        "name" in v and "arguments" in v or isinstance(v.get("function"), dict))
    if not values or not all(looks(v) for v in values):
        return []
    return [_call_of(v, json.dumps(v)) for v in values]


__all__ = ["CLOSE", "OPEN", "ParsedTurn", "ToolCall", "ToolCallError", "parse_block",
           "parse_block_calls", "parse_tool_calls"]
