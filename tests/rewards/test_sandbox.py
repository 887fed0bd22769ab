"""Sandbox: isolation levels, limits, timeouts, cleanup, parallel runs in input order."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from rlx.rewards.sandbox import (
    Isolation,
    Sandbox,
    SandboxLimits,
    _level_works,
    _python_layout,
    detect_isolation,
)
from tests.helpers import ROOT

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=5, memory_mb=512, max_processes=8, max_open_files=32)


SYSTEM_PYTHON = "/usr/bin/python3"
# every level with this interpreter, and rlimits with a system interpreter (which, when the
# grader is root, any slot uid can execute: the rlimits level then runs under its own uid)
VARIANTS = [(level, None) for level in Isolation] + [(Isolation.RLIMITS, SYSTEM_PYTHON)]


@pytest.fixture(
    scope="module", params=VARIANTS, ids=lambda v: v[0].value + ("-system-python" if v[1] else "")
)
def sandbox(request):
    level, python = request.param
    if python is not None and not (os.geteuid() == 0 and os.access(python, os.X_OK)):
        pytest.skip("needs root and a system Python")
    if not _level_works(level, _python_layout(python)):
        pytest.skip(f"isolation level {level.value} does not work on this host")
    with Sandbox(LIMITS, isolation=level, python=python, max_workers=2) as sb:
        yield sb


def _marker_processes(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv:
            found.append(int(pid))
    return found


def test_strongest_level_is_detected_and_recorded():
    level = detect_isolation()
    with Sandbox(LIMITS) as sb:
        assert sb.isolation is level
        assert sb.run("print(1)").isolation is level
    if os.access("/usr/bin/bwrap", os.X_OK) and os.geteuid() == 0:
        assert level is Isolation.BWRAP  # root + bubblewrap installed: must not silently degrade


def test_runs_program_with_stdin_and_scrubbed_env(sandbox):
    assert "PYTEST_CURRENT_TEST" in os.environ
    src = "import os, sys\nprint(input()[::-1])\nprint(sorted(os.environ))\nsys.exit(3)"
    result = sandbox.run(src, stdin="olleh\n")
    lines = result.stdout.splitlines()
    assert result.returncode == 3 and not result.ok and lines[0] == "hello"
    assert "PYTEST_CURRENT_TEST" not in lines[1] and "PATH" in lines[1]
    assert result.isolation is sandbox.isolation


def test_rlimits_are_applied(sandbox):
    src = (
        "import resource as r\n"
        "for n in ('AS', 'FSIZE', 'NOFILE', 'CPU', 'CORE', 'NPROC'):\n"
        "    print(n, r.getrlimit(getattr(r, 'RLIMIT_' + n))[1])\n"
    )
    result = sandbox.run(src)
    got = dict(line.split() for line in result.stdout.splitlines())
    assert int(got["AS"]) == 512 << 20
    assert int(got["FSIZE"]) == LIMITS.file_size_mb << 20
    assert int(got["NOFILE"]) == 32
    assert int(got["CPU"]) == 6  # soft 5 s (SIGXCPU), hard 6 s (SIGKILL)
    assert int(got["CORE"]) == 0
    if result.uid_isolated:
        assert int(got["NPROC"]) == 8  # exact when the program runs under its own uid


def test_fresh_working_dir_per_run(sandbox):
    name = f"leftover_{uuid.uuid4().hex}"
    first = sandbox.run(
        f"import os; open('{name}', 'w').write('x'); print(sorted(os.listdir('.')))"
    )
    second = sandbox.run("import os; print(sorted(os.listdir('.')))")
    assert first.ok and name in first.stdout
    assert second.stdout.strip() == "['prog.py']"
    assert not os.path.exists(os.path.join("/tmp", name))


def test_wall_timeout_kills(sandbox):
    limits = SandboxLimits(wall_s=1.0, cpu_s=30)
    with Sandbox(limits, isolation=sandbox.isolation) as sb:
        start = time.monotonic()
        result = sb.run("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert result.timed_out and result.returncode < 0
    assert result.stdout == "started\n"
    assert 0.9 < result.wall_s < 4.0 and time.monotonic() - start < 6.0


def test_output_is_capped(sandbox):
    result = sandbox.run("import sys\nfor _ in range(1000): sys.stdout.write('x' * 10000)")
    assert len(result.stdout) == LIMITS.max_output_bytes


def test_detached_children_die_with_the_run(sandbox):
    marker = f"rlx-marker-{uuid.uuid4().hex}"
    src = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        argv = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
        f"        os.execv(sys.executable, argv + [{marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "print('parent exits')\n"
    )
    result = sandbox.run(src)
    assert result.ok and "parent exits" in result.stdout
    time.sleep(0.2)
    assert _marker_processes(marker) == []


def test_process_count_is_bounded(sandbox):
    if not sandbox.run("pass").uid_isolated:
        pytest.skip("RLIMIT_NPROC counts per uid: exact only when the program has its own uid")
    src = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(n, flush=True)\n"
        "os._exit(0)\n"
    )
    result = sandbox.run(src)
    assert result.ok and 0 < int(result.stdout) < LIMITS.max_processes


def test_host_directories_are_hidden():
    level = detect_isolation()
    if level is Isolation.RLIMITS:
        pytest.skip("no namespace isolation on this host")
    repo = ROOT
    src = (
        "import os\n"
        f"for p in ('/root', '/home', '/work', {repo!r}, '/etc/passwd', '/var'):\n"
        "    try:\n"
        "        print(p, 'visible', os.listdir(p) if os.path.isdir(p) else open(p).read(1))\n"
        "    except OSError as e:\n"
        "        print(p, 'hidden', type(e).__name__)\n"
    )
    with Sandbox(LIMITS) as sb:
        out = sb.run(src).stdout.splitlines()
    assert len(out) == 6 and all(" hidden " in line for line in out), out


def test_run_many_keeps_input_order_and_runs_in_parallel():
    with Sandbox(LIMITS, max_workers=4) as sb:
        # later inputs finish first; serially the sleeps alone would take 4.6 s
        sources = [f"import time; time.sleep({1.0 + 0.1 * (3 - i)}); print({i})" for i in range(4)]
        start = time.monotonic()
        results = sb.run_many(sources)
        elapsed = time.monotonic() - start
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    assert elapsed < 3.0


def test_invalid_limits_and_levels():
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError):
        Sandbox(isolation="chroot")
