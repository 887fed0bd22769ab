"""PPO with a learned critic (``train.advantage="gae"``) on the tiny config.

The task (``tests/helpers/ppo_driver.py``) has a delayed reward, paid once at the end of each
completion: half of it for the share of completion tokens that start a word (what the policy's
choices control), half for prompts naming "gold" rather than "tin" (what no choice changes and a
critic's baseline should absorb). The random tiny model trains every parameter (``full``; its
critic is a copy of it): a random LoRA-mode policy cannot move its near-uniform next-token
distribution over 49,152 tokens towards any class of tokens. The run is a process of its own on
one CPU device (about four times faster than on the tests' 8 fake devices). Checked: held-out
greedy reward rises, and the critic's explained variance, 0 for its fresh head, rises above 0.5
(it learns to read the prompt's kind).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ppo"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "tests.helpers.ppo_driver", out], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(out, "tiny", "metrics.jsonl")) as f:
        return out, [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def records(run_dir):
    return run_dir[1]


def test_ppo_raises_the_held_out_reward(records):
    (start, end) = [r["eval/mean_reward"] for r in records if "eval/mean_reward" in r]
    assert end > start + 0.2, (start, end)


def test_the_critics_explained_variance_rises_above_half(records):
    ev = [r.get("critic/explained_variance", np.nan) for r in records if "reward/mean" in r]
    assert max(np.nan_to_num(ev[:4], nan=0.0)) < 0.1, ev  # a fresh head predicts nothing
    assert np.mean(np.nan_to_num(ev[-4:], nan=0.0)) > 0.5, ev


def test_every_update_is_reported(records):
    steps = [r for r in records if "reward/mean" in r]
    assert all(r["learner/updates"] == 8 and r["critic/updates"] == 8 for r in steps)
    late = steps[-1]
    assert all(f"learner/update_{i}/clip_frac" in late and f"learner/update_{i}/approx_kl" in late
               for i in range(8))
    assert late["learner/update_0/approx_kl"] == pytest.approx(0.0, abs=1e-6)  # pi = pi_old
    assert max(late[f"learner/update_{i}/approx_kl"] for i in range(1, 8)) > 0  # then it moves
    assert all(np.isfinite(r["critic/value_loss"]) and np.isfinite(r["critic/returns_mean"])
               for r in steps)


def test_the_critic_is_exported_apart_from_the_policy(run_dir):
    # full mode: the policy as a HF folder, the critic as its own HF folder with the value head
    # (HF's score layer) that a later run can start from (config.critic.path)
    from rlx.io.export import read_version
    from rlx.learner.critic import read_value_head

    export = os.path.join(run_dir[0], "export")
    assert read_version(os.path.join(export, "policy")) == "20"
    critic = os.path.join(export, "critic")
    with open(os.path.join(critic, "rlx_export.json")) as f:
        assert json.load(f)["kind"] == "critic"
    kernel, bias = read_value_head(critic)
    assert kernel.shape == (64,) and np.abs(kernel).max() > 0  # trained from its zero start
    assert bias is not None and np.isfinite(bias)
