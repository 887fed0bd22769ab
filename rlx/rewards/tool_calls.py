"""Tool calls in assistant text, for tool environments and the call reward (`rlx.rewards.bfcl`):
``parse_tool_calls(text, max_calls, tool_format)`` reads one turn in a model family's format
(``rlx.rewards.tool_formats``: ``hermes`` by default, ``llama3_json``, ``deepseek_v3``,
``harmony``).

Every call the turn tries to make becomes a `ToolCall` or, when it cannot be used, a
`ToolCallError` with a message for the model, in the order they appear; calls beyond
``max_calls`` are errors too. The parser never raises on model text. Each format's module says
which shapes it reads and which it refuses.
"""

from __future__ import annotations

from rlx.rewards.tool_formats import DEFAULT, FORMATS, detect_format, get_format
from rlx.rewards.tool_formats.base import ParsedTurn, ToolCall, ToolCallError
from rlx.rewards.tool_formats.hermes import CLOSE, OPEN, parse_block, parse_block_calls


def parse_tool_calls(text: str, max_calls: int = 8, tool_format: str = DEFAULT) -> ParsedTurn:
    """The calls of one assistant turn in ``tool_format`` and the text outside them."""
    items, outside = get_format(tool_format).parse(text)
    if len(items) > max_calls:
        items[max_calls:] = [ToolCallError(f"more than {max_calls} tool calls in one turn", i.raw)
                             for i in items[max_calls:]]
    return ParsedTurn(tuple(items), outside)


__all__ = ["CLOSE", "FORMATS", "OPEN", "ParsedTurn", "ToolCall", "ToolCallError",
           "detect_format", "get_format", "parse_block", "parse_block_calls", "parse_tool_calls"]
