"""Continuous batching over the paged cache (``rlx.rollout.jax.continuous``, ``scheduler``).

Oracles: the learner's log-probs of the sampled sequences (<= 1e-5, f32), and each request
alone (same tokens, log-probs <= 1e-6): slots, pages and neighbours change nothing.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.models import from_hf
from rlx.models.paged_kv import PagedKVCache
from rlx.models.stack import layer_counts
from rlx.rollout.jax.continuous import compile_programs, slot_buckets
from rlx.rollout.jax.pages import PagePool
from rlx.rollout.jax.sampler import Knobs, SamplerSpec
from rlx.rollout.jax.scheduler import Scheduler, Shard
from rlx.rollout.jax.stops import device_stops
from rlx.types import SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.parity import sample_prompts, step_logprobs

TOL = 1e-5


def _scheduler(model, spec, *, slots=4, pages=40, page=4, per_octave=1):
    pools = PagedKVCache.zeros(model.config, pages, page, jnp.float32, layer_counts(model))
    programs = compile_programs(nnx.graphdef(model), spec, burst=4)
    return Scheduler(programs, pools, [Shard(PagePool(pages, page))], slots=slots, chunk=8,
                     rows=2, burst=4, per_octave=per_octave)


def test_slot_buckets():
    assert slot_buckets(64) == (64, 32, 16, 8, 4, 2)
    assert slot_buckets(64, 2) == (64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2)
    assert slot_buckets(12, 2) == (12, 9, 6, 3) and slot_buckets(5, 2) == (5,)
    with pytest.raises(ValueError, match="per octave"):
        slot_buckets(64, 3)


def test_continuous_batching_matches_the_learner_and_each_request_alone(tmp_path):
    model = from_hf(make_hf_model("llama", str(tmp_path)))
    prompts = sample_prompts((3, 11, 6, 17, 2), seed=1)
    sampling = SamplingParams(max_new_tokens=20, n=2, seed=3)
    spec = SamplerSpec()
    knobs = Knobs.of(1.0, None, None)
    stops = device_stops([5, 17], None)  # some rows stop early, others run to the cap
    sched = _scheduler(model, spec, per_octave=2)  # bursts of 4, 3 and 2 rows
    mixed = sched.run(nnx.state(model), prompts, sampling, 3, knobs, stops)
    pool = sched.shards[0].pool
    assert pool.free == pool.pages - 1  # every page back
    lengths = [len(r.completion_ids) for r in mixed]
    assert min(lengths) < 20 and max(lengths) == 20
    learner = step_logprobs(model, mixed)
    for r, ref in zip(mixed, learner):
        np.testing.assert_allclose(r.sampler_logp, ref, atol=TOL, rtol=0)
    for i, p in enumerate(prompts):
        alone = _scheduler(model, spec).run(nnx.state(model), [p], sampling, 3, knobs, stops)
        for j, r in enumerate(alone):
            got = mixed[2 * i + j]
            assert got.completion_ids.tolist() == r.completion_ids.tolist()
            np.testing.assert_allclose(got.sampler_logp, r.sampler_logp, atol=1e-6, rtol=0)


def test_out_of_pages_preempts_and_recomputes_the_same_tokens(tmp_path):
    """A pool too small for every slot's sequence at once: the latest started sample is
    preempted and recomputed later; every request's tokens are those of a pool large enough,
    and the preemptions are counted. Log-probs within the engine-vs-learner 1e-5: a resumed
    sample's cache was written by a prefill of its tokens, not by the decode steps that drew
    them (the same keys and values to rounding)."""
    model = from_hf(make_hf_model("llama", str(tmp_path)))
    prompts = sample_prompts((3, 11, 6, 17), seed=2)
    sampling = SamplingParams(max_new_tokens=20, n=2, seed=5)
    spec, knobs, stops = SamplerSpec(), Knobs.of(1.0, None, None), device_stops([], None)
    roomy = _scheduler(model, spec).run(nnx.state(model), prompts, sampling, 5, knobs, stops)
    tight = _scheduler(model, spec, pages=13)
    got = tight.run(nnx.state(model), prompts, sampling, 5, knobs, stops)
    pool = tight.shards[0].pool
    assert tight.stats.preempted > 0 and pool.free == pool.pages - 1
    for a, b in zip(roomy, got):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=TOL, rtol=0)


def test_a_request_longer_than_the_cache_is_refused(tmp_path):
    model = from_hf(make_hf_model("llama", str(tmp_path)))
    sched = _scheduler(model, SamplerSpec(), pages=5)  # 4 pages of 4 tokens
    with pytest.raises(ValueError, match="17 tokens .* need 36 cache slots, more than the 16"):
        sched.run(nnx.state(model), sample_prompts((17,)), SamplingParams(max_new_tokens=20),
                  0, Knobs.of(1.0, None, None), device_stops([], None))
