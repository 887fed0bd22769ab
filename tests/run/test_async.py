"""One-step-off asynchronous rollouts: the bookkeeping that makes them correct.

A random tiny model (shrunken SmolLM2, its real tokenizer, all parameters trained) is rewarded
for the share of its completion tokens that start a new word, so that advantages are not zero and
every update moves the policy. Both modes run the same seeds, data and hyper-parameters; only
``train.max_staleness`` differs. Checked: the first step (nothing to overlap yet) is the
synchronous step exactly; later batches are one version old and corrected by truncated importance
weights; both modes consume exactly the same prompt batches.
"""


import json

import pytest

from rlx.rewards import RewardResult
from rlx.rewards.base import available_rewards, register
from rlx.run.build import build
from tests.helpers.runs import run_config

STEPS = 3
REWARD = "toy:word_starts"


def _word_starts(completion: str, sample) -> RewardResult:
    words = completion.split(" ")
    if not completion:
        return RewardResult(0.0, "empty completion")
    return RewardResult(min(1.0, (len(words) - 1) / 8), "words")  # 8 = rollout.max_new_tokens


if REWARD not in available_rewards():
    register(REWARD, lambda **_: _word_starts)


def _train(tmp_path, staleness: int) -> tuple[list[dict], object]:
    cfg = run_config("tiny", tmp_path / f"s{staleness}", **{
        "mesh.data": 8, "train.mode": "full", "quant.format": "none", "loss.kl_coef": 0.0,
        "data.prompts_per_step": 4, "rollout.group_size": 8, "rollout.max_new_tokens": 8,
        "data.eval_size": 0, "train.steps": STEPS, "train.reward": REWARD,
        "train.max_staleness": staleness, "train.checkpoint_every": 1,
        "data.template": "{prompt}", "optim.learning_rate": 1e-2})
    run = build(cfg, progress=False)
    try:
        records = [r for r in run.train() if "reward/mean" in r]
        return records, run.data.get_state()
    finally:
        run.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return {s: _train(tmp, s) for s in (0, 1)}


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not k.startswith(("time/", "throughput/")) and k != "wall_time"}


def test_first_step_is_the_synchronous_step_and_the_data_is_the_same(runs):
    (sync, sync_data), (one_off, one_off_data) = runs[0], runs[1]
    assert len(sync) == len(one_off) == STEPS
    assert _stable(sync[0]) == _stable(one_off[0])  # same batch, seed and weights: bit-identical
    assert sync_data == one_off_data  # no batch skipped or fetched twice (no prefetch past the end)
    assert [r["reward/mean"] for r in sync[1:]] != [r["reward/mean"] for r in one_off[1:]]


def test_checkpoints_hold_the_position_after_the_trained_batch(tmp_path_factory, runs):
    """Mid-run checkpoints of a one-step-off run (a batch already fetched ahead) save the data
    position after the last trained batch, as the synchronous run does, and the batch in flight
    with its rollouts (exact resume: tests/run/test_resume.py)."""
    root = tmp_path_factory.getbasetemp()

    def saved(staleness, step):
        (path,) = root.glob(f"async[0-9]*/s{staleness}/tiny/checkpoints/{step}/meta/metadata")
        return json.loads(path.read_text())["position"]

    for step in (STEPS - 1, STEPS):  # mid-run (a batch in flight) and at the end
        assert saved(0, step)["data_shards"] == saved(1, step)["data_shards"]
        assert saved(0, step)["in_flight"] == []
    in_flight = saved(1, STEPS - 1)["in_flight"]
    assert [f["step"] for f in in_flight] == [STEPS - 1]  # the next step trains on it
    (done,) = [p["done"] for p in in_flight[0]["progress"]]
    assert len(done) == 4 * 8 and {r["weight_version"] for r in done} == {STEPS - 2}
    assert saved(1, STEPS)["in_flight"] == []  # nothing is fetched past the last step


def test_one_step_off_rollouts_are_one_version_old_and_importance_weighted(runs):
    sync, one_off = runs[0][0], runs[1][0]
    assert all(r["rollout/staleness"] == 0 for r in sync)
    assert one_off[0]["rollout/staleness"] == 0  # the first batch is generated on-policy
    assert all(r["rollout/staleness"] == 1 for r in one_off[1:])
    # sync: sampler == learner, weights 1; one-step-off: the policy moved, TIS reweights
    assert all(r["learner/mismatch_abs_max"] < 1e-4 for r in sync)
    assert all(r["learner/mismatch_abs_max"] > 1e-2 for r in one_off[1:])
    assert all(0 < r["learner/tis_weight_mean"] and r["learner/tis_weight_max"] <= 2.0
               for r in one_off)
