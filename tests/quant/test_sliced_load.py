"""2 processes x 4 CPU devices load a shipped FP8-block checkpoint with the base sharded over the
processes: each process reads exactly the slices its devices hold, each once (the bytes its
``SafetensorsFolder`` returned equal the bytes of its distinct shards, less than the
checkpoint), the two processes together hold every element, and every shard equals a one-device
load bit for bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np

from tests.helpers import ROOT
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.shipped import Scheme, write_shipped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(path: str, outs: list[str], timeout: float = 240) -> None:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the driver sets its own device count
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    port = _free_port()
    cmds = [[sys.executable, "-m", "tests.helpers.sliced_load_driver", "--path", path, "--out", out,
             "--num-processes", "2", "--process-id", str(i), "--local-devices", "4",
             "--coordinator", f"127.0.0.1:{port}"] for i, out in enumerate(outs)]
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]


def _covered(results) -> dict[str, int]:
    """Leaf -> elements of the distinct slices held by any process."""
    seen: dict[str, dict[str, int]] = {}
    for r in results:
        for key in r.files:
            if key.startswith("shard/"):
                leaf, _, index = key[len("shard/"):].rpartition("/")
                seen.setdefault(leaf, {})[index] = int(r[key])
    return {leaf: sum(slices.values()) for leaf, slices in seen.items()}


def test_each_process_reads_only_its_slices(tmp_path):
    path = write_shipped(make_hf_model("deepseek_v3", str(tmp_path)), str(tmp_path / "fp8"),
                         Scheme("fp8_block", ignore=("lm_head",)), shards=2)
    outs = [str(tmp_path / f"p{i}.npz") for i in range(2)]
    _run_pair(path, outs)
    results = [np.load(o) for o in outs]
    for r in results:
        assert int(r["process_count"]) == 2
        assert int(r["equal"]) == 1  # every shard == the one-device load's slice, bit for bit
        assert int(r["read"]) == int(r["held"]), (int(r["read"]), int(r["held"]))  # once each
        assert int(r["read"]) < 0.75 * int(r["whole"])  # not the whole checkpoint
        assert int(r["partial"]) >= 20  # tensors read in part: split over the processes
    first = results[0]
    sizes = {k[len("size/"):]: int(first[k]) for k in first.files if k.startswith("size/")}
    assert len(sizes) > 30 and _covered(results) == sizes  # together: every element of every leaf
