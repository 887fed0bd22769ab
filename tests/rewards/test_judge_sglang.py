"""The LLM judge against a real SGLang server on the CPU serving SmolLM2-135M-Instruct (rlx's f32
export of the GGUF file, with its tokenizer and chat template) through SGLang's OpenAI-compatible
``/v1/chat/completions``.

A 135M model is a poor judge: this checks the plumbing (requests, replies, parsing, counting,
the cache), not its verdicts. Skipped only when the SGLang environment is absent (``.ci/run``
creates it).
"""

import os

import pytest
import requests

from rlx.models import to_hf
from rlx.models.loading import load_gguf
from rlx.rewards import take_metrics
from rlx.rewards.judge import JudgeConfig, JudgeReward, fill_rubric, parse_score
from rlx.rollout.sglang.server import ServerSpec, SGLangServer
from tests.helpers import SMOLLM2_FILE, smollm2_dir
from tests.helpers.sglang_harness import (SGLANG_PYTHON, cpu_server_args, cpu_server_env,
                                          sglang_available)

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not sglang_available(), reason=f"no SGLang at {SGLANG_PYTHON}")]

NAME = "smollm2-judge"  # --served-model-name
# the tiny model seldom writes "Score: N"; asked for a rating it often writes a number
RUBRIC = ('On a scale from 0 to 10, how good is this answer to the question "{prompt}"?\n'
          "Answer: {completion}\nRating (a number from 0 to 10):")
PAIRS = [("What is 2 + 3?", "The answer is 5.", "5"), ("What is 2 + 3?", "The answer is 7.", "5"),
         ("What is the capital of France?", "Paris.", "Paris"),
         ("What is the capital of France?", "Berlin.", "Paris")]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("judge-sglang"))
    loaded = load_gguf(os.path.join(smollm2_dir(), SMOLLM2_FILE))
    folder = os.path.join(tmp, "smollm2")
    to_hf(loaded.model, folder, tokenizer=loaded.tokenizer)  # f32 weights, chat template
    spec = ServerSpec(python=SGLANG_PYTHON, model_path=folder,
                      extra_args=cpu_server_args(0) + ("--served-model-name", NAME),
                      env=cpu_server_env(os.path.join(tmp, "harness")),
                      log_path=os.path.join(tmp, "server.log"))
    with SGLangServer(spec) as server:
        yield server.url


def test_smollm2_on_sglang_judges_a_batch_end_to_end(server_url):
    cfg = JudgeConfig(base_url=f"{server_url}/v1", model=NAME, rubric=RUBRIC,
                      score_pattern=r"(\d+(?:\.\d+)?)", max_reply_tokens=16, max_concurrency=4,
                      timeout_s=300.0)
    samples = [{"prompt": q, "answer": ref} for q, _, ref in PAIRS]
    completions = [c for _, c, _ in PAIRS]
    with JudgeReward(cfg) as judge:
        # one question alone, and the same asked of SGLang with a plain HTTP request: same reply
        q, c, ref = PAIRS[0]
        body = {"model": NAME, "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": fill_rubric(RUBRIC, q, c, ref)}]}
        reply = requests.post(f"{server_url}/v1/chat/completions", json=body, timeout=300).json()
        first = judge(c, samples[0])
        assert parse_score(reply["choices"][0]["message"]["content"], cfg).reason == first.reason
        take_metrics(judge)
        results = judge.batch(completions, samples)  # the first from the cache if it scored
        metrics = take_metrics(judge)
        # a healthy server answers every request at the first try
        hit = "judge_error" not in first.extra
        assert metrics["reward/judge_requests"] == len(PAIRS) - hit
        assert metrics["reward/judge_retries"] == 0 and metrics["reward/judge_cache_hits"] == hit
        failed = [r for r in results if "judge_error" in r.extra]
        assert metrics["reward/judge_errors"] == len(failed)
        assert {r.extra["judge_error"] for r in failed} <= {"unparsable", "out_of_range"}
        scored = [r for r in results if "judge_error" not in r.extra]
        assert len(scored) >= 1, [r.reason for r in results]  # parse rate: at least 1 of 4
        for r in scored:  # a rating N in [0, 10] -> N / 10
            assert 0.0 <= r.score <= 1.0 and r.score == pytest.approx(r.extra["judge_score"] / 10)
        print(f"SmolLM2 judge: {len(scored)}/{len(PAIRS)} replies parsed;",
              [r.reason for r in results])
        # verdicts are cached, failures asked again
        again = judge.batch(completions, samples)
        assert take_metrics(judge)["reward/judge_requests"] == len(failed)
        assert all(a.score == r.score and a.extra["cached"] for a, r in zip(again, results)
                   if "judge_error" not in r.extra)
