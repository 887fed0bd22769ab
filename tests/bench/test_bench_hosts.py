"""``python -m rlx.bench hosts`` runs full mode (fsdp over 8 devices) as 1 process and as 2
processes per rollouts mode, each process reporting its peak memory (a small model: no memory
assertion beyond the shape of the report; the figures are the benchmark's, in its README)."""

import pytest

from rlx.bench.__main__ import main as bench_main


@pytest.mark.slow  # three multi-process runs, about 2 min
def test_hosts_bench_reports_every_process_of_every_run(capsys):
    assert bench_main(["hosts", "--width", "128", "--layers", "1", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines[1:-1]]
    runs = [" ".join(r[:-3]) for r in rows]
    assert runs == ["1 x 8", "2 x 4, global", "2 x 4, global", "2 x 4, primary",
                    "2 x 4, primary"]
    assert [int(r[-3]) for r in rows] == [0, 0, 1, 0, 1]
    assert all(float(r[-2]) > 0.1 and float(r[-1]) > 0 for r in rows)
    assert lines[-1].startswith("parameters: ")
