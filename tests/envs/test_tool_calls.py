"""Tool-call parsing and the built-in tools: every malformed input is an error, never a crash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.envs.tool_calls import ToolCall, ToolCallError, parse_tool_calls
from rlx.envs.tools import Calculator, PythonTool, PythonToolConfig, calculate, check_arguments
from rlx.rewards.sandbox import SandboxLimits


def test_several_calls_in_one_turn_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "17*23"}}\n</tool_call>\nand <tool_call>{"name": "python", '
            '"arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> done')
    parsed = parse_tool_calls(text)
    assert parsed.calls == (
        ToolCall("calculator", {"expression": "17*23"}, parsed.items[0].raw),
        ToolCall("python", {"code": "print(1)"}, parsed.items[1].raw),  # string arguments
    )
    assert parsed.text == "Let me compute.\n\nand  done" and not parsed.errors


@pytest.mark.parametrize("body,message", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": 3}', 'no "name"'),
    ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
    ("", "not valid JSON"),
])
def test_malformed_blocks_become_errors(body, message):
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    (error,) = parsed.items
    assert isinstance(error, ToolCallError) and message in error.message
    assert parsed.has_tool_calls and not parsed.calls


def test_unterminated_block_and_call_limit():
    (error,) = parse_tool_calls('<tool_call>{"name": "x", "arguments": {}}').items
    assert "unterminated" in error.message
    block = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(block * 3, max_calls=2)
    assert len(parsed.calls) == 2 and "more than 2" in parsed.errors[0].message


def test_text_without_calls():
    parsed = parse_tool_calls("The answer is \\boxed{396}.")
    assert not parsed.has_tool_calls and parsed.text == "The answer is \\boxed{396}."


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/tool_call{}":[],namegus 0\\\n')), max_size=80))
def test_parser_never_raises(text):
    parse_tool_calls(text)
    parse_tool_calls("<tool_call>" + text + "</tool_call>")


# ------------------------------------------------------------------------------------ tools
@pytest.mark.parametrize("expression,expected", [
    ("(17*23)+5", 396), ("17*23", 391), ("7/2", 3.5), ("8/2", 4), ("2**10", 1024),
    ("-3 + 4*2", 5), ("10 // 3", 3), ("10 % 3", 1), ("sqrt(16)", 4.0), ("max(2, 9, 4)", 9),
    ("abs(-2.5)", 2.5), ("round(2.567, 2)", 2.57),
])
def test_calculator_values(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression,message", [
    ("1/0", "ZeroDivisionError"), ("2**100000", "too large"), ("9**9**9", "too large"),
    ("__import__('os').system('true')", "unsupported function"), ("x + 1", "unknown name 'x'"),
    ("(-8) ** 0.5", "not a real number"), ("[1, 2]", "unsupported element"),
    ("1 +", "not an arithmetic expression"), ("'a' * 3", "unsupported element"),
    ("1" * 600, "longer than"), ("sqrt(-1)", "math domain"), ("True + 1", "unsupported"),
])
def test_calculator_errors(expression, message):
    output = Calculator()({"expression": expression})
    assert not output.ok and message in output.text


def test_argument_checks():
    spec = Calculator().spec()
    assert check_arguments({"expression": "1"}, spec) is None
    assert "unexpected argument 'expr'" in check_arguments({"expr": "1"}, spec)
    assert "missing required argument 'expression'" in check_arguments({}, spec)
    assert "must be of type string" in check_arguments({"expression": 3}, spec)


def test_python_tool_runs_in_the_sandbox():
    tool = PythonTool()
    try:
        assert tool({"code": "print(17 * 23 + 5)"}).text.strip() == "396"
        failed = tool({"code": "raise ValueError('boom')"})
        assert not failed.ok and "ValueError: boom" in failed.text
        assert "use print()" in tool({"code": "x = 1"}).text
        assert not tool({"source": "print(1)"}).ok
    finally:
        tool.close()


def test_python_tool_timeout():
    tool = PythonTool(PythonToolConfig(limits=SandboxLimits(wall_s=1.5, cpu_s=10)))
    slow = tool({"code": "while True: pass"})
    assert not slow.ok and "killed after 1.5 s" in slow.text
