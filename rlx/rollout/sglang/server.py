"""Launching and stopping SGLang servers as child processes, with no orphans left behind.

SGLang lives in its own virtual environment (it pins its own torch), so a server is started as
``<python> -m sglang.launch_server ...`` from a configured interpreter. Each server gets its own
session and process group (``start_new_session``): a Ctrl-C in the terminal reaches rlx, not the
servers, and stopping a server terminates the scheduler and detokenizer processes SGLang spawns
as well: SIGTERM to the group, SIGKILL to whatever of the group is left after a grace period.
Servers are also stopped when the owning object is garbage-collected and at interpreter exit.

If the rlx process itself dies without cleaning up (SIGKILL, the OOM killer, a crash), Linux still
stops a server it launched from its main thread: such a server starts by setting
``PR_SET_PDEATHSIG`` = SIGKILL (a two-line bootstrap run by the SGLang interpreter before
``sglang.launch_server``), and SGLang's own scheduler and detokenizer processes die with the
server the same way. The kernel ties that signal to the launching *thread*: a server launched
from another thread would die when that thread ends, so there it is not set, and only the
clean-up paths above apply (a server then outlives a SIGKILLed rlx: stop it by its process group).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import threading
import time
import weakref

import requests

from rlx.rollout.errors import RolloutError


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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal still exists
        return True


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left of it after ``grace_s``
    (the server itself, or children it left behind), and reap the server."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped server must run to act on it
        deadline = time.monotonic() + grace_s
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            proc.poll()  # reap the leader as soon as it exits
            time.sleep(0.1)
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


# Started with the SGLang interpreter instead of ``-m sglang.launch_server``: asks the kernel to
# SIGKILL the server when the thread that launched it dies (PR_SET_PDEATHSIG = 1), exits if that
# already happened, then runs the server as ``-m`` would. (Set in the child itself: a
# ``preexec_fn`` would need a plain fork of the multi-threaded rlx process.)
_DIE_WITH_PARENT = (
    "import ctypes, os, runpy, signal, sys; "
    "ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0); "
    "os.getppid() == int(sys.argv.pop(1)) or sys.exit('rlx: the launching process is gone'); "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)")


class SGLangServer:
    """One server process; ``with SGLangServer(spec) as s: s.url``."""

    def __init__(self, spec: ServerSpec):
        self.spec = dataclasses.replace(spec, port=spec.port or free_port(spec.host))
        self.url = f"http://{self.spec.host}:{self.spec.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = spec.log_path
        self._finalizer = None

    def start(self) -> SGLangServer:
        self.spawn()
        self.wait_healthy()
        return self

    def spawn(self) -> None:
        """Start the process (without waiting for it to serve). Call it on the thread that will
        outlive the server, normally the main thread (see the module docstring)."""
        s = self.spec
        main = threading.current_thread() is threading.main_thread()
        start = (["-c", _DIE_WITH_PARENT, str(os.getpid())] if main
                 else ["-m", "sglang.launch_server"])
        cmd = [s.python, *start, "--model-path", s.model_path, "--host", s.host,
               "--port", str(s.port), *s.extra_args]
        self.log_path = s.log_path or os.path.join(
            os.path.dirname(s.model_path.rstrip("/")) or ".", f"sglang-{s.port}.log")
        env = dict(os.environ, **dict(s.env))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, stdin=subprocess.DEVNULL)
        self._finalizer = weakref.finalize(self, _stop_group, self.proc, 20.0)

    def wait_healthy(self) -> None:
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
        except (OSError, TypeError):
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> str | None:
        """What is wrong with the process, if something visibly is (exited, or stopped)."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            tail = self.log_tail(3).strip().replace("\n", " | ")
            return (f"its process {self.proc.pid} exited with code {self.proc.returncode} "
                    f"(log {self.log_path}: ... {tail[-300:]})")
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None
        if state in ("T", "t"):
            return f"its process {self.proc.pid} is stopped (SIGSTOP or a debugger)"
        return None

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            _stop_group(self.proc, grace_s)
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self) -> SGLangServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
