"""Named eval sets in a run: checked at build, counted against the training data, logged per set."""

from __future__ import annotations

import json
import logging

import pytest

from rlx.errors import ConfigError
from rlx.io.metrics import read_metrics
from rlx.rewards import RewardResult, available_rewards, register
from rlx.run.build import build
from rlx.run.heldout import check_eval_sets
from tests.helpers.runs import run_config

REWARD = "test-yes-full-credit"


def yes_full_credit(completion: str, sample) -> RewardResult:
    """1 when the problem's answer is "yes", else 0.25, whatever the completion."""
    return RewardResult(1.0 if sample["answer"] == "yes" else 0.25)


@pytest.mark.parametrize("overrides,message", [
    ({"data.eval_sources": ("nope:x",)}, "unknown source prefix 'nope'"),
    ({"data.eval_sources": ("mmath:aime24",), "data.eval_samples": 4},
     "set rollout.eval_temperature > 0"),
    ({"data.eval_sources": ("mmath:aime24",), "env.kind": "tools"}, "scored single-turn"),
])
def test_bad_settings_get_one_line(tmp_path, overrides, message):
    cfg = run_config("tiny", tmp_path, **overrides)
    with pytest.raises(ConfigError, match=message) as e:
        check_eval_sets(cfg)
    assert "\n" not in str(e.value)


def test_eval_samples_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="eval_samples=0 must be >= 1"):
        run_config("tiny", tmp_path, **{"data.eval_samples": 0})


@pytest.mark.slow  # about 30 s (the tiny model's build); the metrics' arithmetic runs in CI in
# tests/data/test_eval_sets.py, the loop's evaluation in tests/run/test_loop.py
def test_tiny_run_logs_each_set(tmp_path, caplog):
    if REWARD not in available_rewards():
        register(REWARD, lambda: yes_full_credit)
    two = tmp_path / "two.jsonl"  # one "yes" problem, one "no" problem
    two.write_text(json.dumps({"prompt": "Is 2 even?", "answer": "yes"}) + "\n"
                   + json.dumps({"prompt": "Is 3 even?", "answer": "no"}) + "\n")
    train = tmp_path / "train.jsonl"  # holds "is 2 even?" (as the eval set, up to case)
    train.write_text("".join(json.dumps({"prompt": p, "answer": "yes"}) + "\n"
                             for p in ("is 2 EVEN?", "Is 4 even?", "Is 6 even?")))
    cfg = run_config("tiny", tmp_path, **{
        "data.source": f"jsonl:{train}", "data.eval_size": 0, "data.eval_samples": 2,
        "data.eval_sources": (f"pair=jsonl:{two}", "mmath:aime25"),
        "rollout.eval_temperature": 1.0, "rollout.max_new_tokens": 2, "train.reward": REWARD,
        "train.steps": 0, "mesh.data": 8})
    with caplog.at_level(logging.INFO, logger="rlx.run.heldout"):
        run = build(cfg, progress=False)
    try:
        assert [s.name for s in run.eval_sets] == ["pair", "aime25"] and not run.eval_set
        record = run.evaluate()
        summary = run.summary()
    finally:
        run.close()
    # pair: rewards 1, 1 ("yes") and 0.25, 0.25 ("no"): pass@1 = (2/2 + 0/2) / 2 = 0.5,
    # mean@2 = (1 + 1 + 0.25 + 0.25) / 4 = 0.625, pass@2 = (1 + 0) / 2 = 0.5.
    # aime25: 15 problems, no answer is "yes": every reward 0.25, nothing correct.
    assert {k: v for k, v in record.items() if k.startswith("eval/")} == {
        "eval/pair/pass@1": 0.5, "eval/pair/mean@2": 0.625, "eval/pair/pass@2": 0.5,
        "eval/aime25/pass@1": 0.0, "eval/aime25/mean@2": 0.25, "eval/aime25/pass@2": 0.0}
    logged = read_metrics(f"{cfg.output_dir}/metrics.jsonl")
    assert any(r.get("eval/pair/mean@2") == 0.625 for r in logged)
    assert ("eval sets at step 0: pair pass@1 50.0% mean@2 0.62 pass@2 50.0%; "
            "aime25 pass@1 0.0% mean@2 0.25 pass@2 0.0%") in summary
    lines = [r.getMessage() for r in caplog.records if "contamination" in r.getMessage()]
    # the 3 training problems all fall in the train split (rlx.data.sources.split_of at 0.1);
    # "is 2 EVEN?" is "Is 2 even?" once normalised: 1 of 3 in pair, none in aime25
    assert sorted(line.split("/train.jsonl: ", 1)[1].split(" (")[0] for line in lines) == [
        "1 of 3 training problems are also in eval set 'pair'",
        "none of 3 training problems is in eval set 'aime25'"], lines
