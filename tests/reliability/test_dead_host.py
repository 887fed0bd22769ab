"""A process of a 2-process run dies (SIGKILL) mid-step: the other stops in time, cleanly, and
relaunching both resumes to the uninterrupted run's parameters.

The run: the tiny config over 2 processes x 4 CPU devices (gloo collectives), each sampling its
own prompts (``distributed.rollouts="per_host"``), a checkpoint per step,
``distributed.heartbeat_timeout_s=10``, a reward that differs between completions (so the adapters
move) and also grades every completion with the math reward's worker processes (children of the
run that must not outlive it). Process 0 is ``python -m rlx.launch``; process 1 is
``tests/reliability/dead_host_driver.py``, the same run killing itself at one point of step 3:
in generation, inside the train step's collectives, or while a checkpoint is being written.

The same run with ``distributed.rollouts="global"`` (generation one program over both processes'
devices) has process 1 die as it starts generating step 3, leaving process 0 inside the engine's
collectives; relaunched, it too ends with the uninterrupted run's parameters.

Process 0 must exit with status 6 (``rlx.run.multihost.Watchdog``; the runtime's own abort would
be 134) with one line naming process 1 and the last complete checkpoint, leave none of its child
processes alive, and list only complete checkpoints (the one being written when process 1 died is
not among them). Relaunched with ``--config.resume=latest``, both processes finish the run with
the parameters of an uninterrupted 2-process run within 1e-5 (as ``tests/run/test_multihost_run.py``
measures 2 processes against 1).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from rlx.io.checkpoint import committed_steps
from tests.helpers import ROOT
from tests.helpers.multiprocess import child_env, free_port

STEPS, KILL_STEP, TIMEOUT_S, TOL = 5, 3, 10, 1e-5
CONFIG = """import sys
import zlib

import ml_collections

sys.path.insert(0, {root!r})
from configs.tiny import get_config as tiny
from rlx.rewards import RewardResult
from rlx.rewards.base import available_rewards, get_reward, register


class HashGradedReward:
    # crc32 of the completion (differs between completions: real gradients); the math reward
    # grades a boxed answer too, in its worker processes, and its score is dropped
    def __init__(self):
        self.math = get_reward("math")

    def __call__(self, completion, sample):
        self.math(chr(92) + "boxed{{1}}", sample)
        return RewardResult(zlib.crc32(completion.encode()) % 7 / 6, "hash")

    def close(self):
        self.math.close()


def get_config():
    if "test:hash_graded" not in available_rewards():
        register("test:hash_graded", lambda **_: HashGradedReward())
    c = tiny()
    c.output_dir = {out!r}
    c.mesh.data = 8
    c.data.prompts_per_step = 4
    c.data.eval_size = 0
    c.train.update(steps={steps}, checkpoint_every=1, keep_checkpoints=10,
                   reward="test:hash_graded", sample_every=0)
    c.distributed = ml_collections.ConfigDict(dict(
        enabled=True, coordinator_address="", num_processes=2, process_id=0,
        rollouts={rollouts!r}, data_shards=2, heartbeat_timeout_s={timeout}))
    return c
"""


def _env(cache) -> dict[str, str]:
    return child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4",
                     JAX_COMPILATION_CACHE_DIR=str(cache))


def _config(tmp, name: str, rollouts: str = "per_host") -> tuple[str, str]:
    out, path = str(tmp / name), tmp / f"{name}.py"
    path.write_text(CONFIG.format(root=ROOT, out=out, steps=STEPS, timeout=TIMEOUT_S,
                                  rollouts=rollouts))
    return str(path), out


def _launch(config: str, i: int, port: int, log, tmp, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlx.launch", f"--config={config}",
           f"--config.distributed.process_id={i}",
           f"--config.distributed.coordinator_address=127.0.0.1:{port}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp / "xla_cache"), stdout=subprocess.DEVNULL,
                            stderr=log)


def _both(config: str, tmp, name: str, *extra: str) -> None:
    """Both processes with the CLI to the end; each must exit 0."""
    port = free_port()
    logs = [open(tmp / f"{name}.{i}.log", "w+") for i in range(2)]
    procs = [_launch(config, i, port, logs[i], tmp, *extra) for i in range(2)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for code, log in zip(codes, logs):
        log.seek(0)
        assert code == 0, log.read()[-4000:]


def _final_params(out: str, step: int = STEPS) -> dict[str, np.ndarray]:
    """The trainable params of the run's checkpoint ``step``, read onto one device of this
    process (whatever process count wrote them)."""
    import jax

    path = os.path.join(os.path.abspath(out), "checkpoints", str(step), "state")
    ckpt = ocp.StandardCheckpointer()
    meta = ckpt.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = ckpt.restore(path, jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree))
    flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def _descendants(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                parents.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dead_host")
    config, out = _config(tmp, "straight")
    _both(config, tmp, "straight")
    return tmp, _final_params(out)


def _kill_and_watch(tmp, point: str, kill_step: int, rollouts: str = "per_host"):
    """Process 0 by the CLI, process 1 killing itself at ``point`` of step ``kill_step``; process
    0's exit status, its stderr, the children it had, and the run's output folder."""
    name = point if rollouts == "per_host" else f"{point}-{rollouts}"  # one folder per run
    config, out = _config(tmp, name, rollouts)
    port = free_port()
    log0, log1 = open(tmp / f"{name}.0.log", "w+"), open(tmp / f"{name}.1.log", "w+")
    survivor = _launch(config, 0, port, log0, tmp)
    victim = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.dead_host_driver", "--config", config,
         "--coordinator", f"127.0.0.1:{port}", "--kill-at", point, "--kill-step",
         str(kill_step)], cwd=ROOT, env=_env(tmp / "xla_cache"), stdout=subprocess.DEVNULL,
        stderr=log1)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 900
        while victim.poll() is None and time.monotonic() < deadline:
            children |= _descendants(survivor.pid)
            time.sleep(0.2)
        assert victim.poll() == -signal.SIGKILL, _read(log1)[-4000:]
        code = survivor.wait(timeout=300)
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.kill()
    return code, _read(log0), children, out, config


def _read(log) -> str:
    log.seek(0)
    return log.read()


def _check_survivor(tmp, point: str, kill_step: int = KILL_STEP,
                    rollouts: str = "per_host") -> tuple[str, str]:
    code, stderr, children, out, config = _kill_and_watch(tmp, point, kill_step, rollouts)
    folder = os.path.join(out, "checkpoints")
    kept = committed_steps(folder)
    assert code == 6, stderr[-4000:]
    assert "rlx: error: process 1 of the run's 2 was lost" in stderr, stderr[-4000:]
    assert f"the last complete checkpoint is step {kept[-1]} in {folder}" in stderr
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr, stderr[-4000:]
    assert children, "the run had no child processes: the check below would prove nothing"
    assert not [c for c in children if _alive(c)], "children of process 0 outlived it"
    # step kill_step never completed on both; the checkpoint before it too may still have been
    # in its write
    assert 1 <= len(kept) < kill_step and kept == list(range(1, len(kept) + 1)), kept
    assert sorted(n for n in os.listdir(folder) if n.isdigit()) == [str(s) for s in kept]
    return config, out


def _relaunch_matches(uninterrupted, config: str, out: str) -> None:
    tmp, want = uninterrupted
    _both(config, tmp, os.path.basename(out) + "_resumed", "--config.resume=latest")
    got = _final_params(out)
    assert got.keys() == want.keys() and len(want) >= 20
    assert max(np.abs(v).max() for k, v in want.items() if "lora_b" in k) > 1e-3  # they moved
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=TOL, rtol=0, err_msg=k)


def test_a_process_killed_in_the_train_step_stops_the_other(tmp_path):
    """The survivor's side alone, at one kill point of step 2 (the whole run, every kill point
    and the relaunch that matches the uninterrupted run: the slow test below)."""
    _check_survivor(tmp_path, "train", kill_step=2)


@pytest.mark.slow  # a 2-process run to its third step and a relaunch: minutes on 2 cores
def test_a_process_killed_in_global_generation_stops_the_other_and_the_run_resumes(uninterrupted):
    """With ``distributed.rollouts="global"`` generation is one program over both processes'
    devices: a process killed as it starts generating leaves the other inside its collectives,
    and the watchdog stops it as anywhere else; relaunched, the run ends where the
    uninterrupted one did (whose processes sampled their own prompts: the same tokens, each
    keyed by seed, prompt and sample)."""
    config, out = _check_survivor(uninterrupted[0], "generate", rollouts="global")
    _relaunch_matches(uninterrupted, config, out)


@pytest.mark.slow  # two 2-process runs and a relaunch: minutes on 2 cores
@pytest.mark.parametrize("point", ["generate", "train", "checkpoint"])
def test_a_process_killed_mid_step_stops_the_other_and_the_run_resumes(uninterrupted, point):
    tmp = uninterrupted[0]
    config, out = _check_survivor(tmp, point)
    _relaunch_matches(uninterrupted, config, out)


@pytest.fixture(scope="module", params=["per_host", "global"])
def two_process_checkpoint(uninterrupted, request):
    """The run's first 2 steps by 2 processes x 4 devices, checkpointed after each, with each
    rollouts mode."""
    tmp, name = uninterrupted[0], f"first_two_{request.param}"
    config, out = _config(tmp, name, request.param)
    _both(config, tmp, name, "--config.train.steps=2")
    assert committed_steps(os.path.join(out, "checkpoints"))[-1] == 2
    return config, out


@pytest.mark.slow  # a 2-process run and a 1-process resume: minutes on 2 cores
@pytest.mark.parametrize("devices", [8, 4])
def test_a_checkpoint_of_2_processes_resumes_on_1(uninterrupted, two_process_checkpoint,
                                                  devices, tmp_path):
    # data parallel 8 over 2 processes -> 8 or 4 devices of one; distributed.data_shards=2 is
    # fixed, so the one process reads both shards: the same global batches. The 3 resumed steps
    # sample with weights that differ from the uninterrupted run's in their last bits (another
    # per-device batch sums in another order). The sampler's draw is steady under such changes
    # (rlx.rollout.jax.sampling.categorical; tests/rollout/jax/test_sampling.py): the same
    # tokens are drawn and the run ends within 1e-5.
    tmp, want = uninterrupted
    config, first = two_process_checkpoint
    out = str(tmp_path / "resumed")
    shutil.copytree(first, out)
    env = dict(_env(tmp / "xla_cache"), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    r = subprocess.run([sys.executable, "-m", "rlx.launch", f"--config={config}",
                        f"--config.output_dir={out}", "--config.distributed.enabled=False",
                        f"--config.mesh.data={devices}", "--config.resume=latest"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from checkpoint 2" in r.stderr
    got = _final_params(out)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=TOL, rtol=0, err_msg=k)
