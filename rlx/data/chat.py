"""Chat rendering shared by the prompt pipeline and the tool-use environments.

Models differ in what their chat template knows about tools, and in the syntax their calls take
(`rlx.rewards.tool_formats`: the format is the one the template shows, `detect_format`, unless
`PromptFormat.tool_format` names one). A template that mentions `tools` (Qwen2.5/3, Llama 3.1,
gpt-oss) renders the tool specs itself; for one that does not (SmolLM2, plain ChatML,
DeepSeek-V3) the specs are written into the system message with the format's preamble (for
Hermes: JSON schemas inside `<tools></tools>` and the `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` call syntax). Tool results are `tool` messages the template renders in the
family's own tokens; only the Hermes format, under a template that does not write
`<tool_response>` itself, gets them already wrapped in it (`wrap_tool_response`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlx.data.sources import Example, Message
from rlx.models.tokenizer import Tokenizer
from rlx.rewards.tool_formats import DEFAULT, ToolFormat, detect_format, get_format


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How an example becomes a prompt chat.

    system_prompt: a system message put first when the example has none (None: the chat
        template's default, if any).
    template: applied to the last user message; "{prompt}" is replaced by its text (plain
        replacement, so LaTeX braces need no escaping).
    offer_tools: show the example's tools to the model.
    tool_format: the tool-call format (a name of `rlx.rewards.tool_formats.FORMATS`); None: the
        one the tokenizer's chat template shows (`detect_format`).
    """

    system_prompt: str | None = None
    template: str = "{prompt}"
    offer_tools: bool = True
    tool_format: str | None = None

    def __post_init__(self):
        if "{prompt}" not in self.template:
            raise ValueError("PromptFormat.template must contain '{prompt}'")
        if self.tool_format is not None:
            get_format(self.tool_format)


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders a `tools` argument itself."""
    return "tools" in (tokenizer.chat_template or "")


def chat_tool_format(tokenizer: Tokenizer, tool_format: str | None = None) -> ToolFormat:
    """The format ``tool_format`` names, or the one the tokenizer's chat template shows."""
    return get_format(tool_format or detect_format(tokenizer.chat_template))


def wrap_tool_response(tokenizer: Tokenizer, tool_format: str | None = None) -> bool:
    """Whether tool results must be wrapped in `<tool_response>` before rendering: a format
    that answers calls in it (Hermes) under a template that does not write it."""
    return (chat_tool_format(tokenizer, tool_format).wraps_results
            and "tool_response" not in (tokenizer.chat_template or ""))


def tools_system_text(tools: Sequence[Mapping[str, Any]], tool_format: str = DEFAULT) -> str:
    """The tool description, in the format's syntax, for templates that cannot render tools."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return get_format(tool_format).preamble.replace("{tools}", lines)


def prompt_messages(example: Example, fmt: PromptFormat) -> list[Message]:
    """The example's prompt chat with the system prompt and instruction template applied."""
    messages = list(example.messages)
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if users and fmt.template != "{prompt}":
        last = users[-1]
        text = fmt.template.replace("{prompt}", messages[last].content)
        messages[last] = Message("user", text)
    if fmt.system_prompt is not None and not (messages and messages[0].role == "system"):
        messages.insert(0, Message("system", fmt.system_prompt))
    return messages


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] = (),
    add_generation_prompt: bool = True,
    tool_format: str | None = None,
) -> str:
    """The chat as text: tools rendered by the template or written into the system message in
    ``tool_format``'s syntax (None: the template's, see the module docstring), tool results
    wrapped in `<tool_response>` where that format needs it and the template does not do it."""
    fmt = chat_tool_format(tokenizer, tool_format)
    wrap = wrap_tool_response(tokenizer, fmt.name)
    dicts = [
        {"role": "tool", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
        if wrap and m.role == "tool" else m.to_dict()
        for m in messages
    ]
    if not tools:
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)
    if template_renders_tools(tokenizer):
        return tokenizer.apply_chat_template(
            dicts, add_generation_prompt=add_generation_prompt, tools=list(tools))
    text = tools_system_text(tools, fmt.name)
    if dicts and dicts[0]["role"] == "system":
        dicts[0] = {"role": "system", "content": dicts[0]["content"] + "\n\n" + text}
    else:
        dicts.insert(0, {"role": "system", "content": text})
    return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)


def encode_prompt(tokenizer: Tokenizer, example: Example, fmt: PromptFormat) -> list[int]:
    """Token ids of the example's prompt, ending with the assistant generation header."""
    tools = example.tools if fmt.offer_tools else ()
    text = render_chat(tokenizer, prompt_messages(example, fmt), tools,
                       tool_format=fmt.tool_format)
    return tokenizer.encode(text, add_special_tokens=False)
