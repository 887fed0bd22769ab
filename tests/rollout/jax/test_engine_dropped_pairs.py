"""The built-in engine counts the (token, expert) pairs its MoE dispatch capacity drops during
rollouts (``JaxEngine.dropped_pairs``, logged per step as ``rollout/moe_dropped_pairs``).

The oracle recounts them from the experts the engine recorded for every token it fed (routing
replay's ``Rollout.routes``): each forward call (the prefill, then one decode step per fed token)
splits its tokens in row-major order into one contiguous chunk per token shard; a chunk's pairs
bound for one device of its expert group beyond the exchange capacity ``C`` are the dropped ones.
"""

import math

import numpy as np
import pytest

from rlx.mesh import MeshShape, make_mesh
from rlx.quant import LoraConfig
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.engine import JaxEngine
from rlx.types import Prompt, SamplingParams
from tests.helpers.quant import quantized_lora_model

SHAPE = MeshShape(fsdp=2, expert=4)  # tokens over 8 shards, experts over 4 devices
ROWS, PROMPT, NEW, FACTOR = 8, 16, 8, 0.5  # one row per shard, no padding in the bucket


def _recount(experts: np.ndarray, shards: int, split: int, num_experts: int) -> int:
    """Dropped pairs of one forward call's tokens ``experts`` ``[n, layers, k]`` (row-major)."""
    n, layers, k = experts.shape
    n_loc, local = n // shards, num_experts // split
    cap = min(n_loc * min(k, local), max(1, math.ceil(FACTOR * n_loc * k / split)))
    total = 0
    for layer in range(layers):
        for chunk in experts[:, layer].reshape(shards, n_loc * k):
            counts = np.bincount(chunk // local, minlength=split)
            total += int(np.maximum(counts - cap, 0).sum())
    return total


def _generate(model, mesh, record: bool, factor: float | None, batching: str = "lockstep"):
    engine = JaxEngine(model, mesh=mesh, record_routes=record, capacity_factor=factor,
                       settings=JaxSection(batching=batching))
    rs = np.random.RandomState(1)
    prompts = [Prompt(f"p{i}", tuple(int(t) for t in rs.randint(0, 97, PROMPT)))
               for i in range(ROWS)]
    sampling = SamplingParams(max_new_tokens=NEW, seed=5, ignore_eos=True)
    return engine, engine.generate(prompts, sampling)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return quantized_lora_model(str(tmp_path_factory.mktemp("moe")), "qwen3_moe",
                                lora=LoraConfig(rank=3, alpha=5.0, experts=True))


def test_the_engine_counts_the_pairs_its_capacity_drops(model):
    mesh = make_mesh(SHAPE)
    engine, rollouts = _generate(model, mesh, record=True, factor=FACTOR)
    assert [r.length for r in rollouts] == [PROMPT + NEW] * ROWS
    routes = np.stack([r.routes for r in rollouts]).astype(np.int64)  # [rows, p + n, l, k]
    assert np.all(routes[:, :-1] >= 0)  # every fed token has its experts
    shards, split, experts = 8, SHAPE.expert, model.config.moe.num_experts
    expected = _recount(routes[:, :PROMPT].reshape(ROWS * PROMPT, *routes.shape[2:]), shards,
                        split, experts)
    for t in range(PROMPT, PROMPT + NEW - 1):  # one decode step per fed completion token
        expected += _recount(routes[:, t], shards, split, experts)
    assert expected > 0  # the capacity does drop pairs here, so the count can be wrong
    assert engine.dropped_pairs() == expected

    plain, again = _generate(model, mesh, record=False, factor=FACTOR)  # no routes recorded
    assert plain.dropped_pairs() == expected
    assert [r.completion_ids.tolist() for r in again] == [
        r.completion_ids.tolist() for r in rollouts]


def test_continuous_batching_counts_the_pairs_its_capacity_drops(model):
    """The continuous engine's programs (its own rows: a block per data shard) count what
    their dispatch drops: some at a capacity factor of 0.5, none at one that holds every
    pair."""
    mesh = make_mesh(SHAPE)
    tight, _ = _generate(model, mesh, record=False, factor=FACTOR, batching="continuous")
    roomy, _ = _generate(model, mesh, record=False, factor=64.0, batching="continuous")
    assert tight.batching_stats() is not None and roomy.batching_stats() is not None
    assert tight.dropped_pairs() > 0 and roomy.dropped_pairs() == 0


def test_dropless_engines_count_nothing(model):
    assert JaxEngine(model, mesh=make_mesh(SHAPE)).dropped_pairs() is None
