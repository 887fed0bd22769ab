"""A multi-turn tool-use environment: the model calls tools, then answers; the answer is graded.

Each assistant turn is parsed for tool calls in the model family's format
(`ToolEnvConfig.prompt_format.tool_format`, `rlx.rewards.tool_formats`; Hermes `<tool_call>`
blocks when None):
- a turn with no tool call is the final answer: it is graded with the reward function
  (e.g. `get_reward("math")` against the example's gold answer) and the episode ends;
- otherwise every call is answered, in order, by one `tool` message: the tool's output, or an
  error text for a malformed call, an unknown tool, or wrong arguments (the episode goes on, so
  the model can correct itself);
- a turn with tool calls at the turn limit ends the episode with reward 0 ("turn_limit").

Rendering those messages into tokens (in the family's own tool-result tokens, or with
`<tool_response>` wrapping for the Hermes format when the template does not add it) is left to
the episode driver; the reset's observation names the format it reads calls in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rlx.data.chat import PromptFormat, prompt_messages
from rlx.data.sources import Example, Message
from rlx.envs.base import EnvError, Observation, StepInfo, StepResult
from rlx.envs.tool_calls import ToolCall, ToolCallError, parse_tool_calls
from rlx.envs.tools import Tool, ToolOutput
from rlx.rewards import RewardFn, RewardResult
from rlx.rewards.tool_formats import DEFAULT


@dataclasses.dataclass(frozen=True)
class ToolEnvConfig:
    """Limits and prompt of a `ToolEnv`."""

    max_turns: int = 4  # assistant turns per episode, the final answer included
    max_calls_per_turn: int = 4  # further calls in one turn get an error response
    prompt_format: PromptFormat = PromptFormat()
    # a worked exchange put before the task's user turn (e.g. `demonstration(tools)`): small
    # models imitate a shown call far more readily than a described one
    demonstration: tuple[Message, ...] = ()
    # text the first assistant turn opens with, written into the prompt (e.g. "<tool_call>\n":
    # the model then completes a call instead of choosing whether to make one)
    assistant_prefix: str = ""

    def __post_init__(self):
        if self.max_turns < 1 or self.max_calls_per_turn < 1:
            raise ValueError("ToolEnvConfig needs max_turns >= 1 and max_calls_per_turn >= 1")


class ToolEnv:
    """Runs the tools the model calls and grades its final answer. One per episode.

    `tools` and `reward` (e.g. `get_reward("math")`) are meant to be shared by all the
    environments of a run: the built-in tools are stateless, and reward functions may own
    worker processes.
    """

    def __init__(
        self, tools: Sequence[Tool], reward: RewardFn, config: ToolEnvConfig = ToolEnvConfig()
    ):
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError("tool names must be unique")
        if isinstance(reward, str):
            raise TypeError("pass a reward function (e.g. get_reward(name)) shared by the envs")
        self.reward = reward
        self.config = config
        self._example: Example | None = None
        self._turn = 0
        self._done = False

    def reset(self, example: Example) -> Observation:
        self._example, self._turn, self._done = example, 0, False
        messages = prompt_messages(example, self.config.prompt_format)
        if self.config.demonstration:
            last = max(i for i, m in enumerate(messages) if m.role == "user")
            messages[last:last] = self.config.demonstration
        specs = tuple(t.spec() for t in self.tools.values())
        fmt = self.config.prompt_format  # the driver renders in the format calls are read in
        return Observation(tuple(messages), specs if fmt.offer_tools else (),
                           self.config.assistant_prefix, fmt.tool_format or DEFAULT)

    def step(self, action_text: str) -> StepResult:
        if self._example is None:
            raise EnvError("step() before reset()")
        if self._done:
            raise EnvError("step() after the episode ended; call reset()")
        self._turn += 1
        parsed = parse_tool_calls(action_text, self.config.max_calls_per_turn,
                                  self.config.prompt_format.tool_format or DEFAULT)
        if not parsed.has_tool_calls:
            return self._finish(self._grade(action_text), "final_answer")
        if self._turn >= self.config.max_turns:
            result = RewardResult.zero(f"tool calls on the last allowed turn ({self._turn})")
            return self._finish(result, "turn_limit")
        outputs = [self._answer(item) for item in parsed.items]
        info = StepInfo(
            turn=self._turn, reason="tool_calls",
            tool_calls=sum(isinstance(i, ToolCall) for i in parsed.items),
            tool_errors=tuple(o.text for o in outputs if not o.ok),
        )
        messages = tuple(Message("tool", o.text) for o in outputs)
        return StepResult(Observation(messages), reward=0.0, done=False, info=info)

    def _answer(self, item: ToolCall | ToolCallError) -> ToolOutput:
        if isinstance(item, ToolCallError):
            return ToolOutput(f"error: {item.message}", ok=False)
        tool = self.tools.get(item.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolOutput(f"error: unknown tool {item.name!r} (available: {known})", ok=False)
        try:
            output = tool(item.arguments)
        except Exception as e:  # a tool's bug must not end the rollout batch
            return ToolOutput(f"error: tool {item.name!r} failed ({type(e).__name__}: {e})",
                              ok=False)
        return output if output.ok else ToolOutput(f"error: {output.text}", ok=False)

    def _grade(self, answer: str) -> RewardResult:
        return self.reward(answer, self._example.reward_sample())

    def _finish(self, result: RewardResult, reason: str) -> StepResult:
        self._done = True
        info = StepInfo(turn=self._turn, reason=reason, reward_result=result)
        return StepResult(Observation(()), reward=result.score, done=True, info=info)
