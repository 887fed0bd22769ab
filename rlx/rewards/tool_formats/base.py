"""What every tool-call format produces and is: the parsed-call records (`ToolCall`,
`ToolCallError`, `ParsedTurn`), the record of one format (`ToolFormat`), and the JSON helpers the
formats share. Nothing here knows a format's syntax."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

_MAX_ERROR_SNIPPET = 200


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call (arguments not yet checked against the tool's schema)."""

    name: str
    arguments: Mapping[str, Any]
    raw: str


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the model tried to make that is not usable, with the reason."""

    message: str
    raw: str


Item = ToolCall | ToolCallError


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """The calls of one assistant turn, in order, and the text outside them."""

    items: tuple[Item, ...]
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


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format: how its models write calls and how rlx shows tools.

    ``parse(text)`` returns a turn's calls and errors in order and the text outside them; it never
    raises on model text. ``render_call(name, arguments)`` writes one call as the family's model
    writes it (worked examples in the prompt). ``preamble`` offers tools to a chat template that
    cannot render them itself (``{tools}``: one JSON spec a line), in the format's own syntax.
    """

    name: str
    # substrings of a chat template that mark the family's template (any one suffices)
    markers: tuple[str, ...]
    parse: Callable[[str], tuple[list[Item], str]]
    render_call: Callable[[str, Mapping[str, Any]], str]
    preamble: str
    # tool results go into <tool_response> tags unless the chat template writes them (Hermes);
    # False: the template renders a tool message in the family's own tokens
    wraps_results: bool = False
    # rlx can render tool turns with the family's template from text transcripts; False: the
    # template needs the previous assistant turn's structured tool calls (harmony)
    renders_tool_turns: bool = True


def snippet(text: str) -> str:
    """At most 200 characters of ``text``, for an error message."""
    text = text.strip()
    return text if len(text) <= _MAX_ERROR_SNIPPET else text[:_MAX_ERROR_SNIPPET] + "..."


def _json_problem(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return error.msg
    if isinstance(error, RecursionError):
        return "too deeply nested"
    return str(error).split(":")[0]  # "Exceeds the limit (4300 digits) for integer string ..."


def load_json(body: str) -> Any | ToolCallError:
    """``body`` as JSON, or the error naming why it is not."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        return ToolCallError(f"tool call is not valid JSON ({_json_problem(e)}): "
                             f"{snippet(body)}", body)


def call_of(name: Any, arguments: Any, raw: str) -> Item:
    """A call of ``name`` with ``arguments`` (an object, or a JSON string holding one, as some
    models write), or the error naming what is wrong."""
    if not isinstance(name, str) or not name:
        return ToolCallError("tool call has no \"name\" string", raw)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f"\"arguments\" of {name!r} must be a JSON object", raw)
    return ToolCall(name, arguments, raw)


def object_call(value: Any, raw: str, arguments_key: str = "arguments") -> Item:
    """A call from a JSON object ``{"name": ..., arguments_key: {...}}`` (a missing arguments
    key means no arguments), or the error naming what is wrong."""
    if not isinstance(value, dict):
        return ToolCallError(f"tool call must be a JSON object with \"name\" and "
                             f"\"{arguments_key}\"", raw)
    return call_of(value.get("name"), value.get(arguments_key, {}), raw)


__all__ = ["Item", "ParsedTurn", "ToolCall", "ToolCallError", "ToolFormat", "call_of",
           "load_json", "object_call", "snippet"]
