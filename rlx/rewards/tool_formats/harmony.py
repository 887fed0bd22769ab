"""gpt-oss tool calls in OpenAI's harmony format.

A harmony turn is a run of messages, each `<|start|>ROLE HEADER<|message|>BODY` ended by
`<|end|>`, `<|call|>` or `<|return|>`; the first one the model writes has no `<|start|>ROLE`
(the generation prompt holds `<|start|>assistant`), and a turn cut at a stop token may lack its
last end token. A message whose header names a recipient is a call:

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(the recipient may also stand in the role part, `<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`). The call's name is the recipient without the
`functions.` namespace (a built-in tool's, e.g. `browser.search`, stays whole); its body must be
a JSON object, else the call is a `ToolCallError`. Messages without a recipient (the analysis,
commentary and final channels) are outside text: their bodies, joined by newlines.

Tool results: gpt-oss's chat template renders a tool message as `<|start|>functions.NAME
to=assistant<|channel|>commentary<|message|>...<|end|>`, taking NAME from the previous assistant
message's structured `tool_calls`, which rlx's text transcripts do not carry; so tool-use
episodes (`renders_tool_turns`) are refused for this format, while single-turn calls
(`rlx.rewards.bfcl`) are parsed and graded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rlx.rewards.tool_formats.base import Item, ToolCallError, ToolFormat, call_of, load_json

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_END = re.compile("|".join(map(re.escape, ENDS)))

PREAMBLE = (
    "You can call functions to help with the task. Their signatures are these JSON schemas:\n"
    "{tools}\n"
    "To call a function, write a commentary message to it: " + CHANNEL
    + "commentary to=functions.<function-name> " + CONSTRAIN + "json" + MESSAGE
    + "<args-json-object><|call|>. Results come back as messages from the function."
)


def _messages(text: str) -> list[tuple[str, str]]:
    """(header, body) of every message of a turn; text outside any message is a body with an
    empty header."""
    out = []
    for chunk in text.split(START):
        while chunk:
            header, sep, rest = chunk.partition(MESSAGE)
            if not sep:
                out.append(("", header))
                break
            end = _END.search(rest)
            out.append((header, rest[:end.start()] if end else rest))
            chunk = rest[end.end():] if end else ""
    return out


def _call(recipient: str, body: str) -> Item:
    name = recipient.removeprefix("functions.")
    value = load_json(body)
    if isinstance(value, ToolCallError):
        return ToolCallError(f"call of {name!r}: {value.message}", body)
    return call_of(name, value, body)


def parse(text: str) -> tuple[list[Item], str]:
    """The calls of a harmony turn (see the module docstring) and the text outside them."""
    items: list[Item] = []
    outside: list[str] = []
    for header, body in _messages(text):
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1) != "assistant":
            items.append(_call(recipient.group(1), body))
        elif body.strip():
            outside.append(body.strip())
    return items, "\n".join(outside)


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as gpt-oss writes it after its generation prompt (`<|start|>assistant`)."""
    return (f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"
            f"{json.dumps(dict(arguments))}<|call|>")


FORMAT = ToolFormat(name="harmony", markers=(CHANNEL, CONSTRAIN), parse=parse,
                    render_call=render_call, preamble=PREAMBLE, renders_tool_turns=False)

__all__ = ["FORMAT", "PREAMBLE", "parse", "render_call"]
