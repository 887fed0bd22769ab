"""Chat rendering shared by the prompt pipeline and the tool-use environments.

Models differ in what their chat template knows about tools. A template that mentions `tools`
(Qwen2.5/3, Llama 3.1, Hermes) renders the tool specs itself; for one that does not (SmolLM2,
plain ChatML) the specs are written into the system message in the Hermes layout: JSON schemas
inside `<tools></tools>` and the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` call
format. Likewise a template that does not write `<tool_response>` itself gets tool results
already wrapped in it (`wrap_tool_response`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlx.data.sources import Example, Message
from rlx.models.tokenizer import Tokenizer

TOOLS_PREAMBLE = (
    "You can call functions to help with the task. Their signatures are the JSON schemas "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags, one call per block:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
    "Results come back inside <tool_response></tool_response> tags."
)


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How an example becomes a prompt chat.

    system_prompt: a system message put first when the example has none (None: the chat
        template's default, if any).
    template: applied to the last user message; "{prompt}" is replaced by its text (plain
        replacement, so LaTeX braces need no escaping).
    offer_tools: show the example's tools to the model.
    """

    system_prompt: str | None = None
    template: str = "{prompt}"
    offer_tools: bool = True

    def __post_init__(self):
        if "{prompt}" not in self.template:
            raise ValueError("PromptFormat.template must contain '{prompt}'")


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders a `tools` argument itself."""
    return "tools" in (tokenizer.chat_template or "")


def wrap_tool_response(tokenizer: Tokenizer) -> bool:
    """Whether tool results must be wrapped in `<tool_response>` before rendering."""
    return "tool_response" not in (tokenizer.chat_template or "")


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes-style tool description for templates that cannot render tools."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PREAMBLE.replace("{tools}", lines)


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
) -> str:
    """The chat as text: tools rendered by the template or written into the system message,
    tool results wrapped in `<tool_response>` unless the template does it."""
    wrap = wrap_tool_response(tokenizer)
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
    text = tools_system_text(tools)
    if dicts and dicts[0]["role"] == "system":
        dicts[0] = {"role": "system", "content": dicts[0]["content"] + "\n\n" + text}
    else:
        dicts.insert(0, {"role": "system", "content": text})
    return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)


def encode_prompt(tokenizer: Tokenizer, example: Example, fmt: PromptFormat) -> list[int]:
    """Token ids of the example's prompt, ending with the assistant generation header."""
    tools = example.tools if fmt.offer_tools else ()
    text = render_chat(tokenizer, prompt_messages(example, fmt), tools)
    return tokenizer.encode(text, add_special_tokens=False)
