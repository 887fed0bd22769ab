"""DeepSeek-V3 tool calls (DeepSeek-V3 / V3-0324 and R1's chat template; V3.1 writes calls
without the "function" type and the ```json fence, which this format reads as errors).

The model writes its calls in one section after any text:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

(one `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` per call, usually a newline between them; the
bars are U+FF5C, the spaces U+2581, as in DeepSeek's special tokens). Each call becomes a
`ToolCall` or a `ToolCallError`: a call without `<｜tool▁sep｜>`, a type other than "function", no
name, arguments outside a ```json fence, bad JSON or arguments that are not an object, and a
call begun but never ended. A section not closed before the text ends (generation stopped) still
yields its finished calls. The text before the section and after it is outside text.

Tool results go back as `tool` messages, which DeepSeek's template renders between its
`<｜tool▁outputs▁begin｜>` tokens (never wrapped in `<tool_response>`). The template does not
render a tools list, so rlx writes `PREAMBLE` (this syntax) into the system message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rlx.rewards.tool_formats.base import Item, ToolCallError, ToolFormat, call_of, load_json, \
    snippet

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.DOTALL)
_BODY = re.compile(r"\A\s*([^\n]*?)\s*\n```(?:json)?[ \t]*\n(.*?)\n?```\s*\Z", re.DOTALL)

PREAMBLE = (
    "You can call functions to help with the task. Their signatures are these JSON schemas:\n"
    "{tools}\n"
    "To call functions, write\n" + CALLS_BEGIN + CALL_BEGIN + "function" + SEP
    + "<function-name>\n```json\n<args-json-object>\n```" + CALL_END + CALLS_END
    + "\nwith one " + CALL_BEGIN + "..." + CALL_END + " per call. Results come back as tool "
    "outputs."
)


def _one(body: str) -> Item:
    kind, sep, rest = body.partition(SEP)
    if not sep:
        return ToolCallError(f"tool call has no {SEP} between its type and name: "
                             f"{snippet(body)}", body)
    if kind.strip() != "function":
        return ToolCallError(f"tool call type must be \"function\", got {snippet(kind)!r}", body)
    match = _BODY.match(rest)
    if not match:
        return ToolCallError("tool call must be NAME, a newline and its arguments in a ```json "
                             f"fence: {snippet(rest)}", body)
    arguments = load_json(match.group(2))
    if isinstance(arguments, ToolCallError):
        return ToolCallError(arguments.message, body)
    return call_of(match.group(1), arguments, body)


def parse(text: str) -> tuple[list[Item], str]:
    """The calls of a DeepSeek-V3 turn (see the module docstring) and the text outside them."""
    before, begun, section = text.partition(CALLS_BEGIN)
    if not begun:
        return [], text
    section, _, after = section.partition(CALLS_END)
    items: list[Item] = []
    for match in _CALL.finditer(section):
        if match.group(0).endswith(CALL_END):
            items.append(_one(match.group(1)))
        else:
            items.append(ToolCallError(f"unterminated tool call: {snippet(match.group(1))}",
                                       match.group(1)))
    if not items:
        items = [ToolCallError(f"{CALLS_BEGIN} holds no {CALL_BEGIN}: {snippet(section)}",
                               section)]
    return items, before + after


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A one-call section as DeepSeek-V3's template writes an assistant's tool call."""
    return (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n```json\n"
            f"{json.dumps(dict(arguments))}\n```{CALL_END}{CALLS_END}")


FORMAT = ToolFormat(name="deepseek_v3", markers=(CALLS_BEGIN, OUTPUTS_BEGIN), parse=parse,
                    render_call=render_call, preamble=PREAMBLE)

__all__ = ["CALLS_BEGIN", "CALLS_END", "CALL_BEGIN", "CALL_END", "FORMAT", "PREAMBLE", "SEP",
           "parse", "render_call"]
