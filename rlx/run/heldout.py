"""What a run evaluates every ``train.eval_every`` steps: the held-out split and the named sets.

The held-out split of the training source (``data.eval_size`` problems, greedy at
``rollout.eval_temperature``): ``eval/accuracy`` and ``eval/mean_reward`` (tool-use episodes:
``rlx.envs.runner.evaluate_episodes``). The named sets of ``data.eval_sources``
(``rlx.data.eval_sets``): ``data.eval_samples`` samples per problem at
``rollout.eval_temperature``, ``eval/<name>/pass@1``, ``mean@k`` and ``pass@k`` per set. When the
run is built, each set is compared with the training source by normalised prompt hash
(``rlx.data.overlap``) and the count logged once, a warning when it is not 0.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from rlx.config import RunConfig
from rlx.data.chat import PromptFormat
from rlx.data.eval import evaluate
from rlx.data.eval_sets import EvalSet, contamination, evaluate_sets, load_eval_sets, parse_eval_sources
from rlx.data.sources import Example, ListSource
from rlx.envs.runner import EnvRunner, evaluate_episodes
from rlx.errors import ConfigError
from rlx.models.tokenizer import Tokenizer
from rlx.rewards.base import RewardFn
from rlx.types import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


def check_eval_sets(cfg: RunConfig) -> None:
    """``data.eval_sources`` spelled right (``parse_eval_sources``), and samples that can differ:
    ``data.eval_samples > 1`` needs ``rollout.eval_temperature > 0``; single-turn runs only."""
    if not cfg.data.eval_sources:
        return
    parse_eval_sources(cfg.data.eval_sources)
    if cfg.data.eval_samples > 1 and cfg.rollout.eval_temperature == 0:
        raise ConfigError(f"config.data.eval_samples={cfg.data.eval_samples} draws that many "
                          "identical greedy samples at rollout.eval_temperature=0; set "
                          "rollout.eval_temperature > 0 (e.g. 0.6) or data.eval_samples=1")
    if cfg.env.kind != "single":
        raise ConfigError(f"config.data.eval_sources are scored single-turn; env.kind="
                          f"{cfg.env.kind!r} runs episodes: leave data.eval_sources empty")


def named_eval_sets(cfg: RunConfig, train: Sequence[Example]) -> tuple[EvalSet, ...]:
    """The sets of ``data.eval_sources``, after logging how many problems of ``train`` (the
    training source, when held in memory) each one shares."""
    sets = load_eval_sets(cfg.data.eval_sources, cfg.data.eval_size)
    if sets and isinstance(train, ListSource):
        for count, line in contamination(cfg.data.source, train, sets).values():
            (log.warning if count else log.info)("contamination: %s", line)
    return sets


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """What evaluation samples with: the engine, the reward, the prompt rendering."""

    engine: RolloutEngine
    reward: RewardFn
    tokenizer: Tokenizer
    prompt_format: PromptFormat
    env: EnvRunner | None = None  # tool-use episodes (the held-out split only)

    def split(self, examples: Sequence[Example], sampling: SamplingParams,
              rows: int) -> dict[str, float]:
        """``eval/accuracy`` and ``eval/mean_reward`` of the held-out split (one sample each;
        episodes ``rows`` at a time)."""
        if not examples:
            return {}
        if self.env is not None:
            return dict(evaluate_episodes(self.env, self.engine, examples, sampling, chunk=rows))
        report = evaluate(self.engine, examples, self.reward, k=1, sampling=sampling,
                          tokenizer=self.tokenizer, prompt_format=self.prompt_format)
        return {"eval/accuracy": float(report.pass_at[1]), "eval/mean_reward": report.mean_score}

    def sets(self, sets: Sequence[EvalSet], sampling: SamplingParams, k: int) -> dict[str, float]:
        """Each named set's ``eval/<name>/...`` figures from ``k`` samples per problem."""
        if not sets:
            return {}
        return evaluate_sets(sets, k, engine=self.engine, reward=self.reward,
                             sampling=dataclasses.replace(sampling, n=k),
                             tokenizer=self.tokenizer, prompt_format=self.prompt_format)


__all__ = ["Evaluator", "check_eval_sets", "named_eval_sets"]
