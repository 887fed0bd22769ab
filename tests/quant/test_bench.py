"""``python -m rlx.bench quant`` prints a markdown table whose numbers order as quantization predicts."""

from rlx.bench.__main__ import main as bench_main
from rlx.bench.quant import ROWS


def test_quant_bench_table(capsys):
    assert bench_main(["quant", "--tokens", "16", "--models", "dense"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| format |") and len(lines) == 2 + len(ROWS)
    err = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in lines[2:]}
    assert 0 < err["int8 channel"] < err["fp8 channel"] < err["int4 g64 sym"] < 0.5
    assert err["GGUF Q8_0"] < err["GGUF Q4_1"]


def test_unknown_benchmark_is_usage_error(capsys):
    assert bench_main(["nope"]) == 2
    assert "usage" in capsys.readouterr().err
