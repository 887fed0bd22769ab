"""2 processes x 4 CPU devices (gloo collectives) train exactly like 1 process x 8 devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT

TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the driver sets its own device count
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return env


def _driver(out, *extra) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.multihost_driver", "--out", str(out), *extra]


def _run_all(cmds: list[list[str]], timeout: float = 240) -> None:
    procs = [subprocess.Popen(c, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


@pytest.mark.parametrize("mode", [pytest.param("full", marks=pytest.mark.slow), "lora"])  # CI time
def test_two_processes_match_one(tmp_path, mode):
    single, multi = tmp_path / "single.npz", tmp_path / "multi.npz"
    port = _free_port()
    cmds = [_driver(single, "--local-devices", "8", "--mode", mode)]
    cmds += [_driver(multi, "--num-processes", "2", "--process-id", str(i), "--local-devices",
                     "4", "--coordinator", f"127.0.0.1:{port}", "--mode", mode) for i in range(2)]
    _run_all(cmds)
    a, b = np.load(single), np.load(multi)
    assert int(a["process_count"]) == 1 and int(b["process_count"]) == 2
    assert int(a["device_count"]) == int(b["device_count"]) == 8
    assert sorted(a.files) == sorted(b.files)
    assert np.all(np.isfinite(a["losses"])) and np.ptp(a["losses"]) > 0  # steps really ran
    np.testing.assert_allclose(b["losses"], a["losses"], atol=TOL, rtol=0)
    params = [n for n in a.files if n not in ("losses", "process_count", "device_count")]
    assert len(params) >= 9  # every trainable leaf came back
    for name in params:
        np.testing.assert_allclose(b[name], a[name], atol=TOL, rtol=0, err_msg=name)
