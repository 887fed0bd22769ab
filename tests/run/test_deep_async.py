"""Deeper asynchrony (``train.max_staleness = 2``) with partial rollouts (``rollout.partial``) on
the tiny config: two batches in flight, each generated in 3 segments of the 8-token budget (3, 3
and 2 tokens), one segment per step, so a completion spans weight syncs and continues with the
newest weights. The schedule is fixed by the order of the engine's queue, so every token's version
is known. A random tiny model trains every parameter on a reward that varies per sample, so each
update moves the policy. The batch of step c starts at step c - 2 (step 0's three batches all start with version
0), takes a segment per step, and is finished by step c with version c."""

import numpy as np
import pytest

from rlx.learner.batching import pad_rollouts
from rlx.rewards import RewardResult
from rlx.rewards.base import available_rewards, register
from rlx.run.build import build
from rlx.types import Rollout
from tests.helpers.runs import run_config

REWARD = "toy:spaces"  # varies per sample, so every update moves the (random) policy


def _spaces(completion: str, sample) -> RewardResult:
    return RewardResult(completion.count(" ") / 8, "spaces")


if REWARD not in available_rewards():
    register(REWARD, lambda **_: _spaces)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    cfg = run_config("tiny", tmp_path_factory.mktemp("deep"), **{
        "mesh.data": 8, "train.mode": "full", "quant.format": "none", "loss.kl_coef": 0.0,
        "train.reward": REWARD, "data.template": "{prompt}", "optim.learning_rate": 1e-2,
        "train.max_staleness": 2, "rollout.partial": True,
        "rollout.max_new_tokens": 8, "data.eval_size": 0,
        "train.steps": 4, "train.checkpoint_every": 0})
    # every completion max_new_tokens long, so each spans every segment
    run = build(cfg, progress=False, sampling_overrides={"ignore_eos": True, "stop_token_ids": ()})
    try:
        out = [r for r in run.train() if "reward/mean" in r]
        assert run.engine.weight_version == 4 and run.queue.in_flight == 0  # none past the end
        return out
    finally:
        run.close()


def test_batches_and_tokens_are_as_stale_as_the_schedule_says(records):
    # step 0: sampled now (version 0). step 1: segment 1 at step 0 (v0), 2 and 3 at step 1 (v1).
    # steps 2 and 3: segment 1 two versions back, 2 one back, 3 current.
    assert [r["rollout/staleness"] for r in records] == [0, 1, 2, 2]  # by the oldest token
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 2, 2]
    assert [r["rollout/token_staleness_max"] for r in records] == [0, 1, 2, 2]
    want = [0.0, 3 / 8, (2 * 3 + 1 * 3) / 8, (2 * 3 + 1 * 3) / 8]
    np.testing.assert_allclose([r["rollout/token_staleness"] for r in records], want)
    assert all(r["response_length/mean"] == 8 for r in records)  # segments join seamlessly


def test_stale_tokens_are_importance_weighted(records):
    # on-policy step 0: sampler == learner; later, tokens of older versions differ from the
    # learner's current log-probs and truncated importance sampling weights them
    assert records[0]["learner/mismatch_abs_max"] < 1e-4
    assert all(r["learner/mismatch_abs_max"] > 1e-3 for r in records[2:])
    assert all(r["learner/tis_weight_mean"] != 1.0 for r in records[2:])


def test_each_token_keeps_its_version_in_the_batch():
    r = Rollout("u", np.array([1, 2]), np.array([5, 6, 7]), np.zeros(3, np.float32),
                weight_version=3, token_versions=np.array([3, 4, 4]))
    batch = pad_rollouts([r], np.zeros(1))
    assert batch.weight_version[0, :5].tolist() == [3, 3, 3, 4, 4]  # prompt, then per token
