"""Multi-host runs on JAX's own multi-controller runtime (``jax.distributed``), nothing home-made.

Every host runs the same program. After ``initialize`` the mesh spans all processes' devices;
arrays are global ``jax.Array`` s of which each process holds its addressable shards.

Data is sharded per host: a host builds only the rows that land on its own devices
(``local_rows`` says which) and ``global_batch`` assembles the global array from every host's
piece with ``jax.make_array_from_process_local_data``. When one host produces all rollouts
(process 0 drives the rollout engine), ``broadcast_from_primary`` sends them to the others and
each host keeps its slice with ``take_local_rows``. Values needed on the host (metrics, params
for an export) come back with ``to_host``, a cross-process all-gather; only the primary
process writes them (``is_primary``). Host objects of no fixed shape (prompts, rollouts, reward
lists) travel pickled as byte arrays (``broadcast_object``, ``allgather_objects``): the peers are
the processes of one job running the same program, never an outside party.

Every process must make the same collective calls in the same order; all of these are
collective (call them on every process, from the thread that runs the train steps).

CPU runs use gloo TCP collectives between processes (``jax_cpu_collectives_implementation``),
which is what the 2-process CPU test exercises; GPUs use NCCL and TPUs ICI/DCN without settings.

A lost process (its host died, it was killed): a collective never returns on the others, so the
runtime's own detection is what ends them. ``initialize`` passes
``config.distributed.heartbeat_timeout_s`` to ``jax.distributed.initialize`` as
``heartbeat_timeout_seconds`` (the coordination service declares a process dead after that long
without a heartbeat and then aborts every process, with its own message) and
``shutdown_timeout_seconds`` (how long a process waits for the others at exit). Before that,
``Watchdog`` (a thread) ends the process cleanly: every process bumps a counter in the
coordination service's key-value store each ``heartbeat_timeout_s / 10`` s; a process whose
counter stands still for half the timeout, or a coordinator that no longer answers, is lost: the
watchdog prints one line naming it and the last complete checkpoint, kills this process's
children (the main thread may be stuck in a gloo collective, so no clean-up code of the run can
run) and exits with status ``LOST_PROCESS_EXIT``. Orbax commits a checkpoint only after every
process has written its part, so a checkpoint in progress is never listed as complete.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax._src import distributed  # the coordination service's client: no public accessor yet
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from rlx.io.checkpoint import committed_steps
from rlx.mesh import TRAIN_RULES, LogicalRules, batch_sharding, host_values

LOST_PROCESS_EXIT = 6  # the exit status of a process whose peer was lost (``Watchdog``)


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = 0, *,
               local_device_count: int | None = None, cpu_collectives: str = "gloo",
               heartbeat_timeout_s: int = 100) -> None:
    """``jax.distributed.initialize``; empty address / zero processes: auto-detect (TPU, SLURM).

    Call before anything touches a JAX backend; a second call (the runtime is already up) does
    nothing. ``local_device_count`` forces that many CPU devices per process (tests);
    ``cpu_collectives`` picks the cross-process CPU collectives; ``heartbeat_timeout_s`` is the
    runtime's (see the module docstring).
    """
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": heartbeat_timeout_s,
                              "shutdown_timeout_seconds": heartbeat_timeout_s}
    if coordinator_address:
        kwargs["coordinator_address"] = coordinator_address
    if num_processes:
        kwargs.update(num_processes=num_processes, process_id=process_id)
    jax.distributed.initialize(**kwargs)


def initialize_from(section: Any, checkpoints: str = "") -> None:
    """``initialize`` from a run's ``config.distributed`` section and start the ``Watchdog``
    (which names the last complete checkpoint in ``checkpoints``); nothing when it is disabled."""
    if section.enabled:
        initialize(section.coordinator_address, section.num_processes, section.process_id,
                   heartbeat_timeout_s=section.heartbeat_timeout_s)
        Watchdog(section.heartbeat_timeout_s, checkpoints).start()


class Watchdog:
    """Ends this process, cleanly and in time, when another process of the run is lost (see the
    module docstring). One per process; a daemon thread, so it never delays a normal exit."""

    DONE = "done"  # a process's last heartbeat, written as it exits normally

    def __init__(self, timeout_s: float, checkpoints: str = ""):
        self.timeout_s, self.checkpoints = float(timeout_s), checkpoints
        self._client = distributed.global_state.client
        self._stopping = threading.Event()

    def start(self) -> "Watchdog":
        if jax.process_count() > 1:
            # runs before jax.distributed's own exit handler (registered earlier): a process
            # that ends normally says so, and stops watching before the runtime shuts down
            atexit.register(self.stop)
            threading.Thread(target=self._watch, name="rlx-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(Exception):
            self._beat(self.DONE)

    def _beat(self, value: str) -> dict[str, str]:
        self._client.key_value_set(f"rlx/heartbeat/{jax.process_index()}", value,
                                   allow_overwrite=True)
        return dict(self._client.key_value_dir_get("rlx/heartbeat/"))

    def _watch(self) -> None:
        me, count = jax.process_index(), jax.process_count()
        beats, seen = 0, {p: (None, time.monotonic()) for p in range(count) if p != me}
        while not self._stopping.wait(self.timeout_s / 10):
            beats += 1
            try:
                values = self._beat(str(beats))
            except Exception as e:  # noqa: BLE001 - the coordinator (process 0) is gone
                if self._stopping.is_set():
                    return
                self.lost(0, f"the coordinator does not answer ({type(e).__name__})")
            now = time.monotonic()
            for p, (last, since) in seen.items():
                value = values.get(f"rlx/heartbeat/{p}")
                if value != last or value == self.DONE:
                    seen[p] = (value, now)
                elif now - since > self.timeout_s / 2 and not self._stopping.is_set():
                    self.lost(p, f"no heartbeat for {now - since:.0f} s")

    def lost(self, process: int, why: str) -> None:
        """Report ``process`` lost, kill this process's children and exit (never returns)."""
        steps = committed_steps(self.checkpoints) if self.checkpoints else []
        last = (f"the last complete checkpoint is step {steps[-1]} in {self.checkpoints}"
                if steps else f"no checkpoint is complete in {self.checkpoints or '-'}")
        sys.stderr.write(
            f"rlx: error: process {process} of the run's {jax.process_count()} was lost ({why}; "
            f"config.distributed.heartbeat_timeout_s={self.timeout_s:g}); process "
            f"{jax.process_index()} stops here; {last}: relaunch every process with "
            "--config.resume=latest\n")
        sys.stderr.flush()
        kill_descendants()
        os._exit(LOST_PROCESS_EXIT)


def kill_descendants(pid: int | None = None) -> None:
    """SIGKILL every descendant of ``pid`` (default: this process), children before theirs."""
    parents: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        parents.setdefault(ppid, []).append(int(name))
    todo = list(parents.get(os.getpid() if pid is None else pid, []))
    while todo:
        child = todo.pop(0)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        todo += parents.get(child, [])


def is_primary() -> bool:
    """True on process 0, the one that drives rollouts and writes metrics, logs and exports."""
    return jax.process_index() == 0


def local_rows(sharding: NamedSharding, global_rows: int) -> slice:
    """The contiguous rows of a row-sharded ``[global_rows, ...]`` array on this host's devices.

    Raises ``ValueError`` when this host's rows are not one contiguous block (a mesh whose device
    order interleaves hosts along the batch axes); reorder the mesh devices by process then.
    """
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    spans = sorted({(s[0].start or 0, global_rows if s[0].stop is None else s[0].stop)
                    for s in index_map.values()})
    start, stop = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    if covered != stop - start:
        raise ValueError(f"process {jax.process_index()} holds rows {spans}, not one contiguous "
                         "block; order the mesh devices by process along the batch axes")
    return slice(start, stop)


def take_local_rows(batch: Any, mesh: Mesh, rules: LogicalRules = TRAIN_RULES) -> Any:
    """From a full host batch (every field ``[B, ...]``), this host's rows (for ``global_batch``)."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    span = local_rows(batch_sharding(mesh, 1, rules), rows)
    return jax.tree.map(lambda x: np.asarray(x)[span], batch)


def global_batch(local: Any, mesh: Mesh, global_rows: int,
                 rules: LogicalRules = TRAIN_RULES) -> Any:
    """Assemble global row-sharded arrays from every host's local rows (a pytree of numpy)."""

    def one(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.ndim, rules)
        return jax.make_array_from_process_local_data(sharding, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(one, local)


def broadcast_from_primary(tree: Any) -> Any:
    """Process 0's value of a pytree of host arrays on every process (others pass same shapes)."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree)


def to_host(tree: Any) -> Any:
    """Full numpy values of (possibly non-addressable) global arrays, on every process
    (``rlx.mesh.host_values``)."""
    return host_values(tree)


def to_primary(tree: Any) -> Any:
    """``to_host`` kept on process 0 alone: every array is gathered in turn (a collective) and
    dropped on the other processes, which keep its shape (``jax.ShapeDtypeStruct``)."""
    def one(x):
        value = host_values(x)
        return value if is_primary() else jax.ShapeDtypeStruct(value.shape, value.dtype)

    return jax.tree.map(one, tree)


def _encode(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def broadcast_object(obj: Any) -> Any:
    """Process 0's ``obj`` (any picklable host value) on every process; others' ``obj`` is ignored."""
    if jax.process_count() == 1:
        return obj
    data = _encode(obj) if is_primary() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    data = multihost_utils.broadcast_one_to_all(data if is_primary() else np.zeros(size, np.uint8))
    return pickle.loads(np.asarray(data, np.uint8).tobytes())


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (any picklable host value), in process order, on every process."""
    if jax.process_count() == 1:
        return [obj]
    data = _encode(obj)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded), np.uint8)  # [processes, max size]
    return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, sizes.tolist())]
