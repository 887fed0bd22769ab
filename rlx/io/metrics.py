"""Run metrics: tensorboard scalars and text samples, a JSONL file, console lines, a progress bar.

``MetricsLogger.log(step, metrics)`` takes typed records (NamedTuples such as ``StepMetrics``,
dataclasses, flax struct dataclasses) or mappings of names to records or scalars, nested to any
depth; it flattens them into ``/``-joined names (``{"reward": {"math": stats}}`` ->
``reward/math/mean``), fetches every device scalar with one ``jax.device_get`` and writes:

* a tensorboard scalar per name (``<logdir>/events.out.tfevents.*``, tensorboardX's event
  records, written by the calling thread: ``EventFile``);
* one JSON object per call to ``<logdir>/metrics.jsonl``: ``{"step", "wall_time", <name>: value}``
  (``read_metrics`` loads it as a list of records, one per step, ready for ``pandas.DataFrame``);
* a console line every ``console_every`` steps and a tqdm progress bar with ETA and the last reward;
* the same scalars to every tracker of ``trackers`` besides tensorboard (``rlx.io.trackers``:
  wandb, MLflow), at the same step.

``log_text`` writes sample completions every ``text_every`` steps as tensorboard text and to
``<logdir>/samples.jsonl`` (and as a table to each tracker). Only process 0 writes anything; on other processes every method is a
no-op. A run resumed from a checkpoint of step k (``start_step=k``) makes tensorboard drop the
interrupted run's events after k, ``read_metrics`` keeps the last record written per step, and
the trackers continue the run ids they saved.

A file that cannot be written (the disk is full) raises ``MetricsWriteError`` naming it and the
cause, from the call that hit it (the JSONL record of a step is written before anything else of
it); ``close`` after that closes what it can without raising again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from rlx.io.trackers import BUILTIN, Tracker, TrackerRun, open_trackers

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


class MetricsWriteError(OSError):
    """A metrics file could not be written (e.g. no space left on device)."""


class EventFile:
    """A tensorboard event file written by the calling thread (tensorboardX's ``EventsWriter``
    and summaries), so a disk error is raised where it happens. tensorboardX's ``SummaryWriter``
    writes from a thread instead; an ``OSError`` ends that thread, and its bounded queue then
    blocks the next call (and the exit) forever. ``purge_step``: tensorboard drops the events
    of earlier files after it (a resumed run's)."""

    def __init__(self, logdir: str, purge_step: int | None = None, suffix: str = ""):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self._event = Event
        self._file = EventsWriter(os.path.join(logdir, "events"), suffix)
        if purge_step is not None:
            self._file.write_event(Event(step=purge_step, wall_time=time.time(),
                                         session_log=SessionLog(status=SessionLog.START)))

    def scalar(self, name: str, value: float, step: int, walltime: float) -> None:
        from tensorboardX.summary import scalar

        self._file.write_event(self._event(summary=scalar(name, value), step=int(step),
                                           wall_time=walltime))

    def text(self, tag: str, text: str, step: int) -> None:
        from tensorboardX.summary import text as text_summary

        self._file.write_event(self._event(summary=text_summary(tag, text), step=int(step),
                                           wall_time=time.time()))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclasses.dataclass(frozen=True)
class LoggerConfig:
    """Where metrics go and how often the slower outputs are written."""

    logdir: str  # tensorboard events, metrics.jsonl and samples.jsonl
    total_steps: int | None = None  # length of the progress bar (for the ETA); None: open-ended
    text_every: int = 10  # log_text writes samples when step % text_every == 0
    console_every: int = 1  # a console line every n steps; 0: none
    progress: bool = True  # show a tqdm progress bar
    reward_key: str = "reward/mean"  # the scalar shown on the progress bar
    console_keys: tuple[str, ...] = ("reward/mean", "loss", "kl", "entropy", "grad_norm",
                                     "time/step")  # console line; "loss" also finds "x/loss"
    trackers: tuple[str, ...] = ("tensorboard",)  # rlx.io.trackers: tensorboard, wandb, mlflow
    project: str = "rlx"  # wandb project / MLflow experiment
    run_name: str = ""  # "" : the name of logdir
    run_config: Mapping[str, Any] | None = None  # the run's config: config.json, each tracker

    def __post_init__(self):
        if self.text_every < 1:
            raise ValueError(f"LoggerConfig.text_every must be >= 1, got {self.text_every}")
        if self.console_every < 0:
            raise ValueError(f"LoggerConfig.console_every must be >= 0, got {self.console_every}")


@dataclasses.dataclass(frozen=True)
class TextSample:
    """One completion to look at."""

    prompt: str
    completion: str
    reward: float | None = None
    reason: str = ""  # how the reward function graded it (e.g. "math: no answer found")


def _children(record: Any) -> Mapping[str, Any] | None:
    """The named fields of a record or mapping; None for a leaf."""
    if isinstance(record, Mapping):
        return record
    if isinstance(record, tuple) and hasattr(record, "_asdict"):
        return record._asdict()
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return None


def flatten_metrics(metrics: Any, prefix: str = "") -> dict[str, Any]:
    """``/``-joined names -> scalar leaves (not yet fetched); None fields are left out."""
    children = _children(metrics)
    if children is None:
        if not prefix:
            raise TypeError(f"metrics must be a record or a mapping, got {type(metrics).__name__}")
        return {} if metrics is None else {prefix: metrics}
    out: dict[str, Any] = {}
    for name, value in children.items():
        out.update(flatten_metrics(value, f"{prefix}/{name}" if prefix else str(name)))
    return out


def to_scalars(metrics: Any) -> dict[str, float]:
    """Flatten `metrics` and turn every leaf into a Python float, with one device_get."""
    flat = flatten_metrics(metrics)
    values = jax.device_get(list(flat.values()))
    out = {}
    for name, value in zip(flat, values):
        a = np.asarray(value)
        # jnp.issubdtype knows the ml_dtypes floats (bfloat16, fp8) that numpy does not
        if a.size != 1 or not (jnp.issubdtype(a.dtype, jnp.number) or a.dtype == np.bool_):
            raise ValueError(f"metric {name!r} must be a numeric scalar, got {a.dtype} "
                             f"of shape {a.shape}")
        out[name] = float(a.reshape(()))
    return out


def _format(value: float) -> str:
    return f"{value:.4g}"


def _find(scalars: Mapping[str, float], key: str) -> str | None:
    """`key` itself, else the first name ending in ``/key`` (``loss`` finds ``learner/loss``)."""
    if key in scalars:
        return key
    return next((name for name in scalars if name.endswith("/" + key)), None)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in (text or " ").splitlines())


def _sample_markdown(samples: Sequence[TextSample]) -> str:
    """Samples as markdown; indented blocks keep the text verbatim."""
    parts = []
    for i, s in enumerate(samples):
        reward = "" if s.reward is None else f" - reward {_format(s.reward)}"
        reward += f" ({s.reason})" if s.reason else ""
        parts.append(f"**sample {i}{reward}**\n\nprompt:\n\n{_indent(s.prompt)}\n\n"
                     f"completion:\n\n{_indent(s.completion)}\n")
    return "\n".join(parts)


class MetricsLogger:
    """Writes metrics on process 0 (``process_index`` defaults to ``jax.process_index()``).

    ``start_step`` is the last step already done when a run resumes (its checkpoint's step): the
    progress bar starts there and tensorboard drops the interrupted run's events after it.
    """

    def __init__(self, cfg: LoggerConfig, *, process_index: int | None = None,
                 start_step: int = 0, stream: TextIO | None = None):
        self.cfg = cfg
        index = jax.process_index() if process_index is None else process_index
        self.active = index == 0
        self._stream = stream or sys.stderr
        self._writer = self._jsonl = self._samples = self._bar = None
        self._trackers: list[Tracker] = []
        self._last_step = start_step
        self._failed = False  # a write failed (and was raised)
        if not self.active:
            return
        os.makedirs(cfg.logdir, exist_ok=True)
        self._trackers = open_trackers(  # first: one that cannot start leaves no file open
            [t for t in cfg.trackers if t not in BUILTIN],
            TrackerRun(cfg.logdir, project=cfg.project, run_name=cfg.run_name,
                       config=cfg.run_config, resume=start_step > 0))
        if "tensorboard" in cfg.trackers:  # a unique file name: two may start in one second
            self._writer = EventFile(cfg.logdir, start_step + 1 if start_step else None,
                                     f".{uuid.uuid4().hex[:8]}")
        self._jsonl = open(os.path.join(cfg.logdir, METRICS_FILE), "a", encoding="utf-8")
        if cfg.run_config is not None:
            self.log_config(cfg.run_config)
        if cfg.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=cfg.total_steps, initial=start_step, file=self._stream,
                             unit="step", dynamic_ncols=True)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.cfg.logdir, METRICS_FILE)

    def log(self, step: int, metrics: Any) -> dict[str, float]:
        """Write every scalar of `metrics` for `step`; returns the flat name -> float map."""
        if not self.active:
            return {}
        scalars = to_scalars(metrics)
        reserved = {"step", "wall_time"} & set(scalars)
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved for the JSONL record")
        now = time.time()
        with self._writing(self.metrics_path):
            self._jsonl.write(json.dumps({"step": int(step), "wall_time": now, **scalars}) + "\n")
            self._jsonl.flush()
            if self._writer is not None:
                for name, value in scalars.items():
                    self._writer.scalar(name, value, step, now)
        for tracker in self._trackers:
            tracker.log(step, scalars)
        self._progress(step, scalars)
        if self.cfg.console_every and step % self.cfg.console_every == 0:
            self._console(step, scalars)
        return scalars

    @contextlib.contextmanager
    def _writing(self, path: str):
        """Turn an ``OSError`` of the writes inside into ``MetricsWriteError`` naming ``path``."""
        try:
            yield
        except OSError as e:
            self._failed = True
            cause = ("no space left on device" if e.errno == errno.ENOSPC
                     else f"{type(e).__name__}: {e}")
            raise MetricsWriteError(e.errno, f"metrics could not be written to {path}: "
                                    f"{cause}") from e

    def _progress(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._bar is None:
            return
        if step > self._last_step:
            self._bar.update(step - self._last_step)
            self._last_step = step
        if self.cfg.reward_key in scalars:
            self._bar.set_postfix(reward=_format(scalars[self.cfg.reward_key]), refresh=False)

    def _console(self, step: int, scalars: Mapping[str, float]) -> None:
        keys = [k for k in (_find(scalars, key) for key in self.cfg.console_keys) if k]
        keys = keys or list(scalars)[:6]
        total = f"/{self.cfg.total_steps}" if self.cfg.total_steps else ""
        line = f"step {step}{total} | " + " | ".join(f"{k} {_format(scalars[k])}" for k in keys)
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def log_text(self, step: int, samples: Sequence[TextSample], *, tag: str = "samples",
                 force: bool = False) -> bool:
        """Write `samples` if `step` is a multiple of ``text_every`` or `force`; returns whether."""
        if not self.active or not samples or not (force or step % self.cfg.text_every == 0):
            return False
        path = os.path.join(self.cfg.logdir, SAMPLES_FILE)
        rows = [{"step": int(step), **dataclasses.asdict(s)} for s in samples]
        with self._writing(path):
            if self._writer is not None:
                self._writer.text(tag, _sample_markdown(samples), step)
            if self._samples is None:
                self._samples = open(path, "a", encoding="utf-8")
            for row in rows:
                self._samples.write(json.dumps({"step": row["step"], "tag": tag, **{
                    k: v for k, v in row.items() if k != "step"}}) + "\n")
            self._samples.flush()
        for tracker in self._trackers:
            tracker.table(step, tag, rows)
        return True

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run config as tensorboard text and ``<logdir>/config.json``."""
        if not self.active:
            return
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        path = os.path.join(self.cfg.logdir, "config.json")
        with self._writing(path):
            if self._writer is not None:
                self._writer.text("config", _indent(text), 0)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")

    def flush(self) -> None:
        if self.active:
            with self._writing(self.cfg.logdir):
                if self._writer is not None:
                    self._writer.flush()
                self._jsonl.flush()

    def close(self) -> None:
        """Flush and close every output; the logger is inactive afterwards. After a failed write
        (already raised) what cannot be flushed is dropped without raising again."""
        if not self.active:
            return
        self.active = False
        for tracker in self._trackers:
            tracker.close()
        if self._bar is not None:
            self._bar.close()
        reported, error = self._failed, None
        for f in (self._writer, self._jsonl, self._samples):  # each closed even if one fails
            try:
                with self._writing(self.cfg.logdir):
                    if f is not None:
                        f.close()
            except MetricsWriteError as e:
                error = error or e
        if error is not None and not reported:
            raise error


def read_metrics(path: str) -> list[dict[str, float]]:
    """The records of a metrics JSONL file (or of ``<logdir>/metrics.jsonl``), one per step.

    Several records of one step are merged, later values winning (a resumed run overwrites what
    the interrupted one logged after its last checkpoint); the result is sorted by step. A last
    line cut short by a crash is ignored.
    """
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    by_step: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # unterminated last line: a write interrupted by a crash
                continue
            raise ValueError(f"{path}:{i + 1} is not a JSON object") from None
        by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]
