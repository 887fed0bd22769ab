"""Reward records, the reward-function protocol and a name registry.

A reward function maps one completion (the generated text) and its ground-truth sample (a
mapping from the data set: gold answer, unit tests, ...) to a `RewardResult`. Functions that can
grade many completions faster together (a process pool, a sandbox pool) also offer `batch`; use
`score_batch` to call either kind. A reward that counts things across calls (the judge's
failed requests) offers `take_metrics()`, read once per step through `take_metrics(fn)`.

Built-in rewards are registered by dotted path and imported only when asked for, so importing
`rlx.rewards` stays cheap (no sympy, no subprocess machinery).
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

ExtraValue = float | int | str | bool


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The outcome of grading one completion.

    score: the reward (for built-in rewards 0..1 unless shaped, e.g. by an overlong penalty).
    reason: a short human-readable explanation ("correct", "no answer found", "2/5 tests").
    extra: reward-specific facts (extracted answer, tests passed, isolation level ...).
    components: for composed rewards, the unweighted score of each named part.
    """

    score: float
    reason: str = ""
    extra: Mapping[str, ExtraValue] = dataclasses.field(default_factory=dict)
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def zero(cls, reason: str, **extra: ExtraValue) -> RewardResult:
        """A score-0 result with a reason, e.g. for unusable completions."""
        return cls(score=0.0, reason=reason, extra=dict(extra))


@runtime_checkable
class RewardFn(Protocol):
    """`(completion, sample) -> RewardResult`; must not raise on any completion text."""

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> RewardResult: ...


@runtime_checkable
class BatchRewardFn(RewardFn, Protocol):
    """A reward function that also grades a batch (results in input order)."""

    def batch(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]: ...


def score_batch(
    fn: RewardFn, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
) -> list[RewardResult]:
    """Grades `completions[i]` against `samples[i]`, using `fn.batch` when it exists."""
    if len(completions) != len(samples):
        raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
    if isinstance(fn, BatchRewardFn):
        return list(fn.batch(completions, samples))
    return [fn(c, s) for c, s in zip(completions, samples)]


def take_metrics(fn: RewardFn) -> dict[str, float]:
    """What a reward counted since the last call (the judge's errors, requests, cache hits) as
    flat metrics, from its optional `take_metrics()`; {} for a reward that counts nothing."""
    take = getattr(fn, "take_metrics", None)
    return dict(take()) if callable(take) else {}


CHAT_KEY = "chat"  # the sample key of the prompt's messages (`reads_chat`)


def reads_chat(fn: RewardFn) -> bool:
    """Whether `fn` grades the prompt too (a reward model: its attribute `reads_chat` is True);
    its samples then carry the prompt's messages, role/content dicts, under `CHAT_KEY`."""
    return bool(getattr(fn, "reads_chat", False))


RewardFactory = Callable[..., RewardFn]

# name -> "module:attribute" of a factory; imported on first use.
_BUILTIN: dict[str, str] = {
    "math": "rlx.rewards.math:MathReward",
    "math_format": "rlx.rewards.math:FormatReward",
    "code": "rlx.rewards.code:CodeReward",
    "tool_call": "rlx.rewards.bfcl:CallReward",
    "judge": "rlx.rewards.judge:JudgeReward",
}
_REGISTRY: dict[str, RewardFactory] = {}
_LOCK = threading.Lock()


def register(name: str, factory: RewardFactory | None = None):
    """Registers `factory` under `name`; usable as `register("x", f)` or `@register("x")`."""

    def _add(f: RewardFactory) -> RewardFactory:
        with _LOCK:
            if name in _REGISTRY or name in _BUILTIN:
                raise ValueError(f"reward {name!r} is already registered")
            _REGISTRY[name] = f
        return f

    return _add if factory is None else _add(factory)


def available_rewards() -> list[str]:
    """All registered reward names, built-in ones included."""
    with _LOCK:
        return sorted(set(_BUILTIN) | set(_REGISTRY))


def get_reward(name: str, **kwargs: Any) -> RewardFn:
    """Builds the reward registered as `name` with keyword options, e.g.
    `get_reward("math", timeout_s=2.0)`."""
    with _LOCK:
        factory = _REGISTRY.get(name)
        target = _BUILTIN.get(name)
    if factory is None and target is not None:
        module_name, attr = target.split(":")
        factory = getattr(importlib.import_module(module_name), attr)
    if factory is None:
        raise KeyError(f"unknown reward {name!r}; known: {', '.join(available_rewards())}")
    return factory(**kwargs)
