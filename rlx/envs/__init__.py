"""Multi-turn environments: the protocol, tool calls, tools, the tool-use env, the driver, and the
loop's side (`runner`: episodes as a step's rollouts, `config.env.kind = "tools"`; `registry`:
tools by name, user functions "package.module:function"; `verifiers_env`: environments of the
verifiers library, `config.env.kind = "verifiers"`).

Importing this package loads only the protocol records; the rest is imported on first
attribute access.

May import ``rlx.data`` (examples, chat rendering), ``rlx.models`` (the tokenizer), ``rlx.rewards``
(the code sandbox, reward records) and the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``);
``verifiers_env`` imports the optional ``verifiers`` package when an environment is loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlx.envs.base import Env, EnvError, Observation, StepInfo, StepResult

_LAZY = {
    "ToolCall": "rlx.envs.tool_calls",
    "ToolCallError": "rlx.envs.tool_calls",
    "ParsedTurn": "rlx.envs.tool_calls",
    "parse_tool_calls": "rlx.envs.tool_calls",
    "Tool": "rlx.envs.tools",
    "ToolOutput": "rlx.envs.tools",
    "Calculator": "rlx.envs.tools",
    "PythonTool": "rlx.envs.tools",
    "PythonToolConfig": "rlx.envs.tools",
    "check_arguments": "rlx.envs.tools",
    "ToolEnv": "rlx.envs.tool_env",
    "ToolEnvConfig": "rlx.envs.tool_env",
    "Episode": "rlx.envs.episode",
    "EpisodeConfig": "rlx.envs.episode",
    "EpisodeShare": "rlx.envs.episode",
    "Turn": "rlx.envs.episode",
    "run_episodes": "rlx.envs.episode",
    "EnvRunner": "rlx.envs.runner",
    "make_runner": "rlx.envs.runner",
    "FunctionTool": "rlx.envs.registry",
    "make_tools": "rlx.envs.registry",
    "VerifiersEnv": "rlx.envs.verifiers_env",
    "make_verifiers_runner": "rlx.envs.verifiers_env",
}

__all__ = ["Env", "EnvError", "Observation", "StepInfo", "StepResult", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlx.envs' has no attribute {name!r}")
