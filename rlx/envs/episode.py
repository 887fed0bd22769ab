"""Drive multi-turn episodes with any rollout engine and keep the env's tokens out of the loss.

One round generates the next assistant turn of every unfinished episode in a single
`engine.generate` call (n=1 per episode; `group_size` copies of each example run side by side),
then steps each episode's environment with the turn's text (on `env_workers` threads). The token sequence only ever grows
at its end: the model's tokens are kept exactly as sampled (never re-tokenized), and what the
env adds is the difference between chat-template renderings of the conversation before and
after its messages:

    env tokens = encode(trailer + render(chat + tool messages, generation prompt)
                                - render(chat, no generation prompt))

where `chat` ends with the assistant turn just generated and `trailer` is what the template
writes after the model's last sampled token (e.g. "\\n" after `<|im_end|>`, or the whole turn
closing when the model stopped on a stop string). So the sequence a learner sees is token for
token what the engine was conditioned on. `loss_mask` is 1 exactly on the sampled tokens,
`sampler_logp` holds their log-probs and 0 elsewhere.

An env may open the first assistant turn with fixed text (`Observation.assistant_prefix` on
reset, e.g. "<tool_call>\\n"): it ends the prompt tokens (not sampled, not in the loss) and
starts the turn's text that the env reads and the transcript keeps.

Each round's request for an episode is its whole sequence so far. An engine that offers
`prefix_cache()` (the built-in `JaxEngine`) runs the episodes inside it: a request continues from
the KV-cache row of the episode's previous turn and prefills only the tokens after it (the last
sampled token and the env's), and the rows are freed as the episodes end. Other engines get the
same requests (SGLang's radix cache reuses the prefixes it has seen).

Several processes (a multi-host run's "global" rollouts, where every process drives the same
engine program over every episode) pass an `EpisodeShare`: each process resets and steps only the
environments of its own episodes and every process gets every outcome, so tools run once per
episode and every process continues from the same messages and tokens whatever a tool does.

Budget: `max_completion_tokens` bounds everything after the prompt (model and env tokens). A turn
that hits the budget or the engine's per-turn `max_new_tokens` ends the episode with finish
reason "length" and reward 0 (the cut text is not graded); so does an env reply that leaves no
room for another model token (that reply is then not appended).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlx.data.chat import render_chat
from rlx.data.sources import Example, Message
from rlx.envs.base import Env, EnvError, Observation, StepInfo, StepResult
from rlx.models.tokenizer import Tokenizer
from rlx.rewards import RewardResult
from rlx.types import Prompt, Rollout, RolloutEngine, SamplingParams


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    max_completion_tokens: int = 1024  # model + env tokens after the prompt, per episode
    group_size: int = 1  # episodes per example (a GRPO group)
    env_workers: int = 1  # threads stepping environments (tools, grading) concurrently

    def __post_init__(self):
        if min(self.max_completion_tokens, self.group_size, self.env_workers) < 1:
            raise ValueError("EpisodeConfig needs max_completion_tokens, group_size and "
                             "env_workers >= 1")


@dataclasses.dataclass(frozen=True)
class EpisodeShare:
    """Which process resets and steps which episode's environment when several processes hold
    every episode: episode ``i`` (in example-major order) is process ``i % count``'s. ``gather``
    takes any picklable host value and returns every process's, in process order, on every
    process (a collective: every process calls it the same number of times)."""

    index: int
    count: int
    gather: Callable[[Any], list[Any]]

    def owns(self, episode: int) -> bool:
        return episode % self.count == self.index

    def everyone(self, calls: Callable[[Sequence[int]], dict[int, Any]], episodes: Sequence[int]
                 ) -> dict[int, Any]:
        """``calls`` on this process's share of ``episodes``; every process's outcomes, each a
        value or the `_Failed` it raised (raised here on every process alike)."""
        merged: dict[int, Any] = {}
        for part in self.gather(calls([i for i in episodes if self.owns(i)])):
            merged.update(part)
        failed = [(i, f) for i, f in sorted(merged.items()) if isinstance(f, _Failed)]
        if failed:
            i, f = failed[0]
            raise EnvError(f"the environment of episode {i} raised on process {i % self.count}: "
                           f"{f.error}")
        return merged


@dataclasses.dataclass(frozen=True)
class _Failed:
    """An env call's exception, as text that any process can raise."""

    error: str


def _guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - shared with the other processes, raised there too
        return _Failed(f"{type(e).__name__}: {e}")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One assistant turn and the tokens the env appended after it."""

    model_ids: tuple[int, ...]  # sampled by the engine (loss mask 1)
    sampler_logp: tuple[float, ...]
    env_ids: tuple[int, ...]  # appended by the env (loss mask 0); () on the last turn
    text: str  # the turn's text as given to the env (without the stop token)
    info: StepInfo | None  # None when the turn was cut by the token budget
    weight_version: int


@dataclasses.dataclass(frozen=True)
class Episode:
    """A finished episode: prompt, completion (model and env tokens interleaved), mask, reward."""

    uid: str  # the example's uid (the GRPO group)
    sample_index: int  # which of the group_size episodes of this example
    prompt_ids: np.ndarray  # int32 [P]
    completion_ids: np.ndarray  # int32 [C]
    loss_mask: np.ndarray  # int32 [C]: 1 on sampled tokens, 0 on env tokens
    sampler_logp: np.ndarray  # float32 [C]: sampler log-probs, 0 on env tokens
    reward: float
    reward_result: RewardResult
    finish_reason: str  # "final_answer" | "turn_limit" | "length"
    turns: tuple[Turn, ...]
    messages: tuple[Message, ...]  # the transcript, prompt chat included

    def to_rollout(self, uid: str, weight_version: int = 0):
        """As an `rlx.types.Rollout` (with `completion_mask` and `reward`)."""
        from rlx.types import Rollout  # imports flax: only when asked

        return Rollout(
            prompt_uid=uid, prompt_ids=self.prompt_ids, completion_ids=self.completion_ids,
            sampler_logp=self.sampler_logp, weight_version=weight_version,
            completion_mask=self.loss_mask, reward=self.reward,
        )


@dataclasses.dataclass
class _State:
    """An episode in progress (mutable, internal)."""

    env: Env
    example: Example
    sample_index: int
    messages: list[Message]
    tools: tuple[Mapping[str, Any], ...]
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    finish: tuple[str, RewardResult] | None = None
    opening: str = ""  # the reset's assistant_prefix: in the prompt, part of the first turn
    tool_format: str | None = None  # the reset's: the chat renders in the env's call format

    @property
    def prefix(self) -> str:
        """Text the next turn opens with that the model did not sample."""
        return "" if self.turns else self.opening

    @property
    def key(self) -> str:
        return f"{self.example.uid}#{self.sample_index}"

    @property
    def turn_key(self) -> str:
        """The uid of this episode's next `generate` request: "<example uid>#<sample>@<turn>"."""
        return f"{self.key}@{len(self.turns)}"


def run_episodes(
    engine: RolloutEngine,
    make_env: Callable[[], Env],
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    config: EpisodeConfig = EpisodeConfig(),
    share: EpisodeShare | None = None,
) -> list[Episode]:
    """Runs `config.group_size` episodes per example to the end; results in example order.

    The group's episodes are separate prompts of one `generate` call (`sampling.n` must be 1);
    an engine that seeds each prompt alike (`sampling.seed` set) would make them identical.
    ``share``: this process runs the env calls of its own episodes (`EpisodeShare`).
    """
    if sampling.n != 1:
        raise ValueError("run_episodes samples one turn per episode: use "
                         "EpisodeConfig.group_size for groups, with sampling.n == 1")
    stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *_eos(tokenizer))))
    jobs = [(make_env(), example, index) for example in examples
            for index in range(config.group_size)]
    continuing = getattr(engine, "prefix_cache", contextlib.nullcontext)
    with concurrent.futures.ThreadPoolExecutor(config.env_workers) as pool, continuing():
        calls = _EnvCalls(pool, share)
        openings = calls.run(range(len(jobs)), lambda i: jobs[i][0].reset(jobs[i][1]),
                             threads=False)
        states = [_start(env, example, index, openings[i], tokenizer)
                  for i, (env, example, index) in enumerate(jobs)]
        while active := [i for i, s in enumerate(states) if s.finish is None]:
            room = max(config.max_completion_tokens - len(states[i].ids) for i in active)
            turn_sampling = dataclasses.replace(
                sampling, max_new_tokens=min(sampling.max_new_tokens, room), stop_token_ids=stops)
            # a turn's request uid names the episode and the turn: an engine seeding by uid
            # draws fresh random numbers for every turn
            prompts = [Prompt(states[i].turn_key, tuple(states[i].prompt_ids + states[i].ids))
                       for i in active]
            rollouts = engine.generate(prompts, turn_sampling)
            _check_rollouts([states[i] for i in active], rollouts)
            sampled = {i: _take(states[i], r, tokenizer, stops, config.max_completion_tokens)
                       for i, r in zip(active, rollouts)}
            going = [i for i in active if sampled[i] is not None]
            results = calls.run(going, lambda i: states[i].env.step(sampled[i].content))
            for i in going:
                _reply(states[i], sampled[i], results[i], tokenizer, config.max_completion_tokens)
    return [_episode(s) for s in states]


@dataclasses.dataclass(frozen=True)
class _EnvCalls:
    """Env calls on the worker threads: all of them, or (``share``) this process's, with every
    process's outcomes gathered."""

    pool: concurrent.futures.Executor
    share: EpisodeShare | None

    def run(self, episodes: Sequence[int], call: Callable[[int], Any], threads: bool = True
            ) -> dict[int, Any]:
        def calls(mine: Sequence[int], each: Callable[[int], Any]) -> dict[int, Any]:
            return dict(zip(mine, self.pool.map(each, mine) if threads else map(each, mine)))

        if self.share is None:  # dict(zip(...)) consumes the map: env errors re-raise here
            return calls(episodes, call)
        return self.share.everyone(
            lambda mine: calls(mine, lambda i: _guarded(lambda: call(i))), episodes)


def _check_rollouts(active: Sequence[_State], rollouts: Sequence[Rollout]) -> None:
    if len(rollouts) != len(active):
        raise RuntimeError(f"engine returned {len(rollouts)} rollouts for {len(active)} prompts")
    for state, rollout in zip(active, rollouts):
        if rollout.prompt_uid != state.turn_key:
            raise RuntimeError(f"rollout for {rollout.prompt_uid!r} where {state.turn_key!r} was "
                               "expected")


def _eos(tokenizer: Tokenizer) -> tuple[int, ...]:
    return () if tokenizer.eos_id is None else (tokenizer.eos_id,)


def _start(env: Env, example: Example, sample_index: int, observation: Observation,
           tokenizer: Tokenizer) -> _State:
    messages = list(observation.messages)
    text = render_chat(tokenizer, messages, observation.tools, add_generation_prompt=True,
                       tool_format=observation.tool_format)
    text += observation.assistant_prefix
    return _State(env, example, sample_index, messages, observation.tools,
                  tokenizer.encode(text, add_special_tokens=False),
                  opening=observation.assistant_prefix, tool_format=observation.tool_format)


@dataclasses.dataclass(frozen=True)
class _Sampled:
    """A sampled turn the env is to step: its tokens, log-probs and assistant message."""

    ids: list[int]
    logp: list[float]
    assistant: Message
    version: int

    @property
    def content(self) -> str:
        return self.assistant.content


def _take(state: _State, rollout: Rollout, tokenizer: Tokenizer, stops: tuple[int, ...],
          budget: int) -> _Sampled | None:
    """Appends one sampled turn; None when it was cut (the episode then ends unstepped)."""
    room = budget - len(state.ids)
    ids = [int(t) for t in rollout.completion_ids[:room]]
    logp = [float(x) for x in rollout.sampler_logp[:room]]
    cut = rollout.finish_reason == "length" or len(rollout.completion_ids) > room
    state.ids += ids
    state.mask += [1] * len(ids)
    state.logp += logp
    stopped = not cut and bool(ids) and ids[-1] in stops
    text = state.prefix + tokenizer.decode(ids[:-1] if stopped else ids)
    version, assistant = rollout.weight_version, Message("assistant", text)
    if cut:
        state.turns.append(Turn(tuple(ids), tuple(logp), (), text, None, version))
        state.messages.append(assistant)
        state.finish = ("length", RewardResult.zero("cut at the token budget"))
        return None
    return _Sampled(ids, logp, assistant, version)


def _reply(state: _State, sampled: _Sampled, result: StepResult, tokenizer: Tokenizer,
           budget: int) -> None:
    """Appends the env's reply to a sampled turn (or ends the episode)."""
    env_ids: tuple[int, ...] = ()
    if result.done:
        state.finish = (result.info.reason, result.info.reward_result
                        or RewardResult(score=result.reward))
    else:
        env_ids = tuple(_env_tokens(tokenizer, state, sampled.assistant,
                                    result.observation.messages, sampled.ids))
        if len(state.ids) + len(env_ids) >= budget:
            env_ids = ()
            state.finish = ("length", RewardResult.zero("no room left for another turn"))
    state.messages.append(sampled.assistant)
    if env_ids:
        state.messages += result.observation.messages
        state.ids += env_ids
        state.mask += [0] * len(env_ids)
        state.logp += [0.0] * len(env_ids)
    state.turns.append(Turn(tuple(sampled.ids), tuple(sampled.logp), env_ids,
                            sampled.content, result.info, sampled.version))


def _env_tokens(
    tokenizer: Tokenizer, state: _State, assistant: Message, replies: Sequence[Message],
    sampled: Sequence[int],
) -> list[int]:
    """Tokens to append after the sampled turn: the turn's closing and the env's messages, up
    to the next assistant generation header."""
    render = functools.partial(render_chat, tokenizer, tools=state.tools,
                               tool_format=state.tool_format)
    before = render(state.messages, add_generation_prompt=True)
    chat = [*state.messages, assistant]
    with_turn = render(chat, add_generation_prompt=False)
    after = render([*chat, *replies], add_generation_prompt=True)
    if not (with_turn.startswith(before) and after.startswith(with_turn)):
        raise EnvError("the chat template rewrites earlier turns when a turn is added; "
                       "episodes need a template that renders a conversation append-only")
    trailer = _trailer(with_turn[len(before):], state.prefix + tokenizer.decode(sampled),
                       assistant.content, tokenizer)
    return tokenizer.encode(trailer + after[len(with_turn):], add_special_tokens=False)


def _trailer(turn_text: str, sampled_text: str, content: str, tokenizer: Tokenizer) -> str:
    """What the template writes after the model's last sampled token, within its turn."""
    if turn_text.startswith(sampled_text):
        return turn_text[len(sampled_text):]
    eos = tokenizer.decode(_eos(tokenizer)) if tokenizer.eos_id is not None else ""
    if eos and sampled_text.endswith(eos) and eos in turn_text:
        return turn_text[turn_text.rindex(eos) + len(eos):]
    if turn_text.startswith(content):
        return turn_text[len(content):]
    raise EnvError("the chat template changes the assistant's text; cannot find where the "
                   "sampled tokens end in the rendered turn")


def _episode(state: _State) -> Episode:
    reason, result = state.finish
    return Episode(
        uid=state.example.uid, sample_index=state.sample_index,
        prompt_ids=np.asarray(state.prompt_ids, np.int32),
        completion_ids=np.asarray(state.ids, np.int32),
        loss_mask=np.asarray(state.mask, np.int32),
        sampler_logp=np.asarray(state.logp, np.float32),
        reward=float(result.score), reward_result=result, finish_reason=reason,
        turns=tuple(state.turns), messages=tuple(state.messages),
    )
