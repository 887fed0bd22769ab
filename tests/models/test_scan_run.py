"""``config.model.scan_layers`` through a whole run (tiny config: int8 base + LoRA, 2 layers):
scanned and unrolled runs log the same steps (the same sampled tokens and rewards; losses and
mismatch within 1e-6), write checkpoints of the same paths, shapes and values, and a run of one
form resumes the other's checkpoint. Marked ``slow`` (tiny runs of a few steps)."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from rlx.models.stack import is_stacked
from rlx.run.build import build
from tests.helpers.runs import run_config

STEPS = 2
EXACT = ("reward/mean", "response_length/mean", "batch/kept_frac")
CLOSE = ("learner/loss", "learner/kl", "learner/grad_norm", "learner/mismatch_abs_max")


def _train(out, scan: str, steps: int = STEPS, resume: str = ""):
    cfg = run_config("tiny", out, **{"model.scan_layers": scan, "train.steps": steps,
                                     "train.checkpoint_every": 1, "data.eval_size": 0,
                                     "mesh.data": 8, "resume": resume})
    run = build(cfg, progress=False)
    try:
        c = run.compiled
        assert is_stacked(nnx.merge(c.graphdef, c.state.params, c.state.frozen)) == (scan == "on")
        records = [r for r in run.train() if "reward/mean" in r]
        run.save(force=True)
        return records
    finally:
        run.close()


def _arrays(out, step: int) -> dict:
    """Every array of checkpoint ``step`` under ``out``, by path (read without a target)."""
    with ocp.CheckpointManager(f"{out}/tiny/checkpoints") as mgr:
        tree = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.slow
def test_scanned_and_unrolled_runs_agree_and_share_checkpoints(tmp_path):
    scanned, unrolled = _train(tmp_path / "on", "on"), _train(tmp_path / "off", "off")
    assert [r["step"] for r in scanned] == [r["step"] for r in unrolled] == [1, 2]
    for a, b in zip(scanned, unrolled):
        for k in EXACT:
            assert a[k] == b[k], k
        for k in CLOSE:
            assert abs(a[k] - b[k]) <= 1e-6, (k, a[k], b[k])
    on, off = _arrays(tmp_path / "on", STEPS), _arrays(tmp_path / "off", STEPS)
    assert on.keys() == off.keys() and any("'layers'" in k for k in on)
    assert not any("stacks" in k for k in on)
    for k in on:
        np.testing.assert_allclose(on[k], off[k], atol=1e-6, rtol=0, err_msg=k)
    # each form resumes the other's checkpoint: the same next step
    more = _train(tmp_path / "on", "off", steps=STEPS + 1, resume="latest")[-1]
    again = _train(tmp_path / "off", "on", steps=STEPS + 1, resume="latest")[-1]
    assert more["step"] == again["step"] == STEPS + 1
    for k in CLOSE:
        assert abs(more[k] - again[k]) <= 1e-6, (k, more[k], again[k])
