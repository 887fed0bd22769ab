"""``python -m rlx.bench sync`` at tiny sizes: every side served a changed policy after each
update, bytes moved are positive and the adapter moves a small share of the full weights. No
timing assertions."""

import json

import pytest

from rlx.bench.sync import LABELS, main

TINY = ["--model", "tiny", "--lora-rank", "4", "--probe", "8", "--repeats", "1", "--warmup", "1"]


def _run(tmp_path, capsys, *args):
    path = tmp_path / "sync.json"
    assert main(TINY + ["--json", str(path), *args]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def _check(payload, sides):
    labels = [LABELS[s] for s in sides]
    runs = payload["results"]["runs"]
    assert sorted(runs) == sorted(labels)
    for label in labels:
        (r,) = runs[label]
        assert r["seconds"] > 0 and r["bytes"] > 0 and r["logp_change"] > 0, (label, r)
    rows = {r["side"]: r for r in payload["rows"]}
    kind = "rlx" if sides[0].startswith("rlx") else "sglang"
    adapter, full = rows[LABELS[f"{kind}-adapter"]], rows[LABELS[f"{kind}-full"]]
    assert full["share_of_full"] == 1.0 and 0 < adapter["share_of_full"] < 0.02


def test_sync_in_memory_with_sglang_missing(tmp_path, capsys):
    out, payload = _run(tmp_path, capsys, "--parallel-setup",
                        "--sglang-python", str(tmp_path / "no-such-python"))
    _check(payload, ["rlx-adapter", "rlx-full"])
    assert set(payload["skipped"]) == {LABELS[s] for s in ("sglang-adapter", "sglang-full", "sglang-memory")}
    table = [line for line in out.splitlines() if line.startswith("| rlx")]
    assert len(table) == 2
    assert "rlx built-in, adapter in memory: " in out and "(goal <= 2%): met" in out
    assert "| SmolLM2-135M | 135M |" in out  # the rank/targets share table


@pytest.mark.slow  # CI time: a bench smoke test; SGLang hot-loading runs in tests/rollout
@pytest.mark.sglang
def test_sync_on_a_real_sglang_server(tmp_path, capsys, sglang_url):
    out, payload = _run(tmp_path, capsys, "--sides", "sglang-adapter,sglang-full",
                        "--sglang-url", sglang_url, "--parallel-setup")
    _check(payload, ["sglang-adapter", "sglang-full"])
    for r in payload["rows"]:
        assert r["export_s"] > 0 and r["load_s"] > 0 and r["first_request_s"] > 0
    assert "SGLang adapter hot-load: " in out
