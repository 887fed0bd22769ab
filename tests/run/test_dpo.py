"""DPO through the run (``train.algorithm="dpo"``) on the tiny config: pairs from a JSONL file,
the reference the adapter switched off; the preference margin rises, the engine serves the
trained policy, and a file with an empty side is refused before anything is loaded."""

import json

import numpy as np
import pytest

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.run.build import build
from rlx.run.checks import check_before_build
from tests.helpers.runs import config_dict, run_config

WORDS = ["yes no", "red blue", "up down", "cat dog", "one two", "sun moon", "hot cold",
         "left right", "day night", "in out", "big small", "fast slow"]


def _pairs(path, empty_at: int | None = None) -> str:
    with open(path, "w") as f:
        for i, w in enumerate(WORDS):
            chosen, rejected = w.split()
            f.write(json.dumps({"prompt": f"Pick {i}", "chosen": chosen,
                                "rejected": "" if i == empty_at else rejected}) + "\n")
    return f"pairs:{path}"


def test_dpo_raises_the_preference_margin_on_a_tiny_model(tmp_path):
    cfg = run_config("tiny", tmp_path, **{
        "mesh.data": 8, "train.algorithm": "dpo", "data.source": _pairs(tmp_path / "p.jsonl"),
        "data.prompts_per_step": 8, "data.eval_size": 0, "train.steps": 6,
        "optim.learning_rate": 1e-2, "train.checkpoint_every": 0, "loss.kl_coef": 0.0})
    run = build(cfg, progress=False)
    try:
        records = [r for r in run.train() if "dpo/loss" in r]
        assert run.engine.weight_version == 6
    finally:
        run.close()
    margin = [r["dpo/reward_margin"] for r in records]
    assert margin[0] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference
    assert np.mean(margin[-2:]) > 0.05 and records[-1]["dpo/reward_accuracy"] >= 0.75, margin
    assert records[-1]["dpo/loss"] < np.log(2) - 0.01
    assert all(r["dpo/pairs"] == 8 for r in records)


def test_a_pair_with_an_empty_side_is_refused_naming_the_file_and_line(tmp_path):
    source = _pairs(tmp_path / "bad.jsonl", empty_at=2)
    cfg = parse_config(config_dict("tiny", tmp_path, **{
        "mesh.data": 8, "train.algorithm": "dpo", "data.source": source,
        "data.prompts_per_step": 8}))
    with pytest.raises(ConfigError, match=r"^config.data.source='pairs:.*bad.jsonl': .*bad.jsonl: "
                                          r"line 3: field 'rejected' is empty"):
        check_before_build(cfg, 8)
