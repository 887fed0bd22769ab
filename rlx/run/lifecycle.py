"""A run's life cycle around the step: checkpoints, resume, and stopping on signals.

* ``open_checkpointer`` - the run's orbax ``Checkpointer`` in ``<output_dir>/checkpoints``: saved
  every ``train.checkpoint_every`` steps and at exit, keep-last ``train.keep_checkpoints``; LoRA mode
  records a reference to the frozen base (its source, format and hash) instead of the base.
* ``restore`` - ``config.resume``: "" starts fresh (and refuses an ``output_dir`` that already
  holds checkpoints, so nothing written is overwritten by accident), "latest" continues from the
  newest complete checkpoint (fresh when there is none), a number from that step; the data
  position and the rollouts in flight come back from the run's recorded position.
* ``StopSignals`` - SIGTERM / Ctrl-C ask the loop to stop after the current step; the run then
  saves a final checkpoint. A second Ctrl-C interrupts at once.
* ``StartupSignals`` - before that, while the run is being built (loading, compiling, starting
  SGLang servers), SIGTERM / Ctrl-C raise ``Interrupted`` at once, so the clean-up of whatever
  was started runs (a server killed mid start-up could leave processes it was still spawning).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, NamedTuple

from rlx.config import RunConfig, to_dict
from rlx.errors import ConfigError
from rlx.io.checkpoint import CheckpointConfig, Checkpointer
from rlx.io.fingerprint import BaseRef, CheckpointMismatchError, base_reference
from rlx.run.hosts import Hosts

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
MUST_MATCH = ("model", "quant", "lora")  # config sections a resumed checkpoint must agree on


def checkpoint_dir(cfg: RunConfig) -> str:
    return os.path.join(cfg.output_dir, CHECKPOINT_DIR)


def open_checkpointer(cfg: RunConfig, state: Any) -> Checkpointer:
    """The run's checkpointer (LoRA mode: with a reference to the frozen base)."""
    base: BaseRef | None = None
    if cfg.train.mode == "lora":
        base = base_reference(state.frozen, source=cfg.model.path, format=cfg.quant.format)
    every = cfg.train.checkpoint_every or 2**62  # 0: only at exit (forced saves)
    return Checkpointer(
        CheckpointConfig(checkpoint_dir(cfg), every=every, keep=cfg.train.keep_checkpoints,
                         must_match=MUST_MATCH),
        model_config=to_dict(cfg.model), run_config=_recorded_config(cfg), base=base)


def _recorded_config(cfg: RunConfig) -> dict:
    """The config a checkpoint records (and a resume compares): without what legitimately differs
    between the processes or the launches of one run (its resume flag, process id, address), with
    ``output_dir`` as an absolute path (``runs/x/`` and ``./runs/x`` are one folder)."""
    out = to_dict(cfg)
    out.pop("resume", None)
    out["output_dir"] = os.path.abspath(cfg.output_dir)
    for key in ("process_id", "coordinator_address"):
        out.get("distributed", {}).pop(key, None)
    return out


class Resumed(NamedTuple):
    """Where a run starts: the step, the state, and the batches that were in flight there
    (``(step, progress)`` for ``Run.resumed_in_flight``)."""

    step: int
    state: Any
    in_flight: list = []


def restore(cfg: RunConfig, checkpointer: Checkpointer, state: Any, data: Any,
            hosts: Hosts | None = None) -> Resumed:
    """Where to start: step 0 and ``state`` fresh, else the restored checkpoint's step and state,
    ``data`` moved to its saved position (``Hosts.restore_position``, on any process count that
    divides the data shards) and the batches it had in flight."""
    wanted = cfg.resume_step
    steps = checkpointer.steps()
    if wanted is None:
        if steps:
            raise ConfigError(
                f"config.output_dir={cfg.output_dir!r} already holds checkpoints (steps "
                f"{', '.join(map(str, steps))}); pass --config.resume=latest to continue that run, "
                "or choose a new config.output_dir")
        return Resumed(0, state)
    if wanted == "latest":
        restored = checkpointer.restore_latest(state, data)
        if restored is None:
            log.warning("config.resume=latest: no checkpoint in %s; starting at step 0",
                        checkpointer.directory)
            return Resumed(0, state)
    else:
        if wanted not in steps:
            raise CheckpointMismatchError(
                f"config.resume={wanted}: no checkpoint of step {wanted} in "
                f"{checkpointer.directory} (saved steps: {steps or 'none'})")
        restored = checkpointer.restore(wanted, state, data)
    in_flight = []
    if restored.position is not None:
        in_flight = (hosts or Hosts()).restore_position(data, restored.position)
    log.warning("resumed from checkpoint %d in %s", restored.step, checkpointer.directory)
    return Resumed(restored.step, restored.state, in_flight)


class StopSignals:
    """Context manager: SIGTERM and SIGINT set ``received`` (the loop stops after its step);
    a second SIGINT raises ``KeyboardInterrupt``. Only installs handlers on the main thread."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        log.warning("%s received: stopping after this step and saving a checkpoint (Ctrl-C "
                    "again to interrupt at once)", signal.Signals(signum).name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived while the run was being built (``StartupSignals``)."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} received while starting")
        self.signum = signum


class StartupSignals:
    """Context manager: SIGTERM and SIGINT raise ``Interrupted`` (a ``BaseException``, so every
    ``except BaseException`` clean-up on the way runs). Only installs handlers on the main thread."""

    def __init__(self):
        self._previous: dict[int, Any] = {}

    @staticmethod
    def _raise(signum, frame) -> None:
        # once: the clean-up that follows must not be interrupted by a repeated SIGTERM (a
        # second Ctrl-C still interrupts at once)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise Interrupted(signum)

    def __enter__(self) -> "StartupSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._raise)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
