"""``python -m rlx.bench rollout`` at tiny sizes: table and JSON structure, every side produced
exactly the requested tokens, figures positive. No timing assertions. The llama.cpp side runs
where its environment exists (``python -m rlx.bench.peer_envs llama.cpp``) and is skipped,
naming that command, elsewhere."""

import json

import pytest

from rlx.bench.harness import Side, call_once
from rlx.bench.peer_envs import LLAMA_CPP
from rlx.bench.rollout import HF, LLAMA, NOLP, SGLANG, main
from rlx.bench.workloads import Workload, gguf_path, prompt_ids

TINY = ["--model", "tiny", "--batch", "2", "--prompt", "8", "--new", "4", "--repeats", "1"]


def _run(tmp_path, capsys, *args, base=TINY):
    path = tmp_path / "rollout.json"
    assert main(base + ["--json", str(path), *args]) == 0
    return capsys.readouterr(), json.loads(path.read_text())["runs"]


def _check_runs(record, labels, modes=("greedy", "sampled"), batch=2):
    runs = record["results"]["runs"]
    assert sorted(runs) == sorted(labels)
    for label in labels:
        assert sorted(r["case"] for r in runs[label]) == sorted(modes)
        for r in runs[label]:
            assert r["tokens"] == batch * 4 and r["rows"] == batch and r["seconds"] > 0, (label, r)
    assert {(r["side"], r["mode"]) for r in record["rows"]} == {(s, m) for s in labels for m in modes}
    assert all(r["tokens_per_s"] > 0 and r["setup_s"] > 0 for r in record["rows"])


@pytest.mark.slow  # kept out of CI's 30 minutes; `python -m pytest -m slow` runs it
def test_rollout_rlx_bases_and_hf_with_sglang_missing(tmp_path, capsys):
    out, [record] = _run(tmp_path, capsys, "--warmup", "0", "--parallel-setup", "--lora-rank", "4",
                         "--sglang-python", str(tmp_path / "no-such-python"))
    labels = ["rlx f32", NOLP, "rlx int8 base + LoRA r4", "rlx Q4_1 base + LoRA r4", HF]
    _check_runs(record, labels)
    assert sorted(record["skipped"]) == sorted([SGLANG, LLAMA])
    assert "no SGLang interpreter" in record["skipped"][SGLANG]
    assert record["skipped"][LLAMA] == "llama.cpp runs GGUF files; tiny has none"
    for r in record["rows"]:
        assert r["vs_hf"] > 0 and r["vs_sglang"] is None and r["vs_llama"] is None
        assert r["vs_hf"] == 1.0 if r["side"] == HF else r["vs_hf"] > 0
    table = [line for line in out.out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| side | mode | tokens/s | vs HF | vs SGLang | vs llama.cpp |")
    assert len(table) == 2 + 10
    assert f"{SGLANG}: skipped (no SGLang interpreter" in out.out
    assert "rlx f32 vs HF, greedy:" in out.out and f"{NOLP} vs HF, sampled:" in out.out
    assert f"{NOLP} vs SGLang" not in out.out  # SGLang is asked for log-probs


def test_rollout_llama_cpp_batch_1_and_batched_on_the_gguf_file(tmp_path, capsys):
    if reason := LLAMA_CPP.unavailable():
        pytest.skip(reason)
    base = ["--model", "smollm2", "--batch", "1,2", "--prompt", "8", "--new", "4", "--repeats", "1"]
    out, records = _run(tmp_path, capsys, "--warmup", "0", "--sides", "llama.cpp", base=base)
    assert [r["workload"]["batch"] for r in records] == [1, 2]
    for batch, record in zip((1, 2), records):
        _check_runs(record, [LLAMA], batch=batch)
        assert record["skipped"] == {}
        assert all(r["vs_llama"] == 1.0 and r["tokens_per_cpu_s"] > 0 for r in record["rows"])
    assert "### rollout: smollm2, batch 1," in out.out and "### rollout: smollm2, batch 2," in out.out


def test_llama_cpp_batched_greedy_rows_equal_each_prompt_alone():
    # the batch-1 side (high-level API) and the batched side (llama_batch, one sequence id per
    # prompt) compute the same numbers, so their rates compare the same work
    if reason := LLAMA_CPP.unavailable():
        pytest.skip(reason)
    prompts = prompt_ids(Workload("smollm2", batch=3, prompt=16, new=12))
    seen = call_once(Side("rows", "tests.bench.probe_sides:llama_rows",
                          {"gguf": gguf_path(), "prompts": prompts, "new": 12},
                          python=LLAMA_CPP.interpreter()))
    assert seen["batched"] == seen["alone"] and all(len(r) == 12 for r in seen["alone"])


def test_rollout_llama_cpp_side_names_its_missing_environment(tmp_path, capsys):
    base = ["--model", "smollm2", "--batch", "1", "--prompt", "8", "--new", "4", "--repeats", "1"]
    missing = str(tmp_path / "no-such-python")
    out, [record] = _run(tmp_path, capsys, "--warmup", "0", "--sides", "llama.cpp",
                         "--llama-python", missing, base=base)
    assert record["rows"] == [] and "python -m rlx.bench.peer_envs llama.cpp" in record["skipped"][LLAMA]
    assert f"{LLAMA}: skipped (no llama.cpp environment at {missing}" in out.out


@pytest.mark.slow  # CI time: a bench smoke test; SGLang runs in tests/rollout
@pytest.mark.sglang
def test_rollout_against_a_real_sglang_server(tmp_path, capsys, sglang_url):
    out, [record] = _run(tmp_path, capsys, "--warmup", "0", "--sides", "sglang",
                         "--sglang-url", sglang_url)
    _check_runs(record, [SGLANG])
    assert all(r["vs_sglang"] == 1.0 and r["vs_hf"] is None for r in record["rows"])
    assert record["skipped"] == {} and f"| {SGLANG} | sampled |" in out.out
