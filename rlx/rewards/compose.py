"""Reward composition: weighted sums of named rewards, DAPO overlong shaping, batch metrics.

Overlong shaping follows DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", eq. 13, "soft overlong punishment"). With L_max the maximum response length
and L_cache the punishment interval, a response of |y| tokens gets

    R_length(y) = 0                              if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                = -1                             if |y| > L_max

added to its task reward. Departure from the paper: the penalty is multiplied by
`OverlongConfig.weight` (1 in the paper). Token counts come from the rollout (the reward
functions only see text), so they are passed to `ComposedReward` explicitly. DAPO's other
length measure, masking truncated samples out of the loss ("overlong filtering"), belongs to
the loss, not here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rlx.rewards.base import RewardFn, RewardResult, get_reward, score_batch

OVERLONG = "overlong"


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One named reward and its weight in the sum."""

    name: str
    fn: RewardFn
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
    """DAPO soft overlong punishment."""

    max_length: int  # L_max: maximum response length in tokens
    cache: int  # L_cache: the penalty ramps from 0 to -1 over the last `cache` tokens
    weight: float = 1.0  # scale of the penalty (the paper uses 1)

    def __post_init__(self):
        if not 0 < self.cache <= self.max_length:
            raise ValueError("OverlongConfig needs 0 < cache <= max_length")


def overlong_penalty(num_tokens: int, config: OverlongConfig) -> float:
    """DAPO's R_length for a response of `num_tokens` tokens (unweighted, in [-1, 0])."""
    start = config.max_length - config.cache
    if num_tokens <= start:
        return 0.0
    if num_tokens <= config.max_length:
        return (start - num_tokens) / config.cache
    return -1.0


class ComposedReward:
    """score = sum_i weight_i * score_i (+ overlong.weight * R_length when configured).

    `components` of each result holds every term's unweighted score (and "overlong"), for
    `reward_metrics`; `extra` keys are prefixed with the term name.
    """

    def __init__(self, terms: Sequence[RewardTerm], overlong: OverlongConfig | None = None):
        names = [t.name for t in terms]
        if not terms or len(set(names)) != len(names):
            raise ValueError(f"reward terms need unique names, got {names}")
        if overlong is not None and OVERLONG in names:
            raise ValueError(f"{OVERLONG!r} is reserved for the overlong penalty")
        self.terms = tuple(terms)
        self.overlong = overlong

    def __call__(
        self, completion: str, sample: Mapping[str, Any], num_tokens: int | None = None
    ) -> RewardResult:
        lengths = None if num_tokens is None else [num_tokens]
        return self.batch([completion], [sample], lengths)[0]

    def batch(
        self,
        completions: Sequence[str],
        samples: Sequence[Mapping[str, Any]],
        num_tokens: Sequence[int] | None = None,
    ) -> list[RewardResult]:
        if self.overlong is not None and num_tokens is None:
            raise ValueError("overlong shaping needs the token count of every completion")
        if num_tokens is not None and len(num_tokens) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(num_tokens)} token counts")
        per_term = [score_batch(t.fn, completions, samples) for t in self.terms]
        out = []
        for i in range(len(completions)):
            parts = [(t, results[i]) for t, results in zip(self.terms, per_term)]
            length = None if num_tokens is None else int(num_tokens[i])
            out.append(self._combine(parts, length))
        return out

    def _combine(
        self, parts: list[tuple[RewardTerm, RewardResult]], num_tokens: int | None
    ) -> RewardResult:
        total = sum(t.weight * r.score for t, r in parts)
        components = {t.name: r.score for t, r in parts}
        reasons = [f"{t.name}: {r.reason}" for t, r in parts]
        extra = {f"{t.name}/{k}": v for t, r in parts for k, v in r.extra.items()}
        if self.overlong is not None and num_tokens is not None:
            penalty = overlong_penalty(num_tokens, self.overlong)
            total += self.overlong.weight * penalty
            components[OVERLONG] = penalty
            reasons.append(f"{OVERLONG}: {num_tokens} tokens, penalty {penalty:.3g}")
        return RewardResult(
            score=total, reason="; ".join(reasons), extra=extra, components=components
        )

    def close(self) -> None:
        for t in self.terms:
            close = getattr(t.fn, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> ComposedReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def from_weights(
    weights: Mapping[str, float],
    options: Mapping[str, Mapping[str, Any]] | None = None,
    overlong: OverlongConfig | None = None,
) -> ComposedReward:
    """Builds registered rewards by name, e.g. `from_weights({"math": 1.0, "math_format": 0.1})`;
    `options[name]` are keyword arguments for that reward."""
    options = options or {}
    unknown = set(options) - set(weights)
    if unknown:
        raise ValueError(f"options given for rewards without a weight: {sorted(unknown)}")
    terms = [
        RewardTerm(n, get_reward(n, **options.get(n, {})), float(w)) for n, w in weights.items()
    ]
    return ComposedReward(terms, overlong)


@dataclasses.dataclass(frozen=True)
class RewardStats:
    """Summary of one reward over a batch (population std)."""

    mean: float
    std: float
    min: float
    max: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> RewardStats:
        if not values:
            raise ValueError("no values")
        mean = math.fsum(values) / len(values)
        var = math.fsum((v - mean) ** 2 for v in values) / len(values)
        return cls(
            mean=mean, std=math.sqrt(var), min=min(values), max=max(values), count=len(values)
        )


@dataclasses.dataclass(frozen=True)
class RewardMetrics:
    """Batch statistics of the total reward and of each named component."""

    total: RewardStats
    per_reward: Mapping[str, RewardStats]

    def scalars(self, prefix: str = "reward") -> dict[str, float]:
        """Flat `{"reward/<name>/<stat>": value}` for a metrics logger (total under "total")."""
        named = {"total": self.total, **self.per_reward}
        return {
            f"{prefix}/{name}/{field}": float(getattr(stats, field))
            for name, stats in named.items()
            for field in ("mean", "std", "min", "max")
        }


def reward_metrics(results: Sequence[RewardResult]) -> RewardMetrics:
    """Mean/std/min/max of the total score and of every component name in `results`."""
    if not results:
        raise ValueError("reward_metrics needs at least one result")
    names = sorted({name for r in results for name in r.components})
    per_reward = {
        name: RewardStats.of([r.components[name] for r in results if name in r.components])
        for name in names
    }
    return RewardMetrics(total=RewardStats.of([r.score for r in results]), per_reward=per_reward)
