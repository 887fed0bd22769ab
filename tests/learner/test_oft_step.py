"""One compiled RL step (DAPO with KL to the adapter-off reference) on an int4 base with OFT
adapters (``lora.kind="oft"``): only the rotations move, the base stays quantized and bit for bit
the same; the reference log-probs are the base's."""

import jax
import numpy as np
import pytest
from flax import nnx

from rlx.learner.advantages import grpo
from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.losses import LossConfig
from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
from rlx.learner.step import StepConfig, make_logprob_step, make_train_step, reference_forward
from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf
from rlx.quant import QuantWeight, quantize_model
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.parity import TOL
from tests.helpers.quant import INT4, oft_model
from tests.helpers.steps import random_rollouts


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def test_one_rl_step_moves_only_the_rotations(zoo):
    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    rollouts = random_rollouts(8, 97, seed=7)
    uids = np.array([r.prompt_uid for r in rollouts])
    rewards = np.random.RandomState(3).uniform(size=8)
    model = oft_model(zoo, "qwen2_moe")  # rotations on attention, shared expert, experts, MLP
    opt_cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant")
    graphdef, state = create_train_state(model, make_optimizer(opt_cfg), mesh,
                                         trainable=nnx.LoRAParam)
    probe = shard_batch(pad_rollouts(rollouts, np.zeros(8)), mesh)
    reference = make_logprob_step(graphdef, state.params, state.frozen, mesh, StepConfig(),
                                  apply_fn=reference_forward)
    ref = np.asarray(reference(state.params, state.frozen, probe).logp)
    base = quantize_model(from_hf(make_hf_model("qwen2_moe", zoo)), INT4)  # no adapters at all
    g, p, f = nnx.split(base, nnx.Param, ...)
    plain = np.asarray(make_logprob_step(g, p, f, mesh, StepConfig())(p, f, probe).logp)
    mask = np.asarray(probe.loss_mask, bool)
    assert np.abs((ref - plain)[mask]).max() <= TOL  # the reference is the adapter off

    ref_logp = [ref[i, len(r.prompt_ids):len(r.prompt_ids) + len(r.completion_ids)]
                for i, r in enumerate(rollouts)]
    batch = pad_rollouts(rollouts, grpo(rewards, uids), ref_logp=ref_logp)
    step = make_train_step(graphdef, state, mesh,
                           StepConfig(LossConfig("dapo", kl_coef=0.05)), opt_cfg)
    frozen_before = jax.tree.map(np.array, state.frozen)
    params_before = jax.tree.map(np.array, state.params)
    new, metrics = step(state, shard_batch(batch, mesh))
    assert np.isfinite(float(metrics.loss)) and float(metrics.grad_norm) > 0
    for a, b in zip(jax.tree.leaves(new.frozen), jax.tree.leaves(frozen_before)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert any(isinstance(v, QuantWeight) for _, v in nnx.to_flat_state(new.frozen))
    moved = [np.abs(np.asarray(a) - b).max() for a, b in zip(jax.tree.leaves(new.params),
                                                              jax.tree.leaves(params_before))]
    assert len(moved) == 17 and min(moved) > 0  # every rotation, nothing else trains
