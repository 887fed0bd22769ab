"""Continuous batching over the paged cache (``rlx.rollout.jax.continuous``, ``scheduler``).

Oracles: the learner's log-probs of the sampled sequences (<= 1e-5, f32), and each request
alone (same tokens, log-probs <= 1e-6): slots, pages and neighbours change nothing.
"""

import jax.numpy as jnp
import numpy as np

from rlx.models import from_hf
from rlx.models.paged_kv import PagedKVCache
from rlx.models.stack import layer_counts
from rlx.rollout.jax.continuous import compile_programs
from rlx.rollout.jax.pages import PagePool
from rlx.rollout.jax.sampler import Knobs, SamplerSpec
from rlx.rollout.jax.scheduler import Scheduler
from rlx.rollout.jax.stops import device_stops
from rlx.types import SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.parity import sample_prompts, step_logprobs

TOL = 1e-5


def _scheduler(model, spec, *, slots=4, pages=40, page=4, per_seq=12):
    pools = PagedKVCache.zeros(model.config, pages, page, jnp.float32, layer_counts(model))
    return Scheduler(compile_programs(model, spec, burst=4), pools, PagePool(pages, page),
                     slots=slots, pages_per_seq=per_seq, chunk=8, rows=2, burst=4)


def test_continuous_batching_matches_the_learner_and_each_request_alone(tmp_path):
    model = from_hf(make_hf_model("llama", str(tmp_path)))
    prompts = sample_prompts((3, 11, 6, 17, 2), seed=1)
    sampling = SamplingParams(max_new_tokens=20, n=2, seed=3)
    spec = SamplerSpec()
    knobs = Knobs.of(1.0, None, None)
    stops = device_stops([5, 17], None)  # some rows stop early, others run to the cap
    sched = _scheduler(model, spec)
    mixed = sched.run(prompts, sampling, 3, knobs, stops)
    assert sched.pool.free == sched.pool.pages - 1  # every page back
    lengths = [len(r.completion_ids) for r in mixed]
    assert min(lengths) < 20 and max(lengths) == 20
    learner = step_logprobs(model, mixed)
    for r, ref in zip(mixed, learner):
        np.testing.assert_allclose(r.sampler_logp, ref, atol=TOL, rtol=0)
    for i, p in enumerate(prompts):
        alone = _scheduler(model, spec).run([p], sampling, 3, knobs, stops)
        for j, r in enumerate(alone):
            got = mixed[2 * i + j]
            assert got.completion_ids.tolist() == r.completion_ids.tolist()
            np.testing.assert_allclose(got.sampler_logp, r.sampler_logp, atol=1e-6, rtol=0)
