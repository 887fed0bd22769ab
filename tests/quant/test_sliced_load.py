"""2 processes x 4 CPU devices load a shipped FP8-block checkpoint with the base sharded over the
processes: each process reads exactly the slices its devices hold, each once (the bytes its
``SafetensorsFolder`` returned equal the bytes of its distinct shards, less than the
checkpoint), the two processes together hold every element, and every shard equals a one-device
load bit for bit."""

from __future__ import annotations

import sys

import numpy as np

from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.multiprocess import process_commands, run_together
from tests.helpers.shipped import Scheme, write_shipped


def _run_pair(path: str, outs: list[str]) -> None:
    cmds = process_commands([sys.executable, "-m", "tests.helpers.sliced_load_driver", "--path",
                             path, "--out", "", "--local-devices", "4"], 2)
    for cmd, out in zip(cmds, outs):
        cmd[cmd.index("--out") + 1] = out
    run_together(cmds)


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
