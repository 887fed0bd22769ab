"""Full mode's reference policy (``TrainState.ref``): a frozen copy of the initial parameters,
built by ``rlx.run.build.compile_steps`` on the tiny config in ``train.mode='full'``.

* KL: the oracle is a second model loaded from the same config and seed (``load_policy``),
  whose log-probs ``sequence_logprobs`` computes outside any compiled step; the step's ``kl``
  metric is the masked k3 mean of the policy's against those (<= 1e-5, f32); a checkpoint
  saves and restores the copy.
* DPO: with policy == reference every reply's implicit reward is 0, so the loss is
  -log sigmoid(0) = log 2 (<= 1e-6); repeated updates on the same pairs lower it.
* The planner counts the copy: one more set of the trainable variables, as the real state holds.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import parse_config
from rlx.learner.losses import kl_penalty
from rlx.learner.preference import pair_batch
from rlx.learner.step import predicted, sequence_logprobs
from rlx.mesh import make_mesh
from rlx.plan.memory import state_bytes
from rlx.plan.planner import spec_from_config
from rlx.run.build import compile_steps, load_policy
from rlx.run.lifecycle import open_checkpointer
from rlx.types import TrainBatch
from tests.helpers.runs import config_dict

FULL = {"train.mode": "full", "quant.format": "none", "optim.learning_rate": 1e-2,
        "optim.schedule": "constant"}
KL = {**FULL, "loss.kl_coef": 0.1}
DPO = {**FULL, "loss.kl_coef": 0.0, "train.algorithm": "dpo", "data.source": "arith_pairs:add2"}


def _build(tmp_path, **over):
    cfg = parse_config(config_dict("tiny", tmp_path, **over))
    mesh = make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    model, _ = load_policy(cfg, mesh)
    return cfg, mesh, compile_steps(cfg, model, mesh)


def _batch(rows: int = 4, length: int = 12) -> TrainBatch:
    rng = np.random.default_rng(0)
    mask = (np.arange(length)[None, :] >= 4).astype(np.float32) * np.ones((rows, 1), np.float32)
    adv = np.resize([1.0, -1.0, 0.5, -0.5], (rows, 1)) * np.ones(length)
    return TrainBatch(input_ids=jnp.asarray(rng.integers(0, 1000, (rows, length)), jnp.int32),
                      positions=jnp.tile(jnp.arange(length), (rows, 1)),
                      segment_ids=jnp.ones((rows, length), jnp.int32),
                      loss_mask=jnp.asarray(mask), advantages=jnp.asarray(adv, jnp.float32),
                      sampler_logp=jnp.zeros((rows, length), jnp.float32))


def test_kl_is_zero_at_step_zero_then_the_k3_estimate_against_the_initial_model(tmp_path):
    cfg, mesh, compiled = _build(tmp_path, **KL)
    assert compiled.state.ref is not None
    assert jax.tree.map(lambda r: r.sharding, compiled.state.ref) == jax.tree.map(
        lambda p: p.sharding, compiled.state.params)
    oracle = load_policy(cfg, mesh)[0]  # the initial model, built again from the same seed
    batch = _batch()
    want_ref = sequence_logprobs(oracle, batch, cfg.step_config).logp
    mask = batch.loss_mask * predicted(batch.segment_ids)

    ref = compiled.reference_logprobs(batch).logp
    np.testing.assert_allclose(ref, want_ref, atol=1e-5)
    state, m0 = compiled.train_step(compiled.state, batch.replace(ref_logp=ref))
    assert float(m0.kl) == pytest.approx(0.0, abs=1e-6)  # policy == reference

    compiled = dataclasses.replace(compiled, state=state)
    ref = compiled.reference_logprobs(batch).logp  # the frozen copy did not move
    np.testing.assert_allclose(ref, want_ref, atol=1e-5)
    logp = sequence_logprobs(compiled.model(), batch, cfg.step_config).logp  # before donation
    want_kl = float(jnp.sum(kl_penalty(logp, want_ref) * mask) / jnp.sum(mask))
    state, m1 = compiled.train_step(state, batch.replace(ref_logp=ref))
    assert want_kl > 1e-6
    assert float(m1.kl) == pytest.approx(want_kl, rel=1e-4, abs=1e-6)

    # a checkpoint holds the reference: restored onto a state whose copy was zeroed, it is back
    with open_checkpointer(cfg, state) as ckpt:
        ckpt.save(2, state, force=True)
        ckpt.wait()
        zeroed = state.replace(ref=jax.tree.map(jnp.zeros_like, state.ref))
        restored = ckpt.restore(2, zeroed).state
    ref = dataclasses.replace(compiled, state=restored).reference_logprobs(batch).logp
    np.testing.assert_allclose(ref, want_ref, atol=1e-5)


def test_dpo_in_full_mode_starts_at_log_2_and_learns_the_pairs(tmp_path):
    _, _, compiled = _build(tmp_path, **DPO)
    pairs = [([1, 2, 3], [4, 5], [6, 7, 8]), ([9, 10], [11], [12, 13]),
             ([14, 15, 16], [17, 18, 19], [20]), ([21], [22, 23], [24, 25])]
    batch = jax.tree.map(jnp.asarray, pair_batch(pairs))
    state, losses = compiled.state, []
    for _ in range(3):
        compiled = dataclasses.replace(compiled, state=state)
        batch = batch.replace(ref_logp=compiled.reference_logprobs(batch).logp)
        state, metrics = compiled.train_step(state, batch)
        losses.append(float(metrics.loss))
    # step 0: log pi == log pi_ref for every reply, so the loss is -log sigmoid(0) = log 2
    assert losses[0] == pytest.approx(math.log(2.0), abs=1e-6)
    assert losses[2] < losses[1] < losses[0]


def test_the_planner_counts_one_more_copy_of_the_params(tmp_path):
    spec = spec_from_config(config_dict("tiny", tmp_path, **KL))  # the unshrunk SmolLM2-135M
    assert spec.reference and spec.mode == "full" and spec.param_dtype == "float32"
    with_ref, without = state_bytes(spec), state_bytes(spec.replace(reference=False))
    # one copy of the trainable variables at 4 bytes a value: 4 x 134,515,008 = 538,060,032
    assert with_ref["reference"] == with_ref["trainable"] == 4 * spec.model.num_params()
    assert sum(with_ref.values()) - sum(without.values()) == with_ref["reference"]
    lora = spec_from_config(config_dict("tiny", tmp_path, **{"loss.kl_coef": 0.1}))
    assert state_bytes(lora)["reference"] == 0  # the adapter switched off: no copy
    # the real state of the shrunken model holds exactly what the planner counts for it
    _, _, compiled = _build(tmp_path, **KL)
    shrunk = spec.replace(model=compiled.model().config)
    copy = sum(x.nbytes for x in jax.tree.leaves(compiled.state.ref))
    assert state_bytes(shrunk)["reference"] == copy
