"""Tool-use episodes as the RL loop's rollouts (``config.env.kind = "tools"``).

`EnvRunner.generate(engine, examples, sampling)` runs ``sampling.n`` episodes of every example
(`rlx.envs.episode.run_episodes`: a `ToolEnv` per episode, the run's reward grading the final
answer) and returns them as `rlx.types.Rollout`s in the order the engine protocol promises
(example-major, `sample_index` 0..n-1), each with `completion_mask` 0 on the tool turns' tokens,
the sampler log-probs of the policy's own tokens, and `reward` set:

    reward = outcome + format_coef * valid

where `outcome` is the env's score (0 for a cut or turn-limited episode) and `valid` is 1 when
the episode called a tool and ended with an answer, every tool call in it having parsed, named a
known tool with fitting arguments and run. The finished episodes stay with the runner until the loop scores
their rollouts (`scores`): transcripts for the logged samples, reasons, and per-step metrics
(tool-call rate, tool errors, turns, how episodes ended). Nothing a model writes raises: bad
calls are error turns, cut episodes are scored 0 with their reason.

Each turn is one `engine.generate` request holding the whole sequence so far (prompt, earlier
turns, tool turns). SGLang's radix cache reuses the prefix it has seen. The built-in engine runs a
batch's episodes inside its `prefix_cache()` (`rlx.envs.episode.run_episodes`,
`rlx.rollout.jax.prefix_cache`): a turn continues from the KV-cache row of the episode's previous turn
and prefills only the tokens after it (the last sampled token and the tool turn's), with the same
tokens and log-probs as a prefill of the whole sequence; the rows are freed as episodes end and
all of them when the batch is done. An engine
that counts its prefilled tokens (`prefilled_tokens()`) has a batch's count logged as
`env/prefilled_tokens`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlx.data.chat import PromptFormat, chat_tool_format
from rlx.data.sources import Example
from rlx.envs.base import Env
from rlx.envs.episode import Episode, EpisodeConfig, EpisodeShare, run_episodes
from rlx.envs.registry import demonstration, make_tools
from rlx.envs.tool_env import ToolEnv, ToolEnvConfig
from rlx.models.tokenizer import Tokenizer
from rlx.rewards import RewardFn
from rlx.types import Rollout, RolloutEngine, SamplingParams

FINISH_REASONS = ("final_answer", "turn_limit", "length")


def valid(episode: Episode) -> bool:
    """Used the tools well: ended with an answer after at least one call, and every tool call
    of it parsed and ran."""
    return episode.finish_reason == "final_answer" and tool_calls(episode) > 0 and not any(
        t.info is not None and t.info.tool_errors for t in episode.turns)


def tool_calls(episode: Episode) -> int:
    """Well-formed calls that ran."""
    return sum(t.info.tool_calls for t in episode.turns if t.info is not None)


def transcript(episode: Episode) -> str:
    """The task's user turn and the episode's turns, one "[role] text" block each."""
    users = [i for i, m in enumerate(episode.messages) if m.role == "user"]
    first = users[-1] if users else 0
    return "\n".join(f"[{m.role}] {m.content}" for m in episode.messages[first:])


def to_rollout(episode: Episode, reward: float, has_logprobs: bool) -> Rollout:
    versions = [t.weight_version for t in episode.turns] or [0]
    return Rollout(
        prompt_uid=episode.uid, prompt_ids=episode.prompt_ids,
        completion_ids=episode.completion_ids, sampler_logp=episode.sampler_logp,
        finish_reason="length" if episode.finish_reason == "length" else "stop",
        weight_version=min(versions), sample_index=episode.sample_index,
        completion_mask=episode.loss_mask, reward=reward, has_logprobs=has_logprobs)


@dataclasses.dataclass
class EnvRunner:
    """Runs episodes for the loop and keeps them until their rollouts are scored."""

    make_env: Callable[[], Env]
    tokenizer: Tokenizer
    max_episode_tokens: int
    format_coef: float = 0.0
    env_workers: int = 4
    share: EpisodeShare | None = None  # several processes drive every episode (rlx.envs.episode)
    _done: dict = dataclasses.field(default_factory=dict)  # (uid, sample) -> Episode
    _prefilled: dict = dataclasses.field(default_factory=dict)  # a batch's first key -> tokens
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def episodes(self, engine: RolloutEngine, examples: Sequence[Example],
                 sampling: SamplingParams) -> list[Episode]:
        config = EpisodeConfig(max_completion_tokens=self.max_episode_tokens,
                               group_size=sampling.n, env_workers=self.env_workers)
        return run_episodes(engine, self.make_env, examples, self.tokenizer,
                            dataclasses.replace(sampling, n=1), config, self.share)

    def reward(self, episode: Episode) -> float:
        return float(episode.reward) + self.format_coef * valid(episode)

    def generate(self, engine: RolloutEngine, examples: Sequence[Example],
                 sampling: SamplingParams) -> list[Rollout]:
        """``sampling.n`` episodes per example as rollouts (see the module docstring)."""
        counter = getattr(engine, "prefilled_tokens", None)
        before = counter() if counter is not None else 0
        episodes = self.episodes(engine, examples, sampling)
        with self._lock:
            self._done.update({(e.uid, e.sample_index): e for e in episodes})
            if counter is not None and episodes:
                self._prefilled[episodes[0].uid, episodes[0].sample_index] = counter() - before
        return [to_rollout(e, self.reward(e), sampling.logprobs) for e in episodes]

    def scores(self, rollouts: Sequence[Rollout], pool: Callable[[tuple], tuple] = tuple
               ) -> tuple[np.ndarray, list[str], list[str], dict[str, float]]:
        """Rewards, transcripts, reasons and ``env/*`` metrics of a batch of this runner's
        rollouts (their episodes are forgotten). A rollout whose episode another process ran
        (multi-host) keeps its reward, with its decoded tokens as text; ``pool`` (multi-host:
        every process's items, everywhere) pools each process's per-episode figures, so the
        metrics cover every episode of the batch."""
        with self._lock:
            found = [self._done.pop((r.prompt_uid, r.sample_index), None) for r in rollouts]
            prefilled = [self._prefilled.pop((r.prompt_uid, r.sample_index), None)
                         for r in rollouts]
        texts = [transcript(e) if e is not None else self.tokenizer.decode(
            r.completion_ids.tolist(), skip_special_tokens=True) for e, r in zip(found, rollouts)]
        reasons = [f"{e.finish_reason}: {e.reward_result.reason}" if e is not None else "episode"
                   for e in found]
        rewards = np.array([r.reward for r in rollouts], np.float64)
        metrics = _mean_metrics(pool(tuple(episode_figures(e) for e in found if e is not None)))
        prefilled = pool(tuple(n for n in prefilled if n is not None))
        if prefilled:
            metrics["env/prefilled_tokens"] = float(sum(prefilled))
        return rewards, texts, reasons, metrics


def episode_figures(episode: Episode) -> dict[str, float]:
    """An episode's figures that ``episode_metrics`` averages: whether it called a tool that ran,
    its calls, tool errors and turns, whether it is valid, its outcome and how it ended."""
    out = {
        "tool_call_rate": float(tool_calls(episode) > 0),
        "tool_calls": float(tool_calls(episode)),
        "tool_errors": float(sum(len(t.info.tool_errors) for t in episode.turns
                                 if t.info is not None)),
        "turns": float(len(episode.turns)),
        "valid": float(valid(episode)),
        "outcome": float(episode.reward),
    }
    out.update({f"finish_{why}": float(episode.finish_reason == why) for why in FINISH_REASONS})
    return out


def episode_metrics(episodes: Sequence[Episode], prefix: str = "env") -> dict[str, float]:
    """Tool-call rate (episodes with a call that ran), calls, tool errors and turns per episode,
    the fraction of valid episodes and how the episodes ended."""
    return _mean_metrics([episode_figures(e) for e in episodes], prefix)


def _mean_metrics(figures: Sequence[dict[str, float]], prefix: str = "env") -> dict[str, float]:
    """``prefix/name``: the mean of every ``episode_figures`` entry (none without episodes)."""
    if not figures:
        return {}
    return {f"{prefix}/{name}": float(np.mean([f[name] for f in figures])) for name in figures[0]}


def evaluate_episodes(runner: EnvRunner, engine: RolloutEngine, examples: Sequence[Example],
                      sampling: SamplingParams, success_threshold: float = 1.0, chunk: int = 0
                      ) -> dict[str, float]:
    """One episode per example (``sampling``, e.g. greedy): ``eval/accuracy`` (outcome score >=
    ``success_threshold``), ``eval/mean_reward`` and the ``eval/*`` tool metrics. ``chunk`` > 0
    plays at most that many episodes at once (a run passes its rollout batch: the engine's KV
    cache and the caches kept between turns grow with the episodes in flight)."""
    one = dataclasses.replace(sampling, n=1)
    step = chunk if chunk > 0 else max(len(examples), 1)
    episodes = [e for i in range(0, len(examples), step)
                for e in runner.episodes(engine, examples[i:i + step], one)]
    return {"eval/accuracy": float(np.mean([e.reward >= success_threshold for e in episodes])),
            "eval/mean_reward": float(np.mean([runner.reward(e) for e in episodes])),
            **episode_metrics(episodes, prefix="eval")}


def episode_tool_format(tokenizer: Tokenizer, tool_format: str | None = None) -> str:
    """The tool-call format episodes run in: ``tool_format``, or the one the tokenizer's chat
    template shows; ValueError for a format whose template rlx cannot render tool turns with."""
    fmt = chat_tool_format(tokenizer, tool_format)
    if not fmt.renders_tool_turns:
        raise ValueError(f"tool-use episodes in the {fmt.name!r} format are not supported: its "
                         "chat template renders a tool result from the previous assistant "
                         "message's structured tool calls, which rlx's text transcripts do not "
                         "carry (single-turn calls are: train.reward='tool_call')")
    return fmt.name


def make_runner(tools: Sequence[str], reward: RewardFn, tokenizer: Tokenizer,
                prompt_format: PromptFormat, max_turns: int, max_episode_tokens: int,
                format_coef: float = 0.0, demo: bool = False, **env: Any) -> EnvRunner:
    """A runner of `ToolEnv` episodes offering ``tools`` (`rlx.envs.registry.make_tools`),
    grading final answers with ``reward`` (shared by every episode); ``demo``: each episode
    opens with a worked call of every tool that has one (`rlx.envs.registry.demonstration`).
    Calls are read, and worked calls written, in ``prompt_format.tool_format`` or the format the
    tokenizer's chat template shows (`episode_tool_format`)."""
    built = make_tools(tools)
    name = episode_tool_format(tokenizer, prompt_format.tool_format)
    prompt_format = dataclasses.replace(prompt_format, tool_format=name)
    config = ToolEnvConfig(max_turns=max_turns, prompt_format=prompt_format,
                           demonstration=demonstration(built, name) if demo else (), **env)
    return EnvRunner(lambda: ToolEnv(built, reward, config), tokenizer, max_episode_tokens,
                     format_coef)


__all__ = ["EnvRunner", "episode_figures", "episode_metrics", "episode_tool_format",
           "evaluate_episodes", "make_runner", "to_rollout", "transcript", "valid"]
