"""``python -m rlx.bench e2e`` at tiny sizes: one whole GRPO step of rlx (``rlx.build`` +
``Run.step``) and of TRL's ``GRPOTrainer`` on the same tiny model, prompts and reward; table and
JSON structure, both generated exactly the requested completion tokens. No timing assertions.
The Tunix side runs where its environment exists (``python -m rlx.bench.peer_envs tunix``)."""

import json

import pytest

from rlx.bench.e2e import HEADER, main
from rlx.bench.peer_envs import TUNIX

# 2 prompts x 2 samples x exactly 4 new tokens, an update in 2 micro-batches
TINY = ["--model", "tiny", "--prompts", "2", "--group", "2", "--new", "4", "--micro-batches", "2",
        "--repeats", "1", "--warmup", "0", "--parallel-setup", "--sides", "rlx-f32,trl"]


@pytest.mark.slow  # kept out of CI's 30 minutes; `python -m pytest -m slow` runs it
def test_e2e_bench_tiny(tmp_path, tmp_path_factory, capsys):
    path = tmp_path / "e2e.json"
    work = tmp_path_factory.getbasetemp() / "rl-bench-models"  # shared with the learner test
    assert main(TINY + ["--json", str(path), "--work-dir", str(work)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(HEADER) + " |" and len(table) == 2 + 2
    record = json.loads(path.read_text())
    assert record["spec"]["fixed_length"] and [row[0] for row in record["rows"]] == ["rlx-f32", "trl"]
    rows = {row[0]: row for row in record["rows"]}
    for side in ("rlx-f32", "trl"):
        r = record["runs"][side][0]
        assert r["samples"] == 4 and r["completion_tokens"] == 4 * 4, (side, r)
        assert r["peak_rss_mb"] > 0 and 0 <= r["reward_mean"] <= 1, (side, r)
        # one measured repetition: the table's step seconds are this run's, its samples/s is
        # samples / seconds (the median of one value is that value)
        step_s, rate = rows[side][2], rows[side][3]
        assert step_s == r["seconds"] and rate == r["samples"] / r["seconds"], (side, rows[side])
        assert r["cpu_s"] > 0 and rows[side][11] == r["samples"] / r["cpu_s"], (side, r)
    assert rows["rlx-f32"][4] == f"{rows['rlx-f32'][3] / rows['trl'][3]:.2f}x"
    rlx = record["runs"]["rlx-f32"][0]
    assert rlx["generate_s"] > 0 and rlx["update_s"] > 0
    assert rlx["generate_s"] + rlx["update_s"] <= rlx["seconds"]
    # a synchronous step is its five phases in turn: they add up to at most its wall time
    phases = [rlx[f"{p}_s"] for p in ("generate", "score", "logprob", "update", "sync")]
    assert min(phases) > 0 and sum(phases) <= rlx["seconds"], (phases, rlx["seconds"])


@pytest.mark.slow  # CI time: a bench smoke test
def test_e2e_bench_tunix_side_tiny(tmp_path, tmp_path_factory, capsys):
    """Tunix's GRPO learner runs whole steps of the same shape, each completion exactly the
    requested tokens; skipped, naming the command that creates its environment, where missing."""
    if reason := TUNIX.unavailable():
        pytest.skip(reason)
    path = tmp_path / "e2e.json"
    work = tmp_path_factory.getbasetemp() / "rl-bench-models"
    argv = [a if a != "rlx-f32,trl" else "tunix" for a in TINY] + ["--repeats", "2"]
    assert main(argv + ["--json", str(path), "--work-dir", str(work)]) == 0
    record = json.loads(path.read_text())
    assert [row[0] for row in record["rows"]] == ["tunix"] and record["skipped"] == {}
    assert record["rows"][0][5] == "1.00x"  # its own speed against itself
    for r in record["runs"]["tunix"]:
        assert r["samples"] == 4 and r["completion_tokens"] == 4 * 4, r
        assert 0 <= r["reward_mean"] <= 1 and r["generate_s"] > 0 and r["update_s"] > 0, r
        assert r["generate_s"] + r["update_s"] == pytest.approx(r["seconds"])


def test_e2e_bench_names_the_missing_tunix_environment(tmp_path, capsys):
    missing = str(tmp_path / "no-such-python")
    argv = [a if a != "rlx-f32,trl" else "tunix" for a in TINY]
    assert main(argv + ["--tunix-python", missing, "--json", str(tmp_path / "e2e.json")]) == 0
    record = json.loads((tmp_path / "e2e.json").read_text())
    assert record["rows"] == [] and "python -m rlx.bench.peer_envs tunix" in record["skipped"]["tunix"]
    assert f"tunix: skipped (no tunix environment at {missing}" in capsys.readouterr().out
