"""2 processes x 4 CPU devices (gloo collectives) train exactly like 1 process x 8 devices."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.helpers.multiprocess import process_commands, run_together

TOL = 1e-5


def _driver(out, *extra) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.multihost_driver", "--out", str(out), *extra]


@pytest.mark.parametrize("mode", [pytest.param("full", marks=pytest.mark.slow), "lora"])  # CI time
def test_two_processes_match_one(tmp_path, mode):
    single, multi = tmp_path / "single.npz", tmp_path / "multi.npz"
    cmds = [_driver(single, "--local-devices", "8", "--mode", mode)]
    cmds += process_commands(_driver(multi, "--local-devices", "4", "--mode", mode), 2)
    run_together(cmds)
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
