"""The Linux process table, read from /proc: descendants of a process, whether they are still
alive, and which TCP ports are being listened on (the reliability tests check for orphans)."""

from __future__ import annotations

import contextlib
import os
import signal

Proc = tuple[int, int]  # (pid, start time in clock ticks): a pid cannot be confused after reuse


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], ppid [1], pgid [2],
    sid [3], start time [19]); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def table() -> dict[int, list[str]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat(int(name))) is not None:
            out[int(name)] = fields
    return out


def command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> dict[Proc, str]:
    """Every live process below ``root`` (children, theirs, ...), with its command line."""
    procs = table()
    children: dict[int, list[int]] = {}
    for pid, fields in procs.items():
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[(child, int(procs[child][19]))] = command(child)
            todo.append(child)
    return found


def alive(proc: Proc) -> bool:
    """Whether the process still runs (a zombie waiting to be reaped does not count)."""
    fields = _stat(proc[0])
    return fields is not None and int(fields[19]) == proc[1] and fields[0] not in ("Z", "X")


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state (IPv4 and IPv6)."""
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A":
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def kill_all(procs) -> None:
    """SIGKILL what is left (test clean-up after a failure)."""
    for proc in procs:
        if alive(proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc[0], signal.SIGKILL)
