"""Math reward: extract the final answer from a completion and grade it with math-verify.

Extraction (pure Python, in the calling process) tries the configured methods in order and uses
the first that finds something:
- "boxed": the last complete `\\boxed{...}` / `\\fbox{...}` (nested braces allowed);
- "hash": the text after the last `####` (GSM8K style);
- "answer_is": the last "the (final) answer is X" / "Answer: X", up to the end of the line or
  sentence, with surrounding `$` removed.
The gold answer is taken the same way when it contains `\\boxed` or `####`, else used whole.

Grading runs math-verify's `parse` + `verify` (fraction/decimal/percentage equivalence,
sets, intervals, matrices, symbolic expressions) in worker processes, never in the caller:
sympy can run for minutes, and math-verify's own timeout is `signal.alarm`, which only works on
a main thread. Each worker is a spawned process running grading on its main thread with one
`setitimer` deadline for the whole parse+verify (math-verify's timeouts are disabled); if a
worker does not answer within `hard_timeout_s` (a computation that ignores signals) it is killed
and replaced. So grading works from any thread and a grade never takes much over its timeout.

Bad completions (not a string, empty, too long, invalid unicode, no answer) score 0 with a
reason; only a missing gold answer in the sample (a data bug) raises.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import connection
from typing import Any

from rlx.rewards.base import RewardResult

EXTRACTORS = ("boxed", "hash", "answer_is")  # the default order
# "last_number": the last number in the text (the GSM8K convention), opt-in for plain-number tasks
KNOWN_EXTRACTORS = EXTRACTORS + ("last_number",)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_BOX_START = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
_HASH = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(
    r"(?:\bthe\s+(?:final\s+)?answer\s+is|\b(?:final\s+)?answer\s*:)\s*:?\s*([^\n]*)", re.IGNORECASE
)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")


@dataclasses.dataclass(frozen=True)
class MathConfig:
    """Options of the math reward."""

    answer_key: str = "answer"  # sample field holding the gold answer
    extractors: tuple[str, ...] = EXTRACTORS  # extraction methods, in priority order
    timeout_s: float = 5.0  # deadline for one grading (parse gold + parse answer + verify)
    hard_timeout_s: float | None = (
        None  # kill an unresponsive worker after this; default timeout_s + 5
    )
    workers: int = 2  # grading processes (started on first use)
    max_completion_chars: int = 100_000  # longer completions score 0
    max_answer_chars: int = 1_000  # longer extracted answers score 0 (protects sympy)
    float_rounding: int = 6  # math-verify: decimals kept when comparing floats
    strict: bool = True  # math-verify: variables must match, sets != tuples

    def __post_init__(self):
        unknown = set(self.extractors) - set(KNOWN_EXTRACTORS)
        if unknown or not self.extractors:
            raise ValueError(f"MathConfig.extractors must be a non-empty subset of {KNOWN_EXTRACTORS}")
        if self.timeout_s <= 0 or self.workers < 1:
            raise ValueError("MathConfig needs timeout_s > 0 and workers >= 1")
        if self.hard_timeout_s is not None and self.hard_timeout_s <= 0:
            raise ValueError("MathConfig.hard_timeout_s must be > 0")


@dataclasses.dataclass(frozen=True)
class Extraction:
    """An extracted answer and the method that found it."""

    answer: str
    method: str


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each "{" -> index of its matching "}" (backslash-escaped characters skipped);
    one linear pass, so many unclosed \\boxed{ cannot make extraction quadratic."""
    pairs, stack = {}, []
    for m in _BRACE_TOKEN.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif m.group() == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} or \\fbox{...} (or `\\boxed 5`)."""
    starts = [m.end() for m in _BOX_START.finditer(text)]
    pairs = _brace_pairs(text) if starts else {}
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            if start in pairs:
                return text[start + 1 : pairs[start]]
        elif start < len(text):
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                return token.group(0)
    return None


def _clean(answer: str) -> str:
    answer = answer.strip()
    if answer.count("$") >= 2:
        answer = answer.split("$")[1]
    answer = answer.strip().strip("$").strip()
    return answer.rstrip(".").strip()


def _after_answer_is(text: str) -> str | None:
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    tail = matches[-1].group(1)
    if tail.count("$") < 2:
        end = _SENTENCE_END.search(tail)
        tail = tail[: end.start()] if end else tail
    return tail


def extract_answer(text: str, methods: Sequence[str] = EXTRACTORS) -> Extraction | None:
    """The final answer in `text` by the first method (in order) that finds one, or None."""
    for method in methods:
        if method == "boxed":
            raw = _last_boxed(text)
        elif method == "hash":
            found = _HASH.findall(text)
            raw = found[-1] if found else None
        elif method == "answer_is":
            raw = _after_answer_is(text)
        elif method == "last_number":
            found = _NUMBER.findall(text)
            raw = found[-1].replace(",", "") if found else None
        else:
            raise ValueError(f"unknown extraction method {method!r}")
        if raw is not None and _clean(raw):
            return Extraction(answer=_clean(raw), method=method)
    return None


def _gold_answer(gold: Any) -> str:
    text = str(gold)
    if "\\boxed" in text or "\\fbox" in text or "####" in text:
        found = extract_answer(text, ("boxed", "hash"))
        if found is not None:
            return found.answer
    return _clean(text)


class _Deadline(BaseException):
    """Raised in a worker when a grading's time is up (not an Exception: math-verify and sympy
    catch those)."""


def _grade(
    answer: str, gold: str, timeout_s: float, rounding: int, strict: bool
) -> tuple[bool, str]:
    """Runs in a worker process, on its main thread."""
    import signal

    from math_verify import parse, verify

    def on_alarm(signum, frame):
        raise _Deadline()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        if not gold_parsed:
            return False, "gold answer unparsable"
        parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
        if not parsed:
            return False, "answer unparsable"
        ok = verify(
            gold_parsed, parsed, float_rounding=rounding, strict=strict, timeout_seconds=None
        )
        if ok:
            return True, "correct"
        only_text = all(isinstance(p, str) for p in parsed)  # math-verify's raw-string fallback
        return False, "answer unparsable" if only_text else "wrong answer"
    except _Deadline:
        return False, f"grading timed out after {timeout_s:g}s"
    except Exception as exc:  # a sympy bug must not take the worker down
        return False, f"grading error: {type(exc).__name__}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _serve(fd: int) -> None:
    """Worker process main loop: answers `(answer, gold, timeout_s, rounding, strict)` requests
    arriving on the socket `fd` until the grader closes it (or exits: the socket then closes).
    SIGINT and SIGTERM are ignored: a Ctrl-C in the terminal (sent to the whole process group)
    or a job manager's SIGTERM reaches the grader too, which finishes grading its step and then
    stops the workers; a worker killed mid-grading would score that answer 0."""
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notices
    os.dup2(2, 1)  # stray prints must not reach the grader
    conn = connection.Connection(fd)
    import math_verify  # noqa: F401  - import (sympy too) before saying ready: start-up is not
    # part of any grading's deadline
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = _grade(*task)
        except BaseException as exc:  # a deadline that fired while leaving `_grade`
            result = (False, f"grading error: {type(exc).__name__}")
        conn.send(result)


_STARTUP_S = 300.0  # a fresh worker's import time (python + sympy), outside grading deadlines


class _Worker:
    """One grading process (a fresh interpreter: no fork of a threaded grader, and unlike
    multiprocessing's spawn it does not re-run the caller's __main__ module)."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        root = str(pathlib.Path(__file__).resolve().parents[2])
        code = (
            f"import sys; sys.path.insert(0, {root!r}); "
            f"from rlx.rewards.math import _serve; _serve({theirs.fileno()})"
        )
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL
            )
        self.conn = connection.Connection(ours.detach())
        if not (self.conn.poll(_STARTUP_S) and self.conn.recv() == "ready"):
            self.kill()
            raise RuntimeError(f"math grading worker did not start within {_STARTUP_S:.0f} s")

    def call(self, task: tuple, deadline_s: float) -> tuple[bool, str] | None:
        """The worker's answer, or None if it did not answer in time or died."""
        try:
            self.conn.send(task)
            if self.conn.poll(deadline_s):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class _WorkerPool:
    """Up to `size` grading processes, started on demand; a stuck one is killed and replaced."""

    def __init__(self, size: int):
        self._size = size
        self._idle: list[_Worker] = []
        self._alive = 0
        self._cond = threading.Condition()

    def call(self, task: tuple, deadline_s: float) -> tuple[bool, str] | None:
        worker = self._acquire()
        result = worker.call(task, deadline_s)
        if result is None:
            worker.kill()
        with self._cond:
            if result is None:
                self._alive -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()
        return result

    def _acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and self._alive >= self._size:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._alive += 1
        try:
            return _Worker()
        except BaseException:
            with self._cond:
                self._alive -= 1
                self._cond.notify()
            raise

    def close(self) -> None:
        with self._cond:
            workers, self._idle = self._idle, []
            self._alive -= len(workers)
        for w in workers:
            w.kill()


def _reject(completion: Any, max_chars: int) -> tuple[str | None, str]:
    """(usable text, "") or (None, reason it scores 0)."""
    if isinstance(completion, bytes):
        try:
            completion = completion.decode("utf-8")
        except UnicodeDecodeError:
            return None, "completion is not valid UTF-8"
    if not isinstance(completion, str):
        return None, f"completion is a {type(completion).__name__}, not a string"
    if not completion.strip():
        return None, "empty completion"
    if len(completion) > max_chars:
        return None, f"completion longer than {max_chars} characters"
    try:
        completion.encode("utf-8")
    except UnicodeEncodeError:
        return None, "completion is not valid unicode"
    return completion, ""


class MathReward:
    """1.0 when the extracted final answer equals the sample's gold answer, else 0.0.

    `extra` holds the extracted `answer` and the extraction `method`. Grading happens in worker
    processes (see the module docstring); call `close()` (or use `with`) to stop them.
    """

    def __init__(self, config: MathConfig | None = None, **overrides: Any):
        self.config = dataclasses.replace(config or MathConfig(), **overrides)
        self._pool = _WorkerPool(self.config.workers)
        self._threads: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        cfg = self.config
        if cfg.answer_key not in sample or sample[cfg.answer_key] is None:
            raise ValueError(f"sample has no gold answer under {cfg.answer_key!r}")
        gold = _gold_answer(sample[cfg.answer_key])
        text, reason = _reject(completion, cfg.max_completion_chars)
        if text is None:
            return RewardResult.zero(reason)
        found = extract_answer(text, cfg.extractors)
        if found is None:
            return RewardResult.zero("no answer found")
        extra = {"answer": found.answer, "method": found.method}
        if len(found.answer) > cfg.max_answer_chars:
            return RewardResult.zero(
                f"answer longer than {cfg.max_answer_chars} characters", **extra
            )
        hard = cfg.hard_timeout_s if cfg.hard_timeout_s is not None else cfg.timeout_s + 5.0
        task = (found.answer, gold, cfg.timeout_s, cfg.float_rounding, cfg.strict)
        out = self._pool.call(task, hard)
        if out is None:
            return RewardResult.zero(f"grading timed out; worker killed after {hard:g}s", **extra)
        ok, reason = out
        return RewardResult(score=float(ok), reason=reason, extra=extra)

    def batch(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.config.workers, "rlx-math")
        return list(self._threads.map(self, completions, samples))

    def close(self) -> None:
        with self._lock:
            if self._threads is not None:
                self._threads.shutdown(wait=True)
                self._threads = None
        self._pool.close()

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FormatReward:
    """1.0 when the completion states a final answer the math reward can extract and, if
    `pattern` is given, the whole completion matches it (e.g. r"<think>.*</think>.*")."""

    def __init__(
        self,
        pattern: str | None = None,
        extractors: Sequence[str] = EXTRACTORS,
        max_completion_chars: int = 100_000,
    ):
        self._pattern = re.compile(pattern, re.DOTALL) if pattern is not None else None
        self._extractors = tuple(extractors)
        self._max_chars = max_completion_chars
        MathConfig(extractors=self._extractors)  # validates the method names

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        text, reason = _reject(completion, self._max_chars)
        if text is None:
            return RewardResult.zero(reason)
        if self._pattern is not None and not self._pattern.fullmatch(text):
            return RewardResult.zero("does not match the required format")
        found = extract_answer(text, self._extractors)
        if found is None:
            return RewardResult.zero("no answer found")
        return RewardResult(score=1.0, reason="well formatted", extra={"method": found.method})
