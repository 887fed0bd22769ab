"""One step of the tiny run with ``train.reward="judge"``: the rollouts are judged by a local
OpenAI-compatible server (``tests.helpers.judge_server``) that fails every second request; the
failures are counted in the step's record and the step completes."""

import json
import os
import re

import pytest

from rlx.run.build import build
from tests.helpers.judge_server import FaultyJudge
from tests.helpers.runs import run_config


def test_a_step_judged_by_a_failing_server_counts_its_errors_and_trains(tmp_path):
    with FaultyJudge(fail_every=2) as server:
        cfg = run_config("tiny", tmp_path, **{
            "train.reward": "judge", "data.eval_size": 0, "train.checkpoint_every": 0, "mesh.data": 8,
            "judge.base_url": server.url, "judge.model": "judge-model", "judge.max_retries": 0,
            "judge.max_concurrency": 2})
        run = build(cfg, progress=False)
        try:
            record = run.step()
        finally:
            run.close()
    n = cfg.data.prompts_per_step * cfg.rollout.group_size
    assert record["reward/judge_scored"] == n
    assert record["reward/judge_requests"] == len(server.requests) >= 2
    assert record["reward/judge_errors"] >= server.failed >= 1  # a failed verdict may serve twins
    assert record["reward/judge_errors"] == record["reward/judge_errors/http_500"]
    # every verdict that came back is "Score: 7" -> 0.7, every failure 0 (error_score)
    rate = record["reward/judge_error_rate"]
    assert record["reward/mean"] == pytest.approx(0.7 * (1 - rate))
    assert all(re.search(r"Question:\n.*\d+ \+ \d+", r["messages"][0]["content"])
               for r in server.requests)  # the sample's question reached the judge
    assert record["learner/loss"] == record["learner/loss"]  # the update ran (not NaN)
    with open(os.path.join(cfg.output_dir, "samples.jsonl"), encoding="utf-8") as f:
        reasons = [json.loads(line)["reason"] for line in f]
    assert reasons and all(r.startswith(("judge 7", "judge failed (http_500)")) for r in reasons)
