"""The LLM judge reward (``rlx.rewards.judge``) against a local OpenAI-compatible server that
injects faults (``tests.helpers.judge_server``): scores, retries, timeouts, bad replies, the
cache and the concurrency limit, each seen from the server's side too."""

from __future__ import annotations

import logging
import time

import pytest

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.rewards import get_reward, score_batch, take_metrics
from rlx.rewards.judge import DEFAULT_RUBRIC, JudgeConfig, JudgeReward, fill_rubric, parse_score
from tests.helpers.judge_server import FaultyJudge

RUBRIC = "Q: {prompt}\nRef: {reference}\nA: {completion}\nGrade it."
SAMPLE = {"prompt": "What is 2 + 3?", "answer": "5"}


def _judge(server: FaultyJudge, **over) -> JudgeReward:
    options = {"base_url": server.url, "model": "judge-model", "rubric": RUBRIC, "timeout_s": 5.0,
               "max_retries": 1, "backoff_s": 0.01, **over}
    return JudgeReward(JudgeConfig(**options))


def test_scores_are_parsed_from_the_last_match_and_mapped_to_0_1():
    cfg = JudgeConfig()
    assert parse_score("Fine.\nScore: 7", cfg).score == pytest.approx(0.7)  # (7 - 0) / (10 - 0)
    assert parse_score("Score: 2 ... on reflection **Score:** 8/10", cfg).raw == 8.0
    assert parse_score("score = 10", cfg).score == 1.0
    five = JudgeConfig(score_min=1, score_max=5)
    assert parse_score("Score: 4", five).score == pytest.approx(0.75)  # (4 - 1) / (5 - 1)
    assert parse_score("Score: 11", cfg).error == "out_of_range"
    assert parse_score("I like it", cfg).error == "unparsable"
    digit = JudgeConfig(score_pattern=r"(\d+)")
    assert parse_score("Your answer is 5.", digit).score == pytest.approx(0.5)
    # one pass: a completion quoting a placeholder is not filled in again
    assert fill_rubric("{completion}|{reference}", "q", "{reference}", "5") == "{reference}|5"
    assert "{prompt}" in DEFAULT_RUBRIC and "Score: N" in DEFAULT_RUBRIC


def test_bad_settings_are_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^config\.judge\.score_max=1.0 must be > score_min"):
        parse_config({"judge": {"score_min": 1.0, "score_max": 1.0}})
    with pytest.raises(ConfigError, match=r"^config\.judge\.score_pattern needs a group"):
        parse_config({"judge": {"score_pattern": r"Score: \d+"}})
    with pytest.raises(ConfigError, match=r"^config\.judge\.base_url='' and config\.judge\.model"):
        get_reward("judge")
    with pytest.raises(ConfigError, match=r"^config\.judge\.rubric_file='.*nope.txt' cannot be"):
        JudgeReward(base_url="http://h/v1", model="m", rubric_file=str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match=r"^config\.judge\.api_key_env='RLX_NO_SUCH_KEY' names"):
        JudgeReward(base_url="http://h/v1", model="m", api_key_env="RLX_NO_SUCH_KEY")


def test_a_normal_verdict_and_what_the_server_was_sent(tmp_path):
    rubric = tmp_path / "rubric.txt"
    rubric.write_text(RUBRIC)
    with FaultyJudge() as server, _judge(server, rubric="", rubric_file=str(rubric),
                                         max_reply_tokens=32) as judge:
        results = judge.batch(["It is 5. score:9", "It is 6. score:3"], [SAMPLE, SAMPLE])
        assert [r.score for r in results] == pytest.approx([0.9, 0.3])  # 9 / 10, 3 / 10
        assert results[0].extra["judge_score"] == 9.0 and "Score: 9" in results[0].reason
        sent = sorted(server.requests, key=lambda b: b["messages"][0]["content"])
        assert [b["messages"] for b in sent] == [[{"role": "user", "content": fill_rubric(
            RUBRIC, "What is 2 + 3?", c, "5")}] for c in ("It is 5. score:9", "It is 6. score:3")]
        assert all(b["model"] == "judge-model" and b["temperature"] == 0 and b["max_tokens"] == 32
                   for b in sent)
        metrics = take_metrics(judge)
        assert metrics["reward/judge_scored"] == 2 and metrics["reward/judge_errors"] == 0
        assert metrics["reward/judge_requests"] == 2 and metrics["reward/judge_error_rate"] == 0
        assert take_metrics(judge)["reward/judge_scored"] == 0  # counts since the last call


def test_a_slow_server_times_out_and_gives_the_fallback_score():
    with FaultyJudge(slow_s=3.0) as server, _judge(server, timeout_s=0.3,
                                                   error_score=-1.0) as judge:
        start = time.perf_counter()
        (result,) = score_batch(judge, ["case:slow"], [SAMPLE])
        assert time.perf_counter() - start < 2.5  # two tries of 0.3 s, not the server's 3 s
        assert result.score == -1.0 and result.extra["judge_error"] == "timeout"
        assert "after 2 tries" in result.reason
        assert len(server.requests) == 2  # the first try and one retry
        metrics = take_metrics(judge)
        assert metrics["reward/judge_errors"] == 1 and metrics["reward/judge_errors/timeout"] == 1
        assert metrics["reward/judge_retries"] == 1 and metrics["reward/judge_error_rate"] == 1.0


def test_an_http_500_is_retried_and_the_retry_scores():
    with FaultyJudge() as server, _judge(server) as judge:
        (result,) = judge.batch(["case:500once score:6"], [SAMPLE])
        assert result.score == pytest.approx(0.6) and server.failed == 1
        assert len(server.requests) == 2
        metrics = take_metrics(judge)
        assert metrics["reward/judge_errors"] == 0 and metrics["reward/judge_retries"] == 1


def test_failures_are_counted_by_kind_and_logged_once_each(caplog):
    faults = ["case:500", "case:malformed", "case:nochoices", "case:text"]
    with FaultyJudge() as server, _judge(server) as judge:
        with caplog.at_level(logging.WARNING, logger="rlx.rewards.judge"):
            results = judge.batch([*faults, "score:8"], [SAMPLE] * 5)
            again = judge.batch(faults, [SAMPLE] * 4)  # failures are not cached: asked again
        assert [r.score for r in results] == pytest.approx([0, 0, 0, 0, 0.8])
        assert [r.extra.get("judge_error") for r in results + again] == [
            "http_500", "malformed", "malformed", "unparsable", None, *(
                ["http_500", "malformed", "malformed", "unparsable"])]
        # 500, malformed JSON and no choices are tried twice; a reply without a score once
        assert len(server.requests) == 2 * (2 + 2 + 2 + 1) + 1
        metrics = take_metrics(judge)
        assert metrics["reward/judge_errors"] == 8 and metrics["reward/judge_scored"] == 9
        assert metrics["reward/judge_error_rate"] == pytest.approx(8 / 9)
        assert {k: v for k, v in metrics.items() if k.startswith("reward/judge_errors/")} == {
            "reward/judge_errors/http_500": 2, "reward/judge_errors/malformed": 4,
            "reward/judge_errors/unparsable": 2}
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 3, warnings  # one per kind, the first time only
        assert any("http_500" in w and "injected fault" in w for w in warnings)


def test_an_identical_question_is_answered_from_the_cache():
    with FaultyJudge() as server, _judge(server) as judge:
        first = judge.batch(["score:4", "score:4", "score:5"], [SAMPLE] * 3)
        assert len(server.requests) == 2  # the duplicate in the batch is judged once
        second = judge(completion="score:4", sample=SAMPLE)
        assert len(server.requests) == 2 and second.score == first[0].score
        assert second.extra["cached"] is True and first[0].extra["cached"] is False
        judge(completion="score:4", sample={**SAMPLE, "answer": "6"})  # another reference
        assert len(server.requests) == 3
        assert take_metrics(judge)["reward/judge_cache_hits"] == 2
    with FaultyJudge() as server, _judge(server, cache_size=0) as judge:
        judge.batch(["score:4"], [SAMPLE])
        judge.batch(["score:4"], [SAMPLE])
        assert len(server.requests) == 2


def test_at_most_max_concurrency_requests_are_in_flight():
    with FaultyJudge(delay_s=0.3) as server, _judge(server, max_concurrency=3) as judge:
        completions = [f"answer {i} score:{i}" for i in range(9)]
        results = judge.batch(completions, [SAMPLE] * 9)
        assert [r.score for r in results] == pytest.approx([i / 10 for i in range(9)])
        assert server.max_in_flight == 3 and len(server.requests) == 9


def test_a_server_that_is_gone_is_a_connection_error():
    with FaultyJudge() as server:
        url = server.url
    judge = JudgeReward(base_url=url, model="m", max_retries=1, backoff_s=0.01, timeout_s=2.0)
    with judge:
        (result,) = judge.batch(["score:5"], [SAMPLE])
        assert result.score == 0.0 and result.extra["judge_error"] == "connection"
        metrics = take_metrics(judge)
        assert metrics["reward/judge_requests"] == 2 and metrics["reward/judge_errors/connection"] == 1
