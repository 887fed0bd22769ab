"""Orbax checkpoints of a run: trainable params, optimizer state, step, rng, data iterator, config.

One checkpoint per saved step, in ``<directory>/<step>/``, written by an orbax ``CheckpointManager``
as a composite of three items:

* ``state`` - ``TrainState`` without its frozen part: ``step``, ``skipped``, ``params`` (the
  trainable variables), ``opt_state``, the rng (as raw key data; the impl name is in ``meta``)
  and, with PPO's critic, ``critic`` (its trainable variables: an adapter or a whole model, and the
  value head; and their optimizer state) and, in full mode with a KL term or DPO, ``ref`` (the
  frozen reference: the initial parameters);
* ``meta`` - JSON: a ``Fingerprint`` of what was saved (every leaf's path, shape and dtype, the
  model architecture, the frozen-base reference), the run config, a 64-bit checksum per saved
  array computed on device (a flipped byte in an array file otherwise loads silently) and,
  optionally, the run's ``position``: whatever JSON the caller needs to continue exactly (a run
  records its data shards' positions and the rollouts in flight there, ``rlx.run.hosts``), written
  once for all processes so that it reads back on any process count;
* ``data`` - the grain iterator state of each process (optional).

The frozen part of the state is never written. In LoRA mode (frozen quantized base + LoRA) that is the
base: the checkpoint holds the adapters and their optimizer state plus a ``BaseRef`` - the base's
source path, its format and a SHA-256 of its leaves (computed once per run) - and a restore onto a
different base is refused.

Saves are asynchronous: ``save`` returns once the arrays are copied to host and the iterator state
is captured; the write finishes in the background. Orbax writes into
``<step>.orbax-checkpoint-tmp-*`` and renames it when every item is committed, so a process killed
mid-write leaves a temporary directory that is never listed as a step (and is removed by the next
manager that opens the folder, before its first save). Keep-last-n retires an old step by renaming
it into ``deleted/`` before removing it, so a kill cannot leave a half-deleted step listed.

A save that cannot be written raises ``CheckpointWriteError`` naming the step, the cause and the
last complete checkpoint; the earlier checkpoints are untouched. A save first checks that the
disk has room for its arrays, metadata and ``SPACE_MARGIN`` (all processes agreeing) and refuses
before writing anything; a write that fails anyway (another writer filled the disk) is reported
from ``save`` or, in the background, from the next ``save`` / ``wait``, and its temporary
directory is removed (the space is freed, nothing of it is ever listed) once the threads that
save started have ended (orbax reports its first failing writer while the others still write;
one still writing would recreate the directory after it was removed).

Restoring checks the fingerprint (``rlx.io.fingerprint``) before reading any array and names what
differs (a param's shape, a model hyper-parameter, the base hash, a config section). A checkpoint
that cannot be read (truncated files, arrays failing their checksum) raises
``CheckpointCorruptError``; ``restore_latest`` then falls back to the newest checkpoint that reads,
moving the broken ones aside (``<step>.corrupt``) so that the resumed run can save those steps
again.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rlx.io.fingerprint import (BaseRef, CheckpointError, CheckpointMismatchError, Fingerprint,
                                base_reference, check_compatible, checksums, config_changes,
                                leaf_map)
from rlx.learner.state import TrainState
from rlx.models.stack import per_layer_tree, stacked_tree

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bumped when the layout of a checkpoint changes
TRASH = "deleted"  # old steps are renamed here (atomic), then removed
SPACE_MARGIN = 1 << 20  # bytes a save needs beyond its arrays and metadata (files, indexes)
WRITERS_GRACE = 10.0  # seconds a failed save's other writer threads get to end before cleanup


class CheckpointCorruptError(CheckpointError):
    """The checkpoint's files are truncated, missing or unreadable."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (e.g. no space left); earlier ones are intact."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint."""

    directory: str  # one sub-directory per saved step
    every: int = 100  # save when step % every == 0 (and at exit, with force=True)
    keep: int = 3  # keep the last n checkpoints; older ones are deleted
    async_save: bool = True  # write in the background; save() returns after the host copy
    must_match: tuple[str, ...] = ()  # run-config sections a resume must agree on (others warn)

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"CheckpointConfig.every must be >= 1, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"CheckpointConfig.keep must be >= 1, got {self.keep}")


class Restored(NamedTuple):
    """The result of a restore: the checkpointed step, the state to continue from, its config and
    the position the caller saved with it (None when it saved none)."""

    step: int
    state: TrainState
    config: dict[str, Any]
    position: dict[str, Any] | None = None


def _saved_tree(state: TrainState) -> dict[str, Any]:
    """What is written; a scanned model's stacked layers per layer, as the unrolled model has them
    (``rlx.models.stack.per_layer_tree``: the files do not depend on ``model.scan_layers``)."""
    tree = {"step": state.step, "skipped": state.skipped, "params": per_layer_tree(state.params),
            "opt_state": per_layer_tree(state.opt_state), "rng": jax.random.key_data(state.rng)}
    if state.ref is not None:  # full mode's frozen reference (the initial params)
        tree["ref"] = per_layer_tree(state.ref)
    if state.critic is not None:  # its adapter or model and value head; never the base
        tree["critic"] = {"params": per_layer_tree(state.critic.params),
                          "opt_state": per_layer_tree(state.critic.opt_state)}
    return tree


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _as_dict(x) -> dict[str, Any]:
    if x is None:
        return {}
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return dict(x)


def _brief(e: BaseException) -> str:
    """The first line of an error, without tensorstore's spec dump."""
    text = str(e).split(" See full TensorStore details")[0].strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _write_cause(error: BaseException) -> str:
    """Why a write failed, in one line: "no space left on device" when that is it anywhere in the
    chain of errors (orbax raises OSError, tensorstore ValueError with the errno in its text)."""
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return "no space left on device"
        if getattr(e, "errno", None) == errno.EDQUOT or "Disk quota exceeded" in str(e):
            return "disk quota exceeded"
    return _brief(error)


def _verify(tree, expected: Mapping[str, str] | None, where: str) -> None:
    """Compare the restored arrays with the checksums written at save time."""
    if expected is None:
        return
    got = checksums(tree)
    bad = sorted(p for p in expected if got.get(p) != expected[p])
    if bad:
        raise CheckpointCorruptError(
            f"checkpoint {where} is corrupt: {len(bad)} array(s) differ from the checksums written "
            f"when it was saved: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")


def committed_steps(directory: str) -> list[int]:
    """The complete checkpoints in ``directory`` (oldest first), from its listing alone: orbax
    commits a step by renaming its temporary directory to the bare step number, so this needs no
    other process (what a process reports when the others are gone)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


class Checkpointer:
    """Saves and restores a run's `TrainState` (without its frozen part) and data iterator.

    ``model_config`` (a ``ModelConfig`` or dict) and ``run_config`` (a dict of the run config) are
    recorded; ``base`` references the frozen base (default: hashed from the state at the first save
    or restore, with an empty source). Use as a context manager or call ``close()``: that waits for
    the last asynchronous write.
    """

    def __init__(self, cfg: CheckpointConfig, *, model_config: Any = None,
                 run_config: Mapping[str, Any] | None = None, base: BaseRef | None = None):
        self.cfg = cfg
        self.directory = epath.Path(os.path.abspath(cfg.directory))
        self._model = _as_dict(model_config)
        self._config = dict(run_config or {})
        self._base, self._base_known = base, base is not None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True,
            cleanup_tmp_directories=True, todelete_subdir=TRASH)
        self._mgr = ocp.CheckpointManager(self.directory, options=options)
        self._writing: int | None = None  # the step being written (in the background)
        self._writers: list[threading.Thread] = []  # the threads that write started
        self._failed = False  # a write failed (and was raised)
        self._empty_trash()

    def _empty_trash(self) -> None:
        """Remove the steps keep-last-n retired. Orbax deletes a step in place (a kill midway
        would leave a half-deleted step listed); renaming it away first makes that atomic."""
        trash = self.directory / TRASH
        if jax.process_index() != 0 or not trash.exists():
            return
        for entry in trash.iterdir():  # each entry arrived by one rename: complete or absent
            shutil.rmtree(entry, ignore_errors=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first (partial writes are never listed)."""
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def should_save(self, step: int) -> bool:
        return step % self.cfg.every == 0

    def fingerprint(self, state: TrainState) -> Fingerprint:
        """What a checkpoint of `state` would hold (hashes the frozen base the first time)."""
        if not self._base_known:
            self._base, self._base_known = base_reference(state.frozen), True
        return Fingerprint(version=FORMAT_VERSION, leaves=leaf_map(_saved_tree(state)),
                           model=self._model, base=self._base,
                           rng_impl=str(jax.random.key_impl(state.rng)))

    def save(self, step: int, state: TrainState, data_iter=None, *, force: bool = False,
             position: Mapping[str, Any] | None = None) -> bool:
        """Checkpoint `state` (and `data_iter`'s position, or the caller's JSON `position`) as
        `step` if it is due or `force`d.

        Returns whether a save was started. Asynchronous unless configured otherwise: the arrays
        are copied off the device before this returns, so `state` may be donated right after.
        Raises ``CheckpointWriteError`` when this or the previous background write failed.
        """
        if not (force or self.should_save(step)) or step in self._mgr.all_steps():
            return False
        self.wait()  # a failed background write is reported before another starts
        tree = _saved_tree(state)
        meta = {"fingerprint": self.fingerprint(state).to_json(), "config": self._config,
                "step": int(step), "has_data": data_iter is not None, "checksums": checksums(tree)}
        if position is not None:
            meta["position"] = dict(position)
        items = {"state": ocp.args.StandardSave(tree), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            import grain.checkpoint as grain_checkpoint
            items["data"] = grain_checkpoint.CheckpointSave(data_iter)
        self._writing = step
        self._check_space(tree, meta)
        before = set(threading.enumerate())
        try:
            started = bool(self._mgr.save(step, args=ocp.args.Composite(**items), force=True))
        except Exception as e:  # noqa: BLE001 - a synchronous part of the write failed
            self._writers = [t for t in threading.enumerate() if t not in before]
            self._write_failed(e)
        self._writers = [t for t in threading.enumerate() if t not in before]
        if not self.cfg.async_save:
            self.wait()
        return started

    def wait(self) -> None:
        """Block until every started save is committed; ``CheckpointWriteError`` if one failed."""
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the background write failed
            self._write_failed(e)
        self._writing, self._writers = None, []
        self._empty_trash()

    def _check_space(self, tree, meta: Mapping[str, Any]) -> None:
        """Refuse to start a write the disk cannot hold (every process agrees, so none waits for
        the others in the middle of it): the arrays' bytes, the metadata and ``SPACE_MARGIN``."""
        need = sum(x.nbytes for x in jax.tree.leaves(tree)) + len(json.dumps(meta)) + SPACE_MARGIN
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        fits = np.bool_(free >= need)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            fits = np.asarray(multihost_utils.process_allgather(fits)).all()
        if not fits:
            self._write_failed(OSError(errno.ENOSPC, f"No space left on device: about {need} bytes "
                                       f"needed, {free} free on this process"))

    def _write_failed(self, error: BaseException) -> None:
        """Remove what the failed write left and raise ``CheckpointWriteError`` saying so."""
        step, self._writing, self._failed = self._writing, None, True
        self._join_writers()
        if jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        steps = sorted(s for s in self._mgr.all_steps() if s != step)
        last = (f"the last complete checkpoint is step {steps[-1]} in {self.directory}"
                if steps else f"no complete checkpoint is in {self.directory}")
        raise CheckpointWriteError(
            f"checkpoint {step} could not be written: {_write_cause(error)}. Nothing of it is "
            f"kept; {last}. Free space (or set config.output_dir elsewhere), then resume with "
            "--config.resume=latest") from error

    def _join_writers(self) -> None:
        """Wait (``WRITERS_GRACE`` seconds at most) for the threads the failed save started to
        end: nothing of that save writes any more once its temporary directory is removed."""
        deadline = time.monotonic() + WRITERS_GRACE
        for thread in self._writers:  # Thread.join itself: orbax's threads re-raise their error
            threading.Thread.join(thread, max(deadline - time.monotonic(), 0.0))
        self._writers = []

    def close(self) -> None:
        """Wait for the last write (a failure is raised once: not again on a later close)."""
        reported = self._failed
        try:
            self.wait()
        except CheckpointWriteError:
            if not reported:
                raise
        finally:
            self._mgr.close()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON item of checkpoint `step` (fingerprint, config, step, has_data)."""
        self.wait()  # a step still being written is read once committed
        try:
            args = ocp.args.Composite(meta=ocp.args.JsonRestore())
            meta = self._mgr.restore(step, args=args)["meta"]
            Fingerprint.from_json(meta["fingerprint"])
            return dict(meta)
        except Exception as e:  # unreadable JSON, a missing item, a missing field
            raise CheckpointCorruptError(
                f"checkpoint {step} in {self.directory} is incomplete or corrupt: its metadata "
                f"cannot be read ({_brief(e)})") from e

    def restore(self, step: int, state: TrainState, data_iter=None, *,
                report_changes: bool = True) -> Restored:
        """Restore checkpoint `step` onto the shardings of `state` (a fresh state of this run).

        The frozen part comes from `state`; `data_iter` (if given) is moved to the saved position
        (a checkpoint saved with a ``position`` instead returns it in ``Restored.position``).
        ``report_changes``: log the config fields that differ from the checkpoint's (a resume;
        an evaluation reads the parameters only, and ``must_match`` holds either way).
        Raises ``CheckpointMismatchError`` / ``CheckpointCorruptError`` naming what is wrong.
        """
        where = f"{step} in {self.directory}"
        meta = self.read_meta(step)
        saved = Fingerprint.from_json(meta["fingerprint"])
        check_compatible(saved, self.fingerprint(state), meta.get("config") or {}, self._config,
                         self.cfg.must_match, where)
        changes = config_changes(meta.get("config") or {}, self._config) if report_changes else []
        if changes:
            log.warning("resuming checkpoint %s with a changed config:\n  %s", where,
                        "\n  ".join(changes))
        if data_iter is not None and not meta.get("has_data"):
            if "position" in meta:  # the caller's own record of where its data stood
                data_iter = None
            else:
                raise CheckpointMismatchError(f"checkpoint {where} holds no data-iterator state, "
                                              "but a data iterator was given to restore")
        tree = self._read_arrays(step, state, where)
        _verify(tree, meta.get("checksums"), where)
        if data_iter is not None:
            self._read_data(step, data_iter, where)
        rng = jax.random.wrap_key_data(tree["rng"], impl=saved.rng_impl)
        restored = state.replace(step=tree["step"], skipped=tree["skipped"],
                                 params=stacked_tree(tree["params"], state.params),
                                 opt_state=stacked_tree(tree["opt_state"], state.opt_state), rng=rng)
        if "ref" in tree:
            restored = restored.replace(ref=stacked_tree(tree["ref"], state.ref))
        if "critic" in tree:
            restored = restored.replace(critic=state.critic.replace(**{
                k: stacked_tree(v, getattr(state.critic, k)) for k, v in tree["critic"].items()}))
        return Restored(step=int(meta["step"]), state=restored, config=meta.get("config") or {},
                        position=meta.get("position"))

    def _read_arrays(self, step: int, state: TrainState, where: str):
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(_saved_tree(state))))
        try:
            return self._mgr.restore(step, args=args)["state"]
        except Exception as e:  # tensorstore / OCDBT read errors, missing files
            raise CheckpointCorruptError(
                f"checkpoint {where} is truncated or corrupt: its arrays cannot be read "
                f"({_brief(e)})") from e

    def _read_data(self, step: int, data_iter, where: str) -> None:
        """Move `data_iter` to the saved position (after the arrays are known to be good)."""
        import grain.checkpoint as grain_checkpoint

        args = ocp.args.Composite(data=grain_checkpoint.CheckpointRestore(data_iter))
        try:
            self._mgr.restore(step, args=args)
        except json.JSONDecodeError as e:
            raise CheckpointCorruptError(f"checkpoint {where} is truncated or corrupt: its "
                                         f"data-iterator state cannot be read ({_brief(e)})") from e
        except Exception as e:  # the pipeline or the process count changed
            raise CheckpointMismatchError(
                f"the data-iterator state of checkpoint {where} does not fit the current data "
                f"pipeline or process count ({_brief(e)})") from e

    def restore_latest(self, state: TrainState, data_iter=None) -> Restored | None:
        """Restore the newest checkpoint that reads completely; None when there is none at all.

        Unreadable newer checkpoints are skipped with a warning and moved aside; a foreign one
        (``CheckpointMismatchError``) stops the search. Raises ``CheckpointCorruptError`` when
        checkpoints exist but none of them is complete.
        """
        steps = self.steps()
        failures = []
        for step in reversed(steps):
            try:
                restored = self.restore(step, state, data_iter)
            except CheckpointCorruptError as e:
                log.warning("skipping checkpoint: %s", e)
                failures.append(str(e))
                continue
            self._quarantine([s for s in steps if s > step])
            return restored
        if not steps:
            return None
        raise CheckpointCorruptError(f"no complete checkpoint in {self.directory}; tried "
                                     f"{len(steps)}:\n  " + "\n  ".join(failures))

    def _quarantine(self, steps: Sequence[int]) -> None:
        """Move unreadable checkpoints to ``<step>.corrupt`` so their steps can be saved again."""
        if steps and jax.process_index() == 0:
            for step in steps:
                src = self.directory / str(step)
                dst = self.directory / f"{step}.corrupt"
                n = 0
                while dst.exists():
                    n += 1
                    dst = self.directory / f"{step}.corrupt{n}"
                src.rename(dst)
                log.warning("moved unreadable checkpoint %s to %s", src, dst)
        if steps:
            self._mgr.reload()
