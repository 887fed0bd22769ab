"""Context parallelism (``rlx.kernels.attention.context``): on 8 fake CPU devices, a mesh whose
``context`` axis splits every row's tokens gives the logits, log-probs and gradients (full
parameters and LoRA) of one device, for GQA (llama) and MLA (deepseek_v3). Tolerance 1e-5 (f32):
logits and log-probs absolute, gradients relative to their largest entry. Each device runs
blockwise attention (8-token blocks) on its queries over the gathered keys; rows are packed and
padded and their length (30) is not a multiple of the zig-zag's 2 x context chunks."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlx.kernels.attention.context import ZigZag
from rlx.learner.batching import pack_rollouts, shard_batch
from rlx.learner.losses import LossConfig
from rlx.learner.state import create_train_state
from rlx.learner.step import StepConfig, compute_grads, make_logprob_step
from rlx.mesh import TRAIN_RULES, MeshShape, batch_sharding, make_mesh
from rlx.models import from_hf
from rlx.models.parallel import parallelize
from rlx.platform.policy import CPU, active
from rlx.quant import LoraConfig, apply_lora
from rlx.quant.config import GQA_TARGETS, MLA_TARGETS
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.engine import JaxEngine
from rlx.types import SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.parity import max_diff, sample_prompts
from tests.helpers.steps import random_rollouts

TOL = 1e-5
BLOCKWISE = dataclasses.replace(CPU, dense_attention_slots=0, attention_block=8)
MESHES = {"context4": MeshShape(context=4),
          "context2-fsdp2-tensor2": MeshShape(fsdp=2, context=2, tensor=2),
          "context2-tensor2-expert2": MeshShape(context=2, tensor=2, expert=2)}
GRAD_MESHES = ("context4", "context2-fsdp2-tensor2")
T = 30


def test_zigzag_order_round_trips():
    """Device i of c holds chunks i and 2c-1-i; ``restore`` inverts ``permute``."""
    order = ZigZag(3)
    x = jnp.arange(12)[None]
    assert order.permute(x).tolist() == [[0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]]
    assert order.restore(order.permute(x)).tolist() == x.tolist()
    assert order.padding(30) == 0 and order.padding(31) == 5


def _mesh(shape: MeshShape):
    return make_mesh(shape, jax.devices()[:shape.num_devices])


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


@pytest.mark.parametrize("family,mesh_name", [
    ("llama", "context4"), pytest.param("llama", "context2-fsdp2-tensor2", marks=pytest.mark.slow),
    pytest.param("deepseek_v3_dense", "context4", marks=pytest.mark.slow),
    ("deepseek_v3", "context2-fsdp2-tensor2"), ("qwen3_moe", "context2-tensor2-expert2"),
    pytest.param("gpt_oss", "context2-tensor2-expert2", marks=pytest.mark.slow),  # sinks, window
    pytest.param("deepseek_v3", "context2-tensor2-expert2", marks=pytest.mark.slow)])
def test_context_parallel_logits_equal_one_device(zoo, family, mesh_name):
    """Left-padded rows of 30 tokens: the logits of every real token. With experts split too,
    MoE layers dispatch each device's own tokens (``rlx.models.moe_dispatch``). MLA at context
    4 is DeepSeek-V3's attention with dense MLPs: the zoo's routed experts (logits up to 4.1)
    take the two programs' different f32 rounding to 1.03e-5 there, each within 6.5e-6 of
    transformers' logits."""
    path = make_hf_model(family, zoo)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, (4, T)))
    mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [5], [0], [17]])).astype(jnp.int32)
    forward = jax.jit(lambda m, x, a: m(x, attention_mask=a))
    with active(BLOCKWISE):
        one = np.asarray(forward(from_hf(path), ids, mask))
        mesh = _mesh(MESHES[mesh_name])
        model = parallelize(from_hf(path, mesh=mesh), mesh, TRAIN_RULES)
        assert model.sharding.context_shards == MESHES[mesh_name].context
        rows = batch_sharding(mesh, 2)
        split = forward(model, jax.device_put(ids, rows), jax.device_put(mask, rows))
    real = np.asarray(mask, bool)
    assert np.abs(np.asarray(split) - one)[real].max() <= TOL


def _batch():
    rollouts = random_rollouts(10, 97, seed=4, max_prompt=9, max_completion=12)
    adv = np.random.RandomState(5).normal(size=10)
    batch = pack_rollouts(rollouts, adv, row_len=T, rows_multiple=4)
    assert batch.segment_ids.max() >= 2 and (batch.segment_ids == 0).any()  # packed and padded
    return batch


def _learner(path, mode, mesh):
    model = from_hf(path)
    if mode == "lora":
        mla = model.config.attention_kind == "mla"
        model = apply_lora(model, LoraConfig(rank=4, targets=MLA_TARGETS if mla else GQA_TARGETS),
                           nnx.Rngs(1))
        for _, var in nnx.iter_graph(model):  # B = 0 at init: give A a gradient too
            if isinstance(var, nnx.LoRAParam) and not var[...].any():
                var.set_value(0.1 * jax.random.normal(jax.random.key(2), var.shape))
    trainable = nnx.LoRAParam if mode == "lora" else nnx.Param
    return create_train_state(model, optax.sgd(0.1), mesh, trainable=trainable)


def _logprobs_and_grads(path, mode, shape: MeshShape):
    mesh = _mesh(shape)
    graphdef, state = _learner(path, mode, mesh)
    cfg = StepConfig(loss=LossConfig("ppo", kl_coef=0.0), logprob_chunk=7)
    batch = shard_batch(_batch(), mesh)
    logp = make_logprob_step(graphdef, state.params, state.frozen, mesh, cfg)(
        state.params, state.frozen, batch).logp
    grads_fn = jax.jit(functools.partial(compute_grads, graphdef=graphdef, cfg=cfg,
                                         row_sharding=batch_sharding(mesh, 1)))
    grads = grads_fn(state.params, state.frozen, batch)[0]
    return np.asarray(logp), jax.tree.map(np.asarray, grads)


FAST = {("llama", "full", "context2-fsdp2-tensor2"), ("deepseek_v3", "lora", "context2-fsdp2-tensor2")}


@pytest.mark.parametrize("family,mode,mesh_name", [
    case if case in FAST else pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product(("llama", "deepseek_v3"), ("full", "lora"), GRAD_MESHES)])
def test_context_parallel_logprobs_and_grads_equal_one_device(zoo, family, mode, mesh_name):
    """The learner's log-probs (``make_logprob_step``) and gradients (``compute_grads``) of
    packed rows, full parameters or LoRA adapters."""
    path = make_hf_model(family, zoo)
    with active(BLOCKWISE):
        logp_one, grads_one = _logprobs_and_grads(path, mode, MeshShape())
        logp, grads = _logprobs_and_grads(path, mode, MESHES[mesh_name])
    assert np.abs(logp_one).max() > 1.0  # real log-probs
    assert np.abs(logp - logp_one).max() <= TOL
    leaves = list(zip(jax.tree.leaves(grads), jax.tree.leaves(grads_one)))
    assert leaves and all(a.shape == b.shape for a, b in leaves)
    for a, b in leaves:
        scale = max(float(np.abs(b).max()), 1e-6)
        assert float(np.abs(a - b).max()) <= TOL * scale


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_context_parallel_engine_samples_and_scores_as_one_device(zoo, family, batching):
    """The built-in engine on context 2 x fsdp 2 x tensor 2. Lockstep: prefills and scored
    chunks split over the context devices in zig-zag order (their keys gathered into the cache
    every context device holds), decode steps whole; continuous: the context devices are more
    data shards (each sequence's pages on one device). The same tokens, sampler log-probs and
    scores as one device."""
    path = make_hf_model(family, zoo)
    sampling = SamplingParams(max_new_tokens=10, n=2, top_p=0.9, seed=5)
    with active(BLOCKWISE):
        single = JaxEngine(from_hf(path)).generate(sample_prompts(), sampling)
        mesh = _mesh(MeshShape(fsdp=2, context=2, tensor=2))
        engine = JaxEngine(from_hf(path, mesh=mesh), mesh=mesh,
                           settings=JaxSection(batching=batching))
        split = engine.generate(sample_prompts(), sampling)
        assert (engine.batching_stats() is not None) == (batching == "continuous")
        seqs = [(np.concatenate([r.prompt_ids, r.completion_ids]), len(r.prompt_ids))
                for r in split]
        scores = engine.score(seqs)
    for a, b in zip(single, split):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL
    assert max_diff(scores, [r.sampler_logp for r in single]) <= TOL
