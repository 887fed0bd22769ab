"""Composition: weighted sums, DAPO overlong shaping, per-reward metrics, registry."""

from __future__ import annotations

import math
import uuid

import pytest

from rlx.rewards import RewardResult, available_rewards, get_reward, register, score_batch
from rlx.rewards.compose import (ComposedReward, OverlongConfig, RewardTerm, from_weights,
                                 overlong_penalty, reward_metrics)
from tests.helpers import ROOT


class Contains:
    """1.0 if the completion contains the sample's `needle`."""

    def __call__(self, completion, sample):
        hit = sample["needle"] in completion
        return RewardResult(float(hit), "found" if hit else "missing", {"needle": sample["needle"]})


class Length:
    """len(completion) / 10, graded in batches (counts batch calls)."""

    def __init__(self):
        self.batch_calls = 0

    def __call__(self, completion, sample):
        return RewardResult(len(completion) / 10, "length")

    def batch(self, completions, samples):
        self.batch_calls += 1
        return [self(c, s) for c, s in zip(completions, samples)]


@pytest.mark.parametrize(
    "tokens, expected",
    [
        # L_max = 100, L_cache = 20: free up to 80 tokens, then (80 - |y|) / 20, then -1.
        (0, 0.0),
        (80, 0.0),
        (81, -0.05),  # (80 - 81) / 20
        (90, -0.5),  # (80 - 90) / 20
        (100, -1.0),  # (80 - 100) / 20
        (101, -1.0),
        (10_000, -1.0),
    ],
)
def test_overlong_penalty_goldens(tokens, expected):
    assert overlong_penalty(tokens, OverlongConfig(max_length=100, cache=20)) == pytest.approx(
        expected
    )


def test_overlong_config_validation():
    with pytest.raises(ValueError):
        OverlongConfig(max_length=10, cache=0)
    with pytest.raises(ValueError):
        OverlongConfig(max_length=10, cache=11)


def test_weighted_sum_with_overlong_shaping():
    length = Length()
    reward = ComposedReward(
        [RewardTerm("hit", Contains(), 1.0), RewardTerm("len", length, 0.5)],
        overlong=OverlongConfig(max_length=100, cache=20, weight=2.0),
    )
    samples = [{"needle": "42"}, {"needle": "7"}]
    results = reward.batch(["x 42 y", "abcd"], samples, num_tokens=[50, 90])
    # first: 1.0 * 1 + 0.5 * 0.6 + 2.0 * 0 = 1.3
    assert results[0].score == pytest.approx(1.3)
    # second: 1.0 * 0 + 0.5 * 0.4 + 2.0 * (80 - 90) / 20 = 0.2 - 1.0 = -0.8
    assert results[1].score == pytest.approx(-0.8)
    assert results[1].components == pytest.approx({"hit": 0.0, "len": 0.4, "overlong": -0.5})
    assert results[0].extra == {"hit/needle": "42"}
    assert "hit: missing" in results[1].reason and "overlong: 90 tokens" in results[1].reason
    assert length.batch_calls == 1  # the batch path of a batch-capable reward is used
    single = reward("x 42 y", {"needle": "42"}, num_tokens=50)
    assert single.score == pytest.approx(1.3)


def test_overlong_needs_token_counts_and_names_must_be_unique():
    reward = ComposedReward([RewardTerm("hit", Contains())], overlong=OverlongConfig(100, 20))
    with pytest.raises(ValueError, match="token count"):
        reward("x", {"needle": "x"})
    with pytest.raises(ValueError, match="unique"):
        ComposedReward([RewardTerm("a", Contains()), RewardTerm("a", Contains())])
    with pytest.raises(ValueError, match="reserved"):
        ComposedReward([RewardTerm("overlong", Contains())], overlong=OverlongConfig(100, 20))


def test_reward_metrics_goldens():
    reward = ComposedReward([RewardTerm("hit", Contains(), 1.0), RewardTerm("len", Length(), 0.5)])
    completions = ["a", "bb", "ccc", "dddd"]
    samples = [{"needle": "a"}, {"needle": "a"}, {"needle": "c"}, {"needle": "c"}]
    metrics = reward_metrics(reward.batch(completions, samples))
    # hit = [1, 0, 1, 0]: mean 0.5, population std 0.5
    hit = metrics.per_reward["hit"]
    assert (hit.mean, hit.std, hit.min, hit.max, hit.count) == pytest.approx(
        (0.5, 0.5, 0.0, 1.0, 4)
    )
    # len = [0.1, 0.2, 0.3, 0.4]: mean 0.25, std sqrt((0.0225 + 0.0025) * 2 / 4) = sqrt(0.0125)
    ln = metrics.per_reward["len"]
    assert ln.mean == pytest.approx(0.25) and ln.std == pytest.approx(math.sqrt(0.0125))
    # total = hit + 0.5 * len = [1.05, 0.1, 1.15, 0.2]: mean 0.625
    assert metrics.total.mean == pytest.approx(0.625)
    assert metrics.total.min == pytest.approx(0.1) and metrics.total.max == pytest.approx(1.15)
    scalars = metrics.scalars()
    assert scalars["reward/hit/mean"] == pytest.approx(0.5)
    assert set(scalars) == {
        f"reward/{n}/{s}" for n in ("total", "hit", "len") for s in ("mean", "std", "min", "max")
    }
    with pytest.raises(ValueError):
        reward_metrics([])


def test_registry_and_from_weights():
    name = f"contains_{uuid.uuid4().hex[:8]}"
    register(name, Contains)
    assert name in available_rewards()
    with pytest.raises(ValueError, match="already registered"):
        register(name, Contains)
    with pytest.raises(KeyError, match="unknown reward"):
        get_reward("no_such_reward")
    with from_weights({name: 2.0, "math_format": 0.5}) as reward:
        result = reward(r"so \boxed{3}", {"needle": "3"})
    # 2.0 * 1 (needle found) + 0.5 * 1 (answer is boxed) = 2.5
    assert result.score == pytest.approx(2.5)
    with pytest.raises(ValueError, match="without a weight"):
        from_weights({name: 1.0}, options={"math": {}})


def test_score_batch_checks_lengths():
    with pytest.raises(ValueError):
        score_batch(Contains(), ["a", "b"], [{"needle": "a"}])
    assert [r.score for r in score_batch(Contains(), ["a", "b"], [{"needle": "a"}] * 2)] == [
        1.0,
        0.0,
    ]


def test_package_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, rlx.rewards\n"
        "heavy = ('sympy', 'math_verify', 'rlx.rewards.sandbox', 'rlx.rewards.math')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "print(heavy)"
    )
    repo = ROOT
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert out.stdout.strip() == "[]"
