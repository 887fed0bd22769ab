"""The notebooks in notebooks/ run top to bottom, and are stored without outputs.

Each notebook is executed with nbclient on a python3 kernel in a temporary working directory,
with a cell of shortened parameters injected after its ``parameters`` cell (the papermill
convention). The kernel sees one CPU device (the test process's 8 fake devices are for the other
tests). The quickstart runs its real model, SmolLM2-135M-Instruct as GGUF Q4_1 blocks + LoRA, for
2 short steps; the consistency notebook compares learner and engine log-probs on a tiny model.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from tests.helpers import ROOT

NOTEBOOKS = os.path.join(ROOT, "notebooks")
INSTALL_HINT = 'pip install -e ".[test]" (the notebook tests need nbclient, nbformat, ipykernel, matplotlib)'
CELL_TIMEOUT_S = 900

QUICKSTART_PARAMS = {
    "STEPS": 2,
    "EVAL_SIZE": 4,
    # the quickstart's data, reward, loss and engine on a shrunken random copy of its model (the
    # real model's run is what the README measures; here the notebook's plumbing is under test)
    "OVERRIDES": {"model.shrink.enabled": True, "quant.format": "int8", "quant.serving": "hf",
                  "data.prompts_per_step": 2, "rollout.group_size": 4,
                  "rollout.max_new_tokens": 16, "train.micro_batches": 1},
}
CONSISTENCY_PARAMS = {"N_SAMPLES": 2, "MAX_NEW_TOKENS": 12}


def _require():
    """The notebook machinery, or a failure that says how to install it (these are test extras)."""
    try:
        import ipykernel  # noqa: F401
        import matplotlib  # noqa: F401
        import nbclient
        import nbformat
    except ImportError as e:
        pytest.fail(f"{e.name} is not installed: {INSTALL_HINT}", pytrace=False)
    return nbformat, nbclient


def _read(name: str):
    nbformat, _ = _require()
    return nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)


def _inject(nb, params: dict) -> None:
    """Insert ``NAME = value`` lines after the cell tagged ``parameters``."""
    nbformat, _ = _require()
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(
        source, metadata={"tags": ["injected-parameters"]}))


def _execute(name: str, workdir, params: dict):
    """Run the notebook in ``workdir``; nbclient raises ``CellExecutionError`` on any error."""
    _, nbclient = _require()
    nb = _read(name)
    _inject(nb, {"REPO_ROOT": ROOT, **params})
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="module://matplotlib_inline.backend_inline",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore::DeprecationWarning")
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute(env=env)
    return nb


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


def _pngs(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs)


@pytest.mark.parametrize("name", ["quickstart.ipynb", "consistency.ipynb"])
def test_notebook_is_stored_stripped(name):
    nb = _read(name)
    nbformat, _ = _require()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, name
    for i, cell in enumerate(code):
        assert cell.outputs == [], f"{name}: code cell {i} has stored outputs"
        assert cell.execution_count is None, f"{name}: code cell {i} has an execution count"
        assert "execution" not in cell.metadata, f"{name}: code cell {i} has execution timings"
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: needs exactly one cell tagged 'parameters'"
    assert nb.metadata.kernelspec.name == "python3"


def test_quickstart_notebook_trains_and_plots(tmp_path):
    from rlx.io.metrics import read_metrics

    out = tmp_path / "run"
    nb = _execute("quickstart.ipynb", tmp_path, {**QUICKSTART_PARAMS, "OUTPUT_DIR": str(out)})
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]
    assert [r["step"] for r in records if "preflight/max_abs" in r] == [0]
    assert (out / "curves.png").stat().st_size > 10_000
    assert _pngs(nb) == 1  # the curves, inline
    text = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "held-out greedy accuracy at step 2" in text and "before:" in text


@pytest.mark.slow  # CI: the per-format sampler == learner checks are in tests/rollout/jax/test_engine.py
def test_consistency_notebook_compares_every_format(tmp_path):
    out = tmp_path / "run"
    nb = _execute("consistency.ipynb", tmp_path, {**CONSISTENCY_PARAMS, "OUTPUT_DIR": str(out)})
    text = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    rows = dict(re.findall(r"^\| (\w+) \| (\d+) \|", text, flags=re.M))
    tokens = str(3 * CONSISTENCY_PARAMS["N_SAMPLES"] * CONSISTENCY_PARAMS["MAX_NEW_TOKENS"])
    assert rows == {f: tokens for f in ("none", "int8", "int4", "nf4", "fp8", "gguf")}, text
    assert "every format passes" in text
    assert (out / "consistency.png").stat().st_size > 10_000
    assert _pngs(nb) == 1
    print(json.dumps({"table": [line for line in text.splitlines() if line.startswith("|")]},
                     indent=1))
