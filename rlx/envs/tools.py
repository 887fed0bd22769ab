"""Tools an environment can offer: a safe calculator and a sandboxed Python interpreter.

A tool has a `name`, an OpenAI/Hermes function `spec` (JSON schema of its arguments) and is
called with the parsed arguments; it returns a `ToolOutput` and never raises on bad input:
arguments are checked against the spec first (`check_arguments`: unknown, missing and mistyped
arguments are errors for the model to read).

- `Calculator`: evaluates one arithmetic expression by walking its Python AST; only numbers,
  + - * / // % **, unary signs, parentheses, the constants pi and e and the functions abs,
  round, min, max, sqrt, floor, ceil are allowed, nothing is ever passed to `eval`. Results
  larger than 2**1024 (and powers that would be) are refused, so no expression can exhaust
  memory or time. `/` of two integers that divide exactly gives an integer.
- `PythonTool`: runs a program in `rlx.rewards.Sandbox` (its own process tree with rlimits and
  the strongest isolation available, no network) and returns what it printed. Each call is a
  fresh process: nothing persists between calls.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Mapping
from typing import Any, Protocol

from rlx.rewards.sandbox import Sandbox, SandboxLimits


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    """A tool's reply, shown to the model; `ok` is False for errors."""

    text: str
    ok: bool = True


class Tool(Protocol):
    name: str

    def spec(self) -> dict[str, Any]: ...

    def __call__(self, arguments: Mapping[str, Any]) -> ToolOutput: ...


def function_spec(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI/Hermes tool spec whose arguments are all required."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)},
    }}


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,),
}


def check_arguments(arguments: Mapping[str, Any], spec: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit the spec's parameters, or None when they do."""
    params = spec["function"].get("parameters", {})
    properties = params.get("properties", {})
    name = spec["function"]["name"]
    for key in arguments:
        if key not in properties:
            return f"{name}: unexpected argument {key!r} (expected: {', '.join(properties)})"
    for key in params.get("required", []):
        if key not in arguments:
            return f"{name}: missing required argument {key!r}"
    for key, value in arguments.items():
        kinds = _JSON_TYPES.get(properties[key].get("type", ""), (object,))
        wrong_bool = isinstance(value, bool) and bool not in kinds
        if wrong_bool or not isinstance(value, kinds):
            return f"{name}: argument {key!r} must be of type {properties[key]['type']}"
    return None


# ------------------------------------------------------------------------------- calculator
class CalculatorError(ValueError):
    pass


_MAX_BITS = 1024
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt,
              "floor": math.floor, "ceil": math.ceil}
_CONSTANTS = {"pi": math.pi, "e": math.e}

Number = int | float


def _checked(value: Number) -> Number:
    if type(value) not in (int, float):  # e.g. complex from (-8) ** 0.5
        raise CalculatorError("result is not a real number")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise CalculatorError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _divide(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
        return a // b
    return a / b


def _power(a: Number, b: Number) -> Number:
    if abs(a) >= 2 and abs(b) * math.log2(abs(a)) > _MAX_BITS:
        raise CalculatorError("result too large")
    return a**b


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div):
            return _checked(_divide(a, b))
        if isinstance(node.op, ast.Pow):
            return _checked(_power(a, b))
        if type(node.op) in _BINARY:
            return _checked(_BINARY[type(node.op)](a, b))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS and not node.keywords):
        return _checked(_FUNCTIONS[node.func.id](*[_evaluate(a) for a in node.args]))
    if isinstance(node, ast.Name):
        raise CalculatorError(f"unknown name {node.id!r}")
    if isinstance(node, ast.Call):
        raise CalculatorError(f"unsupported function call (known: {', '.join(_FUNCTIONS)})")
    raise CalculatorError(f"unsupported element {type(node).__name__}")


def calculate(expression: str, max_chars: int = 500) -> Number:
    """The value of an arithmetic expression; raises CalculatorError when it is not one."""
    if len(expression) > max_chars:
        raise CalculatorError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        reason = e.msg if isinstance(e, SyntaxError) else "too deeply nested"
        raise CalculatorError(f"not an arithmetic expression ({reason})") from None
    try:
        return _evaluate(tree)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError, RecursionError) as e:
        if isinstance(e, CalculatorError):
            raise
        raise CalculatorError(f"{type(e).__name__}: {e}") from None


def format_number(value: Number) -> str:
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


class Calculator:
    """`calculator(expression)`: the value of an arithmetic expression."""

    name = "calculator"
    # (question, arguments, the tool's reply): a worked call for `rlx.envs.registry.demonstration`
    demo = ("What is 512 * 38?", {"expression": "512 * 38"}, "19456")

    def spec(self) -> dict[str, Any]:
        return function_spec(self.name, "Evaluate an arithmetic expression, e.g. (17*23)+5. "
                             "Supports + - * / // % **, parentheses, sqrt, abs, round, min, max.",
                             {"expression": {"type": "string",
                                             "description": "the expression to evaluate"}})

    def __call__(self, arguments: Mapping[str, Any]) -> ToolOutput:
        problem = check_arguments(arguments, self.spec())
        if problem:
            return ToolOutput(problem, ok=False)
        try:
            return ToolOutput(format_number(calculate(arguments["expression"])))
        except CalculatorError as e:
            return ToolOutput(f"calculator error: {e}", ok=False)


# ----------------------------------------------------------------------------------- python
@dataclasses.dataclass(frozen=True)
class PythonToolConfig:
    limits: SandboxLimits = SandboxLimits(wall_s=10.0, cpu_s=10, memory_mb=512)
    isolation: str | None = None  # force "bwrap" / "unshare" / "rlimits"; None = strongest
    max_output_chars: int = 2000  # longer outputs are cut, with a note
    max_code_chars: int = 20_000  # longer programs are refused without running


class PythonTool:
    """`python(code)`: runs a Python program in the sandbox and returns its output."""

    name = "python"

    def __init__(self, config: PythonToolConfig = PythonToolConfig()):
        self.config = config
        self.sandbox = Sandbox(config.limits, config.isolation)  # probes isolation on first run

    def spec(self) -> dict[str, Any]:
        return function_spec(self.name, "Run a Python 3 program and return what it prints "
                             "(stdout; stderr too on errors). Use print() to see values. Each "
                             "call starts fresh; there is no network.",
                             {"code": {"type": "string", "description": "the program"}})

    def __call__(self, arguments: Mapping[str, Any]) -> ToolOutput:
        problem = check_arguments(arguments, self.spec())
        if problem:
            return ToolOutput(problem, ok=False)
        code = arguments["code"]
        if len(code) > self.config.max_code_chars:
            return ToolOutput(f"python: program longer than {self.config.max_code_chars} "
                              "characters", ok=False)
        result = self.sandbox.run(code)
        text, ok = result.stdout, result.ok
        if result.timed_out:
            text += f"\n[killed after {self.config.limits.wall_s:g} s]"
        elif result.returncode != 0:
            text += result.stderr if result.stderr else f"[exit code {result.returncode}]"
        if not text.strip():
            text = "(no output; use print() to show values)"
        cap = self.config.max_output_chars
        if len(text) > cap:
            text = text[:cap] + f"\n[output cut at {cap} characters]"
        return ToolOutput(text, ok=ok)

    def close(self) -> None:
        self.sandbox.close()
