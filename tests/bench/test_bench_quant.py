"""``python -m rlx.bench quant`` prints a markdown table whose numbers order as quantization predicts."""

import pytest

from rlx.bench.__main__ import main as bench_main
from rlx.bench.quant import ROWS


@pytest.mark.slow  # kept out of CI's 30 minutes; `python -m pytest -m slow` runs it
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


@pytest.mark.slow  # CI time: a bench smoke test
def test_quant_decode_tokens_per_format(tmp_path, capsys):
    """``--decode``: one row per format with positive tokens/s (tiny sizes; no timing assertion)."""
    import json

    path = tmp_path / "quant.json"
    assert bench_main(["quant", "--tokens", "16", "--models", "dense", "--decode",
                       "--decode-model", "tiny", "--decode-formats", "f32,GGUF Q4_1",
                       "--decode-shape", "2,4,4", "--decode-rounds", "1,0", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| f32 |") or line.startswith("| GGUF Q4_1 |")]
    assert len(rows) == 3  # f32 decode row, Q4_1 error row and Q4_1 decode row
    decode = json.loads(path.read_text())["decode"]
    assert set(decode["rate"]) == {"f32", "GGUF Q4_1"} and min(decode["rate"].values()) > 0
    for runs in decode["results"]["runs"].values():
        assert runs[0]["tokens"] == 2 * 4 and runs[0]["weight_bytes"] > 0
