"""The learner's side of a step (``rlx.run.learn.StepLearner``) with stand-ins for the compiled
steps: rollouts longer than the model's positions are left out and counted, and the batch's
layout is reported (``train/*``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import parse_config
from rlx.learner.step import Compiled
from rlx.mesh import make_mesh
from rlx.run.hosts import Hosts
from rlx.run.learn import StepLearner
from rlx.types import Rollout, StepMetrics
from tests.helpers.runs import config_dict

LENGTHS = (6, 30, 10, 12, 4, 9)  # completion tokens after a 2-token prompt


def _learner(tmp_path, limit: int, shapes: list, **over) -> StepLearner:
    cfg = parse_config(config_dict("tiny", tmp_path, **{"loss.kl_coef": 0.0, **over}))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=8),
                              rollout=dataclasses.replace(cfg.rollout, max_new_tokens=32))

    def train_step(state, batch):
        shapes.append(batch.shape)
        zero = jnp.zeros((), jnp.float32)
        return state, StepMetrics(*[zero] * len(StepMetrics._fields))

    state = type("State", (), {"params": None, "frozen": None})()
    compiled = Compiled(graphdef=None, state=state, train_step=train_step, ref_step=None,
                        max_positions=limit)
    return StepLearner(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), compiled, Hosts())


def _step(learner):
    rollouts = [Rollout(f"p{i // 2}", np.array([1, 2]), 10 * (i + 1) + np.arange(n),
                        np.zeros(n, np.float32), sample_index=i % 2) for i, n in enumerate(LENGTHS)]
    rewards = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    prepared = learner.prepare(rollouts, rewards, np.array([r.prompt_uid for r in rollouts]),
                               np.arange(len(rollouts)))
    return prepared, learner.update(prepared, step=0)


def test_rollouts_past_the_models_positions_are_skipped_and_counted(tmp_path):
    """A 32-token rollout on a model of 24 positions is not trained on; the batch is packed into
    rows of 16 tokens (the token budget), one per micro-batch."""
    shapes: list = []
    prepared, record = _step(_learner(tmp_path, 24, shapes, **{"train.tokens_per_micro_batch": 16}))
    assert record["rollout/skipped_too_long"] == 1
    ids, mask = np.asarray(prepared.batch.input_ids), np.asarray(prepared.batch.loss_mask) > 0
    assert not np.any((ids >= 20) & (ids < 30))  # the second rollout is nowhere
    assert int(mask.sum()) == sum(LENGTHS) - 30
    # kept: 8, 12, 14, 6, 11 tokens first-fit decreasing into 16: [14], [12], [11], [8, 6]: 4
    # rows, 51 tokens; one row per micro-batch (1 shard), 4 micro-batches (a count_bucket value)
    assert shapes == [(4, 16)] and record["train/micro_batches"] == 4
    assert record["train/pack_efficiency"] == pytest.approx(51 / 64)
    assert (record["train/rows"], record["train/row_tokens"]) == (4, 16)
    # GRPO over all six rewards (the skipped one's too): p0 = (1, 0) -> +-0.7071 on rollout 0
    adv = np.asarray(prepared.batch.advantages)[mask & (ids >= 10) & (ids < 20)]
    np.testing.assert_allclose(adv, 0.7071068, atol=1e-5)
    _, fits = _step(_learner(tmp_path / "b", 32, []))
    assert fits["rollout/skipped_too_long"] == 0
    with pytest.raises(ValueError, match="every rollout of this step is longer than the 4 "
                                         "positions the model was built for"):
        _step(_learner(tmp_path / "c", 4, []))
