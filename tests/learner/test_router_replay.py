"""Routing replay end to end on a tiny DeepSeek-V3 (MLA, a dense first layer, sigmoid
group-limited routers) with an int4 base and random LoRA adapters.

* The built-in engine records the experts of every token it feeds (prompt tokens in the prefill,
  each completion token when it is fed back); the completion's last token, never fed, gets -1.
  Both batchings: continuous (prefill chunks, decode bursts over pages; also with samples
  preempted and resumed) and lockstep.
  Shared prompt prefills (two samples per prompt) and left padding (prompts of 3, 11 and 6
  tokens) must not shift them.
* Batched (``pad_rollouts``), the routes line up with ``input_ids``: the learner's free choice
  equals the engine's record on every fed token (f32, the same kernels, a spread router), and with
  ``TrainBatch.routes`` the learner uses exactly the recorded experts there (its own choice at
  -1), or any other experts given there.
* Sampler log-probs vs the learner's compiled log-prob step with replay on: <= 1e-5 (f32), the
  engine parity bound of ``tests/rollout/jax/test_engine_mla.py``.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.step import StepConfig, make_logprob_step
from rlx.mesh import MeshShape, make_mesh
from rlx.models import Transformer
from rlx.quant import LoraConfig, apply_lora, quantize_model
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.engine import JaxEngine
from rlx.types import Prompt, SamplingParams
from tests.helpers.moe import tiny_deepseek
from tests.helpers.quant import INT4, randomize_lora_b

TOL = 1e-5


def tiny_moe(layers: int = 3, seed: int = 0) -> Transformer:
    """A tiny DeepSeek-V3, router spread (x50), int4 base + random LoRA on every linear."""
    model = tiny_deepseek(layers, seed)
    model = apply_lora(quantize_model(model, INT4), LoraConfig(rank=3, alpha=5.0), nnx.Rngs(1))
    randomize_lora_b(model)
    return model


BATCHINGS = {"continuous": JaxSection(), "lockstep": JaxSection(batching="lockstep"),
             # 8 pages of 4 tokens for 6 sequences of up to 17: samples are preempted and
             # resumed, keeping the experts recorded before
             "preempting": JaxSection(slots=4, page_size=4, kv_pages=9)}


@pytest.fixture(scope="module", params=list(BATCHINGS))
def sampled(request):
    model = tiny_moe()
    engine = JaxEngine(model, record_routes=True, settings=BATCHINGS[request.param])
    prompts = [Prompt(f"p{i}", tuple(int(t) for t in np.random.RandomState(i).randint(0, 97, n)))
               for i, n in enumerate((3, 11, 6))]
    rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=3))
    stats = engine.batching_stats()
    assert (stats is None) == (request.param == "lockstep")
    assert (request.param == "preempting") == bool(stats and stats.preempted)
    return model, rollouts


@nnx.jit
def _routes(model, batch, replay):
    x, angles = model.embed_tokens(batch.input_ids), model.rope_angles(batch.positions)
    return model.routed_layers(x, batch.positions, batch.segment_ids, angles,
                               replay=replay)[1].experts


def test_engine_records_every_fed_token(sampled):
    model, rollouts = sampled
    k, moe_layers = model.config.moe.top_k, len(model.config.moe.sparse_layers)
    for r in rollouts:
        assert r.routes.shape == (r.length, moe_layers, k) and r.routes.dtype == np.int16
        assert np.all(r.routes[:-1] >= 0) and np.all(r.routes[-1] == -1)
    assert not np.array_equal(rollouts[0].routes[-3:-1], rollouts[2].routes[-3:-1])


def test_learner_replays_the_engines_experts(sampled):
    model, rollouts = sampled
    batch = pad_rollouts(rollouts, np.zeros(len(rollouts)))
    fed = np.asarray(batch.routes) >= 0  # [B, T, L, k]
    assert fed.any(axis=(2, 3)).sum() == sum(r.length - 1 for r in rollouts)
    free = np.asarray(_routes(model, batch, None))
    np.testing.assert_array_equal(np.sort(free, -1)[fed], np.sort(batch.routes, -1)[fed])
    replayed = np.asarray(_routes(model, batch, jnp.asarray(batch.routes)))
    np.testing.assert_array_equal(replayed, np.where(fed, batch.routes, free))
    other = np.where(fed, (np.asarray(batch.routes) + 1) % model.config.moe.num_experts, -1)
    replayed = np.asarray(_routes(model, batch, jnp.asarray(other, jnp.int16)))
    np.testing.assert_array_equal(replayed[fed], other[fed])  # the given experts are used


def test_sampler_logprobs_match_the_replaying_learner(sampled):
    model, rollouts = sampled
    mesh = make_mesh(MeshShape(), devices=jax.devices()[:1])
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    step = make_logprob_step(graphdef, params, frozen, mesh, StepConfig(logprob_chunk=64))
    batch = shard_batch(pad_rollouts(rollouts, np.zeros(len(rollouts))), mesh)
    assert batch.routes is not None
    logp = np.asarray(step(params, frozen, batch).logp)
    for i, r in enumerate(rollouts):
        np.testing.assert_allclose(logp[i, len(r.prompt_ids):r.length], r.sampler_logp,
                                   atol=TOL, rtol=0)
