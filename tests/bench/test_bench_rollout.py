"""``python -m rlx.bench rollout`` at tiny sizes: table and JSON structure, every side produced
exactly the requested tokens, figures positive. No timing assertions."""

import json

import pytest

from rlx.bench.rollout import HF, NOLP, SGLANG, main

TINY = ["--model", "tiny", "--batch", "2", "--prompt", "8", "--new", "4", "--repeats", "1"]


def _run(tmp_path, capsys, *args):
    path = tmp_path / "rollout.json"
    assert main(TINY + ["--json", str(path), *args]) == 0
    return capsys.readouterr(), json.loads(path.read_text())["models"]["tiny"]


def _check_runs(record, labels, modes=("greedy", "sampled")):
    runs = record["results"]["runs"]
    assert sorted(runs) == sorted(labels)
    for label in labels:
        assert sorted(r["case"] for r in runs[label]) == sorted(modes)
        for r in runs[label]:
            assert r["tokens"] == 2 * 4 and r["rows"] == 2 and r["seconds"] > 0, (label, r)
    assert {(r["side"], r["mode"]) for r in record["rows"]} == {(s, m) for s in labels for m in modes}
    assert all(r["tokens_per_s"] > 0 and r["setup_s"] > 0 for r in record["rows"])


def test_rollout_rlx_bases_and_hf_with_sglang_missing(tmp_path, capsys):
    out, record = _run(tmp_path, capsys, "--warmup", "0", "--parallel-setup", "--lora-rank", "4",
                       "--sglang-python", str(tmp_path / "no-such-python"))
    labels = ["rlx f32", NOLP, "rlx int8 base + LoRA r4", "rlx Q4_1 base + LoRA r4", HF]
    _check_runs(record, labels)
    assert record["skipped"] == {SGLANG: record["skipped"][SGLANG]}
    assert "no SGLang interpreter" in record["skipped"][SGLANG]
    for r in record["rows"]:
        assert r["vs_hf"] > 0 and r["vs_sglang"] is None
        assert r["vs_hf"] == 1.0 if r["side"] == HF else r["vs_hf"] > 0
    table = [line for line in out.out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| side | mode | tokens/s | vs HF | vs SGLang |") and len(table) == 2 + 10
    assert f"{SGLANG}: skipped (no SGLang interpreter" in out.out
    assert "rlx f32 vs HF, greedy:" in out.out and f"{NOLP} vs HF, sampled:" in out.out
    assert f"{NOLP} vs SGLang" not in out.out  # SGLang is asked for log-probs


@pytest.mark.sglang
def test_rollout_against_a_real_sglang_server(tmp_path, capsys, sglang_url):
    out, record = _run(tmp_path, capsys, "--warmup", "0", "--sides", "sglang",
                       "--sglang-url", sglang_url)
    _check_runs(record, [SGLANG])
    assert all(r["vs_sglang"] == 1.0 and r["vs_hf"] is None for r in record["rows"])
    assert record["skipped"] == {} and f"| {SGLANG} | sampled |" in out.out
