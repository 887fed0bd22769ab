"""The environment protocol for multi-turn episodes, and the records it exchanges.

An environment works on chat messages, not tokens: `reset(example)` returns the opening chat
(and the tool specs to show the model), `step(action_text)` takes the text of one assistant
turn and returns the messages to append (tool results), a reward and whether the episode is
over. Turning messages into tokens with the model's chat template, and keeping the env's
tokens out of the loss, is the episode driver's job (`rlx.envs.episode`), so one environment
serves every model and rollout engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from rlx.data.sources import Example, Message
from rlx.rewards import RewardResult


class EnvError(RuntimeError):
    """An environment was used wrongly (step before reset, step after done)."""


@dataclasses.dataclass(frozen=True)
class Observation:
    """Messages to append to the chat; on reset also the tool specs offered to the model, the
    text the first assistant turn opens with (written into the prompt, not sampled) and the
    tool-call format the env reads calls in (the driver renders the chat in the same one)."""

    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    assistant_prefix: str = ""  # on reset: e.g. "<tool_call>\n"; part of the turn's text
    # on reset: a name of rlx.rewards.tool_formats.FORMATS; None: the chat template's
    tool_format: str | None = None


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one step did.

    reason: "tool_calls" (tools ran, the episode goes on), "final_answer" (a turn without tool
        calls was graded), or "turn_limit" (tool calls on the last allowed turn).
    """

    turn: int  # 1-based index of the assistant turn just taken
    reason: str
    tool_calls: int = 0  # well-formed calls that ran
    tool_errors: tuple[str, ...] = ()  # one message per malformed or failed call
    reward_result: RewardResult | None = None  # set when the episode ended


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The outcome of one assistant turn."""

    observation: Observation  # empty when done
    reward: float
    done: bool
    info: StepInfo


class Env(Protocol):
    """A stateful multi-turn environment; one instance per concurrent episode."""

    def reset(self, example: Example) -> Observation: ...

    def step(self, action_text: str) -> StepResult: ...
