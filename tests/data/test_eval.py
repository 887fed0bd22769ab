"""pass@k: the unbiased estimator against hand-derived values, and `evaluate` end to end."""

from __future__ import annotations

import math

import pytest

from rlx.data.eval import evaluate, pass_at_k
from rlx.data.sources import user_example
from rlx.rewards import RewardResult, available_rewards, get_reward, register
from rlx.types import SamplingParams
from tests.helpers.replay import ReplayEngine
from tests.helpers.tokenizers import byte_tokenizer


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 2 / 5),  # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    (10, 1, 5, 1 - 126 / 252),  # 1 - C(9,5)/C(10,5) = 1 - 126/252 = 0.5
    (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4) = 1 - 35/210 = 5/6
    (3, 1, 3, 1.0),  # n - c = 2 < k = 3: some correct sample is always drawn
    (4, 0, 2, 0.0),
    (4, 4, 1, 1.0),
    (200, 10, 100, 1 - math.comb(190, 100) / math.comb(200, 100)),
])
def test_pass_at_k_goldens(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def exact(completion: str, sample) -> RewardResult:
    return RewardResult(float(completion.strip() == sample["answer"]))


def test_evaluate_reports_pass_at_1_and_k():
    tok = byte_tokenizer()
    examples = [user_example("a", "toy", "1+1", answer="2"),
                user_example("b", "toy", "2+2", answer="4")]
    # a: 2 of 4 samples right -> pass@1 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6.
    # b: 0 of 4 right -> 0 and 0. Means: pass@1 = 0.25, pass@2 = 5/12.
    engine = ReplayEngine(tok, {"a": ["2", "3"], "b": ["5"]})
    report = evaluate(engine, examples, exact, k=2, sampling=SamplingParams(n=4),
                      tokenizer=tok, batch_size=1, keep_completions=True)
    assert report.pass_at[1] == pytest.approx(0.25)
    assert report.pass_at[2] == pytest.approx(5 / 12)
    assert report.mean_score == pytest.approx(2 / 8)
    first = report.records[0]
    assert first.uid == "a" and first.correct == 2 and first.n == 4
    assert first.completions == ("2", "3", "2", "3")
    with pytest.raises(ValueError, match="sampling.n >= 8"):
        evaluate(engine, examples, exact, k=8, sampling=SamplingParams(n=4), tokenizer=tok)


class ClosingExact:
    """An exact-match reward that records being closed."""

    closed = 0

    def __call__(self, completion, sample):
        return exact(completion, sample)

    def close(self):
        ClosingExact.closed += 1


def test_evaluate_builds_a_named_reward_and_closes_it():
    if "test-exact-closing" not in available_rewards():
        register("test-exact-closing", ClosingExact)
    tok = byte_tokenizer()
    examples = [user_example("a", "toy", "1+1", answer="2")]
    before = ClosingExact.closed
    report = evaluate(ReplayEngine(tok, {"a": ["2"]}), examples, "test-exact-closing", k=1,
                      sampling=SamplingParams(n=1), tokenizer=tok)
    assert report.pass_at == {1: 1.0} and ClosingExact.closed == before + 1


def test_evaluate_with_the_math_reward():
    tok = byte_tokenizer()
    examples = [user_example("half", "toy", "1/2 as a fraction?", answer="\\frac{1}{2}")]
    engine = ReplayEngine(tok, {"half": ["It is \\boxed{0.5}.", "\\boxed{2}"]})
    math = get_reward("math", timeout_s=20.0, hard_timeout_s=60.0)  # generous on a busy CPU
    try:
        report = evaluate(engine, examples, math, k=2, sampling=SamplingParams(n=2),
                          tokenizer=tok)
    finally:
        math.close()
    assert report.records[0].scores == (1.0, 0.0)
    assert report.pass_at == {1: 0.5, 2: 1.0}
