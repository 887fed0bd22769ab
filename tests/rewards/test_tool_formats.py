"""Tool-call formats per model family: transcripts written from each format's documented shape
(well-formed calls, several calls in one turn, text around calls, malformed calls), detection
from the families' real chat templates, and calls as those templates render them.

The chat templates are the originals TRL ships (``trl/chat_templates``: Qwen2.5, Llama 3.1,
DeepSeek-V3, gpt-oss), an oracle rlx did not write.
"""

from __future__ import annotations

import json
import os

import pytest
import trl
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.rewards.tool_calls import FORMATS, ToolCall, ToolCallError, detect_format, \
    parse_tool_calls
from tests.helpers.tokenizers import byte_tokenizer

TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
FAMILY_TEMPLATES = {"qwen2_5": "hermes", "qwen3": "hermes", "llama3_1": "llama3_json",
                    "deepseekv3": "deepseek_v3", "gptoss": "harmony"}
CALC = {"expression": "17*23"}
# DeepSeek-V3's tokens: fullwidth bars (U+FF5C) and U+2581 spaces
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _template(name: str) -> str:
    with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def _calls(text: str, fmt: str, **kw) -> list:
    return [(c.name, dict(c.arguments)) if isinstance(c, ToolCall) else c.message
            for c in parse_tool_calls(text, tool_format=fmt, **kw).items]


def _ds(name: str, args: str, kind: str = "function") -> str:
    return f"{DS_CALL}{kind}{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


# ------------------------------------------------------------------- detection and rendering
@pytest.mark.parametrize("template, fmt", sorted(FAMILY_TEMPLATES.items()))
def test_the_format_is_detected_from_the_family_chat_template(template, fmt):
    assert detect_format(_template(template)) == fmt


def test_templates_without_a_family_syntax_get_hermes():
    # SmolLM2's and plain ChatML templates know no tool syntax: rlx's preamble teaches Hermes
    assert detect_format(None) == detect_format("") == "hermes"
    assert detect_format(byte_tokenizer().chat_template) == "hermes"


@pytest.mark.parametrize("template, fmt", sorted(FAMILY_TEMPLATES.items()))
def test_a_call_the_template_renders_parses_back(template, fmt):
    """The family's own template writes an assistant's structured call; the format reads it
    back, and (where the format writes calls the template's way) writes it identically."""
    arguments = json.dumps(CALC) if template == "deepseekv3" else CALC  # DeepSeek's: a string
    call = {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    tokenizer = byte_tokenizer(_template(template))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
    # what the model writes: after the generation prompt (DeepSeek's opens "<think>" there, so
    # the common prefix may end inside a special token's "<")
    common = os.path.commonprefix([prompt, rendered]).removesuffix("<")
    turn = rendered[len(common):]
    assert _calls(turn, fmt) == [("calculator", CALC)]
    written = FORMATS[fmt].render_call("calculator", CALC)
    assert _calls(written, fmt) == [("calculator", CALC)]
    if fmt != "harmony":  # gpt-oss's template names the recipient in the role part
        assert written in rendered


# ---------------------------------------------------------------------------- Llama 3.1 JSON
@pytest.mark.parametrize("text, expected", [
    ('{"name": "calculator", "parameters": {"expression": "17*23"}}', [("calculator", CALC)]),
    ('<|python_tag|>{"name": "calculator", "parameters": {"expression": "17*23"}}<|eom_id|>',
     [("calculator", CALC)]),
    # "arguments" where "parameters" is missing; no parameters at all: no arguments
    ('{"name": "calculator", "arguments": {"expression": "17*23"}}', [("calculator", CALC)]),
    ('{"name": "now"}', [("now", {})]),
    # several calls, separated by ";" (and whitespace)
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     [("a", {"x": 1}), ("b", {})]),
    ('<|python_tag|>{"name": "a", "parameters": {}};\n{"name": "b", "parameters": {"y": [1]}}',
     [("a", {}), ("b", {"y": [1]})]),
])
def test_llama_calls(text, expected):
    assert _calls(text, "llama3_json") == expected


def test_llama_text_around_calls():
    parsed = parse_tool_calls('Let me compute.<|python_tag|>{"name": "calculator", "parameters": '
                              '{"expression": "17*23"}} then answer', tool_format="llama3_json")
    assert [c.name for c in parsed.calls] == ["calculator"]
    assert parsed.text == "Let me compute. then answer"
    # a turn that does not open with a call object is an answer, JSON in it or not
    for answer in ("The answer is \\boxed{396}.", 'I would call {"name": "calculator"}.',
                   '{"answer": 396}'):
        parsed = parse_tool_calls(answer, tool_format="llama3_json")
        assert not parsed.has_tool_calls and parsed.text == answer


@pytest.mark.parametrize("text, message", [
    ('{"name": "calculator", "parameters": {"expression": "1"}', "not valid JSON"),
    ('<|python_tag|>[1, 2]', "must be a JSON object"),
    ('<|python_tag|>{"parameters": {}}', 'no "name"'),
    ('{"name": 3, "parameters": {}}', 'no "name"'),
    ('{"name": "calculator", "parameters": [1]}', "must be a JSON object"),
    ("<|python_tag|>", "not followed by a JSON call"),
    ('<|python_tag|>print("hi")', "not valid JSON"),
])
def test_llama_malformed_calls(text, message):
    (error,) = parse_tool_calls(text, tool_format="llama3_json").items
    assert isinstance(error, ToolCallError) and message in error.message


def test_llama_good_call_then_bad_one_keeps_both_in_order():
    assert _calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {',
                  "llama3_json")[0] == ("a", {})
    assert "not valid JSON" in _calls('{"name": "a", "parameters": {}}; {"name": "b", '
                                      '"parameters": {', "llama3_json")[1]


# ------------------------------------------------------------------------------- DeepSeek-V3
def test_deepseek_several_calls_with_text_around():
    text = (f"Let me compute.{DS_BEGIN}{_ds('calculator', json.dumps(CALC))}\n"
            f"{_ds('python', json.dumps({'code': 'print(1)'}))}{DS_END} after")
    parsed = parse_tool_calls(text, tool_format="deepseek_v3")
    assert [(c.name, dict(c.arguments)) for c in parsed.items] == [
        ("calculator", CALC), ("python", {"code": "print(1)"})]
    assert parsed.text == "Let me compute. after"


def test_deepseek_section_cut_at_the_end_keeps_its_finished_calls():
    # generation stopped before <｜tool▁calls▁end｜>: the finished call counts
    assert _calls(f"{DS_BEGIN}{_ds('calculator', json.dumps(CALC))}", "deepseek_v3") == [
        ("calculator", CALC)]
    assert _calls("The answer is \\boxed{396}.", "deepseek_v3") == []


@pytest.mark.parametrize("call, message", [
    (_ds("calculator", '{"expression": "1"'), "not valid JSON"),
    (_ds("calculator", "[1]"), "must be a JSON object"),
    (_ds("", "{}"), 'no "name"'),
    (_ds("calculator", "{}", kind="retrieval"), 'must be "function"'),
    (f"{DS_CALL}function calculator\n```json\n{{}}\n```{DS_CALL_END}", "no <｜tool▁sep｜>"),
    (f"{DS_CALL}function{DS_SEP}calculator\n{{}}{DS_CALL_END}", "```json fence"),
    (f"{DS_CALL}calculator{DS_SEP}{{}}{DS_CALL_END}", 'must be "function"'),  # V3.1's shape
    (f"{DS_CALL}function{DS_SEP}calculator\n```json\n{{}}", "unterminated"),
    ("no call here", "holds no"),
])
def test_deepseek_malformed_calls(call, message):
    (error,) = parse_tool_calls(f"{DS_BEGIN}{call}{DS_END}", tool_format="deepseek_v3").items
    assert isinstance(error, ToolCallError) and message in error.message


# ----------------------------------------------------------------------------- gpt-oss harmony
HARMONY_CALL = ('<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>'
                '{"expression": "17*23"}<|call|>')


def test_harmony_call_after_analysis_and_around_text():
    text = ("<|channel|>analysis<|message|>Need the calculator.<|end|><|start|>assistant"
            + HARMONY_CALL)
    parsed = parse_tool_calls(text, tool_format="harmony")
    assert [(c.name, dict(c.arguments)) for c in parsed.items] == [("calculator", CALC)]
    assert parsed.text == "Need the calculator."
    # the stop token <|call|> is not in the text the env reads: the call still counts
    assert _calls(HARMONY_CALL.removesuffix("<|call|>"), "harmony") == [("calculator", CALC)]


def test_harmony_several_calls_and_recipient_in_the_role_part():
    text = (HARMONY_CALL + "<|start|>assistant to=functions.python<|channel|>commentary json"
            '<|message|>{"code": "print(1)"}<|call|>'
            "<|start|>assistant to=browser.search<|channel|>commentary<|message|>{}<|call|>")
    assert _calls(text, "harmony") == [("calculator", CALC), ("python", {"code": "print(1)"}),
                                       ("browser.search", {})]


def test_harmony_final_answer_is_no_call():
    text = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
            "<|message|>The answer is \\boxed{396}.<|return|>")
    parsed = parse_tool_calls(text, tool_format="harmony")
    assert not parsed.has_tool_calls and parsed.text == "Easy.\nThe answer is \\boxed{396}."


@pytest.mark.parametrize("body, message", [
    ('{"expression": "1"', "not valid JSON"), ("[1]", "must be a JSON object"),
    ("calculate 17*23", "not valid JSON"),
])
def test_harmony_malformed_calls(body, message):
    text = f"<|channel|>commentary to=functions.calculator<|message|>{body}<|call|>"
    (error,) = parse_tool_calls(text, tool_format="harmony").items
    assert isinstance(error, ToolCallError) and message in error.message


# ------------------------------------------------------------------------------------ all
def test_call_limit_and_unknown_format():
    text = ";".join(['{"name": "a", "parameters": {}}'] * 3)
    parsed = parse_tool_calls(text, max_calls=2, tool_format="llama3_json")
    assert len(parsed.calls) == 2 and "more than 2" in parsed.errors[0].message
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'; known: hermes"):
        parse_tool_calls("x", tool_format="mistral")


_PIECES = ['{"name": "a", "parameters": {}}', '"x"', "{", "}", "[", ";", "\n", "```json",
           "```", "<|python_tag|>", DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP, "function",
           "<|channel|>", "commentary to=functions.a", "<|message|>", "<|call|>", "<|end|>",
           "<|start|>", "<tool_call>", "</tool_call>", "text "]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12), st.sampled_from(sorted(FORMATS)))
def test_parsers_never_raise(pieces, fmt):
    parsed = parse_tool_calls("".join(pieces), tool_format=fmt)
    assert all(isinstance(i, (ToolCall, ToolCallError)) for i in parsed.items)
