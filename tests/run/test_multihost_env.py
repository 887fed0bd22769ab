"""Tool-use episodes (``env.kind="tools"``) in a run of 2 processes x 4 CPU devices (gloo).

Each ``distributed.rollouts`` mode runs one step of the tiny config on three-turn episodes
(``tests/helpers/multihost_env_driver.py``: 2 prompts x 4 episodes, one prompt from each
process's data shard, rewards that differ within a group):

* ``"global"`` (the default with the built-in engine): both processes drive all 8 episodes with
  one engine program over the whole mesh; each process resets and steps the envs of its own 4
  episodes (12 env steps, not 24) and gets the other's replies;
* ``"primary"``: every process's examples are gathered to process 0, whose engine runs all 8
  episodes (as the single-turn path gathers prompts); process 1 runs none;
* ``"per_host"``: each process's engine runs the 4 episodes of its own prompt.

Either way both processes end the step with the same record (the ``env/*`` metrics over every
episode, whichever process ran it) and the same trainable parameters, which moved; every episode ran 3
turns, and the sampler/learner mismatch stays within 1e-5 (f32). The engines seed every turn by
(step, episode, turn), so both modes draw the same tokens: the same episodes, rewards and prefilled
tokens, and parameters within 1e-5. CI runs the global mode; primary, per_host and the comparisons
are slow.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.helpers.multiprocess import process_commands, run_together

TOL = 1e-5


def _run(tmp, mode: str, timeout: float = 480) -> list[dict[str, np.ndarray]]:
    """Both processes of one mode; each one's results (process order)."""
    out = tmp / mode
    run_together(process_commands(
        [sys.executable, "-m", "tests.helpers.multihost_env_driver", "--out", str(out),
         "--output-dir", str(tmp / f"run_{mode}"), "--local-devices", "4", "--rollouts", mode], 2),
        timeout=timeout, logdir=tmp)
    return [dict(np.load(f"{out}.{i}.npz")) for i in range(2)]


@pytest.fixture(scope="module")
def global_(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("env_global"), "global")


@pytest.fixture(scope="module")
def primary(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("env_primary"), "primary")


@pytest.fixture(scope="module")
def per_host(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("env_per_host"), "per_host")


def _params(result) -> list[str]:
    return sorted(k for k in result if k.startswith("param:"))


def _processes_agree(results) -> None:
    first, second = results
    assert [int(r["process_index"]) for r in results] == [0, 1]
    assert int(first["process_count"]) == 2
    assert _params(first) == _params(second) and len(_params(first)) == 28
    for name in _params(first):
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    assert max(np.abs(first[k]).max() for k in _params(first) if "lora_b" in k) > 1e-4  # moved
    for name in (k for k in first if k.startswith("record:")):
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    assert float(first["record:env/turns"]) == 3.0
    assert float(first["record:learner/mismatch_abs_max"]) <= TOL
    assert float(first["record:learner/loss"]) != 0.0


def test_global_rollouts_drive_every_episode_everywhere_and_step_each_env_once(global_):
    _processes_agree(global_)
    first, second = global_
    assert len(first["ran"]) == len(second["ran"]) == 8
    for name in ("ran", "tokens", "rewards"):
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    assert len({r.split("#")[0] for r in first["ran"]}) == 2  # both processes' prompts
    # 8 episodes x 3 turns = 24 env steps in all; each process took its own 4 episodes' 12
    assert int(first["env_steps"]) == int(second["env_steps"]) == 12
    assert np.ptp(first["rewards"]) > 0


@pytest.mark.slow  # CI: the global mode above covers the 2-process episode path
def test_global_rollouts_equal_the_primary_ones(global_, primary):
    both = primary[0]
    for name in ("ran", "tokens", "rewards"):
        np.testing.assert_array_equal(global_[0][name], both[name], err_msg=name)
    # (not env/prefilled_tokens: the prompts' shared prefills depend on the engine's mesh, all 8
    # devices here and process 0's 4 with "primary")
    for name in ("record:reward/mean", "record:response_length/mean", "record:env/turns"):
        np.testing.assert_array_equal(global_[0][name], both[name], err_msg=name)
    for name in _params(both):
        np.testing.assert_allclose(global_[0][name], both[name], atol=TOL, rtol=0, err_msg=name)


@pytest.mark.slow  # CI: the global mode covers the 2-process episode path
def test_primary_rollouts_run_every_episode_on_process_0(primary):
    _processes_agree(primary)
    first, second = primary
    assert len(first["ran"]) == 8 and len(second["ran"]) == 0
    assert len({r.split("#")[0] for r in first["ran"]}) == 2  # both processes' prompts
    assert np.ptp(first["rewards"]) > 0


@pytest.mark.slow  # CI: the global mode above covers the 2-process episode path
def test_per_host_rollouts_run_each_process_its_own_episodes_alike(per_host, primary):
    _processes_agree(per_host)
    first, second = per_host
    assert len(first["ran"]) == len(second["ran"]) == 4
    assert not {r.split("#")[0] for r in first["ran"]} & {r.split("#")[0] for r in second["ran"]}
    both, alone = primary[0], (first, second)
    for name in ("ran", "tokens", "rewards"):
        np.testing.assert_array_equal(np.concatenate([r[name] for r in alone]), both[name])
    for name in ("record:reward/mean", "record:response_length/mean", "record:env/turns",
                 "record:env/prefilled_tokens"):
        np.testing.assert_array_equal(first[name], both[name], err_msg=name)
    for name in _params(both):
        np.testing.assert_allclose(first[name], both[name], atol=TOL, rtol=0, err_msg=name)
