"""Tests that run one JAX program as several local processes (gloo collectives over localhost).

Test side: ``free_port``, ``child_env`` (a child's environment: CPU platform, this checkout on the
path, one OpenMP thread, no inherited ``XLA_FLAGS``), ``process_commands`` (one command per
process with its coordinator flags) and ``run_together`` (start every command at once; the first
to fail ends the others, whose peers would wait for them forever, and fails the test with its log).

Driver side: ``add_process_args`` (the flags every driver takes) and ``start_devices`` (the local
CPU device count and, where the driver joins the processes itself, ``jax.distributed``).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import tempfile
import time

from tests.helpers import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process; ``XLA_FLAGS`` only if given (drivers set their own
    device count)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


def process_commands(base: list[str], processes: int) -> list[list[str]]:
    """``base`` once per process, each with its id and a shared coordinator (alone: as is)."""
    if processes == 1:
        return [list(base)]
    coordinator = f"127.0.0.1:{free_port()}"
    return [[*base, "--num-processes", str(processes), "--process-id", str(i),
             "--coordinator", coordinator] for i in range(processes)]


def _log_file(logdir, cmd: list[str], i: int):
    if logdir is None:
        return tempfile.TemporaryFile("w+")
    name = os.path.basename(cmd[cmd.index("--out") + 1]) if "--out" in cmd else "process"
    return open(os.path.join(logdir, f"{os.path.splitext(name)[0]}.{i}.log"), "w+")


def run_together(cmds: list[list[str]], env: dict[str, str] | None = None, timeout: float = 240,
                 logdir=None) -> list[str]:
    """Run every command at once from the repository root; each one's output (logs under
    ``logdir`` when given). Raises AssertionError naming the first command that failed."""
    logs = [_log_file(logdir, c, i) for i, c in enumerate(cmds)]
    procs, deadline = [], time.monotonic() + timeout
    try:
        procs = [subprocess.Popen(c, cwd=ROOT, env=env or child_env(), stdout=log,
                                  stderr=subprocess.STDOUT) for c, log in zip(cmds, logs)]
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    # the first to fail exited with an error; the others were killed or lost their peer
    failed = sorted((p.returncode <= 0, i) for i, p in enumerate(procs) if p.returncode != 0)
    for _, i in failed[:1]:
        late = f" (killed after {timeout:.0f} s)" if time.monotonic() >= deadline else ""
        raise AssertionError(f"{' '.join(cmds[i][2:])} exited with {procs[i].returncode}{late}"
                             f"\n{texts[i][-4000:]}")
    return texts


def add_process_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", required=True)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--coordinator", default="")
    p.add_argument("--local-devices", type=int, default=8)
    return p


def start_devices(args: argparse.Namespace, distributed: bool) -> None:
    """Before any JAX backend starts: ``args.local_devices`` CPU devices, and with
    ``distributed`` and several processes, ``jax.distributed`` through rlx (a driver whose run
    joins the processes itself from its config passes ``distributed=False``)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if distributed and args.num_processes > 1:
        from rlx.run import multihost

        multihost.initialize(args.coordinator, args.num_processes, args.process_id,
                             local_device_count=args.local_devices)
        return
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)
