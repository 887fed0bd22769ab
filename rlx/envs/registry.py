"""Tools by name: the built-in ones, and user functions named "package.module:function".

`make_tools(("calculator", "python", "mypkg.mymod:lookup"))` gives the `Tool`s a run offers:

- "calculator": `rlx.envs.tools.Calculator` (AST arithmetic, no `eval`);
- "python": `rlx.envs.tools.PythonTool` (the program runs in `rlx.rewards.Sandbox`: its own
  process with CPU, memory and wall-clock limits, no network, a scratch working directory);
- "package.module:function": a `FunctionTool` around a plain Python function. Its JSON schema
  comes from the signature (annotations int, float, str, bool, list, dict; parameters without a
  default are required) and its description from the docstring. The function runs on a worker
  thread with a wall-clock limit: an exception or an overrun becomes the tool's error text (an
  overrunning call is abandoned, its thread left to finish on its own), and its result (`str()`
  of what it returns) is cut at `max_output_chars`.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlx.data.sources import Message
from rlx.envs.tools import Calculator, PythonTool, Tool, ToolOutput, check_arguments, function_spec
from rlx.rewards.tool_formats import DEFAULT, get_format

TOOLS: dict[str, Callable[[], Tool]] = {"calculator": Calculator, "python": PythonTool}

_JSON_OF = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
            dict: "object"}


class FunctionTool:
    """A user function as a tool (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, timeout_s: float = 10.0,
                 max_output_chars: int = 2000):
        self.fn, self.name = fn, name or fn.__name__
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self._spec = _spec_of(fn, self.name)

    def spec(self) -> dict[str, Any]:
        return self._spec

    def __call__(self, arguments: Mapping[str, Any]) -> ToolOutput:
        problem = check_arguments(arguments, self._spec)
        if problem:
            return ToolOutput(problem, ok=False)
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = self.fn(**arguments)
            except Exception as e:  # the user's bug is the model's error text
                box["error"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=call, name=f"rlx-tool-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return ToolOutput(f"{self.name}: timed out after {self.timeout_s:g} s", ok=False)
        if "error" in box:
            return ToolOutput(f"{self.name} failed ({box['error']})", ok=False)
        text = str(box.get("value"))
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + \
                f"\n[output cut at {self.max_output_chars} characters]"
        return ToolOutput(text)


def _spec_of(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _JSON_OF.get(param.annotation if not isinstance(param.annotation, str)
                            else {t.__name__: t for t in _JSON_OF}.get(param.annotation))
        properties[param.name] = {"type": kind} if kind else {}
        if param.default is param.empty:
            required.append(param.name)
    spec = function_spec(name, inspect.getdoc(fn) or name, properties)
    spec["function"]["parameters"]["required"] = required
    return spec


def load_function(reference: str) -> Callable[..., Any]:
    """The function "package.module:function" names; ValueError saying what is wrong."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"tool {reference!r} is neither a built-in tool ({', '.join(TOOLS)}) "
                         "nor a function reference 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"tool {reference!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"tool {reference!r}: {module_name} has no function {attribute!r}")
    return fn


def demonstration(tools: Sequence[Tool], tool_format: str = DEFAULT) -> tuple[Message, ...]:
    """A worked exchange per tool that has a `demo` (user question, assistant call written in
    ``tool_format``, tool reply, boxed answer), for `ToolEnvConfig.demonstration`."""
    messages: list[Message] = []
    render_call = get_format(tool_format).render_call
    for tool in tools:
        demo = getattr(tool, "demo", None)
        if demo is None:
            continue
        question, arguments, reply = demo
        messages += [Message("user", question),
                     Message("assistant", render_call(tool.name, arguments)),
                     Message("tool", reply),
                     Message("assistant", f"The answer is \\boxed{{{reply}}}.")]
    return tuple(messages)


def make_tools(names: Sequence[str]) -> list[Tool]:
    """One tool per name (see the module docstring); ValueError naming a bad one."""
    tools = [TOOLS[n]() if n in TOOLS else FunctionTool(load_function(n)) for n in names]
    seen = [t.name for t in tools]
    if len(set(seen)) != len(seen):
        raise ValueError(f"tool names must be unique, got {seen}")
    return tools


__all__ = ["FunctionTool", "TOOLS", "demonstration", "load_function", "make_tools"]
