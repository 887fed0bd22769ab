"""Held-out evaluation: pass@k with the unbiased estimator of Chen et al. (2021).

For a problem with `n` sampled completions of which `c` are correct,
    pass@k = 1 - C(n - c, k) / C(n, k),
the probability that at least one of `k` completions drawn without replacement from the `n` is
correct; averaged over problems it is an unbiased estimate of pass@k (taking the best of only
`k` samples per problem is not). We evaluate the ratio as a product,
    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i),
as the paper's reference code does, which stays exact in floating point for large `n`.
A completion counts as correct when its reward is at least `success_threshold`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from rlx.data.chat import PromptFormat, encode_prompt
from rlx.data.sources import Example, content_key
from rlx.models.tokenizer import Tokenizer
from rlx.rewards import RewardFn, get_reward, score_batch
from rlx.rewards.base import reads_chat
from rlx.types import Prompt, Rollout, RolloutEngine, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct out of `n` samples (needs k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclasses.dataclass(frozen=True)
class EvalRecord:
    """One problem's samples and its pass@k estimates."""

    uid: str
    scores: tuple[float, ...]  # reward of each sample
    correct: int  # samples with score >= success_threshold
    pass_at: Mapping[int, float]  # k -> pass@k of this problem
    completions: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        return len(self.scores)


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """pass@k averaged over problems, and the per-problem records."""

    pass_at: Mapping[int, float]
    mean_score: float  # mean reward over all samples
    records: tuple[EvalRecord, ...]


def distinct_examples(source: Sequence[Example], count: int) -> list[Example]:
    """The first `count` examples of `source` with pairwise different prompts (for eval sets
    drawn from procedural sources, whose small problem spaces repeat)."""
    chosen, seen = [], set()
    for index in range(len(source)):
        if len(chosen) == count:
            break
        example = source[index]
        key = content_key(example.messages)
        if key not in seen:
            seen.add(key)
            chosen.append(example)
    if len(chosen) < count:
        raise ValueError(f"only {len(chosen)} distinct examples, {count} asked for")
    return chosen


def evaluate(
    engine: RolloutEngine,
    examples: Sequence[Example],
    reward: RewardFn | str,
    *,
    k: int,
    sampling: SamplingParams,
    tokenizer: Tokenizer,
    prompt_format: PromptFormat = PromptFormat(),
    success_threshold: float = 1.0,
    batch_size: int | None = None,
    keep_completions: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> EvalReport:
    """Samples `sampling.n` completions per example and reports pass@1 and pass@k.

    `reward` is a reward function or a registered name (then built here and closed after);
    `on_batch(count)` is called after each batch of `count` problems is graded (a progress bar).
    """
    if sampling.n < k:
        raise ValueError(f"pass@{k} needs sampling.n >= {k}, got n={sampling.n}")
    if not examples:
        raise ValueError("evaluate needs at least one example")
    grader = get_reward(reward) if isinstance(reward, str) else reward
    ks = sorted({1, k})
    step = batch_size or len(examples)
    records: list[EvalRecord] = []
    try:
        for start in range(0, len(examples), step):
            chunk = examples[start:start + step]
            prompts = [Prompt(e.uid, tuple(encode_prompt(tokenizer, e, prompt_format)))
                       for e in chunk]
            rollouts = engine.generate(prompts, sampling)
            _check_order(rollouts, chunk, sampling.n)
            texts = [tokenizer.decode(r.completion_ids, skip_special_tokens=True)
                     for r in rollouts]
            samples = [e.reward_sample(reads_chat(grader)) for e in chunk for _ in range(sampling.n)]
            scores = [r.score for r in score_batch(grader, texts, samples)]
            for i, example in enumerate(chunk):
                mine = slice(i * sampling.n, (i + 1) * sampling.n)
                correct = sum(s >= success_threshold for s in scores[mine])
                records.append(EvalRecord(
                    uid=example.uid, scores=tuple(scores[mine]), correct=correct,
                    pass_at={kk: pass_at_k(sampling.n, correct, kk) for kk in ks},
                    completions=tuple(texts[mine]) if keep_completions else (),
                ))
            if on_batch is not None:
                on_batch(len(chunk))
    finally:
        if isinstance(reward, str) and hasattr(grader, "close"):
            grader.close()  # built here (e.g. math grading workers): ours to stop
    return EvalReport(
        pass_at={kk: float(np.mean([r.pass_at[kk] for r in records])) for kk in ks},
        mean_score=float(np.mean([s for r in records for s in r.scores])),
        records=tuple(records),
    )


def _check_order(rollouts: Sequence[Rollout], chunk: Sequence[Example], n: int) -> None:
    if len(rollouts) != len(chunk) * n:
        raise RuntimeError(f"engine returned {len(rollouts)} rollouts for {len(chunk)} prompts "
                           f"x n={n}")
    for i, example in enumerate(chunk):
        got = rollouts[i * n].prompt_uid
        if got != example.uid:
            raise RuntimeError(f"rollout {i * n} is for prompt {got!r}, not {example.uid!r}")
