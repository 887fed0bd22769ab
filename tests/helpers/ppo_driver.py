"""PPO with a learned critic on the tiny config, in a process of its own on one CPU device.

Run as ``python -m tests.helpers.ppo_driver OUTPUT_DIR``; the run's records land in
``OUTPUT_DIR/tiny/metrics.jsonl``, its export (``Run.export``) in ``OUTPUT_DIR/export``. The task (``tests/run/test_ppo.py`` says why) has a delayed
reward, paid at the end of each 4-token completion: half for the share of completion tokens that
start a word (the policy's choices), half for prompts naming "gold" (no choice changes it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WORDS = 4  # rollout.max_new_tokens
REWARD = "toy:gold_and_words"
OVERRIDES = {
    "train.mode": "full", "quant.format": "none", "loss.kl_coef": 0.0,
    "train.advantage": "gae", "critic.enabled": True, "critic.learning_rate": 3e-3,
    "critic.lam": 1.0, "train.epochs": 2, "train.minibatches": 4, "data.template": "{prompt}",
    "data.prompts_per_step": 4, "rollout.group_size": 8, "rollout.max_new_tokens": WORDS,
    "data.eval_size": 16, "train.steps": 20, "train.reward": REWARD,
    "optim.learning_rate": 1e-2, "train.checkpoint_every": 0, "train.sample_every": 0}


def _gold_and_words(completion: str, sample):
    from rlx.rewards import RewardResult

    words = min(1.0, completion.count(" ") / WORDS)
    return RewardResult(0.5 * (sample["answer"] == "gold") + 0.5 * words, "gold and words")


def main(out: str) -> None:
    from rlx.rewards.base import register
    from rlx.run.build import build
    from tests.helpers.runs import run_config

    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "boxes.jsonl")
    with open(data, "w") as f:
        for i in range(200):
            kind = ("gold", "tin")[i % 2]
            f.write(json.dumps({"prompt": f"{kind} {kind} {kind} {kind} box {i}",
                                "answer": kind}) + "\n")
    register(REWARD, lambda **_: _gold_and_words)
    run = build(run_config("tiny", Path(out), **{**OVERRIDES, "data.source": f"jsonl:{data}"}),
                progress=False)
    try:
        run.train()
        run.export(os.path.join(out, "export"))  # the policy and the critic, apart
    finally:
        run.close()


if __name__ == "__main__":
    main(sys.argv[1])
