"""BFCL-style call reward: the calls in a completion against a `possible_answer` ground truth.

The ground truth (`sample["answer"]`, JSON, as BFCL's `possible_answer` files and the "bfcl:<category>"
source hold it) is a list of calls, each `{function_name: {parameter: [allowed values]}}`. A
completion's calls are parsed with `rlx.rewards.tool_calls` in the model family's format
(`CallRewardConfig.tool_format`: Hermes `<tool_call>` blocks by default, Llama 3.1 JSON,
DeepSeek-V3, gpt-oss harmony). Following BFCL's AST checker:

- the completion makes exactly as many calls as the ground truth, each well-formed;
- every ground-truth call is matched by a different emitted call (any order: parallel calls are
  order-free), one that has the same function name, no parameter outside the ground truth's, every
  parameter whose allowed values do not include "" (BFCL's mark for optional), and for each given
  parameter a value equal to one of the allowed values;
- types follow the allowed values: an integer parameter takes an int (not a bool, not a float), a
  float parameter an int or float, a boolean a bool, a string a str (compared case-insensitively,
  ignoring spaces and the punctuation `,./-_*^`, as BFCL does), a list element by element in
  order, a dict key by key.

Score 1.0 when every call matches, else 0.0 with a reason (for a ground-truth call no emitted call
matches: why the call in its position does not). Without an answer (the
irrelevance categories) a completion scores 1.0 exactly when it makes no call.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlx.rewards.base import RewardResult
from rlx.rewards.tool_calls import ToolCall, ToolCallError, parse_tool_calls

_STRIP = re.compile(r"[ ,./\-_*^]")


def _text(value: str) -> str:
    return _STRIP.sub("", value).lower()


def value_matches(value: Any, allowed: Any) -> bool:
    """Whether an emitted value equals one allowed value under BFCL's type rules."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value == allowed
    if isinstance(allowed, int):
        return isinstance(value, int) and value == allowed
    if isinstance(allowed, float):
        return isinstance(value, (int, float)) and float(value) == allowed
    if isinstance(allowed, str):
        return isinstance(value, str) and _text(value) == _text(allowed)
    if isinstance(allowed, list):
        return isinstance(value, list) and len(value) == len(allowed) and all(
            value_matches(v, a) for v, a in zip(value, allowed))
    if isinstance(allowed, dict):
        return isinstance(value, dict) and set(value) <= set(allowed) and all(
            _one_of(value[k], allowed[k]) if k in value else "" in _options(allowed[k])
            for k in allowed)
    return value == allowed


def _options(allowed: Any) -> list:
    return allowed if isinstance(allowed, list) else [allowed]


def _one_of(value: Any, allowed: Any) -> bool:
    """Nested dict values in BFCL answers are lists of allowed values ("" = may be omitted)."""
    return any(value_matches(value, a) for a in _options(allowed) if a != "")


def call_problem(call: ToolCall, truth: Mapping[str, Mapping[str, list]]) -> str | None:
    """Why `call` does not match one ground-truth call, or None when it does."""
    (name, params), = truth.items()
    if call.name != name:
        return f"called {call.name!r}, expected {name!r}"
    for key in call.arguments:
        if key not in params:
            return f"{name}: unexpected argument {key!r}"
    for key, allowed in params.items():
        if key not in call.arguments:
            if "" not in allowed:
                return f"{name}: missing required argument {key!r}"
            continue
        options = [a for a in allowed if a != ""]
        if not any(value_matches(call.arguments[key], a) for a in options):
            return f"{name}: argument {key!r}={call.arguments[key]!r} is not one of {options}"
    return None


def grade_calls(calls: Sequence[ToolCall | ToolCallError], truth: Sequence[Mapping[str, Any]]
                ) -> RewardResult:
    """1.0 when `calls` match the ground-truth calls (any order), else 0.0 with the reason."""
    errors = [c for c in calls if isinstance(c, ToolCallError)]
    if errors:
        return RewardResult.zero(f"malformed call: {errors[0].message}")
    if len(calls) != len(truth):
        return RewardResult.zero(f"{len(calls)} calls, expected {len(truth)}")
    if not truth:
        return RewardResult(1.0, "no call, as expected")
    fits = [[call_problem(c, t) for t in truth] for c in calls]  # [call][truth]: None = match
    if _perfect_matching([[p is None for p in row] for row in fits]):
        return RewardResult(1.0, "calls match")
    for j in range(len(truth)):
        if all(row[j] for row in fits):  # no call matches expected call j: say why the call in
            return RewardResult.zero(fits[j][j])  # its position does not
    return RewardResult.zero("the calls cannot be paired one to one with the expected calls")


def _perfect_matching(ok: list[list[bool]]) -> bool:
    """Whether every call pairs with a different ground-truth call (Kuhn's augmenting paths)."""
    owner: dict[int, int] = {}  # truth index -> call index

    def place(call: int, seen: set[int]) -> bool:
        for t, fits in enumerate(ok[call]):
            if fits and t not in seen:
                seen.add(t)
                if t not in owner or place(owner[t], seen):
                    owner[t] = call
                    return True
        return False

    return all(place(c, set()) for c in range(len(ok)))


@dataclasses.dataclass(frozen=True)
class CallRewardConfig:
    max_calls: int = 16  # more calls in one completion are malformed
    tool_format: str = "hermes"  # the model's call syntax (rlx.rewards.tool_formats.FORMATS)


class CallReward:
    """`get_reward("tool_call")`: BFCL-style grading of a completion's calls (module docstring)."""

    def __init__(self, config: CallRewardConfig = CallRewardConfig(), **overrides: Any):
        self.config = dataclasses.replace(config, **overrides)

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        answer = sample.get("answer")
        try:
            truth = [] if answer is None else json.loads(answer) if isinstance(answer, str) \
                else list(answer)
        except ValueError:
            return RewardResult.zero("the sample's answer is not JSON ground-truth calls")
        calls = parse_tool_calls(completion, self.config.max_calls, self.config.tool_format).items
        return grade_calls(calls, truth)


__all__ = ["CallReward", "CallRewardConfig", "call_problem", "grade_calls", "value_matches"]
