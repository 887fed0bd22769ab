"""The tool-call parser for environments; it lives in `rlx.rewards.tool_calls` (the call reward
grades the same calls) and is re-exported here."""

from __future__ import annotations

from rlx.rewards.tool_calls import (CLOSE, OPEN, ParsedTurn, ToolCall, ToolCallError, parse_block,
                                    parse_block_calls, parse_tool_calls)

__all__ = ["CLOSE", "OPEN", "ParsedTurn", "ToolCall", "ToolCallError", "parse_block",
           "parse_block_calls", "parse_tool_calls"]
