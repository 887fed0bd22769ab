"""The disk fills while a checkpoint is written: the run stops with one clear error (exit status 5),
the earlier checkpoints stay intact and resumable, nothing half-written is taken for a checkpoint.

The output folder is a small tmpfs mounted for the test (root only; skipped naming the reason
otherwise), unmounted afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.io.checkpoint import CheckpointConfig, Checkpointer, CheckpointWriteError, committed_steps
from rlx.io.metrics import LoggerConfig, MetricsLogger, MetricsWriteError, read_metrics
from rlx.learner.state import TrainState
from tests.helpers import ROOT

TINY = os.path.join(ROOT, "configs", "tiny.py")
LEAVE = 64 * 1024  # bytes left free by the filler: metrics lines fit, a checkpoint does not


def _mount(folder, size: str):
    """A tmpfs of ``size`` at ``folder`` (skips naming the reason when it cannot be mounted)."""
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    return folder


def _unmount(folder) -> None:
    if subprocess.run(["umount", str(folder)]).returncode != 0:
        subprocess.run(["umount", "-l", str(folder)])


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs at ``tmp_path / "disk"``, unmounted afterwards."""
    folder = _mount(tmp_path / "disk", "16m")
    try:
        yield folder
    finally:
        _unmount(folder)


def _fill(folder, leave: int = LEAVE) -> str:
    """A file taking all of ``folder``'s free space but ``leave`` bytes (less if it fills up)."""
    path = os.path.join(folder, "filler")
    st = os.statvfs(folder)
    todo = max(st.f_bavail * st.f_frsize - leave, 0)
    block = b"\0" * (1 << 16)
    with open(path, "wb") as f:
        try:
            while todo > 0:
                todo -= f.write(block[:min(todo, len(block))])
                f.flush()
        except OSError:  # the run wrote meanwhile: full already
            pass
    return path


def _state(seed: int) -> TrainState:
    w = jax.random.normal(jax.random.key(seed), (64, 1024))  # 256 KB: more than LEAVE
    return TrainState(step=jnp.int32(seed), skipped=jnp.int32(0), params={"w": w}, frozen={},
                      opt_state={"m": jnp.zeros_like(w)}, rng=jax.random.key(seed))


def test_a_full_disk_fails_the_write_and_keeps_the_earlier_checkpoints(small_disk):
    folder = str(small_disk / "checkpoints")
    with Checkpointer(CheckpointConfig(folder, every=1, keep=5)) as ckpt:
        assert ckpt.save(1, _state(1))
        ckpt.wait()
        filler = _fill(small_disk)
        with pytest.raises(CheckpointWriteError) as e:
            ckpt.save(2, _state(2))
            ckpt.wait()  # the write is asynchronous: its failure surfaces here
        assert "checkpoint 2 could not be written: no space left on device" in str(e.value)
        assert f"the last complete checkpoint is step 1 in {folder}" in str(e.value)
        assert sorted(os.listdir(folder)) == ["1"]  # the partial write is gone
        assert ckpt.steps() == [1]
        os.remove(filler)
        restored = ckpt.restore(1, _state(0))  # intact: checksums verified
        np.testing.assert_array_equal(restored.state.params["w"], _state(1).params["w"])
        assert ckpt.save(2, _state(2))  # with space again the step saves
    assert committed_steps(folder) == [1, 2]


def test_metrics_on_a_full_disk_raise_instead_of_hanging(small_disk):
    """Another writer fills the disk: the first metrics write that needs space raises
    ``MetricsWriteError`` naming the file and the cause (tensorboardX's ``SummaryWriter`` wrote
    from a thread that died on that error, and its queue then blocked the run for good); the
    records written before stay readable and ``close`` does not raise again."""
    logdir = str(small_disk / "run")
    logger = MetricsLogger(LoggerConfig(logdir, progress=False, console_every=0))
    logger.log(1, {"loss": 1.0})
    _fill(small_disk, leave=0)
    with pytest.raises(MetricsWriteError) as e:
        for step in range(2, 100):  # a step's JSONL record and events take about 3 KB
            logger.log(step, {f"m{i}": float(i) for i in range(64)})
    assert f"metrics could not be written to {logdir}" in str(e.value)
    assert "no space left on device" in str(e.value)
    logger.close()
    first = read_metrics(logdir)[0]
    assert (first["step"], first["loss"]) == (1, 1.0)


def _launch(out: str, log, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlx.launch", f"--config={TINY}", f"--config.output_dir={out}",
           "--config.train.steps=5", "--config.train.checkpoint_every=1",
           "--config.train.keep_checkpoints=10", *overrides]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS="")  # one device
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)


def _finish(proc: subprocess.Popen, log) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    log.seek(0)
    return code, log.read()


@pytest.mark.slow  # two launches of the tiny run; CI keeps the Checkpointer-level test above
def test_a_run_whose_disk_fills_stops_cleanly_and_resumes(tmp_path):
    """A 2 MB disk holds the tiny run's first checkpoints (about 0.5 MB each) and not the next:
    that save is refused before anything is written; with room again (remounted larger) the run
    resumes from the last complete one."""
    disk = _mount(tmp_path / "disk", "2m")
    try:
        out = str(disk / "run")
        folder = os.path.join(out, "checkpoints")
        log = open(tmp_path / "run.log", "w+")  # off the small disk
        code, stderr = _finish(_launch(out, log), log)
        kept = committed_steps(folder)
        assert code == 5, stderr[-3000:]
        assert kept and kept[-1] < 5, kept  # some fitted, not all
        failed = kept[-1] + 1
        assert (f"rlx: error: checkpoint {failed} could not be written: no space left on device"
                in stderr), stderr[-3000:]
        assert f"the last complete checkpoint is step {kept[-1]}" in stderr
        assert "Traceback" not in stderr, stderr[-3000:]  # one clear error, no wall
        assert kept == list(range(1, failed))
        assert sorted(os.listdir(folder)) == [str(s) for s in kept]  # nothing half-written
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        log = open(tmp_path / "resumed.log", "w+")
        code, stderr = _finish(_launch(out, log, "--config.resume=latest"), log)
        assert code == 0, stderr[-3000:]
        assert f"resumed from checkpoint {kept[-1]}" in stderr
        assert committed_steps(folder)[-1] == 5
    finally:
        _unmount(disk)


@pytest.mark.slow  # one launch of the tiny run
def test_a_run_whose_disk_another_writer_fills_mid_write_stops_cleanly(tmp_path):
    """Another writer fills the disk right after checkpoint 2's save started
    (``disk_filler_driver``): the run stops with status 5 and one line naming the cause and the
    last complete checkpoint (that of the cut write, or of the metrics that failed first), no
    traceback of rlx, nothing half-written listed. It used to hang in tensorboardX's writer
    queue."""
    disk = _mount(tmp_path / "disk", "8m")
    try:
        out = str(disk / "run")
        folder = os.path.join(out, "checkpoints")
        log = open(tmp_path / "run.log", "w+")  # off the small disk
        cmd = [sys.executable, "-m", "tests.reliability.disk_filler_driver", "--fill_step=2",
               f"--config={TINY}", f"--config.output_dir={out}", "--config.train.steps=4",
               "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=10"]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS="")
        code, stderr = _finish(subprocess.Popen(cmd, env=env, cwd=ROOT,
                                                stdout=subprocess.DEVNULL, stderr=log), log)
        kept = committed_steps(folder)
        assert code == 5, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("rlx: error: ")]
        assert len(errors) == 1 and "no space left on device" in errors[0], stderr[-3000:]
        assert f"the last complete checkpoint is step {kept[-1]} in {folder}" in errors[0]
        # no traceback through rlx (tensorstore itself may print 'Event loop is closed' ones from
        # write callbacks that fire after orbax closed the failed write's event loop)
        assert f'File "{ROOT}/rlx/' not in stderr, stderr[-3000:]
        assert kept in ([1], [1, 2]), kept  # 2 is listed only if its write beat the filler
        assert sorted(os.listdir(folder)) == [str(s) for s in kept]  # nothing half-written
    finally:
        _unmount(disk)
