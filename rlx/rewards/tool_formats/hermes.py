"""Hermes / Qwen tool calls (Qwen2.5, Qwen3, Hermes, and rlx's own preamble for templates that
cannot render tools, e.g. SmolLM2's).

A call is a block `<tool_call>{"name": "...", "arguments": {...}}</tool_call>` (whitespace
around the JSON allowed); a turn may hold several, with text around them. Each block becomes a
`ToolCall` or, when it cannot be used, a `ToolCallError`, in the order they appear: bad JSON, a
JSON value that is not an object, a missing or non-string "name", "arguments" that is not an
object (a JSON string holding an object is accepted, as some models write that), and a block
opened but never closed. A missing "arguments" means no arguments.

Other shapes models write are accepted too:
- a JSON list of calls in one block (`<tool_call>[{"name": ...}, {...}]</tool_call>`, the format
  SmolLM2 was tuned on): one item per call, in order;
- OpenAI-style objects, `{"type": "function", "function": {"name": ..., "arguments": "<JSON
  string>"}}`, in a block or a list;
- without any `<tool_call>` block, a turn that is nothing but such JSON (an object with "name"
  and "arguments", a list of them, or `{"tool_calls": [...]}`, optionally in a ```json fence).
  Any other text is an answer, not a call.

Tool results go back as `tool` messages; a chat template that does not write
`<tool_response>` itself (ChatML, SmolLM2) gets them already wrapped in it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rlx.rewards.tool_formats.base import Item, ToolCallError, ToolFormat, load_json, \
    object_call, snippet

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)

PREAMBLE = (
    "You can call functions to help with the task. Their signatures are the JSON schemas "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags, one call per block:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
    "Results come back inside <tool_response></tool_response> tags."
)


def _call(value: Any, raw: str) -> Item:
    if isinstance(value, dict) and isinstance(value.get("function"), dict):  # OpenAI style
        value = value["function"]
    return object_call(value, raw)


def parse_block(body: str) -> Item:
    """One block's content as a call or an error (the first call of a list)."""
    return parse_block_calls(body)[0]


def parse_block_calls(body: str) -> list[Item]:
    """One block's content as calls or errors: one object, or a non-empty list of them."""
    value = load_json(body)
    if isinstance(value, ToolCallError):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_call(v, json.dumps(v)) for v in value]
    return [_call(value, body)]


def _bare_calls(text: str) -> list[Item]:
    """The OpenAI-style fallback: the whole turn is call JSON (else no calls)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1) if fenced else body
    if not body.startswith(("{", "[")):
        return []
    value = load_json(body)
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    values = value if isinstance(value, list) else [value]
    looks = lambda v: isinstance(v, dict) and (  # noqa: E731
        "name" in v and "arguments" in v or isinstance(v.get("function"), dict))
    if not values or not all(looks(v) for v in values):
        return []
    return [_call(v, json.dumps(v)) for v in values]


def parse(text: str) -> tuple[list[Item], str]:
    """Every `<tool_call>` block of ``text`` (or, without blocks, a turn that is only call
    JSON) and the text outside the blocks."""
    items: list[Item] = []
    outside: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        outside.append(text[position:match.start()])
        position = match.end()
        body = match.group(1)
        if not match.group(0).endswith(CLOSE):
            items.append(ToolCallError(f"unterminated {OPEN} block: {snippet(body)}", body))
        else:
            items += parse_block_calls(body)
    outside.append(text[position:])
    if not items and (items := _bare_calls(text)):
        outside = []
    return items, "".join(outside)


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A block as Qwen's template writes an assistant's tool call."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{CLOSE}"


FORMAT = ToolFormat(name="hermes", markers=(OPEN,), parse=parse, render_call=render_call,
                    preamble=PREAMBLE, wraps_results=True)

__all__ = ["CLOSE", "FORMAT", "OPEN", "PREAMBLE", "parse", "parse_block", "parse_block_calls",
           "render_call"]
