"""Host-side rewards: math answers (math-verify), code (sandboxed execution), tool calls against
BFCL-style ground truth (`rlx.rewards.bfcl`), an LLM judge (`rlx.rewards.judge`), composition.

Importing this package loads only the records and the registry; the graders (sympy, the
sandbox) are imported on first use, by `get_reward(name)` or by attribute access below.

May import only the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``): rewards run on the
host and know nothing of models or the learner.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlx.rewards.base import (BatchRewardFn, RewardFn, RewardResult, available_rewards, get_reward,
                              register, score_batch, take_metrics)

_LAZY = {
    "MathReward": "rlx.rewards.math",
    "MathConfig": "rlx.rewards.math",
    "FormatReward": "rlx.rewards.math",
    "extract_answer": "rlx.rewards.math",
    "CodeReward": "rlx.rewards.code",
    "CodeConfig": "rlx.rewards.code",
    "extract_code": "rlx.rewards.code",
    "Sandbox": "rlx.rewards.sandbox",
    "SandboxLimits": "rlx.rewards.sandbox",
    "SandboxResult": "rlx.rewards.sandbox",
    "Isolation": "rlx.rewards.sandbox",
    "ComposedReward": "rlx.rewards.compose",
    "from_weights": "rlx.rewards.compose",
    "overlong_penalty": "rlx.rewards.compose",
    "RewardStats": "rlx.rewards.compose",
    "RewardTerm": "rlx.rewards.compose",
    "OverlongConfig": "rlx.rewards.compose",
    "RewardMetrics": "rlx.rewards.compose",
    "reward_metrics": "rlx.rewards.compose",
    "CallReward": "rlx.rewards.bfcl",
    "grade_calls": "rlx.rewards.bfcl",
    "parse_tool_calls": "rlx.rewards.tool_calls",
    "JudgeReward": "rlx.rewards.judge",
    "JudgeConfig": "rlx.rewards.judge",
}

__all__ = [
    "BatchRewardFn",
    "RewardFn",
    "RewardResult",
    "available_rewards",
    "get_reward",
    "register",
    "score_batch",
    "take_metrics",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlx.rewards' has no attribute {name!r}")
