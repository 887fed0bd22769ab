"""A non-finite loss skips the update, is logged, and N in a row stop the run with the last good
checkpoint intact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.io.metrics import read_metrics
from rlx.run.build import build
from rlx.run.loop import NonFiniteError
from tests.helpers.runs import run_config


def test_nan_updates_are_skipped_then_the_run_stops_with_its_last_good_checkpoint(tmp_path):
    cfg = run_config("tiny", tmp_path, **{"mesh.data": 8, "data.eval_size": 0, "train.steps": 10,
                                        "train.checkpoint_every": 1, "train.keep_checkpoints": 2,
                                        "train.max_skipped_steps": 3})
    run = build(cfg, progress=False)
    try:
        run.train(2)
        good = jax.tree.map(np.asarray, run.compiled.state.params)
        leaves, treedef = jax.tree.flatten(run.compiled.state.params)
        leaves[0] = jnp.full_like(leaves[0], jnp.nan)  # poisons the loss and every gradient
        run.compiled.state = run.compiled.state.replace(params=jax.tree.unflatten(treedef, leaves))
        with pytest.raises(NonFiniteError, match=r"3 updates in a row \(up to step 5\).*last good "
                                                 r"checkpoint is step 2"):
            run.train()
        assert run.checkpointer.steps() == [1, 2]  # nothing saved from the poisoned state
        restored = run.checkpointer.restore(2, run.compiled.state)
        for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(restored.state.params)):
            assert np.array_equal(a, np.asarray(b))
    finally:
        run.close()
    records = [r for r in read_metrics(cfg.output_dir) if "learner/skipped" in r]
    assert [r["learner/skipped"] for r in records] == [0, 0, 1, 1, 1]
