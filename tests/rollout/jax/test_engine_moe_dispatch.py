"""Expert-parallel rollouts: on a mesh whose ``expert`` axis splits the experts, the built-in
engine's decode and the learner's log-prob step both dispatch tokens to the experts' devices
(``rlx.models.moe_dispatch``), and the engine's sampler log-probs equal the learner's (<= 1e-5, f32)
on an int4 base with per-expert LoRA (Qwen3-MoE; gpt-oss with tensor-split heads and sinks)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.state import create_train_state
from rlx.learner.step import StepConfig, make_logprob_step
from rlx.mesh import MeshShape, make_mesh
from rlx.models.moe import SparseMoE
from rlx.quant import LoraConfig
from rlx.rollout.jax.engine import JaxEngine
from rlx.types import Prompt, SamplingParams
from tests.helpers.quant import quantized_lora_model

TOL = 1e-5


def _dispatching(graphdef: nnx.GraphDef, *states) -> list[bool]:
    model = nnx.merge(graphdef, *states)
    return [node.expert_parallel is not None for _, node in nnx.iter_graph(model)
            if isinstance(node, SparseMoE)]


@pytest.mark.parametrize("family, shape", [
    pytest.param("qwen3_moe", MeshShape(fsdp=2, expert=4), id="expert4-fsdp2"),
    pytest.param("qwen3_moe", MeshShape(expert=8), id="expert8", marks=pytest.mark.slow),
    # gpt-oss: biased experts, and the paged decode's sinks split with their heads over tensor
    pytest.param("gpt_oss", MeshShape(tensor=2, expert=4), id="gpt_oss-expert4-tensor2",
                 marks=pytest.mark.slow)])
def test_engine_logprobs_equal_the_learners_on_an_expert_mesh(tmp_path, family, shape):
    model = quantized_lora_model(str(tmp_path), family, lora=LoraConfig(rank=3, alpha=5.0,
                                                                       experts=True))
    mesh = make_mesh(shape)
    engine = JaxEngine(model, mesh=mesh)
    assert all(_dispatching(engine._graphdef, engine._state))
    rs = np.random.RandomState(0)
    prompts = [Prompt(f"p{i}", tuple(int(t) for t in rs.randint(0, 97, n)))
               for i, n in enumerate((3, 7, 5, 4))]  # 8 rows: the batch shards
    rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=8, n=2, seed=3))

    graphdef, state = create_train_state(model, optax.sgd(0.1), mesh, trainable=nnx.LoRAParam)
    assert all(_dispatching(graphdef, state.params, state.frozen))
    step = make_logprob_step(graphdef, state.params, state.frozen, mesh,
                             StepConfig(logprob_chunk=64))
    batch = shard_batch(pad_rollouts(rollouts, np.zeros(len(rollouts))), mesh)
    logp = np.asarray(jax.device_get(step(state.params, state.frozen, batch).logp))
    for i, r in enumerate(rollouts):
        learner = logp[i, len(r.prompt_ids):r.length]
        assert np.abs(learner - r.sampler_logp).max() <= TOL
