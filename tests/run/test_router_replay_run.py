"""One RL step of the shrunken Kimi-K2 recipe (int4 experts + LoRA, experts split 8 ways, the
built-in engine) with ``train.router_replay=True`` and a dispatch capacity
(``model.moe_capacity_factor=0.5``): the engine's rollouts carry their routes, the step's metrics
are finite, and the capacity drops (token, expert) pairs that ``learner/moe_dropped_pairs`` and
``rollout/moe_dropped_pairs`` count (dropless runs report 0: tests/learner/test_router_replay.py
and the config tests; the engine's count: tests/rollout/jax/test_engine_dropped_pairs.py).
"""

import os

import numpy as np
import pytest

from rlx.bench.replay import load_config, shrunken
from rlx.config import parse_config
from rlx.run.build import build
from tests.helpers import ROOT


@pytest.mark.slow  # about 90 s on 2 cores; the replay itself is in tests/learner/test_router_replay.py
def test_one_step_with_router_replay_and_a_capacity(tmp_path):
    cfg = shrunken(load_config(os.path.join(ROOT, "configs", "kimi_k2.py")), str(tmp_path),
                   **{"train.router_replay": True, "model.moe_impl": "ragged",
                      "model.moe_capacity_factor": 0.5})
    run = build(parse_config(cfg), progress=False)
    try:
        record = run.step()
        for key in ("learner/loss", "learner/grad_norm", "learner/mismatch_abs_max"):
            assert np.isfinite(record[key]), (key, record[key])
        assert record["learner/moe_dropped_pairs"] > 0
        assert record["rollout/moe_dropped_pairs"] > 0  # the engine's rollouts drop pairs too
        run.queue.wait()  # the step's weight sync runs on the rollout worker: let it finish
        rollouts = run.engine.generate(next(run.data).prompts[:1], run._sampling())
        moe = run.compiled.model().config.moe
        layers, k = len(moe.sparse_layers), moe.top_k
        for r in rollouts:
            assert r.routes.shape == (r.length, layers, k) and np.all(r.routes[:-1] >= 0)
    finally:
        run.close()
