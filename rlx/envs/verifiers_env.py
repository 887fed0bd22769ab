"""Environments of the `verifiers` library (0.4, ``verifiers.v1``) played with rlx's engine
(``config.env.kind = "verifiers"``, ``pip install -e ".[verifiers]"``).

``env.verifiers = "package.module:function"``, called with the keyword arguments of
``env.verifiers_args`` (a JSON object), must return a ``verifiers.v1.Env``. verifiers 0.4 plays an
episode by launching its harness's program (a chat loop, a coding agent) in a runtime and
answering the program's OpenAI-style model calls through an interception server; it has no
per-turn hook to step. rlx plays the environment's tasks itself, in process, through the parts of
the environment that are plain Python:

- examples: the tasks of the environment's taskset (`verifiers_source`; the run's train and eval
  splits are rlx's deterministic prompt-hash split); the prompt chat is the task's system prompt
  and prompt, the uid its ``id`` (else its content hash);
- turns: sampled by rlx's engine and driven by `rlx.envs.episode.run_episodes` (the chat
  template's tokens, env tokens out of the loss). The tools are the ``@vf.tool`` methods of the
  toolsets the taskset and its task type declare (``Taskset.toolsets``: one instance per run;
  ``Task.toolsets``: one per episode), called in process (coroutines awaited) like
  `rlx.envs.registry.FunctionTool`s: a turn with tool calls gets one tool message per call and
  the episode goes on (a multi-turn game is a stateful toolset), a turn without calls is the
  final answer (with no tools, the first turn is);
- reward: the task's own scoring (``Task.score``: its ``@vf.reward`` functions and plugged
  judges, awaited, weighted and summed as ``trace.reward``) on a verifiers ``Trace`` of the
  transcript, the assistant turns marked as sampled. As in `ToolEnv`, an episode that still
  calls tools on its last allowed turn (``env.max_turns``, "turn_limit") or is cut at the token
  budget ("length") scores 0 unscored.

Not played here: harness programs (bash, coding agents), tools behind remote MCP servers,
multi-agent environments (user simulators, judges that sample), and scoring functions that
need a runtime (verifiers skips them without one, and says so in its log).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlx.data.chat import PromptFormat
from rlx.data.sources import Example, ListSource, Message, select_split
from rlx.envs.base import Observation, StepResult
from rlx.envs.registry import FunctionTool
from rlx.envs.runner import EnvRunner, episode_tool_format
from rlx.envs.tool_env import ToolEnv, ToolEnvConfig
from rlx.envs.tools import Tool
from rlx.models.tokenizer import Tokenizer
from rlx.rewards import RewardResult

SOURCE = "verifiers"  # Example.source of the environment's tasks


def load_verifiers_env(reference: str, args: Mapping[str, Any] | None = None) -> Any:
    """The ``verifiers.v1.Env`` that ``reference`` ("package.module:function") returns when
    called with ``args``; ValueError saying what is wrong."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"env.verifiers={reference!r} is not a function reference "
                         "'package.module:function' (e.g. 'my_env:load_environment')")
    try:
        from verifiers.v1 import Env as VerifiersEnvBase
    except ImportError:
        raise ValueError("env.kind='verifiers' needs the verifiers package: "
                         'pip install -e ".[verifiers]"') from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"env.verifiers={reference!r}: cannot import {module_name!r} ({e})"
                         ) from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"env.verifiers={reference!r}: {module_name} has no function "
                         f"{attribute!r}")
    env = fn(**dict(args or {}))
    if not isinstance(env, VerifiersEnvBase):
        raise ValueError(f"env.verifiers={reference!r} returned a {type(env).__name__}, not a "
                         "verifiers.v1.Env (e.g. vf.SingleAgentEnv(...)); return the environment")
    if not env.taskset.bounded:
        raise ValueError(f"env.verifiers={reference!r}: its taskset "
                         f"{type(env.taskset).__name__} is infinite; bound it (e.g. "
                         "taskset.take(n)) so that rlx can split it into train and eval tasks")
    return env


@functools.lru_cache(maxsize=4)
def _loaded(reference: str, args_json: str) -> tuple[Any, dict[str, Any]]:
    """The environment and its tasks by uid, loaded once per run (source and runner share it)."""
    env = load_verifiers_env(reference, json.loads(args_json or "{}"))
    tasks: dict[str, Any] = {}
    for task in env.taskset:
        uid = f"{SOURCE}:{task.data.id if task.data.id is not None else task.key[:16]}"
        if uid in tasks:
            raise ValueError(f"env.verifiers={reference!r}: two tasks share the uid {uid!r}; "
                             "give each task a distinct TaskData.id")
        tasks[uid] = task
    return env, tasks


def task_example(uid: str, task: Any) -> Example:
    """The prompt chat of a verifiers task (system prompt, then its prompt messages)."""
    data = task.data
    messages = [Message("system", data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append(Message("user", data.prompt))
    else:
        messages += [Message(m.role, _text(m.content)) for m in data.prompt or ()]
    if not messages:
        raise ValueError(f"verifiers task {uid!r} has no prompt (a user-simulated opening is "
                         "not supported)")
    answer = getattr(data, "answer", None)
    return Example(uid, SOURCE, "all", data.prompt_text, tuple(messages),
                   answer=None if answer is None else str(answer))


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content_text(content) or ""


def verifiers_source(reference: str, split: str = "train", args_json: str = "{}",
                     eval_fraction: float = 0.1) -> ListSource:
    """The ``split`` ("train", "eval" or "all") of the environment's tasks as examples."""
    _, tasks = _loaded(reference, args_json)
    examples = [task_example(uid, task) for uid, task in tasks.items()]
    return select_split(f"{SOURCE}:{reference}", examples, split, eval_fraction)


def toolset_tools(toolsets: Sequence[Any]) -> list[Tool]:
    """The ``@vf.tool`` methods of ``toolsets`` as `FunctionTool`s (coroutines awaited)."""
    from verifiers.v1.utils.decorators import discover_decorated

    return [FunctionTool(_awaited(fn), name=getattr(fn, "tool_name", None) or fn.__name__)
            for toolset in toolsets for fn in discover_decorated(toolset, "tool")]


def _awaited(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # the signature (the tool's schema) and docstring carry over
    def call(**kwargs: Any) -> Any:
        out = fn(**kwargs)
        return asyncio.run(out) if inspect.isawaitable(out) else out

    return call


def _ungraded(completion: str, sample: Mapping[str, Any]) -> RewardResult:
    raise RuntimeError("a verifiers episode is graded by its task's scoring")


class VerifiersEnv(ToolEnv):
    """One episode of a verifiers task (see the module docstring)."""

    def __init__(self, tasks: Mapping[str, Any], tools: Sequence[Tool],
                 config: ToolEnvConfig = ToolEnvConfig()):
        super().__init__(tools, _ungraded, config)
        self.tasks = tasks
        self.chat: list[Message] = []
        self.opening = 0  # prompt messages: assistant turns after them were sampled

    def reset(self, example: Example) -> Observation:
        if example.uid not in self.tasks:
            raise KeyError(f"{example.uid!r} is not a task of this verifiers environment")
        observation = super().reset(example)
        self.chat, self.opening = list(observation.messages), len(observation.messages)
        return observation

    def step(self, action_text: str) -> StepResult:
        if self._example is not None and not self._done:
            self.chat.append(Message("assistant", action_text))
        if not self.tools and self._example is not None and not self._done:
            self._turn += 1  # no tools: the first turn is the answer
            return self._finish(self._grade(action_text), "final_answer")
        result = super().step(action_text)
        self.chat += result.observation.messages
        return result

    def _grade(self, answer: str) -> RewardResult:
        return score_transcript(self.tasks[self._example.uid], self.chat, self.opening)


def score_transcript(task: Any, chat: Sequence[Message], opening: int) -> RewardResult:
    """The task's scoring (``Task.score``) of the transcript ``chat``, whose messages from
    ``opening`` on are the episode's (assistant ones sampled): ``trace.reward``, and the
    rewards by name as the reason. A scoring function that raises scores 0 with its error."""
    trace = transcript_trace(task, chat, opening)
    try:
        asyncio.run(task.score(trace))
    except Exception as e:  # the environment's bug is the episode's reason, not a crash
        return RewardResult.zero(f"verifiers scoring failed ({type(e).__name__}: {e})")
    parts = ", ".join(f"{name}={'unscored' if r is None else f'{r.score:g}'}"
                      for name, r in trace.rewards.items())
    return RewardResult(float(trace.reward), f"verifiers: {parts or 'no rewards'}")


def transcript_trace(task: Any, chat: Sequence[Message], opening: int) -> Any:
    """A verifiers ``Trace`` of ``chat``: one message node per message, in a chain."""
    from verifiers.v1 import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, SystemMessage, ToolMessage, UserMessage

    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                 hash=task.hash),
                  agent=AgentInfo(config=AgentConfig()))
    for i, message in enumerate(chat):
        vf_message = (ToolMessage(tool_call_id=f"call_{i}", content=message.content)
                      if message.role == "tool" else
                      kinds[message.role](content=message.content))
        trace.nodes.append(MessageNode(
            parent=i - 1 if i else None, message=vf_message,
            sampled=i >= opening and message.role == "assistant"))
    return trace


def make_verifiers_runner(reference: str, args_json: str, tokenizer: Tokenizer,
                          prompt_format: PromptFormat, max_turns: int, max_episode_tokens: int,
                          format_coef: float = 0.0, assistant_prefix: str = "") -> EnvRunner:
    """A runner of `VerifiersEnv` episodes over the environment ``reference`` returns, in the
    tool-call format of ``prompt_format`` or the tokenizer's chat template; ``assistant_prefix``
    opens each episode's first turn (`ToolEnvConfig`)."""
    env, tasks = _loaded(reference, args_json)
    task_type = type(env.taskset).task_type()
    shared = toolset_tools(type(env.taskset).toolsets(env.taskset.config))
    task_config = getattr(env.taskset.config, "task", None)
    name = episode_tool_format(tokenizer, prompt_format.tool_format)
    config = ToolEnvConfig(max_turns=max_turns, assistant_prefix=assistant_prefix,
                           prompt_format=dataclasses.replace(prompt_format, tool_format=name))

    def make_env() -> VerifiersEnv:
        own = toolset_tools(task_type.toolsets(task_config)) if task_config is not None else []
        return VerifiersEnv(tasks, [*shared, *own], config)

    return EnvRunner(make_env, tokenizer, max_episode_tokens, format_coef)


__all__ = ["SOURCE", "VerifiersEnv", "load_verifiers_env", "make_verifiers_runner",
           "score_transcript", "task_example", "toolset_tools", "transcript_trace",
           "verifiers_source"]
