"""KL in the reward (``loss.kl_as="reward-penalty"``): the exact penalty on a hand-made batch.

The learner's side of a step (``rlx.run.learn.StepLearner.prepare``) runs on four rollouts with
stand-ins for the compiled log-prob and value steps, so every number is set by hand: reference
log-probs -1 on every token, the policy's -1 + d with d per completion, k1 estimator (KL_t = d).
Completion i's tokens are 10 (i + 1), 10 (i + 1) + 1, ...: the stand-ins and the checks find each
completion by its tokens, so the same numbers hold for padded rows and packed ones.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import parse_config
from rlx.learner.step import Compiled
from rlx.mesh import make_mesh
from rlx.run.hosts import Hosts
from rlx.run.learn import StepLearner
from rlx.types import LogProbs, Rollout
from tests.helpers.runs import config_dict

D = np.array([0.5, 0.0, 2.0, 0.0])  # per-token log pi_old - log pi_ref of each completion
LENGTHS = (2, 3, 1, 2)


def _rollouts():
    return [Rollout(uid, np.array([5, 6]), 10 * (i + 1) + np.arange(n), np.zeros(n, np.float32),
                    sample_index=j) for i, ((uid, j), n) in enumerate(zip(
                        [("a", 0), ("a", 1), ("b", 0), ("b", 1)], LENGTHS))]


def _learner(tmp_path, pack: bool, **over) -> StepLearner:
    cfg = parse_config(config_dict("tiny", tmp_path, **{
        "loss.kl_as": "reward-penalty", "loss.kl_coef": 0.1, "loss.kl_estimator": "k1",
        "train.pack": pack, **over}))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=8),
                              rollout=dataclasses.replace(cfg.rollout, max_new_tokens=8))
    by_token = jnp.asarray(np.concatenate([np.zeros(10), np.repeat(D, 10)]))  # d of each token id

    def ref(params, frozen, batch):
        return LogProbs(jnp.where(batch.loss_mask > 0, -1.0, 0.0), None)

    def old(params, frozen, batch):
        return LogProbs(jnp.where(batch.loss_mask > 0, -1.0 + by_token[batch.input_ids], 0.0), None)

    state = type("State", (), {"params": None, "frozen": None, "ref": None})()
    compiled = Compiled(graphdef=None, state=state, train_step=None, ref_step=ref, old_step=old,
                        value_step=lambda s, batch: jnp.zeros(batch.shape, jnp.float32))
    return StepLearner(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), compiled, Hosts())


def _per_completion(prepared, field: str) -> list[np.ndarray]:
    """``field`` on each completion's loss tokens, in order, wherever its row and columns are."""
    batch = prepared.batch
    ids, mask = np.asarray(batch.input_ids), np.asarray(batch.loss_mask) > 0
    values = np.asarray(getattr(batch, field))
    return [values[mask & (ids // 10 == i + 1)] for i in range(len(LENGTHS))]


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_penalty_is_subtracted_from_the_sequence_reward_before_grpo(tmp_path, pack):
    learner = _learner(tmp_path, pack)
    prepared = learner.prepare(_rollouts(), np.array([1.0, 0.0, 1.0, 1.0]),
                               np.array(["a", "a", "b", "b"]), np.arange(4))
    assert (prepared.batch.shape[0] == 1) == pack  # packed: 4 + 5 + 3 + 4 tokens in one row of 16
    # penalty 0.1 * sum_t KL_t: 0.1 * (2 x 0.5) = 0.1, 0, 0.1 * 2.0 = 0.2, 0
    # rewards 1, 0, 1, 1 -> 0.9, 0.0, 0.8, 1.0; GRPO (std ddof 1) per prompt:
    #   a: mean 0.45, std sqrt(2 x 0.45^2 / 1) = 0.6364: +-0.45 / 0.6364 = +-0.7071
    #   b: mean 0.9, std sqrt(2 x 0.1^2 / 1) = 0.1414: -+0.1 / 0.1414 = -+0.7071 (without the
    #   penalty b's rewards are equal: advantages 0)
    want = [0.7071068, -0.7071068, -0.7071068, 0.7071068]
    for got, a, n in zip(_per_completion(prepared, "advantages"), want, LENGTHS):
        np.testing.assert_allclose(got, [a] * n, atol=1e-5)
    assert prepared.record["reward/kl_penalty"] == pytest.approx((0.1 + 0.2) / 4)
    mask = np.asarray(prepared.batch.loss_mask) > 0
    assert np.all(np.asarray(prepared.batch.advantages)[~mask] == 0)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_penalty_is_subtracted_from_every_token_reward_before_gae(tmp_path, pack):
    learner = _learner(tmp_path, pack, **{"train.advantage": "gae", "critic.enabled": True,
                                          "critic.gamma": 1.0, "critic.lam": 1.0})
    prepared = learner.prepare(_rollouts(), np.array([1.0, 0.0, 1.0, 1.0]),
                               np.array(["a", "a", "b", "b"]), np.arange(4))
    # token rewards: -0.1 x KL_t on every token, + the reward on the last one; values 0, so
    # the returns (gamma = lambda = 1) are the sums of the rewards from each token on:
    #   completion 0: [-0.05, 0.95] -> [0.9, 0.95]; 1: 0 everywhere; 2: [1 - 0.2] -> [0.8];
    #   3: [0, 1] -> [1, 1]
    want = [[0.9, 0.95], [0, 0, 0], [0.8], [1.0, 1.0]]
    for got, w in zip(_per_completion(prepared, "returns"), want):
        np.testing.assert_allclose(got, w, atol=1e-6)
    assert np.all(np.asarray(prepared.batch.old_values) == 0)
    on = np.concatenate(want)  # advantages: the returns (values 0) whitened over the 8 tokens
    adv = np.concatenate(_per_completion(prepared, "advantages"))
    np.testing.assert_allclose(adv, (on - on.mean()) / np.sqrt(on.var() + 1e-8), atol=1e-5)
    assert prepared.record["reward/kl_penalty"] == pytest.approx((0.1 + 0.2) / 4)
