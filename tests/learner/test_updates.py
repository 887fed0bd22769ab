"""Several updates per rollout batch (``rlx.learner.updates``): the minibatch plan, and a golden
of two PPO updates whose second one is clipped against the old log-probs of the step's start."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.losses import LossConfig
from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
from rlx.learner.step import StepConfig, make_logprob_step, make_train_step
from rlx.learner.updates import plan_minibatches, run_updates, summarise
from rlx.mesh import MeshShape, make_mesh
from rlx.types import Rollout


class Logits(nnx.Module):
    """A policy over two tokens that ignores its input: logits (w0, w1) at every position."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros((1, 2), jnp.float32))


def _forward(model: Logits, batch):
    hidden = jnp.ones((*batch.input_ids.shape, 1), jnp.float32)  # [B, T, 1]
    return hidden, lambda h: h @ model.w[...]  # logits [.., 2] = (w0, w1)


def test_the_plan_deals_every_real_row_once_per_epoch_into_equal_minibatches():
    real = np.array([True] * 6 + [False] * 2)  # 6 rollouts, 2 padding rows
    plan = plan_minibatches(real, epochs=3, minibatches=4, seed=(0, 5))
    assert len(plan) == 12 and {len(p) for p in plan} == {2}
    for epoch in range(3):
        rows = np.concatenate(plan[4 * epoch:4 * epoch + 4])
        assert sorted(rows[real[rows]].tolist()) == list(range(6))  # each real row once
        assert all(real[p].any() for p in plan[4 * epoch:4 * epoch + 4])  # spread evenly
    assert [p.tolist() for p in plan] == [p.tolist() for p in
                                          plan_minibatches(real, 3, 4, seed=(0, 5))]
    orders = {tuple(np.concatenate(plan[4 * e:4 * e + 4]).tolist()) for e in range(3)}
    assert len(orders) > 1  # reshuffled per epoch
    # 2 real rows, 4 minibatches: the two all-padding minibatches take no update
    assert len(plan_minibatches(np.array([True, True] + [False] * 6), 1, 4, (0, 0))) == 2
    assert plan_minibatches(np.ones(4, bool), 1, 1, (0, 0))[0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="6 rows do not split into 4"):
        plan_minibatches(np.ones(6, bool), 1, 4, (0, 0))


def test_second_update_is_clipped_against_the_old_logprobs_of_the_step():
    # Two rows, one completion token each, both sampled at pi = 1/2 (w = 0):
    #   row 0: token 0, advantage +1;  row 1: token 1, advantage -1.
    # PPO-clip (eps 0.2, seq-mean-token-mean), minibatches = 2 in the order row 0, row 1; old
    # log-probs computed once before the first update: log 1/2 for both rows.
    # Update 1 (row 0): r = 1, loss = -r A = -1; d logp(0) / dw = (1 - pi0, -pi1) = (0.5, -0.5),
    #   so g = (-0.5, 0.5). Adam's first step (bias corrected) is -lr * g / |g| per coordinate:
    #   lr 0.25 -> w = (0.25, -0.25).
    # Update 2 (row 1): pi(1) = sigmoid(w1 - w0) = sigmoid(-0.5) = 0.3775407, so
    #   r = 0.3775407 / 0.5 = 0.7550813 < 1 - 0.2 with A = -1: the clipped term is chosen,
    #   -min(r A, clip(r) A) = -min(-0.7550813, -0.8) = 0.8, no gradient (clip_frac 1);
    #   approx_kl = (r - 1) - log r = -0.2449187 + 0.2809298 = 0.0360111.
    # Had the old log-probs been recomputed before update 2, r would be 1 and nothing clipped.
    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    graphdef, state = create_train_state(
        Logits(), make_optimizer(OptimizerConfig(learning_rate=0.25, schedule="constant",
                                                 max_grad_norm=None)), mesh)
    cfg = StepConfig(loss=LossConfig("ppo"))
    opt = OptimizerConfig(learning_rate=0.25, schedule="constant", max_grad_norm=None)
    step = make_train_step(graphdef, state, mesh, cfg, opt, apply_fn=_forward)
    half = np.array([math.log(0.5)], np.float32)
    rollouts = [Rollout("a", np.array([0]), np.array([0]), half),
                Rollout("b", np.array([1]), np.array([1]), half)]
    batch = shard_batch(pad_rollouts(rollouts, np.array([1.0, -1.0])), mesh)
    old = make_logprob_step(graphdef, state.params, state.frozen, mesh, cfg,
                            apply_fn=_forward)(state.params, state.frozen, batch).logp
    batch = batch.replace(old_logp=old)
    state, ((m1, m2),) = run_updates([step], state, batch, [np.array([0]), np.array([1])], mesh)
    # Adam still moves on update 2 (its momentum): m = 0.9 * 0.1 g, v = 0.999 * 0.001 g^2,
    # bias-corrected 0.4736842 g / (0.7069300 |g|): w moves 0.25 * 0.6700582 = 0.1675146 more
    w = np.asarray(jax.tree.leaves(state.params)[0]).ravel()
    # (in f32, Adam's bias correction 1 - 0.999^2 = 0.001999 carries ~1e-5 relative rounding)
    np.testing.assert_allclose(w, [0.4175146, -0.4175146], atol=1e-5)
    assert float(m1.ratio_mean) == pytest.approx(1.0, abs=1e-6)
    assert float(m1.pg_loss) == pytest.approx(-1.0, abs=1e-6)
    assert float(m1.clip_frac) == 0.0 and float(m1.approx_kl) == pytest.approx(0.0, abs=1e-7)
    # 1e-5: Adam's f32 bias corrections (1 - 0.999 = 0.00099998713 in f32) move w by ~2e-6
    assert float(m2.ratio_mean) == pytest.approx(0.7550813, abs=1e-5)
    assert float(m2.pg_loss) == pytest.approx(0.8, abs=1e-6)
    assert float(m2.clip_frac_low) == 1.0 and float(m2.clip_frac) == 1.0
    assert float(m2.approx_kl) == pytest.approx(0.0360111, abs=1e-5)
    assert float(m2.grad_norm) == 0.0
    record = summarise([m1, m2])
    assert record["update_1/clip_frac"] == 1.0 and record["update_0/clip_frac"] == 0.0
    assert record["clip_frac"] == 0.5 and record["updates"] == 2.0
