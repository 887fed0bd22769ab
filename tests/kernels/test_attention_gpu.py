"""On a GPU (``pytest -m gpu``): the attention kernels and one tiny RL step, with the parity bounds
of the CPU tests (float32 products at full precision: TF32 would not meet 1e-5). Without a GPU
these tests skip, naming why."""

import json
import os
import subprocess
import sys

import jax
import pytest

from rlx.kernels.attention import attend
from rlx.platform.policy import policy_for
from tests.helpers.attention import TOL, batch, dense, errors


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not _gpus(), reason="no GPU: jax.devices('gpu') finds none (these tests run with -m gpu on "
                        "a machine with one)")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_attention_on_gpu_equals_dense():
    """The GPU policy's attention (2k tokens: past any dense threshold) against dense attention,
    outputs and gradients, GQA with padding and packing."""
    b, t, h, kv, d = 2, 2048, 8, 2, 64
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, t, n, d)) for kk, n in zip(keys, (h, kv, kv)))
    seg, pos = batch(b, t, pad=100, packed=True)
    gpu = policy_for("gpu")
    fn = lambda q, k, v: attend(  # noqa: E731
        q, k, v, seg, seg, pos, pos, causal_columns=True, policy=gpu)
    ref = lambda q, k, v: dense(q, k, v, seg, pos)  # noqa: E731
    with jax.default_device(_gpus()[0]), jax.default_matmul_precision("highest"):
        out_err, grad_err = errors(fn, ref, (q, k, v), seg)
    assert out_err <= TOL and grad_err <= TOL, (out_err, grad_err)


def test_one_tiny_rl_step_on_gpu(tmp_path):
    """configs/tiny.py for one step on the GPU: it runs and logs its update."""
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
    cmd = [sys.executable, "-m", "rlx.launch", "--config", os.path.join(ROOT, "configs/tiny.py"),
           f"--config.output_dir={tmp_path}/run", "--config.train.steps=1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert any(s.get("step") == 1 and "time/update" in s for s in steps)
