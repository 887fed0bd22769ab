"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (Meta's "JSON based tool calling").

The model answers a call with nothing but JSON, `{"name": "...", "parameters": {...}}`,
possibly after the `<|python_tag|>` token (and ended by `<|eom_id|>` or `<|eot_id|>`); several
calls in one turn are separated by ";" (or whitespace). "arguments" is read where "parameters"
is missing, and a missing one means no arguments.

A turn is a call attempt when it holds `<|python_tag|>` (the text before it is outside text) or
when it starts with a JSON object whose first key is "name"; any other turn is an answer. Within
an attempt each object becomes a `ToolCall` or a `ToolCallError` (bad JSON, not an object, no
"name" string, parameters that are not an object); text after the last object is outside text.

Tool results go back as `tool` messages, which Llama's template renders in its own `ipython`
turns (never wrapped in `<tool_response>`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rlx.rewards.tool_formats.base import Item, ToolCallError, ToolFormat, object_call, snippet

PYTHON_TAG = "<|python_tag|>"
_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")
_STARTS_CALL = re.compile(r'\A\s*\{\s*"name"\s*:')
_SEPARATORS = " \t\r\n;"

PREAMBLE = (
    "You can call functions to help with the task. Their signatures are these JSON schemas:\n"
    "{tools}\n"
    "To call a function, respond with only a JSON object in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}; '
    "separate several calls with \";\". Results come back in the next turn."
)


def _objects(body: str) -> tuple[list[Item], str]:
    """The JSON objects at the start of ``body`` (separated by ";" or whitespace) as calls, and
    the text after the last one."""
    decoder, items, position = json.JSONDecoder(), [], 0
    while True:
        after = position  # the text after the last object, separators included
        while position < len(body) and body[position] in _SEPARATORS:
            position += 1
        if position == len(body) or (items and body[position] != "{"):
            return items, body[after:] if position < len(body) else ""
        try:
            value, end = decoder.raw_decode(body, position)
        except (ValueError, RecursionError) as e:
            problem = e.msg if isinstance(e, json.JSONDecodeError) else "too deeply nested"
            rest = body[position:]
            items.append(ToolCallError(f"tool call is not valid JSON ({problem}): "
                                       f"{snippet(rest)}", rest))
            return items, ""
        raw = body[position:end]
        key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        items.append(object_call(value, raw, key))
        position = end


def parse(text: str) -> tuple[list[Item], str]:
    """The calls of a Llama turn (see the module docstring) and the text outside them."""
    for token in _END_TOKENS:
        text = text.replace(token, "")
    if PYTHON_TAG in text:
        before, _, body = text.partition(PYTHON_TAG)
        items, after = _objects(body)
        if not items:
            items = [ToolCallError(f"{PYTHON_TAG} is not followed by a JSON call: "
                                   f"{snippet(body)}", body)]
        return items, before + after
    if not _STARTS_CALL.match(text):
        return [], text
    return _objects(text)


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as Llama 3.1's template writes an assistant's tool call."""
    return json.dumps({"name": name, "parameters": dict(arguments)})


FORMAT = ToolFormat(name="llama3_json", markers=(PYTHON_TAG, "<|start_header_id|>ipython"),
                    parse=parse, render_call=render_call, preamble=PREAMBLE)

__all__ = ["FORMAT", "PREAMBLE", "PYTHON_TAG", "parse", "render_call"]
