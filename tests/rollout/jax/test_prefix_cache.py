"""The built-in engine's prefix cache (``JaxEngine.prefix_cache``): a request that extends a
sequence the engine just produced continues from that sequence's KV-cache row.

Three turns of a multi-turn exchange on a tiny random Llama (unrolled, and with its layers
stacked as a scanned model) and a tiny DeepSeek-V3 (latent-attention cache, MoE): every turn's prompts are the previous turn's first samples' whole
sequences plus a few appended tokens, except one new prompt per turn (so a batch mixes continued
rows and whole prefills), sampled at temperature 1 with ``n = 2`` (the samples of a prompt share
its prefill). Against an engine that prefills every prompt whole, with the same seeds: the same
tokens, sampler log-probs within 1e-5 (f32), and per turn the continuing engine prefills only the
appended tokens, the last sampled token before them and the new prompt. A weight update drops
every kept row (the next turn prefills whole), as does leaving the context. Prompt buckets of at
least 64 tokens keep the programs few: one whole-prefill bucket, one continued.
"""

import numpy as np
import pytest

from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf
from rlx.models.stack import stack_layers
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.engine import Buckets, JaxEngine
from rlx.types import Prompt, SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.moe import tiny_deepseek

TOL = 1e-5
SAMPLING = SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=11)
BUCKETS = Buckets(min_prompt=64)
PAGE = 4


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _tokens(rs, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rs.randint(0, 97, n))


def _turns(engine: JaxEngine, turns: int = 3, page: int | None = None):
    """Each turn's prompts, rollouts, tokens prefilled and the count a prefix cache prefills
    (sequences it just produced continue; see the module docstring). ``page``: the engine
    shares whole pages of this many tokens (continuous batching), so a continued prompt
    prefills from the end of the last full page its previous sequence wrote."""
    rs = np.random.RandomState(0)
    prompts = [Prompt(f"p{i}", _tokens(rs, n)) for i, n in enumerate((3, 11, 6))]
    expected = sum(len(p.token_ids) for p in prompts)
    out = []
    for t in range(turns):
        before = engine.prefilled_tokens()
        rollouts = engine.generate(prompts, SAMPLING)
        out.append((prompts, rollouts, engine.prefilled_tokens() - before, expected))
        firsts = rollouts[::SAMPLING.n]
        extra = [_tokens(rs, 1 + 3 * i) for i in range(len(firsts) - 1)]
        prompts = [Prompt(f"p{i}.{t}", (*r.prompt_ids.tolist(), *r.completion_ids.tolist(), *x))
                   for i, (r, x) in enumerate(zip(firsts, extra))] + [Prompt(f"new{t}",
                                                                            _tokens(rs, 4))]
        expected = sum(1 + len(x) for x in extra) + 4
        if page is not None:  # written: the prompt and every completion token but the last
            written = [len(r.prompt_ids) + len(r.completion_ids) - 1 for r in firsts[:-1]]
            expected = sum(len(p.token_ids) - page * (w // page)
                           for p, w in zip(prompts, written)) + 4
    return out


@pytest.mark.parametrize("batching", ["continuous", "lockstep"])
@pytest.mark.parametrize("kind", [
    # CI: the unrolled model's continued turns also run in tests/envs/test_episode_jax.py
    pytest.param("llama", marks=pytest.mark.slow), "llama stacked",
    pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_continued_requests_prefill_only_their_new_tokens(zoo, kind, batching):
    """Lockstep keeps each sequence's cache row; continuous batching its full pages (of
    ``PAGE`` tokens), which ``cached_sequences`` counts then."""
    if kind == "deepseek_v3":
        model = tiny_deepseek()
    else:
        model = from_hf(make_hf_model("llama", zoo))
        model = stack_layers(model) if kind.endswith("stacked") else model
    settings = JaxSection(batching=batching, page_size=PAGE)
    engine, whole = (JaxEngine(model, buckets=BUCKETS, settings=settings) for _ in range(2))
    paged = batching == "continuous"
    with engine.prefix_cache():
        turns = _turns(engine, page=PAGE if paged else None)
        held = engine.cached_sequences()
        engine.update_weights(model, engine.weight_version + 1)  # the same weights, a new version
        assert engine.cached_sequences() == 0
        prompts = turns[-1][0]
        before = engine.prefilled_tokens()
        again = engine.generate(prompts, SAMPLING)
        assert engine.prefilled_tokens() - before == sum(len(p.token_ids) for p in prompts)
    assert engine.cached_sequences() == 0
    assert held > 0 if paged else held == 3 * SAMPLING.n
    diffs = []
    for t, (prompts, rollouts, prefilled, expected) in enumerate(turns):
        assert prefilled == expected, f"turn {t}"
        if t:
            assert prefilled < sum(len(p.token_ids) for p in prompts)
        before = whole.prefilled_tokens()
        reference = whole.generate(prompts, SAMPLING)
        assert whole.prefilled_tokens() - before == sum(len(p.token_ids) for p in prompts)
        for a, b in zip(rollouts, reference):
            assert (a.prompt_uid, a.sample_index) == (b.prompt_uid, b.sample_index)
            assert a.completion_ids.tolist() == b.completion_ids.tolist(), f"turn {t}"
            diffs.append(float(np.abs(a.sampler_logp - b.sampler_logp).max()))
    assert len({tuple(r.completion_ids) for r in turns[0][1]}) > 3  # the samples differ
    for a, b in zip(again, whole.generate(turns[-1][0], SAMPLING)):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
    print(f"max |diff| of sampler log-probs, continued vs whole prefill: {max(diffs):.2e}; "
          f"programs compiled: {engine.compilations()}")
    assert max(diffs) <= TOL


def test_continued_requests_on_data_shards_prefill_only_their_new_tokens(zoo):
    """Continuous batching on 4 data shards x tensor 2: each data shard keeps the pages of the
    sequences it finished (the requests spread over the shards), and a continued request goes
    to the shard holding its pages, so each turn prefills what one device does."""
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    engine = JaxEngine(from_hf(make_hf_model("llama", zoo), mesh=mesh), mesh=mesh,
                       buckets=BUCKETS, settings=JaxSection(page_size=PAGE))
    with engine.prefix_cache():
        turns = _turns(engine, page=PAGE)
    assert engine.batching_stats() is not None
    for t, (prompts, _, prefilled, expected) in enumerate(turns):
        assert prefilled == expected, f"turn {t}"
