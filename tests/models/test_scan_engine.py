"""The built-in engine over a scanned model (``rlx.models.stack``) samples what the learner's
log-prob step scores on the same stacked model (<= 1e-5 f32, as tests/rollout/jax/test_engine.py),
whether its decode unstacks the layers inside the program (XLA:CPU, a small model: one cache
buffer per layer) or scans them over a stacked cache: in full mode (llama) and in LoRA mode on
DeepSeek-V3 (an int8 base with LoRA on attention, dense MLP and experts; MLA's latent cache; a
dense-prefix stack and a MoE stack), and on a sharded mesh (data x tensor) the same tokens as on
one device; on an expert=4 x fsdp=2 mesh tokens are dispatched to the experts' devices by the
engine and from inside the learner's scan.
The longer variants are marked ``slow`` (``python -m pytest -m slow``).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.step import StepConfig, make_logprob_step
from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf
from rlx.models.stack import layer_counts, stack_layers
from rlx.platform import CPU
from rlx.quant import QuantConfig
from rlx.rollout.jax.engine import JaxEngine
from rlx.types import Prompt, SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import quantized_lora_model

TOL = 1e-5
SAMPLING = SamplingParams(max_new_tokens=6, n=2, seed=3)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _prompts():
    rs = np.random.RandomState(0)
    return [Prompt(f"p{i}", tuple(int(t) for t in rs.randint(0, 97, n)))
            for i, n in enumerate((3, 7))]


def _learner(model, rollouts) -> list[np.ndarray]:
    mesh = make_mesh(MeshShape(), devices=jax.devices()[:1])
    trainable = nnx.LoRAParam if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)) else nnx.Param
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    step = make_logprob_step(graphdef, params, frozen, mesh, StepConfig(logprob_chunk=64))
    logp = np.asarray(step(params, frozen, shard_batch(pad_rollouts(
        rollouts, np.zeros(len(rollouts))), mesh)).logp)
    return [logp[i, len(r.prompt_ids):r.length] for i, r in enumerate(rollouts)]


def _parity(model, engine: JaxEngine | None = None) -> float:
    rollouts = (engine or JaxEngine(model)).generate(_prompts(), SAMPLING)
    learner = _learner(model, rollouts)
    return max(float(np.abs(a - r.sampler_logp).max()) for a, r in zip(learner, rollouts))


@pytest.mark.parametrize("unstacked", [True, False], ids=["unstacked_decode", "scanned_decode"])
def test_full_mode_llama(zoo, unstacked):
    """On XLA:CPU a small model's decode unstacks its layers inside the program (one cache buffer
    per layer); a model over the policy's ``unroll_decode_bytes`` (here: any) scans them over a
    stacked cache."""
    policy = CPU if unstacked else dataclasses.replace(CPU, unroll_decode_bytes=0)
    model = stack_layers(from_hf(make_hf_model("llama", zoo)))
    assert layer_counts(model) == (2,)
    engine = JaxEngine(model, platform_policy=policy)
    assert engine._stacks == (None if unstacked else (2,))
    assert _parity(model, engine) <= TOL


@pytest.mark.slow
def test_lora_mode_deepseek_v3(zoo):
    model = stack_layers(quantized_lora_model(zoo, "deepseek_v3", QuantConfig(format="int8")))
    assert layer_counts(model) == (1, 1)
    assert _parity(model) <= TOL


@pytest.mark.slow
def test_sharded_mesh_gives_the_same_tokens(zoo):
    path = make_hf_model("llama", zoo)
    single = JaxEngine(stack_layers(from_hf(path))).generate(_prompts(), SAMPLING)
    mesh = make_mesh(MeshShape(data=2, tensor=2), devices=jax.devices()[:4])
    sharded = JaxEngine(stack_layers(from_hf(path, mesh=mesh)), mesh=mesh).generate(
        _prompts(), SAMPLING)
    for a, b in zip(single, sharded):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL


@pytest.mark.slow
def test_expert_dispatch_inside_the_scan(zoo):
    """qwen3_moe, int4 base with per-expert LoRA, stacked, on expert=4 x fsdp=2: the engine (its
    layers unstacked in the program) and the learner (inside its layer scan) both dispatch tokens
    to the experts' devices, and the sampler's log-probs equal the learner's."""
    import optax

    from rlx.learner.state import create_train_state
    from rlx.models.moe import SparseMoE
    from rlx.quant import LoraConfig

    model = stack_layers(quantized_lora_model(zoo, "qwen3_moe", lora=LoraConfig(
        rank=3, alpha=5.0, experts=True)))
    mesh = make_mesh(MeshShape(fsdp=2, expert=4))
    rollouts = JaxEngine(model, mesh=mesh).generate(_prompts() * 2, SAMPLING)
    graphdef, state = create_train_state(model, optax.sgd(0.1), mesh, trainable=nnx.LoRAParam)
    moe = [n for _, n in nnx.iter_graph(nnx.merge(graphdef, state.params, state.frozen))
           if isinstance(n, SparseMoE)]
    assert moe and all(n.expert_parallel is not None for n in moe)
    step = make_logprob_step(graphdef, state.params, state.frozen, mesh,
                             StepConfig(logprob_chunk=64))
    logp = np.asarray(jax.device_get(step(state.params, state.frozen, shard_batch(
        pad_rollouts(rollouts, np.zeros(len(rollouts))), mesh)).logp))
    for i, r in enumerate(rollouts):
        assert np.abs(logp[i, len(r.prompt_ids):r.length] - r.sampler_logp).max() <= TOL
