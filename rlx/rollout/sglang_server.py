"""Launching and stopping SGLang servers as child processes, with no orphans left behind.

SGLang lives in its own virtual environment (it pins its own torch), so a server is started as
``<python> -m sglang.launch_server ...`` from a configured interpreter. Each server gets its own
process group (``start_new_session``), so stopping it terminates the scheduler and detokenizer
processes SGLang spawns as well: SIGTERM to the group, SIGKILL after a grace period. Servers are
also stopped when the owning object is garbage-collected and at interpreter exit.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import time
import weakref

import requests

from rlx.rollout.base import RolloutError


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """How to start one SGLang server."""

    python: str  # interpreter of the SGLang environment
    model_path: str  # HF folder (or GGUF file) exported by rlx
    port: int = 0  # 0: pick a free port
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()  # e.g. ("--quantization", "fp8", "--enable-lora", ...)
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables
    startup_timeout_s: float = 600.0
    log_path: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


class SGLangServer:
    """One server process; ``with SGLangServer(spec) as s: s.url``."""

    def __init__(self, spec: ServerSpec):
        self.spec = dataclasses.replace(spec, port=spec.port or free_port(spec.host))
        self.url = f"http://{self.spec.host}:{self.spec.port}"
        self.proc: subprocess.Popen | None = None
        self._finalizer = None

    def start(self) -> SGLangServer:
        s = self.spec
        cmd = [s.python, "-m", "sglang.launch_server", "--model-path", s.model_path,
               "--host", s.host, "--port", str(s.port), *s.extra_args]
        log_path = s.log_path or os.path.join(os.path.dirname(s.model_path.rstrip("/")) or ".",
                                              f"sglang-{s.port}.log")
        self.log_path = log_path
        log = open(log_path, "ab")
        env = dict(os.environ, **dict(s.env))
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        log.close()
        self._finalizer = weakref.finalize(self, _stop_group, self.proc, 20.0)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RolloutError(f"SGLang server on port {self.spec.port} exited with code "
                                   f"{self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise RolloutError(f"SGLang server on port {self.spec.port} not healthy after "
                           f"{self.spec.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            _stop_group(self.proc, grace_s)
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self) -> SGLangServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
