"""PPO's critic (``rlx.learner.critic``) and GAE for a run (``rlx.learner.advantages``): goldens,
the LoRA critic on the policy's frozen base, and one critic update lowering the value loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.learner.advantages import explained_variance, gae_advantages, token_rewards, whiten
from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.critic import init_critic, make_critic_step, make_value_step, value_head
from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
from rlx.mesh import MeshShape, make_mesh
from tests.helpers.steps import TINY, add_qlora, random_rollouts, tiny_model


def test_token_rewards_gae_and_whitening_golden():
    mask = np.array([[0, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]], np.float32)  # row 2: padding
    kl = np.full((3, 4), 0.5)
    # reward on each row's last loss token; -0.1 * 0.5 on every loss token
    want = [[0, -0.05, -0.05, 0.95], [0, -0.05, 1.95, 0], [0, 0, 0, 0]]
    np.testing.assert_allclose(token_rewards([1.0, 2.0], mask, kl, 0.1), want, atol=1e-12)
    # gamma 1, lambda 1, values v: A_t = (sum of rewards from t) - v_t
    values = np.array([[9, 0.5, 0.25, 0.0], [9, 1.0, 0.0, 9], [0, 0, 0, 0]], np.float64)
    adv, ret = gae_advantages([1.0, 2.0], values, mask, 1.0, 1.0)
    raw = np.array([[0, 0.5, 0.75, 1.0], [0, 1.0, 2.0, 0], [0, 0, 0, 0]])  # [1,1,1]-v, [2,2]-v
    np.testing.assert_allclose(ret, [[0, 1, 1, 1], [0, 2, 2, 0], [0, 0, 0, 0]], atol=1e-6)
    # whitened over the 5 loss tokens (0.5, 0.75, 1, 1, 2): mean 1.05, var 6.8125 / 5 - 1.05^2 = 0.26
    on = raw[mask > 0]
    assert on.mean() == pytest.approx(1.05) and on.var() == pytest.approx(0.26)
    np.testing.assert_allclose(adv, np.where(mask > 0, (raw - 1.05) / np.sqrt(0.26 + 1e-8), 0),
                               atol=1e-6)
    np.testing.assert_allclose(whiten(np.ones((2, 2)), np.zeros((2, 2))), 0)
    # explained variance: 1 - var(ret - v) / var(ret) over loss tokens
    ev = explained_variance(values, ret, mask)
    resid, r = (ret - values)[mask > 0], ret[mask > 0]
    assert ev == pytest.approx(1 - resid.var() / r.var())
    assert np.isnan(explained_variance(values, np.ones((3, 4)), mask))


def _lora_state(mesh):
    model = add_qlora(tiny_model(0, head_scale=10.0))
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-2, schedule="constant"))
    graphdef, state = create_train_state(model, opt, mesh, trainable=nnx.LoRAParam)
    critic_opt = make_optimizer(OptimizerConfig(learning_rate=1e-2, schedule="constant"))
    critic = init_critic(state.params, value_head(TINY.hidden_size), critic_opt)
    return graphdef, state.replace(critic=critic), opt, model


def test_lora_critic_is_a_second_adapter_on_the_same_base_and_learns_its_targets():
    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    graphdef, state, opt, model = _lora_state(mesh)
    assert state.critic.frozen is None  # no base of its own: it runs on state.frozen
    assert jax.tree.structure(state.critic.params["body"]) == jax.tree.structure(state.params)
    assert all(a is not b for a, b in zip(jax.tree.leaves(state.critic.params["body"]),
                                          jax.tree.leaves(state.params)))  # its own adapter
    rollouts = random_rollouts(8, TINY.vocab_size, seed=3)
    batch = shard_batch(pad_rollouts(rollouts, np.zeros(8)), mesh)
    value_step = make_value_step(graphdef, state, mesh, opt)
    v0 = np.asarray(value_step(state, batch))
    assert np.all(v0 == 0)  # the head starts at zero
    # aligned like log-probs: V(s_t) = head(hidden[t - 1]); a head of ones sums the hidden state
    head = {"kernel": jnp.ones((TINY.hidden_size,)), "bias": jnp.float32(0.5)}
    probe = state.replace(critic=state.critic.replace(
        params={**state.critic.params, "head": head}))
    hidden = nnx.merge(graphdef, state.params, state.frozen).hidden_states(
        batch.input_ids, batch.positions, batch.segment_ids)  # the critic's adapter is B = 0 too
    want = np.pad(np.asarray(hidden.sum(-1))[:, :-1] + 0.5, ((0, 0), (1, 0)))
    seg = np.asarray(batch.segment_ids)
    predicted = (seg > 0) & (seg == np.pad(seg[:, :-1], ((0, 0), (1, 0))))
    np.testing.assert_allclose(np.asarray(value_step(probe, batch)), np.where(predicted, want, 0),
                               rtol=1e-5, atol=1e-5)
    # a few critic updates towards fixed returns lower the value loss; the policy is untouched
    mask = np.asarray(batch.loss_mask)
    returns = np.where(mask > 0, np.asarray(batch.input_ids) % 3 / 2.0, 0).astype(np.float32)
    target = batch.replace(old_values=jnp.asarray(v0), returns=jnp.asarray(returns))
    step = make_critic_step(graphdef, state, mesh, opt, value_clip=10.0, micro_batches=2)
    policy = jax.tree.map(np.asarray, state.params)
    losses = []
    for _ in range(15):
        state, m = step(state, target)
        losses.append(float(m.value_loss))
    assert losses[-1] < 0.5 * losses[0], losses
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), policy,
                                     state.params))
    body_moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(state.critic.params["body"]), jax.tree.leaves(policy))]
    assert any(body_moved)  # the critic's own adapter trained
