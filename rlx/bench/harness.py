"""Side-by-side benchmark harness: each contender in its own worker process, runs interleaved.

A *side* is one contender (rlx, HF transformers, SGLang, TRL, ...). It is built once inside its own
worker subprocess by a factory ``"module:function"`` called with keyword arguments; the factory
returns a callable that runs one repetition and returns its figures (``{"tokens": 2048, "seconds":
11.3}``, any floats). The parent asks the workers in turn (A B A B ...), so slow drifts of a shared
machine hit every side alike, and reports medians. Separate processes keep the thread pools of
PyTorch and XLA from competing and give each side its own peak RSS (``ru_maxrss``, reported with
every repetition as ``peak_rss_mb``) and CPU time (``cpu_s``: every thread of the worker during the
repetition, unless the side reports its own, e.g. a server's process group). On a machine shared
with other jobs the wall-clock rate also measures how much CPU each side gets; the CPU-time rate
only the work it needs.

A side may serve several *cases* (e.g. greedy and sampled decoding): its callable then takes the
case as its one argument, ``interleave(..., cases=("greedy", "sampled"))`` runs every case of every
side in each round, and each figure record carries its ``"case"``. Warm-up repetitions (compilation,
caches) are dropped from the medians but kept in ``Results.warmup``.

Worker protocol (JSON lines): the parent writes the spec ``{"target", "kwargs"}``; the worker answers
``{"ready": ..., "setup_s": ...}``; then for every ``"run"`` (or ``{"run": case}``) line one result
line; ``"exit"`` ends it. Anything the side prints goes to the worker's stderr, so stdout carries
only protocol lines. A side may name another interpreter (``Side.python``: a peer that cannot share
rlx's environment); its worker then runs there, importing rlx from this checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# Every worker's environment. rlx's workers run with OpenMP threads that sleep as soon as they are
# idle (a library loaded beside jax brings libgomp); the peers whose kernels run in OpenMP regions
# (PyTorch, llama.cpp) get OpenMP's default wait policy (``OMP_DEFAULT_ENV``): waking sleeping
# threads for every small product slows HF ``generate`` down (figures: README.md, "Design
# measurements") and llama.cpp's batch-1 decode to a third.
BASE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
            "TF_CPP_MIN_LOG_LEVEL": "2"}
OMP_DEFAULT_ENV = {"OMP_WAIT_POLICY": None}  # a side's ``env`` value None: the variable is unset


class BenchError(RuntimeError):
    """A side failed to build or to run; the message carries the worker's last output."""


@dataclasses.dataclass(frozen=True)
class Side:
    """One contender: ``label`` in tables, ``target`` = "module:factory", its keyword arguments."""

    label: str
    target: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    env: dict = dataclasses.field(default_factory=dict)  # over BASE_ENV; None unsets
    python: str = ""  # the worker's interpreter ("": this one); see ``worker_command``


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def stolen_cpu_s() -> float | None:
    """CPU seconds the hypervisor has taken from this (virtual) machine since boot, summed over its
    CPUs (``steal`` of ``/proc/stat``); None where the kernel does not report it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _timed_run(worker: "Worker", case: Any) -> tuple[dict, float]:
    """One repetition and its wall time; the record gains ``stolen_share``: the fraction of the
    machine's CPU time the hypervisor took meanwhile (a noisy neighbour; figures of such runs are
    less comparable)."""
    s0, t0 = stolen_cpu_s(), time.perf_counter()
    r = worker.run(case)
    s1, wall = stolen_cpu_s(), time.perf_counter() - t0
    if s0 is not None and s1 is not None and wall > 0:
        r["stolen_share"] = (s1 - s0) / (wall * (os.cpu_count() or 1))
    return r, wall


def worker_command(side: Side) -> tuple[list[str], dict]:
    """The worker's command line and the variables it adds. A side with its own interpreter (a
    peer's separate environment, ``rlx.bench.peer_envs``) imports rlx from this checkout: the
    checkout goes first on its ``PYTHONPATH``, and its side module imports only what that
    environment holds."""
    if not side.python:
        return [sys.executable, "-m", "rlx.bench.worker"], {}
    import rlx

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(rlx.__file__)))
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p)
    return [side.python, "-m", "rlx.bench.worker"], {"PYTHONPATH": path}


def resolve(target: str) -> Callable[..., Callable[[], dict]]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class Worker:
    """A side's subprocess (see the module docstring)."""

    def __init__(self, side: Side, log_path: str | None = None, wait: bool = True):
        self.side = side
        command, extra = worker_command(side)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no fake test devices
        env.update(BASE_ENV)
        env.update(extra)
        env.update(side.env)
        env = {k: v for k, v in env.items() if v is not None}
        self._log = open(log_path or os.devnull, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)
        self._send({"target": side.target, "kwargs": side.kwargs})
        self.setup: dict | None = self._receive() if wait else None

    def ready(self) -> dict:
        """The setup record, waiting for it if the worker was started with ``wait=False``."""
        if self.setup is None:
            self.setup = self._receive()
        return self.setup

    def _send(self, msg: Any) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise BenchError(f"side {self.side.label!r} ({self.side.target}) exited with code "
                             f"{self.proc.returncode}" + self._tail())
        msg = json.loads(line)
        if "error" in msg:
            raise BenchError(f"side {self.side.label!r} failed: {msg['error']}")
        return msg

    def _tail(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path) as f:
            return "; last output:\n" + "".join(f.readlines()[-15:])

    def run(self, case: Any = None) -> dict:
        self._send("run" if case is None else {"run": case})
        figures = self._receive()
        if case is not None:
            figures["case"] = case
        return figures

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send("exit")
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@dataclasses.dataclass
class Results:
    """Every repetition's figures per side label, in run order, plus each side's setup record."""

    runs: dict[str, list[dict]]
    setup: dict[str, dict]
    warmup: dict[str, list[dict]] = dataclasses.field(default_factory=dict)

    def select(self, label: str, case: Any = None, warmup: bool = False) -> list[dict]:
        """The records of ``label`` (of one ``case`` when given; warm-up ones if asked)."""
        records = (self.warmup if warmup else self.runs).get(label, [])
        return [r for r in records if case is None or r.get("case") == case]

    def median(self, label: str, key: str, case: Any = None) -> float:
        return statistics.median(r[key] for r in self.select(label, case))

    def rate(self, label: str, amount: str, seconds: str = "seconds", case: Any = None) -> float:
        """Median over repetitions of amount / seconds (e.g. tokens per second)."""
        return statistics.median(r[amount] / r[seconds] for r in self.select(label, case))

    def stolen(self) -> float | None:
        """The largest ``stolen_share`` of any measured repetition (None where not reported)."""
        shares = [r["stolen_share"] for rs in self.runs.values() for r in rs if "stolen_share" in r]
        return max(shares) if shares else None

    def to_json(self) -> dict:
        return {"runs": self.runs, "setup": self.setup, "warmup": self.warmup,
                "max_stolen_share": self.stolen()}


def interleave(sides: Sequence[Side], repeats: int = 3, warmup: int = 1,
               log_dir: str | None = None, progress: bool = True,
               cases: Sequence[Any] = (None,), parallel_setup: bool = False) -> Results:
    """Build every side, then run ``warmup + repeats`` rounds of A B C ... (each round every case);
    warm-up runs are kept apart from the measured ones. ``parallel_setup`` builds the sides at the
    same time (a faster start; their setup times and memory peaks then overlap)."""
    workers: list[Worker] = []
    try:
        for s in sides:
            log = os.path.join(log_dir, f"{_slug(s.label)}.log") if log_dir else None
            workers.append(Worker(s, log, wait=not parallel_setup))
        for w in workers:
            w.ready()
        runs: dict[str, list[dict]] = {s.label: [] for s in sides}
        warm: dict[str, list[dict]] = {s.label: [] for s in sides}
        for i in range(warmup + repeats):
            kind = "warm-up" if i < warmup else f"run {i - warmup + 1}/{repeats}"
            for case in cases:
                for w in workers:
                    r, wall = _timed_run(w, case)
                    if progress:
                        what = w.side.label if case is None else f"{w.side.label} [{case}]"
                        stolen = f", {r['stolen_share']:.0%} stolen" if "stolen_share" in r else ""
                        print(f"  {what}: {kind} {wall:.1f} s{stolen}",
                              file=sys.stderr)
                    (warm if i < warmup else runs)[w.side.label].append(r)
        results = Results(runs, {w.side.label: w.setup for w in workers}, warm)
        if progress and results.stolen():
            print(f"The hypervisor took up to {results.stolen():.1%} of the machine's CPU time in a "
                  "measured run (figures of a contended machine vary more)", file=sys.stderr)
        return results
    finally:
        for w in workers:
            w.close()


def call_once(side: Side, log_dir: str | None = None) -> dict:
    """Build ``side`` in a fresh worker, run it once and return its figures (one-off jobs such as
    exporting a checkpoint, kept out of the parent process)."""
    log = os.path.join(log_dir, f"{_slug(side.label)}.log") if log_dir else None
    worker = Worker(side, log)
    try:
        return worker.run()
    finally:
        worker.close()


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1, default=float)


def add_run_args(p: argparse.ArgumentParser, repeats: int, sides_help: str) -> None:
    """The flags shared by the whole-model benchmarks (``learner``, ``e2e``): compute dtype,
    rounds, sides, output files, the model work folder and the Tunix side's interpreter."""
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of every side")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sides", default=None, help=sides_help)
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--log-dir", default=None, help="keep each side's worker output here")
    p.add_argument("--parallel-setup", action="store_true",
                   help="build the sides at the same time (faster start, overlapping peaks)")
    p.add_argument("--work-dir", default=None,
                   help="where the model folders are written and reused (default: a fresh "
                        "temporary folder, removed at the end)")
    p.add_argument("--tunix-python", default="",
                   help="the Tunix side's interpreter (default: $RLX_TUNIX_PYTHON or the "
                        "environment `python -m rlx.bench.peer_envs tunix` creates)")
