"""Tool-call formats, one module per model family's syntax, and the registry that picks one.

* ``hermes`` - `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2.5/3, Hermes, and
  rlx's own tool preamble for templates that cannot render tools, e.g. SmolLM2's);
* ``llama3_json`` - `{"name", "parameters"}` JSON, optionally after `<|python_tag|>` (Llama 3.1+);
* ``deepseek_v3`` - `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>` sections (DeepSeek-V3, R1);
* ``harmony`` - messages to `functions.NAME` on the commentary channel (gpt-oss).

``detect_format(chat_template)`` names the format a model's chat template uses, by the markers
each format lists (``ToolFormat.markers``); a template with none of them (or no template) gets
``hermes``, the format rlx's own tool preamble teaches. The records every format produces are in
``base``; ``rlx.rewards.tool_calls`` parses a turn in a named format.

Not covered: GLM-4.5's template also opens calls with `<tool_call>`, but writes the name and then
`<arg_key>`/`<arg_value>` pairs, not JSON; it detects as ``hermes`` and its calls read as errors.
"""

from __future__ import annotations

from rlx.rewards.tool_formats import deepseek_v3, harmony, hermes, llama3_json
from rlx.rewards.tool_formats.base import ToolFormat

FORMATS: dict[str, ToolFormat] = {m.FORMAT.name: m.FORMAT
                                  for m in (hermes, llama3_json, deepseek_v3, harmony)}
DEFAULT = "hermes"  # a template that shows no family's tool syntax gets rlx's own preamble's


def get_format(name: str) -> ToolFormat:
    """The format called ``name``; ValueError listing the known ones."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def detect_format(chat_template: str | None) -> str:
    """The name of the format whose markers ``chat_template`` holds (``DEFAULT`` if none)."""
    template = chat_template or ""
    for name, fmt in FORMATS.items():
        if name != DEFAULT and any(marker in template for marker in fmt.markers):
            return name
    return DEFAULT


__all__ = ["DEFAULT", "FORMATS", "ToolFormat", "detect_format", "get_format"]
