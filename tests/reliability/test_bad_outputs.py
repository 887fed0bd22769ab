"""Bad model output scores 0 with a reason, through the real grading path.

Already covered elsewhere (not repeated): 13 unusable completions for the math reward
(tests/rewards/test_math.py), 4 for the code reward and 8 hostile programs
(tests/rewards/test_code.py), 6 malformed tool-call blocks (tests/envs/test_tool_calls.py),
malformed calls, the turn limit and the token budget in whole episodes (tests/envs/test_episode.py).

Here, graded by `MathReward` in its worker process: 12 generations with no answer, 7 huge or
pathological ones, 5 token sequences that decode to invalid UTF-8, 200 generated id sequences
(invalid UTF-8, ids past the vocabulary; ids outside [0, 2**32) raised OverflowError before
the fix), and 4 turns of malformed tool calls in the tool environment. The reason of each
zero reaches the composed reward result that the training metrics are computed from.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.data.sources import user_example
from rlx.envs import Calculator, ToolEnv, ToolEnvConfig
from rlx.rewards.compose import ComposedReward, RewardTerm, reward_metrics
from rlx.rewards.math import MathReward
from rlx.models.tokenizer import TokenizerError, _byte_alphabet
from tests.helpers.tokenizers import byte_tokenizer

GRADED_ZERO = ("wrong answer", "answer unparsable", "grading error: ", "grading timed out")


@pytest.fixture(scope="module")
def grader():
    with MathReward(workers=1, timeout_s=2.0, hard_timeout_s=8.0) as reward:
        yield reward


# --------------------------------------------------------------------------------- no answer
NO_ANSWER = [
    "I think it is one.",
    "Let me compute 17 + 25 step by step: 17 + 20 = 37, 37 + 5 = 42",
    "<think>" + "hmm, " * 2000,  # cut off while thinking
    "\\boxed{",
    "\\boxed{ }",
    "\\fbox{}",
    "#### ",
    "The answer is",
    "The answer is .",
    "Answer: $$",
    "$ $ $",
    "\ufffd\ufffd\ufffd",
]


@pytest.mark.parametrize("completion", NO_ANSWER)
def test_no_answer_scores_zero_with_a_reason(grader, completion):
    result = grader(completion, {"answer": "42"})
    assert result.score == 0.0 and result.reason == "no answer found"


# ---------------------------------------------------------------------------------- huge ones
HUGE = {
    "a million characters": ("x" * 1_000_000, "completion longer than 100000"),
    "20k boxed answers": ("\\boxed{1}" * 20_000, "completion longer than 100000"),
    "a 5000-digit answer": ("\\boxed{" + "9" * 5000 + "}", "answer longer than 1000 characters"),
    "100k unclosed boxes": ("\\boxed{" * 14_000, "no answer found"),
    "400 nested braces": ("\\boxed{" + "{" * 400 + "2" + "}" * 400 + "}", GRADED_ZERO),
    "a 990-character sum": ("\\boxed{" + "1+" * 495 + "}", GRADED_ZERO),
    "a tower of powers": ("\\boxed{9^{9^{9^{9^{9}}}}}", GRADED_ZERO),
}


@pytest.mark.parametrize("completion, reason", HUGE.values(), ids=HUGE.keys())
def test_huge_output_scores_zero_with_a_reason(grader, completion, reason):
    start = time.monotonic()
    result = grader(completion, {"answer": "3"})
    assert result.score == 0.0
    assert result.reason.startswith(reason), result.reason
    assert time.monotonic() - start < 15.0  # the 2 s grading deadline, the 8 s worker kill


def test_a_long_output_with_the_right_answer_still_scores(grader):
    assert grader("x" * 99_000 + " so \\boxed{3}", {"answer": "3"}).score == 1.0


# -------------------------------------------------------------------- invalid UTF-8 sequences
def _byte(tok, value: int) -> int:
    """The id of the single-byte token for `value` (the byte tokenizer has one per byte)."""
    return tok.backend.token_to_id(_byte_alphabet()[value])


def _invalid_sequences(tok) -> dict[str, tuple[list[int], float, str]]:
    euro = tok.encode("€")  # 3 bytes: e2 82 ac
    return {  # ids, expected score, expected reason (prefix)
        "lone continuation byte before": (
            [_byte(tok, 0x80)] + tok.encode("so \\boxed{4}"), 1.0, "correct"),
        "character cut after": (tok.encode("so \\boxed{4} ") + euro[:2], 1.0, "correct"),
        "cut character inside the box": (tok.encode("\\boxed{4") + euro[:1] + tok.encode("}"),
                                         0.0, GRADED_ZERO),
        "only broken bytes": ([_byte(tok, b) for b in (0xff, 0xfe, 0xc3, 0x28)], 0.0,
                              "no answer found"),
        "overlong encoding of '/'": ([_byte(tok, 0xc0), _byte(tok, 0xaf)], 0.0,
                                     "no answer found"),
    }


def test_invalid_utf8_token_sequences_are_graded(grader):
    tok = byte_tokenizer()
    for name, (ids, score, reason) in _invalid_sequences(tok).items():
        text = tok.decode(ids)
        assert isinstance(text, str) and "\ufffd" in text, name
        result = grader(text, {"answer": "4"})
        assert result.score == score and result.reason.startswith(reason), (name, result)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 400), max_size=40))
def test_any_ids_in_the_id_range_decode_to_text(ids):
    tok = byte_tokenizer()  # 258 ids: 259..400 are past the vocabulary, as in a padded embedding
    text = tok.decode(ids)
    text.encode("utf-8")  # valid text: broken bytes became U+FFFD, no lone surrogates
    assert tok.decode([i for i in ids if i >= tok.vocab_size]) == ""


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64])
def test_ids_no_token_can_have_raise_a_tokenizer_error(bad):
    with pytest.raises(TokenizerError, match=f"token id {bad} at position 1"):
        byte_tokenizer().decode([65, bad])


# ------------------------------------------------------------------------ malformed tool calls
TASK = user_example("calc:1", "toy", "Compute 17*23 with the calculator.", answer="391")


def test_malformed_calls_then_no_answer_scores_zero(grader):
    env = ToolEnv([Calculator()], grader, ToolEnvConfig(max_turns=4, max_calls_per_turn=2))
    env.reset(TASK)
    turn = env.step("<tool_call>{'name': 'calculator'}</tool_call>"  # not JSON
                    '<tool_call>{"name": "calculator", "arguments": {"expression": '
                    + "9" * 5000 + "}}</tool_call>"  # a number Python refuses to parse
                    + '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    assert not turn.done and turn.reward == 0.0 and turn.info.tool_calls == 0
    errors = turn.info.tool_errors
    assert "not valid JSON" in errors[0] and "4300 digits" in errors[1]
    assert "more than 2 tool calls" in errors[2]
    turn = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}'
                    "</tool_call><tool_call>{\"name\": \"calculator\"")
    assert turn.info.tool_calls == 1 and "unterminated" in turn.info.tool_errors[-1]
    final = env.step("I could not compute it.")
    assert final.done and final.reward == 0.0
    assert final.info.reward_result.reason == "no answer found"


def test_malformed_calls_on_the_last_turn_score_zero(grader):
    env = ToolEnv([Calculator()], grader, ToolEnvConfig(max_turns=1))
    env.reset(TASK)
    final = env.step("<tool_call>{broken</tool_call>")
    assert final.done and final.reward == 0.0 and final.info.reason == "turn_limit"
    assert final.info.reward_result.reason == "tool calls on the last allowed turn (1)"


def test_a_turn_of_ten_thousand_blocks_is_answered_quickly(grader):
    env = ToolEnv([Calculator()], grader, ToolEnvConfig(max_turns=4, max_calls_per_turn=4))
    env.reset(TASK)
    start = time.monotonic()
    turn = env.step("<tool_call>{}</tool_call>" * 10_000)
    assert time.monotonic() - start < 5.0
    assert len(turn.observation.messages) == 10_000 and turn.info.tool_calls == 0
    assert all(m.content.startswith("error: ") for m in turn.observation.messages)


# --------------------------------------------------------------------- reasons reach metrics
def test_zero_reasons_reach_the_composed_result(grader):
    composed = ComposedReward([RewardTerm("math", grader)])
    results = composed.batch(["no idea", "x" * 200_000, "\\boxed{391}"],
                             [{"answer": "391"}] * 3)
    assert [r.reason for r in results] == [
        "math: no answer found", "math: completion longer than 100000 characters",
        "math: correct"]
    metrics = reward_metrics(results).scalars()
    assert metrics["reward/math/mean"] == pytest.approx(1 / 3)
