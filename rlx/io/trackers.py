"""Experiment trackers besides tensorboard: Weights & Biases and MLflow (``config.log``).

``config.log.trackers`` names where a run's metrics go: ``"tensorboard"`` (built in) and any of
``TRACKERS``, each an optional extra (``pip install -e ".[wandb]"``); naming one whose package is
missing is refused when the config is read, with its install line. ``MetricsLogger``
(``rlx.io.metrics``) hands every tracker exactly the scalars it writes to tensorboard, at the same
step, the sample completions as a table (one row per sample: step, prompt, completion, reward,
reason) and the whole run config once.

* ``wandb``: project ``log.project``, run name ``log.run_name`` (default: the output folder's
  name), the config as the run's config, files under ``<output_dir>/wandb``. Its environment
  applies (``WANDB_MODE=offline``, ``WANDB_API_KEY``, ``WANDB_ENTITY``, ...).
* ``mlflow``: experiment ``log.project``, run ``log.run_name``, the config flattened into params;
  ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<output_dir>/mlflow.db`` with the artifacts
  in ``<output_dir>/mlartifacts``. Tables go to the run's artifacts as ``<tag>/step_<step>.json``.

The run id of each tracker is kept in ``<output_dir>/trackers.json``; a run resumed from a
checkpoint (``--config.resume``) continues the same wandb run and MLflow run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rlx.errors import ConfigError

IDS_FILE = "trackers.json"
TRACKER_COLUMNS = ("step", "prompt", "completion", "reward", "reason")


@dataclasses.dataclass(frozen=True)
class TrackerSpec:
    """One tracker: the module it needs, the line that installs it, what to do when it fails."""

    module: str
    install: str
    fix: str


TRACKERS = {
    "wandb": TrackerSpec("wandb", 'pip install -e ".[wandb]"  (or: pip install wandb)',
                         "log in (`wandb login` or WANDB_API_KEY) or set WANDB_MODE=offline"),
    "mlflow": TrackerSpec("mlflow", 'pip install -e ".[mlflow]"  (or: pip install mlflow)',
                          "check MLFLOW_TRACKING_URI (or unset it: a sqlite file in output_dir)"),
}
BUILTIN = ("tensorboard",)  # written by rlx.io.metrics itself (tensorboardX)


@dataclasses.dataclass(frozen=True)
class LogSection:
    """Where metrics go besides ``metrics.jsonl`` (``config.log``)."""

    # any of "tensorboard" and the keys of rlx.io.trackers.TRACKERS ("wandb", "mlflow")
    trackers: tuple[str, ...] = ("tensorboard",)
    project: str = "rlx"  # wandb project / MLflow experiment
    run_name: str = ""  # "" : the name of config.output_dir

    def validate(self) -> None:
        known = (*BUILTIN, *TRACKERS)
        bad = [t for t in self.trackers if t not in known]
        if bad:
            raise ConfigError(f"config.log.trackers={list(self.trackers)}: {bad[0]!r} is not one "
                              f"of {list(known)}")
        if len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"config.log.trackers={list(self.trackers)} names a tracker twice")
        for name in self.trackers:
            if name in TRACKERS and not installed(name):
                raise ConfigError(f"config.log.trackers names {name!r}, which is not installed: "
                                  f"{TRACKERS[name].install}")
        if not self.project:
            raise ConfigError("config.log.project is empty; name the wandb project / MLflow "
                              "experiment")


def installed(name: str) -> bool:
    """Whether the package of tracker ``name`` can be imported."""
    try:
        return importlib.util.find_spec(TRACKERS[name].module) is not None
    except (ValueError, ImportError):  # a module set to None in sys.modules, a broken parent
        return False


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def table(self, step: int, tag: str, rows: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class TrackerRun:
    """What every tracker is told about the run."""

    logdir: str  # the run's output folder
    project: str = "rlx"
    run_name: str = ""  # "" : the output folder's name
    config: Mapping[str, Any] | None = None  # the whole run config (nested dict)
    resume: bool = False  # continue the run ids saved in <logdir>/trackers.json

    @property
    def name(self) -> str:
        return self.run_name or os.path.basename(os.path.normpath(os.path.abspath(self.logdir)))


class WandbTracker:
    def __init__(self, run: TrackerRun, run_id: str | None):
        import wandb

        self._wandb = wandb
        kw = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(project=run.project, name=run.name, dir=run.logdir,
                              config=dict(run.config or {}), **kw)
        self.id = self.run.id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=int(step))

    def table(self, step: int, tag: str, rows: Sequence[Mapping[str, Any]]) -> None:
        data = [[row.get(c) for c in TRACKER_COLUMNS] for row in rows]
        self.run.log({tag: self._wandb.Table(columns=list(TRACKER_COLUMNS), data=data)},
                     step=int(step))

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, run: TrackerRun, run_id: str | None):
        import mlflow

        self._mlflow = mlflow
        logdir = os.path.abspath(run.logdir)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        if local:  # the store and the artifacts (tables) in the output folder, not the cwd
            mlflow.set_tracking_uri("sqlite:///" + os.path.join(logdir, "mlflow.db"))
        if run_id:
            self.run = mlflow.start_run(run_id=run_id)
        else:
            if local and mlflow.get_experiment_by_name(run.project) is None:
                mlflow.create_experiment(run.project, artifact_location=pathlib.Path(
                    logdir, "mlartifacts").as_uri())
            mlflow.set_experiment(run.project)
            self.run = mlflow.start_run(run_name=run.name)
            params = _flat(run.config or {})
            if params:
                mlflow.log_params(params)
        self.id = self.run.info.run_id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(scalars), step=int(step))

    def table(self, step: int, tag: str, rows: Sequence[Mapping[str, Any]]) -> None:
        data = {c: [row.get(c) for row in rows] for c in TRACKER_COLUMNS}
        self._mlflow.log_table(data=data, artifact_file=f"{tag}/step_{int(step):06d}.json")

    def close(self) -> None:
        self._mlflow.end_run()


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``a.b`` -> text (MLflow params are strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, name + "."))
        else:
            out[name] = json.dumps(value, default=str) if not isinstance(value, str) else value
    return out


_OPENERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(names: Sequence[str], run: TrackerRun) -> list[Tracker]:
    """Start the trackers ``names`` (besides the built-in ones) for ``run``; their run ids are
    saved to ``<logdir>/trackers.json`` and, when ``run.resume``, read from it to continue."""
    path = os.path.join(run.logdir, IDS_FILE)
    saved: dict[str, str] = {}
    if run.resume and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    out, ids = [], dict(saved)
    for name in names:
        if name in BUILTIN:
            continue
        if name not in _OPENERS or not installed(name):
            raise ConfigError(f"tracker {name!r} is not available: "
                              f"{TRACKERS[name].install if name in TRACKERS else list(TRACKERS)}")
        try:
            tracker = _OPENERS[name](run, saved.get(name))
        except Exception as e:  # not logged in, a tracking server out of reach, ...
            first = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(f"config.log.trackers: {name} could not start ({type(e).__name__}: "
                              f"{first}); {TRACKERS[name].fix}") from e
        ids[name] = tracker.id
        out.append(tracker)
    if out:
        os.makedirs(run.logdir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(ids, f, indent=2)
    return out


__all__ = ["BUILTIN", "IDS_FILE", "LogSection", "MlflowTracker", "TRACKERS", "TRACKER_COLUMNS",
           "Tracker", "TrackerRun", "WandbTracker", "installed", "open_trackers"]
