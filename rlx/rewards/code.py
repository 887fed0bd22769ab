"""Code reward: run a completion's program against unit tests inside the sandbox.

Two sample formats are understood (keys of the ground-truth mapping):
- assert tests: `tests` (a list of Python statements, usually `assert f(x) == y`) and optional
  `setup` (code run before the solution, e.g. imports);
- HumanEval: `prompt`, `test` (defines `check(candidate)`) and `entry_point`. The program is the
  prompt followed by the completion (a function body continuing the prompt), or, when the
  extracted code defines the entry point itself, the prompt followed by that code; then the
  test code and `check(<entry_point>)`, as in the HumanEval paper's harness.

The score is the fraction of tests passed (`mode="fraction"`) or 1/0 (`mode="all"`); a HumanEval
sample is a single test. All tests of one completion run in one sandboxed process: a small
harness executes the solution (its `__name__` is "solution", so `if __name__ == "__main__":`
blocks do not run; `SystemExit` from it is ignored), then each test with its own timer, and
writes one line per test tagged with a per-run random nonce to a private copy of stdout, so a
solution that exits early or prints fake results scores 0. The harness resists accidents and
naive reward hacks, not a program that searches the interpreter's memory for the nonce.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rlx.rewards.base import RewardResult
from rlx.rewards.sandbox import Sandbox, SandboxLimits, SandboxResult

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}

_HARNESS = r"""
import io, json, os, signal, sys


class _TestTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _TestTimeout("test timed out")


def _describe(exc):
    try:
        return (type(exc).__name__ + ": " + str(exc))[:300]
    except BaseException:
        return type(exc).__name__


def _run(code, name, namespace, seconds):
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        exec(compile(code, name, "exec"), namespace)
        return True, ""
    except SystemExit as exc:
        return name == "solution.py", _describe(exc)
    except BaseException as exc:
        return False, _describe(exc)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _main():
    spec = json.loads(sys.stdin.read())
    report = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    nonce, seconds = spec["nonce"], spec["timeout"]

    def emit(index, ok, message):
        os.write(report, (json.dumps([nonce, index, ok, message]) + "\n").encode())

    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    emit(-1, *_run(spec["program"], "solution.py", namespace, seconds))
    for index, test in enumerate(spec["tests"]):
        emit(index, *_run(test, "test_%d" % index, namespace, seconds))


_main()
"""


@dataclasses.dataclass(frozen=True)
class CodeConfig:
    """How completions are turned into programs and scored."""

    mode: Literal["fraction", "all"] = "fraction"  # partial credit, or 1 only if every test passes
    test_timeout_s: float = 5.0  # per test (and for running the solution itself)
    limits: SandboxLimits = SandboxLimits(wall_s=30.0, cpu_s=30)  # whole program, all tests
    isolation: str | None = None  # force "bwrap" / "unshare" / "rlimits"; None = strongest
    python: str | None = None  # interpreter that runs the programs; None = this one
    max_workers: int | None = None  # parallel sandboxes in `batch`
    max_completion_chars: int = 100_000  # longer completions score 0 without running

    def __post_init__(self):
        if self.mode not in ("fraction", "all"):
            raise ValueError(f"CodeConfig.mode must be 'fraction' or 'all', got {self.mode!r}")
        if self.test_timeout_s <= 0:
            raise ValueError("CodeConfig.test_timeout_s must be > 0")


@dataclasses.dataclass(frozen=True)
class _Job:
    """One completion made ready to run: the program, its tests, or why it cannot run."""

    program: str = ""
    tests: tuple[str, ...] = ()
    error: str = ""


def extract_code(completion: str) -> str:
    """The last ```python (or untagged) fenced block; the whole text when there is none.

    An unterminated final fence (a truncated completion) counts as a block up to the end.
    """
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(completion)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python:
        return python[-1]
    untagged = [body for tag, body in blocks if tag == ""]
    return untagged[-1] if untagged else completion


def _humaneval_job(completion: str, sample: Mapping[str, Any]) -> _Job:
    prompt, entry = str(sample["prompt"]), str(sample["entry_point"])
    code = extract_code(completion)
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        body = prompt + "\n" + code
    else:
        body = prompt + code
    return _Job(program=body + "\n\n" + str(sample["test"]) + "\n", tests=(f"check({entry})",))


def _assert_job(completion: str, sample: Mapping[str, Any]) -> _Job:
    tests = sample["tests"]
    if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
        raise ValueError("sample['tests'] must be a list of Python statements")
    setup = str(sample.get("setup", "") or "")
    return _Job(program=setup + "\n" + extract_code(completion), tests=tuple(tests))


def _make_job(completion: Any, sample: Mapping[str, Any], cfg: CodeConfig) -> _Job:
    """Raises only for malformed samples (a data bug); bad completions become `_Job.error`."""
    if "entry_point" in sample and "test" in sample and "prompt" in sample:
        build = _humaneval_job
    elif "tests" in sample:
        build = _assert_job
    else:
        raise ValueError("code sample needs 'tests' or HumanEval 'prompt'/'test'/'entry_point'")
    if not isinstance(completion, str):
        return _Job(error="completion is not a string")
    if len(completion) > cfg.max_completion_chars:
        return _Job(error=f"completion longer than {cfg.max_completion_chars} characters")
    try:
        completion.encode("utf-8")
    except UnicodeEncodeError:
        return _Job(error="completion is not valid unicode")
    job = build(completion, sample)
    if not job.tests:
        raise ValueError("code sample has no tests")
    return job if extract_code(completion).strip() else _Job(error="no code found")


def _parse_report(stdout: str, nonce: str, n_tests: int) -> tuple[dict[int, tuple[bool, str]], str]:
    outcomes: dict[int, tuple[bool, str]] = {}
    solution_error = ""
    for line in stdout.splitlines():
        try:
            tag, index, ok, message = json.loads(line)
        except (ValueError, TypeError):
            continue
        if tag != nonce or not isinstance(index, int) or index in outcomes:
            continue
        if index == -1:
            solution_error = "" if ok else str(message)
        elif 0 <= index < n_tests:
            outcomes[index] = (ok is True, str(message))
    return outcomes, solution_error


def _score(job: _Job, nonce: str, run: SandboxResult, cfg: CodeConfig) -> RewardResult:
    outcomes, solution_error = _parse_report(run.stdout, nonce, len(job.tests))
    total = len(job.tests)
    passed = sum(ok for ok, _ in outcomes.values())
    score = passed / total if cfg.mode == "fraction" else float(passed == total)
    failures = [f"test {i}: {msg}" for i, (ok, msg) in sorted(outcomes.items()) if not ok]
    if run.timed_out:
        reason = f"{passed}/{total} tests passed; killed after {cfg.limits.wall_s:g}s"
    elif solution_error:
        reason = f"{passed}/{total} tests passed; solution raised {solution_error}"
    elif len(outcomes) < total:
        reason = f"{passed}/{total} tests passed; exited with code {run.returncode} early"
    else:
        reason = f"{passed}/{total} tests passed" + (f"; {failures[0]}" if failures else "")
    extra = {
        "passed": passed,
        "total": total,
        "isolation": run.isolation.value,
        "timed_out": run.timed_out,
        "returncode": run.returncode,
    }
    return RewardResult(score=score, reason=reason, extra=extra)


class CodeReward:
    """Runs completions against the sample's unit tests in a `Sandbox`."""

    def __init__(self, config: CodeConfig | None = None, **overrides: Any):
        self.config = dataclasses.replace(config or CodeConfig(), **overrides)
        cfg = self.config
        self.sandbox = Sandbox(cfg.limits, cfg.isolation, cfg.python, cfg.max_workers)

    @property
    def isolation(self) -> str:
        return self.sandbox.isolation.value

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        return self.batch([completion], [sample])[0]

    def batch(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        jobs = [_make_job(c, s, self.config) for c, s in zip(completions, samples)]
        runnable = [i for i, job in enumerate(jobs) if not job.error]
        nonces = {i: secrets.token_hex(16) for i in runnable}
        stdins = [self._spec(jobs[i], nonces[i]) for i in runnable]
        runs = dict(zip(runnable, self.sandbox.run_many([_HARNESS] * len(runnable), stdins)))
        return [
            _score(job, nonces[i], runs[i], self.config)
            if i in runs
            else RewardResult.zero(job.error, passed=0, total=len(job.tests))
            for i, job in enumerate(jobs)
        ]

    def _spec(self, job: _Job, nonce: str) -> str:
        spec = {
            "nonce": nonce,
            "timeout": self.config.test_timeout_s,
            "program": job.program,
            "tests": list(job.tests),
        }
        return json.dumps(spec)

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self) -> CodeReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
