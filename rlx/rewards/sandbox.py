"""Run untrusted Python programs in a throwaway sandbox, one process tree per program.

Every run gets rlimits (CPU seconds, address space, file size, processes, open files, no core
dumps), a scrubbed environment, a fresh private working directory, and a wall-clock timeout
after which the whole process tree is killed. On top of that the strongest available isolation
level is used, and recorded in each result:

- `bwrap`: bubblewrap with new pid, network, ipc and uts namespaces. The program sees an empty
  root holding only read-only /usr (and the /lib, /bin links), the Python installation, a few
  /etc files, a minimal /dev, its own /proc and a size-limited tmpfs /tmp as working directory;
  /root, /home, the repository and the host /tmp do not exist for it. When bwrap exits the pid
  namespace dies, which kills every descendant, including ones that called setsid.
- `unshare`: the same layout built by a shell script with util-linux `unshare` (`--pid --fork
  --kill-child --net --ipc --uts --mount`), `mount` and `chroot`.
- `rlimits`: no namespaces: rlimits, a session of its own and a scrubbed environment only; the
  program shares the host file system and network.

A root grader also gives each concurrent run an otherwise unused uid (a "slot"): RLIMIT_NPROC
then counts exactly that program's processes, the program cannot signal or ptrace the grader,
and every leftover process of that uid is killed after the run. Without root, RLIMIT_NPROC is
the caller's current process count plus the allowance. Not covered: seccomp, cgroups.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import os
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

_ETC_FILES = ("ld.so.cache", "ld.so.conf", "localtime", "nsswitch.conf")
_TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_MiB = 1 << 20
_TOKEN_VAR = "RLX_SANDBOX_RUN"
_HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_BWRAP_UNSHARE = (
    "--unshare-pid --unshare-net --unshare-ipc --unshare-uts --unshare-cgroup-try".split()
)
_UNSHARE = "--pid --fork --kill-child --net --ipc --uts --mount".split()
_DROP_CAPS = "--inh-caps=-all --bounding-set=-all --no-new-privs".split()


class Isolation(enum.StrEnum):
    """Isolation levels, strongest first."""

    BWRAP = "bwrap"
    UNSHARE = "unshare"
    RLIMITS = "rlimits"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-program resource limits."""

    wall_s: float = 10.0  # wall-clock timeout; the whole process tree is killed after it
    cpu_s: int = 10  # RLIMIT_CPU seconds (per process)
    memory_mb: int = 1024  # RLIMIT_AS per process
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file (stdout/stderr included)
    max_processes: int = 16  # RLIMIT_NPROC allowance for the program's own processes
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmp_mb: int = 64  # size of the private /tmp (namespace levels)
    max_output_bytes: int = 1 << 16  # stdout/stderr bytes kept in the result

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"SandboxLimits.{field.name} must be > 0")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did."""

    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool  # killed by the wall-clock timeout
    wall_s: float
    isolation: Isolation
    uid_isolated: bool  # ran under its own uid (grader was root)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where things live on the host, for building the sandbox's view."""

    python: str  # interpreter path, valid inside and outside the sandbox
    extra_ro_dirs: tuple[str, ...]  # Python installation dirs outside /usr


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one run is started."""

    level: Isolation
    layout: _Layout
    limits: SandboxLimits
    uid: int | None  # the run's slot uid (root only)


def _python_layout(python: str | None) -> _Layout:
    exe = os.path.realpath(python or sys.executable)
    if exe == os.path.realpath(sys.executable):
        roots = {sys.base_prefix, sys.base_exec_prefix}
    else:
        roots = {os.path.dirname(os.path.dirname(exe))}
    roots.add(os.path.dirname(exe))
    extra = sorted(os.path.realpath(r) for r in roots if not _under(os.path.realpath(r), "/usr"))
    extra = [d for d in extra if not any(d != o and _under(d, o) for o in extra)]
    return _Layout(python=exe, extra_ro_dirs=tuple(extra))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _world_executable(path: str) -> bool:
    """Whether any user may execute `path` (every parent directory searchable by others)."""
    try:
        return all(os.stat(p).st_mode & 0o001 for p in ["/", *_ancestors(path), path])
    except OSError:
        return False


def _ancestors(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b'] (directories to create above a bind mount)."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


@functools.lru_cache(maxsize=1)
def _uid_slots() -> queue.SimpleQueue | None:
    """Uids nobody else uses, one per concurrent run, shared by all sandboxes of this grader
    process (None unless root)."""
    if os.geteuid() != 0:
        return None
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    base = 200_000 + (os.getpid() % 10_000) * 64
    for uid in range(base, base + 64):
        free.put(uid)
    return free


def _sweep(uid: int, token: str | None = None) -> None:
    """SIGKILLs, until none is left, the processes of `uid` (a slot uid) or, given `token`, the
    processes of `uid` whose environment carries it (children that left the process group when
    there is neither a namespace nor a slot uid)."""
    needle = f"{_TOKEN_VAR}={token}".encode() if token else None
    for _ in range(50):
        pids = [p for p, owner in _processes() if owner == uid and p != os.getpid()]
        pids = [p for p in pids if needle is None or needle in _environ(p)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _processes() -> list[tuple[int, int]]:
    """(pid, uid) of every process in /proc."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            found.append((int(name), os.stat(f"/proc/{name}").st_uid))
    return found


def _prlimit_argv(limits: SandboxLimits, nproc: int) -> list[str]:
    """rlimits for the whole tree: soft CPU limit sends SIGXCPU, hard (1 s later) SIGKILL."""
    values = {
        "cpu": f"{limits.cpu_s}:{limits.cpu_s + 1}",
        "as": limits.memory_mb * _MiB,
        "fsize": limits.file_size_mb * _MiB,
        "nproc": nproc,
        "nofile": limits.max_open_files,
        "core": 0,
    }
    return [_tool("prlimit"), *(f"--{k}={v}" for k, v in values.items()), "--"]


def _tool(name: str) -> str:
    """Absolute path of a system tool (under /usr or /bin, so also valid in the sandbox)."""
    return shutil.which(name, path=_HOST_PATH) or name


def _setpriv_argv(uid: int | None) -> list[str]:
    """Drops every capability (and, as root, switches to the slot uid) before exec."""
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    return [_tool("setpriv"), *ids, *_DROP_CAPS, "--"]


def _sandbox_env() -> dict[str, str]:
    return {"PATH": _SANDBOX_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


def _view(layout: _Layout) -> list[tuple[str, str, str]]:
    """The sandbox's read-only file system as (kind, host source, path) entries; kind is "ro"
    (bind mount), "link" (symlink to source) or "dir" (mode 0711: traversable, not listable)."""
    view = [("ro", "/usr", "/usr")]
    for host in ("/" + name for name in _TOP_DIRS):
        if os.path.islink(host):
            view.append(("link", os.readlink(host), host))
        elif os.path.isdir(host):
            view.append(("ro", host, host))
    view += [("ro", "/etc/" + n, "/etc/" + n) for n in _ETC_FILES if os.path.isfile("/etc/" + n)]
    for d in layout.extra_ro_dirs:
        view += [("dir", "", a) for a in _ancestors(d)] + [("ro", d, d)]
    return view


def _bwrap_argv(plan: _Plan, prog_fd: int) -> list[str]:
    argv = [_tool("bwrap"), "--die-with-parent", "--new-session", *_BWRAP_UNSHARE]
    if os.geteuid() == 0:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    for kind, source, path in _view(plan.layout):
        if kind == "ro":
            argv += ["--ro-bind", source, path]
        elif kind == "link":
            argv += ["--symlink", source, path]
        else:
            argv += ["--perms", "0711", "--dir", path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "0777", "--size", str(plan.limits.tmp_mb * _MiB), "--tmpfs", "/tmp"]
    argv += ["--perms", "0644", "--file", str(prog_fd), "/tmp/prog.py", "--chdir", "/tmp"]
    argv += ["--clearenv"]
    for k, v in _sandbox_env().items():
        argv += ["--setenv", k, v]
    drop = _setpriv_argv(plan.uid) if os.geteuid() == 0 else []
    return [*argv, "--", *drop, plan.layout.python, "-I", "-B", "prog.py"]


def _unshare_script(plan: _Plan, stage: str) -> str:
    """A shell script that builds the bwrap-like root under stage/root and runs the program."""
    q = shlex.quote
    root = os.path.join(stage, "root")
    lines = ["set -e", f"R={q(root)}", 'mount -t tmpfs -o size=4m,mode=0755 rlx-root "$R"']
    lines.append('mkdir -p "$R/etc" "$R/dev" "$R/proc" "$R/tmp"')
    for kind, source, path in _view(plan.layout):
        target = '"$R"' + q(path)
        if kind == "ro":
            make = "mkdir -p" if os.path.isdir(source) else "touch"
            lines.append(f"{make} {target}; mount --rbind {q(source)} {target}")
            lines.append(f"mount -o remount,bind,ro {target}")
        elif kind == "link":
            lines.append(f"ln -s {q(source)} {target}")
        else:
            lines.append(f"mkdir -p {target}; chmod 0711 {target}")
    for name in ("null", "zero", "random", "urandom"):
        lines.append(f'touch "$R/dev/{name}"; mount --bind /dev/{name} "$R/dev/{name}"')
    env = " ".join(f"{k}={q(v)}" for k, v in _sandbox_env().items())
    cmd = " ".join(map(q, [*_setpriv_argv(plan.uid), plan.layout.python, "-I", "-B", "prog.py"]))
    lines += [
        'ln -s /proc/self/fd "$R/dev/fd"',
        'mount -t proc -o nosuid,nodev,noexec proc "$R/proc"',
        f'mount -t tmpfs -o size={plan.limits.tmp_mb}m,mode=0777 rlx-tmp "$R/tmp"',
        f'cp {q(os.path.join(stage, "prog.py"))} "$R/tmp/prog.py"; chmod 0644 "$R/tmp/prog.py"',
        'mount -o remount,bind,ro "$R"',
        f'exec chroot "$R" /usr/bin/env -i -C /tmp {env} {cmd}',
    ]
    return "\n".join(lines)


def _unshare_argv(plan: _Plan, stage: str) -> list[str]:
    argv = [_tool("unshare"), *_UNSHARE]
    if os.geteuid() != 0:
        argv += ["--user", "--map-root-user"]
    return [*argv, "--", "/bin/sh", "-c", _unshare_script(plan, stage)]


@dataclasses.dataclass(frozen=True)
class _Run:
    """Host-side files of one run: stage/{prog.py, stdin, stdout, stderr}, all private to the
    grader, plus stage/work (owned by the slot uid) at the rlimits level."""

    stage: str
    token: str  # marks the run's processes at the rlimits level

    def path(self, name: str) -> str:
        return os.path.join(self.stage, name)

    @classmethod
    def create(cls, source: str, stdin: bytes, level: Isolation, uid: int | None) -> _Run:
        run = cls(tempfile.mkdtemp(prefix="rlx-sandbox-"), secrets.token_hex(8))
        code = source.encode("utf-8", errors="surrogateescape")
        _write_private(run.path("prog.py"), code)
        _write_private(run.path("stdin"), stdin)
        if level is Isolation.RLIMITS:
            os.chmod(run.stage, 0o711)
            os.mkdir(run.path("work"), 0o700)  # prog.py (root's, mode 0644) is readable in it
            _write_private(os.path.join(run.path("work"), "prog.py"), code, 0o644)
            if uid is not None:
                os.chown(run.path("work"), uid, uid)
        return run

    def read(self, name: str, limit: int) -> str:
        with open(self.path(name), "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")

    def remove(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)


def _write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
        f.write(data)


def _popen(argv: list[str], run: _Run, env: dict, uid: int | None, **kwargs) -> subprocess.Popen:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out, err = (os.open(run.path(n), flags, 0o600) for n in ("stdout", "stderr"))
    if uid is not None:
        kwargs.update(user=uid, group=uid, extra_groups=[])
    try:
        with open(run.path("stdin"), "rb") as fin:
            std = {"stdin": fin, "stdout": out, "stderr": err}
            return subprocess.Popen(argv, env=env, start_new_session=True, **std, **kwargs)
    finally:
        os.close(out)
        os.close(err)


def _wait(proc: subprocess.Popen, wall_s: float) -> bool:
    """Waits for the run; on timeout kills its process group. Returns whether it timed out."""
    try:
        proc.wait(timeout=wall_s)
        return False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        return True


class Sandbox:
    """Runs Python sources under the strongest isolation available (or the one asked for).

    `run(source, stdin)` runs one program as `python -I -B prog.py` in a fresh directory;
    `run_many` runs several on a bounded thread pool and returns results in input order.
    """

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        isolation: Isolation | str | None = None,
        python: str | None = None,
        max_workers: int | None = None,
    ):
        self.limits = limits
        self._layout = _python_layout(python)
        self._requested = Isolation(isolation) if isolation is not None else None
        self._max_workers = max_workers or min(4, os.cpu_count() or 1)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @functools.cached_property
    def isolation(self) -> Isolation:
        """The level runs use; probed once (raises if a requested level does not work)."""
        if self._requested is not None:
            if not _level_works(self._requested, self._layout):
                raise RuntimeError(f"isolation level {self._requested.value!r} does not work here")
            return self._requested
        return _detect(self._layout)

    def run(self, source: str, stdin: str | bytes = b"") -> SandboxResult:
        data = stdin.encode("utf-8", errors="surrogateescape") if isinstance(stdin, str) else stdin
        return _execute(source, data, self.isolation, self._layout, self.limits)

    def run_many(
        self, sources: Sequence[str], stdins: Sequence[str | bytes] | None = None
    ) -> list[SandboxResult]:
        stdins = stdins if stdins is not None else [b""] * len(sources)
        if len(stdins) != len(sources):
            raise ValueError(f"{len(sources)} sources but {len(stdins)} stdins")
        _ = self.isolation  # probe once, before fanning out
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._max_workers, "rlx-sandbox")
        return list(self._pool.map(self.run, sources, stdins))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _execute(
    source: str, stdin: bytes, level: Isolation, layout: _Layout, limits: SandboxLimits
) -> SandboxResult:
    slots = _uid_slots()
    if level is Isolation.RLIMITS and not _world_executable(layout.python):
        slots = None  # a slot uid could not even start Python; stays the caller's uid
    uid = slots.get() if slots is not None else None
    run = _Run.create(source, stdin, level, uid)
    try:
        own = 0 if uid is not None else sum(u == os.getuid() for _, u in _processes()) + 4
        plan = _Plan(level, layout, limits, uid)
        start = time.monotonic()
        proc = _start(plan, _prlimit_argv(limits, own + limits.max_processes), run)
        timed_out = _wait(proc, limits.wall_s)
        wall = time.monotonic() - start
        if uid is not None or level is Isolation.RLIMITS:
            _sweep(os.getuid() if uid is None else uid, run.token if uid is None else None)
        cap = limits.max_output_bytes
        return SandboxResult(
            returncode=proc.returncode,
            stdout=run.read("stdout", cap),
            stderr=run.read("stderr", cap),
            timed_out=timed_out,
            wall_s=wall,
            isolation=level,
            uid_isolated=uid is not None,
        )
    finally:
        run.remove()
        if uid is not None:
            slots.put(uid)


def _start(plan: _Plan, prefix: list[str], run: _Run) -> subprocess.Popen:
    host_env = {"PATH": _HOST_PATH}
    if plan.level is Isolation.BWRAP:
        fd = os.open(run.path("prog.py"), os.O_RDONLY)
        try:
            return _popen(prefix + _bwrap_argv(plan, fd), run, host_env, None, pass_fds=(fd,))
        finally:
            os.close(fd)
    if plan.level is Isolation.UNSHARE:
        os.mkdir(run.path("root"))
        return _popen(prefix + _unshare_argv(plan, run.stage), run, host_env, None)
    work = run.path("work")
    env = {**_sandbox_env(), "HOME": work, "TMPDIR": work, _TOKEN_VAR: run.token}
    argv = prefix + [plan.layout.python, "-I", "-B", "prog.py"]
    return _popen(argv, run, env, plan.uid, cwd=work)


_PROBE = "import sys; print('rlx-sandbox-ok', sys.version_info[0])"


def _level_works(level: Isolation, layout: _Layout) -> bool:
    needs = {
        Isolation.BWRAP: ["bwrap", "setpriv"],
        Isolation.UNSHARE: ["unshare", "setpriv", "mount"],
    }
    if not all(shutil.which(t, path=_HOST_PATH) for t in ["prlimit", *needs.get(level, [])]):
        return False
    try:
        result = _execute(_PROBE, b"", level, layout, SandboxLimits(wall_s=30.0))
    except OSError:
        return False
    return result.ok and result.stdout.strip() == "rlx-sandbox-ok 3"


def detect_isolation(python: str | None = None) -> Isolation:
    """The strongest level that runs a trivial program here (probed once per interpreter)."""
    return _detect(_python_layout(python))


@functools.cache
def _detect(layout: _Layout) -> Isolation:
    for level in (Isolation.BWRAP, Isolation.UNSHARE, Isolation.RLIMITS):
        if _level_works(level, layout):
            return level
    raise RuntimeError("no sandbox level works here (is util-linux prlimit installed?)")
