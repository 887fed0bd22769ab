"""``python -m rlx.bench learner`` at tiny sizes: table and JSON structure, both sides trained on
the same tokens, and the correctness anchor: on the same weights, batch and LoRA init, rlx's loss
and gradient norm equal those of TRL's own GRPO loss on the PyTorch + PEFT side (f32, tolerance
1e-5 absolute on the loss, 1e-4 relative on the gradient norm; measured about 1e-7), so the
benchmark times the same computation. No timing assertions. The Tunix side runs where its
environment exists (``python -m rlx.bench.peer_envs tunix``)."""

import json

import pytest

from rlx.bench.learner import HEADER, main
from rlx.bench.peer_envs import TUNIX

# batch 4 = 2 micro-batches of 2 rows, prompt 8 + completion 8 tokens
TINY = ["--model", "tiny", "--batch", "4", "--prompt", "8", "--completion", "8",
        "--micro-batches", "2", "--repeats", "1", "--warmup", "0", "--parallel-setup"]


def test_learner_bench_tiny_matches_trl_loss(tmp_path, tmp_path_factory, capsys):
    path = tmp_path / "learner.json"
    work = tmp_path_factory.getbasetemp() / "rl-bench-models"  # shared with the e2e smoke test
    assert main(TINY + ["--sides", "rlx-f32,peft", "--json", str(path),
                        "--work-dir", str(work)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(HEADER) + " |" and len(table) == 2 + 2
    record = json.loads(path.read_text())
    assert [row[0] for row in record["rows"]] == ["rlx-f32", "peft"]
    runs = {side: record["runs"][side][0] for side in ("rlx-f32", "peft")}
    for side, r in runs.items():
        assert r["tokens"] == 4 * (8 + 8) and r["loss_tokens"] == 4 * 8, (side, r)
        assert r["seconds"] > 0 and r["peak_rss_mb"] > 0, (side, r)
    rlx, peft = runs["rlx-f32"], runs["peft"]
    assert abs(rlx["loss"] - peft["loss"]) <= 1e-5, (rlx["loss"], peft["loss"])
    assert abs(rlx["grad_norm"] - peft["grad_norm"]) <= 1e-4 * peft["grad_norm"]
    assert peft["grad_norm"] > 0
    assert record["rows"][1][4] == "1.00x" and record["rows"][0][3] > 0
    # one measured repetition: tokens per CPU-second is its tokens over its worker's CPU time
    assert record["rows"][1][9] == "1.00x" and all(r["cpu_s"] > 0 for r in runs.values())
    assert record["rows"][0][8] == rlx["tokens"] / rlx["cpu_s"]


def test_learner_bench_tunix_side_tiny(tmp_path, tmp_path_factory, capsys):
    """Tunix's GRPO learner updates on the same batch (its loss is that of another rotary base,
    so only the work is compared); skipped, naming the command that creates its environment,
    where missing."""
    if reason := TUNIX.unavailable():
        pytest.skip(reason)
    path = tmp_path / "learner.json"
    work = tmp_path_factory.getbasetemp() / "rl-bench-models"
    assert main(TINY + ["--sides", "tunix", "--json", str(path), "--work-dir", str(work)]) == 0
    record = json.loads(path.read_text())
    assert [row[0] for row in record["rows"]] == ["tunix"] and record["rows"][0][5] == "1.00x"
    r = record["runs"]["tunix"][0]
    assert r["tokens"] == 4 * (8 + 8) and r["loss_tokens"] == 4 * 8 and r["seconds"] > 0, r
