"""KL in the reward (``loss.kl_as="reward-penalty"``): the exact penalty on a hand-made batch.

The learner's side of a step (``rlx.run.learn.StepLearner.prepare``) runs on four rollouts with
stand-ins for the compiled log-prob and value steps, so every number is set by hand: reference
log-probs -1 on every token, the policy's -1 + d with d per completion, k1 estimator (KL_t = d).
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
    return [Rollout(uid, np.array([5, 6]), np.arange(10, 10 + n), np.zeros(n, np.float32),
                    sample_index=j) for (uid, j), n in zip(
                        [("a", 0), ("a", 1), ("b", 0), ("b", 1)], LENGTHS)]


def _learner(tmp_path, **over) -> StepLearner:
    cfg = parse_config(config_dict("tiny", tmp_path, **{
        "loss.kl_as": "reward-penalty", "loss.kl_coef": 0.1, "loss.kl_estimator": "k1", **over}))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=8),
                              rollout=dataclasses.replace(cfg.rollout, max_new_tokens=8))
    rows = jnp.asarray(np.pad(D, (0, 4)))  # the batch pads to 8 rows (bucketed)

    def ref(params, frozen, batch):
        return LogProbs(jnp.where(batch.loss_mask > 0, -1.0, 0.0), None)

    def old(params, frozen, batch):
        return LogProbs(jnp.where(batch.loss_mask > 0, -1.0 + rows[:batch.shape[0], None], 0.0),
                        None)

    state = type("State", (), {"params": None, "frozen": None})()
    compiled = Compiled(graphdef=None, state=state, train_step=None, ref_step=ref, old_step=old,
                        value_step=lambda s, batch: jnp.zeros(batch.shape, jnp.float32))
    return StepLearner(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), compiled, Hosts())


def test_penalty_is_subtracted_from_the_sequence_reward_before_grpo(tmp_path):
    learner = _learner(tmp_path)
    prepared = learner.prepare(_rollouts(), np.array([1.0, 0.0, 1.0, 1.0]),
                               np.array(["a", "a", "b", "b"]), np.arange(4))
    # penalty 0.1 * sum_t KL_t: 0.1 * (2 x 0.5) = 0.1, 0, 0.1 * 2.0 = 0.2, 0
    # rewards 1, 0, 1, 1 -> 0.9, 0.0, 0.8, 1.0; GRPO (std ddof 1) per prompt:
    #   a: mean 0.45, std sqrt(2 x 0.45^2 / 1) = 0.6364: +-0.45 / 0.6364 = +-0.7071
    #   b: mean 0.9, std sqrt(2 x 0.1^2 / 1) = 0.1414: -+0.1 / 0.1414 = -+0.7071 (without the
    #   penalty b's rewards are equal: advantages 0)
    adv = np.asarray(prepared.batch.advantages)
    mask = np.asarray(prepared.batch.loss_mask) > 0
    want = [0.7071068, -0.7071068, -0.7071068, 0.7071068]
    for row, (a, n) in enumerate(zip(want, LENGTHS)):
        np.testing.assert_allclose(adv[row][mask[row]], [a] * n, atol=1e-5)
    assert prepared.record["reward/kl_penalty"] == pytest.approx((0.1 + 0.2) / 4)
    assert np.all(adv[~mask] == 0)


def test_penalty_is_subtracted_from_every_token_reward_before_gae(tmp_path):
    learner = _learner(tmp_path, **{"train.advantage": "gae", "critic.enabled": True,
                                    "critic.gamma": 1.0, "critic.lam": 1.0})
    prepared = learner.prepare(_rollouts(), np.array([1.0, 0.0, 1.0, 1.0]),
                               np.array(["a", "a", "b", "b"]), np.arange(4))
    # token rewards: -0.1 x KL_t on every token, + the reward on the last one; values 0, so
    # the returns (gamma = lambda = 1) are the sums of the rewards from each token on:
    #   row 0: [-0.05, 0.95] -> [0.9, 0.95]; row 1: 0 everywhere; row 2: [1 - 0.2] -> [0.8];
    #   row 3: [0, 1] -> [1, 1]
    ret, mask = np.asarray(prepared.batch.returns), np.asarray(prepared.batch.loss_mask) > 0
    want = [[0.9, 0.95], [0, 0, 0], [0.8], [1.0, 1.0]]
    for row, w in enumerate(want):
        np.testing.assert_allclose(ret[row][mask[row]], w, atol=1e-6)
    assert np.all(np.asarray(prepared.batch.old_values) == 0)
    on = np.concatenate(want)  # advantages: the returns (values 0) whitened over the 8 tokens
    adv = np.concatenate([np.asarray(prepared.batch.advantages)[r][mask[r]] for r in range(4)])
    np.testing.assert_allclose(adv, (on - on.mean()) / np.sqrt(on.var() + 1e-8), atol=1e-5)
    assert prepared.record["reward/kl_penalty"] == pytest.approx((0.1 + 0.2) / 4)
