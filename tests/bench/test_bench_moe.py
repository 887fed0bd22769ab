"""``python -m rlx.bench moe`` prints one row per path with XLA's FLOPs (tiny sizes; no timing
assertion)."""

import json

from rlx.bench.__main__ import main as bench_main
from rlx.bench.moe import MESHES, PATHS


def test_moe_bench_table(tmp_path, capsys):
    path = tmp_path / "moe.json"
    assert bench_main(["moe", "--tokens", "128", "--hidden", "16", "--ffn", "32", "--experts", "8",
                       "--repeats", "1", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| mesh | path | fwd+bwd s | XLA:CPU GFLOP |")
    assert len(lines) == 2 + 1 + len(MESHES) * len(PATHS)
    rows = {(r["mesh"], r["path"]): r for r in json.loads(path.read_text())["rows"]}
    for mesh in MESHES:
        # a device's capacity rows against all its experts on all tokens (E=8, top-2)
        assert rows[mesh, "dispatch, capacity 1.25"]["cpu_flops"] < rows[mesh, "dense"]["cpu_flops"]
        assert all(rows[mesh, label]["seconds"] > 0 for label, _, _ in PATHS)
