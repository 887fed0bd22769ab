"""Engine-vs-learner log-prob parity: the built-in engine's sampler and scorer against the
learner's compiled log-prob step on the same sequences (``TOL``: f32)."""

import jax
import numpy as np
from flax import nnx

from rlx.learner.batching import pad_rollouts, shard_batch
from rlx.learner.step import StepConfig, make_logprob_step
from rlx.mesh import MeshShape, make_mesh
from rlx.rollout.jax.engine import JaxEngine
from rlx.rollout.preflight import learner_logprobs
from rlx.types import Prompt, SamplingParams

TOL = 1e-5


def sample_prompts(lengths=(3, 11, 6), seed=0, vocab=97) -> list[Prompt]:
    rs = np.random.RandomState(seed)
    return [Prompt(f"p{i}", tuple(int(t) for t in rs.randint(0, vocab, n)))
            for i, n in enumerate(lengths)]


def step_logprobs(model, rollouts) -> list[np.ndarray]:
    """The learner's compiled log-prob step on the rollouts' sequences (1-device mesh)."""
    mesh = make_mesh(MeshShape(), devices=jax.devices()[:1])
    trainable = nnx.LoRAParam if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)) else nnx.Param
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    step = make_logprob_step(graphdef, params, frozen, mesh, StepConfig(logprob_chunk=64))
    batch = pad_rollouts(rollouts, np.zeros(len(rollouts)))
    logp = np.asarray(step(params, frozen, shard_batch(batch, mesh)).logp)  # aligned with ids
    return [logp[i, len(r.prompt_ids):r.length] for i, r in enumerate(rollouts)]


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def parity(model, sampling=SamplingParams(max_new_tokens=12, n=2, seed=3)):
    """(sampler, scorer, preflight) max |log-prob difference| against the learner's step."""
    engine = JaxEngine(model)
    rollouts = engine.generate(sample_prompts(), sampling)
    assert all(len(r.completion_ids) == sampling.max_new_tokens for r in rollouts)
    learner = step_logprobs(model, rollouts)
    seqs = [(np.concatenate([r.prompt_ids, r.completion_ids]), len(r.prompt_ids))
            for r in rollouts]
    return (max_diff(learner, [r.sampler_logp for r in rollouts]),
            max_diff(learner, engine.score(seqs)), max_diff(learner, learner_logprobs(model, seqs)))


def decoded_logits(model, ids, mask, cache, prefill: int) -> np.ndarray:
    """Logits of every slot of ``ids`` (rows left-padded as ``mask`` says) from ``model.decode``
    over ``cache``: the first ``prefill`` slots in one call, then one token per call."""
    import jax.numpy as jnp

    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    step = jax.jit(lambda m, x, p, s, c: (lambda h, c: (m.logits(h), c))(*m.decode(x, p, s, c)))
    spans = [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]
    outs = []
    for a, b in spans:
        logits, cache = step(model, ids[:, a:b], positions[:, a:b], mask[:, a:b], cache)
        outs.append(np.asarray(logits))
    return np.concatenate(outs, axis=1)
