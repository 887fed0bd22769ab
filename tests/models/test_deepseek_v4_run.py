"""DeepSeek-V4 in the run: ``rlx.models.from_hf`` and the run's model loading read a
``DeepseekV4ForCausalLM`` folder as rlx's ``DeepseekV4`` (logits against transformers 5.25 within
1e-4 relative, f32, also placed on a 4-device mesh), and the learner trains it in mode B: the
compiled step's log-probs equal ``log_softmax`` of the model's own logits within 1e-5 (f32), and
one optimizer step moves the LoRA adapters (queries, the shared key-value projection, the grouped
output's second projection, routed and shared experts) and nothing else.
The tiny random model is ``tests.helpers.deepseek_v4``'s, where every feature binds; the fast
cases use one compressed sparse attention layer (with the indexer) and a routed MoE, or two
layers (and heavily compressed attention, a hash-routed MoE), the slow ones all four."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.learner.advantages import grpo
from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.losses import LossConfig
from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
from rlx.learner.step import FORWARDS, StepConfig, make_logprob_step, make_train_step
from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf, from_hf_config, to_hf
from rlx.models.deepseek_v4.model import DeepseekV4
from rlx.models.hparams import ModelConfigError
from rlx.models.loading import ModelSection, load_from_section
from rlx.quant import LoraConfig, apply_lora
from tests.helpers.deepseek_v4 import TOL, VOCAB, hf_logits, ids_of, logits, make_v4
from tests.helpers.steps import random_rollouts


LOGP_TOL = 1e-5  # |learner log-prob - log_softmax(logits)|, f32
TARGETS = ("q_a", "q_b", "kv", "o_b", "gate", "up", "down")
ONE_LAYER = dict(num_hidden_layers=1, mlp_layer_types=["moe"],
                 layer_types=["compressed_sparse_attention"])
TWO_LAYERS = dict(num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"], layer_types=[
    "compressed_sparse_attention", "heavily_compressed_attention"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_v4(str(tmp_path_factory.mktemp("v4run")))


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return make_v4(str(tmp_path_factory.mktemp("v4one")), **ONE_LAYER)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_v4(str(tmp_path_factory.mktemp("v4small")), **TWO_LAYERS)


def test_from_hf_and_the_run_load_the_v4_folder(small, tmp_path):
    """``from_hf`` (on a 4-device fsdp x tensor mesh) and ``load_from_section`` give a
    ``DeepseekV4`` with transformers' logits, and ``rlx.models.to_hf`` writes a folder that
    transformers reads back to rlx's (within 1e-5); ``from_hf_config`` (the ``ModelConfig`` reader)
    names ``from_hf`` instead of calling the class unsupported."""
    mesh = make_mesh(MeshShape(fsdp=2, tensor=2), jax.devices()[:4])
    model = from_hf(small, mesh=mesh)
    assert isinstance(model, DeepseekV4)
    assert len(model.embed[...].sharding.device_set) == 4
    ids = ids_of()
    ref = hf_logits(small, ids)
    ours = logits(model, ids)
    assert np.abs(ours - ref).max() <= TOL * np.abs(ref).max()
    assert isinstance(load_from_section(ModelSection(path=small), None).model, DeepseekV4)
    out = str(tmp_path / "out")
    to_hf(model, out)  # the family's writer; the round trip's tolerance: 1e-5 relative
    assert np.abs(hf_logits(out, ids) - ours).max() <= 1e-5 * np.abs(ours).max()
    with open(f"{small}/config.json") as f:
        hf = json.load(f)
    with pytest.raises(ModelConfigError, match="DeepseekV4ForCausalLM has a decoder of its own"):
        from_hf_config(hf)


def _adapted(path: str) -> DeepseekV4:
    """The model with LoRA on ``TARGETS`` and random (nonzero) adapter outputs."""
    model = from_hf(path)
    apply_lora(model, LoraConfig(rank=2, targets=TARGETS), nnx.Rngs(1))
    rs = np.random.RandomState(2)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.LoRAParam) and not np.any(np.asarray(var[...])):
            var.set_value(jnp.asarray(0.1 * rs.standard_normal(var.shape), var.dtype))
    return model


@nnx.jit(static_argnums=3)
def _logits(model, ids, mask, adapter: bool):
    return model(ids, attention_mask=mask, adapter=adapter)


def _expected_logp(model, batch, adapter: bool) -> np.ndarray:
    """log_softmax of the model's own logits (right-padded rows: each real token's logits are
    the unpadded row's, ``test_padded_rows_equal_unpadded``) at each token, aligned as
    ``rlx.types`` says (token t's log-prob at t; 0 at a row's first token and on padding)."""
    ids, seg = np.asarray(batch.input_ids), np.asarray(batch.segment_ids)
    lp = np.asarray(jax.nn.log_softmax(_logits(model, jnp.asarray(ids), jnp.asarray(seg > 0),
                                               adapter), -1))  # [B, T, V]
    out = np.zeros(ids.shape, np.float32)
    out[:, 1:] = np.take_along_axis(lp[:, :-1], ids[:, 1:, None], -1)[..., 0]
    return np.where((seg > 0) & (np.pad(seg, ((0, 0), (1, 0)))[:, :-1] == seg), out, 0.0)


def test_learner_logprobs_equal_the_models_log_softmax(one):
    """``_check_logprobs`` on one compressed sparse attention layer with a routed MoE, adapters
    on, without recomputation."""
    _check_logprobs(one, "none", adapters=(True,))


@pytest.mark.slow  # CI: test_learner_logprobs_equal_the_models_log_softmax (one layer)
@pytest.mark.parametrize("remat", ["none", "layer"])
def test_learner_logprobs_of_all_four_layers(tiny, remat):
    """``_check_logprobs`` on the four-layer model, adapters on and off (mode B's reference),
    with and without ``train.remat='layer'``."""
    _check_logprobs(tiny, remat)


def _check_logprobs(path: str, remat: str, adapters=(True, False)):
    """The compiled log-prob step (``model.forward`` + the chunked lm-head log-softmax) on
    right-padded rows of varied lengths equals ``log_softmax`` of ``DeepseekV4``'s logits over
    each row alone within 1e-5, with the adapters on and off (mode B's reference)."""
    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    model = _adapted(path)
    batch = shard_batch(pad_rollouts(random_rollouts(4, VOCAB, seed=5), np.zeros(4)), mesh)
    g, p, f = nnx.split(model, nnx.LoRAParam, ...)
    cfg = StepConfig(logprob_chunk=8, vocab_block=16)
    for adapter in adapters:
        apply = lambda m, b: FORWARDS[remat](m, b, adapter=adapter)  # noqa: E731
        got = np.asarray(make_logprob_step(g, p, f, mesh, cfg, apply_fn=apply)(p, f, batch).logp)
        diff = np.abs(got - _expected_logp(model, batch, adapter)).max()
        print(f"remat={remat} adapter={adapter}: max |logp difference| {diff:.2e}")
        assert diff <= LOGP_TOL


def test_one_mode_b_step_moves_only_the_adapters(one):
    """``_check_step`` on one compressed sparse attention layer with a routed MoE."""
    _check_step(one, ("indexer", "compressor", "attn_hc", "mlp/gate", "mlp/bias"))


@pytest.mark.slow  # CI: test_one_mode_b_step_moves_only_the_adapters (one layer)
def test_one_mode_b_step_over_hash_and_routed_layers(small):
    """``_check_step`` on the two-layer model (a hash-routed and a routed MoE layer), each
    block recomputed in the backward pass (``train.remat='layer'``)."""
    _check_step(small, ("indexer", "compressor", "attn_hc", "mlp/tid2eid", "mlp/bias"), "layer")


def _check_step(path: str, frozen_parts: tuple[str, ...], remat: str = "none"):
    """One compiled GRPO step (LoRA mode, DAPO loss) on a 2-device fsdp mesh: the loss and the
    gradient norm are finite and nonzero, every adapter moves, and the frozen base (attention,
    indexer, compressors, hyper-connections, router, correction biases, hash tables: each of
    ``frozen_parts`` is there) stays bit for bit the same."""
    mesh = make_mesh(MeshShape(fsdp=2), jax.devices()[:2])
    rollouts = random_rollouts(8, VOCAB, seed=7)
    rewards = np.random.RandomState(3).uniform(size=8)
    model = _adapted(path)
    opt_cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant")
    graphdef, state = create_train_state(model, make_optimizer(opt_cfg), mesh,
                                         trainable=nnx.LoRAParam)
    adapted = ["/".join(map(str, k)) for k, _ in nnx.to_flat_state(state.params)]
    for part in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "experts/gate_lora",
                 "shared_expert/down_proj"):
        assert any(part in n for n in adapted), part
    frozen = nnx.to_flat_state(state.frozen)
    names = ["/".join(map(str, k)) for k, _ in frozen]
    for part in frozen_parts:
        assert any(part in n for n in names), part
    batch = pad_rollouts(rollouts, grpo(rewards, np.array([r.prompt_uid for r in rollouts])))
    step = make_train_step(graphdef, state, mesh, StepConfig(LossConfig("dapo")), opt_cfg,
                           apply_fn=FORWARDS[remat])
    frozen_before = jax.tree.map(np.array, state.frozen)
    params_before = jax.tree.map(np.array, state.params)
    new, metrics = step(state, shard_batch(batch, mesh))
    assert np.isfinite(float(metrics.loss)) and float(metrics.grad_norm) > 0
    for a, b in zip(jax.tree.leaves(new.frozen), jax.tree.leaves(frozen_before)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    moved = [np.abs(np.asarray(a) - b).max() for a, b in zip(jax.tree.leaves(new.params),
                                                              jax.tree.leaves(params_before))]
    assert len(moved) == len(jax.tree.leaves(params_before)) > 0 and min(moved) > 0


def test_an_expert_mesh_axis_is_refused(one):
    """V4's experts run whole (no token dispatch): a mesh with an expert axis is refused by
    name before anything compiles."""
    mesh = make_mesh(MeshShape(expert=2), jax.devices()[:2])
    with pytest.raises(ValueError, match="V4MoE layers have no token dispatch.*mesh.expert=1"):
        create_train_state(_adapted(one), make_optimizer(OptimizerConfig()), mesh,
                           trainable=nnx.LoRAParam)
