"""Reading untrusted checkpoint files in a child process.

The `gguf` package parses a file by trusting its declared lengths, and a wrong one can make it
loop without end; a reader bug could also take the interpreter down. So the GGUF fuzz tests read
each mutated file in a long-lived child process with a per-read deadline: a read that takes too
long or kills the child becomes an `Outcome` naming the input, and the child is replaced, instead
of a stuck or dead test run. The child reports its peak resident memory after each read, so
a huge allocation from a declared size shows up as well.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
from multiprocessing import connection

_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
_STARTUP_S = 300.0  # importing rlx.models (jax) on a busy machine


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What reading one file did: "ok", "raised" (with the exception), "hang" or "crash"."""

    status: str
    error_type: str = ""  # module.qualname of the exception
    message: str = ""
    peak_rss_mb: float = 0.0  # the child's peak resident memory after the read


def _read_gguf(path: str) -> None:
    """Everything a loader does with a GGUF file: metadata, every tensor, the tokenizer."""
    from rlx.models.gguf import read_gguf

    checkpoint = read_gguf(path)
    for name in checkpoint.tensors:
        checkpoint.tensors[name]
    if checkpoint.tokenizer is not None:
        ids = checkpoint.tokenizer.encode("the theory of everything")
        checkpoint.tokenizer.decode(ids + list(range(checkpoint.tokenizer.vocab_size)))


def _read_gguf_tokenizer(path: str) -> None:
    """Only the tokenizer, straight from the file (``Tokenizer.from_gguf(path)``)."""
    from rlx.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    tok.decode(tok.encode("the theory of everything"))


_READERS = {"gguf": _read_gguf, "gguf_tokenizer": _read_gguf_tokenizer}


class _Deadline(BaseException):
    """Raised in the child when a read runs past its time."""


def _serve(fd: int) -> None:
    """Child main loop: reads `(kind, path, seconds)` requests, answers `Outcome` fields."""
    import resource
    import signal

    os.dup2(2, 1)  # stray prints must not reach the parent
    conn = connection.Connection(fd)
    import rlx.models.gguf  # noqa: F401  - import before saying ready

    def on_alarm(signum, frame):
        raise _Deadline()

    signal.signal(signal.SIGALRM, on_alarm)
    conn.send("ready")
    while True:
        try:
            kind, path, seconds = conn.recv()
        except (EOFError, OSError):
            return
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            _READERS[kind](path)
            status, error_type, message = "ok", "", ""
        except _Deadline:
            status, error_type, message = "hang", "", f"still reading after {seconds} s"
        except BaseException as exc:  # every exception is an outcome to check
            status = "raised"
            error_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
            message = str(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        conn.send((status, error_type, message, peak))


class IsolatedReader:
    """A child process that reads files on request; restarted after a hang or a crash."""

    def __init__(self, per_read_s: float = 10.0):
        self.per_read_s = per_read_s
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        code = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
                f"from tests.helpers.isolated import _serve; _serve({theirs.fileno()})")
        with theirs:
            self._process = subprocess.Popen([sys.executable, "-c", code],
                                             pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        self._conn = connection.Connection(ours.detach())
        if not (self._conn.poll(_STARTUP_S) and self._conn.recv() == "ready"):
            self.close()
            raise RuntimeError(f"reader process did not start within {_STARTUP_S:.0f} s")

    def read(self, kind: str, path: str | os.PathLike) -> Outcome:
        """Reads `path` with reader `kind` in the child."""
        try:
            self._conn.send((kind, os.fspath(path), self.per_read_s))
            # The child's own alarm fires after per_read_s; past twice that, it ignores signals.
            if self._conn.poll(2 * self.per_read_s + 5):
                return Outcome(*self._conn.recv())
            outcome = Outcome("hang", message=f"no answer after {2 * self.per_read_s + 5:g} s")
        except (EOFError, OSError):
            code = self._process.wait()
            outcome = Outcome("crash", message=f"reader process died with exit code {code}")
        self.close()
        self.restarts += 1
        self._start()
        return outcome

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._conn.close()
