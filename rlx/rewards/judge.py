"""LLM-as-a-judge reward: a chat model behind an OpenAI-compatible endpoint grades each completion.

The judge is sent one user message, the rubric template filled with the sample's question
(`{prompt}`), its reference answer (`{reference}`, the sample's `answer`, "" when it has none) and
the completion (`{completion}`); the last match of `score_pattern` in its reply is the raw score,
mapped linearly from `[score_min, score_max]` to [0, 1] (`(s - score_min) / (score_max -
score_min)`). Requests go through the `openai` client (`chat.completions.create`, the API that
openai 2.x and 3.x share) at temperature 0, so a repeated question gets the same verdict: results
are cached in memory, keyed by (model, rubric, prompt, completion, reference), and identical
completions of one batch (a GRPO group often holds some) are judged once.

A batch is judged by `max_concurrency` threads, so at most that many requests are in flight.
Each request has `timeout_s`; a timeout, a lost connection, an HTTP 429 or 5xx, or a reply that
is not the JSON of a chat completion is retried up to `max_retries` times, waiting `backoff_s *
2**attempt` before attempt `attempt + 1`. A verdict without a score in range is not retried
(at temperature 0 the judge would repeat it). A completion whose judging failed gets
`error_score` and the reason: the run goes on. Failures are counted by kind (`timeout`,
`connection`, `http_<status>`, `malformed`, `unparsable`, `out_of_range`, `error`), the first of
each kind is logged with its reason, and `take_metrics()` hands the counts since its last call to
the run's step record (`reward/judge_errors`, `reward/judge_error_rate`, ...).

The judge is only as good as its model: nothing here checks that its verdicts are right.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rlx.errors import ConfigError
from rlx.rewards.base import RewardResult

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = """\
You are grading an answer to a question.

Question:
{prompt}

Reference answer (may be empty):
{reference}

Answer to grade:
{completion}

Rate how correct and complete the answer is, from 0 (wrong or no answer) to 10 (fully correct). \
Give a one-sentence reason, then end with a line of exactly this form, N an integer from 0 to 10:
Score: N"""
# "Score: 7", "score = 7.5", "**Score:** 8/10" (the last match counts)
DEFAULT_PATTERN = r"(?i)score\s*\**\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
PLACEHOLDERS = ("{prompt}", "{completion}", "{reference}")
RETRIED = ("timeout", "connection", "malformed")  # and HTTP 408, 429, 5xx


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """The judge's endpoint, rubric, score format and request policy (``train.reward="judge"``)."""

    base_url: str = ""  # the OpenAI-compatible endpoint, e.g. "http://127.0.0.1:30000/v1"
    model: str = ""  # the model name the endpoint serves (SGLang: its --model-path, or served name)
    api_key_env: str = ""  # environment variable holding the API key ("": none, local servers)
    # the judge's prompt with {prompt}, {completion} and {reference} (other braces stay as they
    # are); "": rlx.rewards.judge.DEFAULT_RUBRIC (0-10, "Score: N" on the last line)
    rubric: str = ""
    rubric_file: str = ""  # read the rubric from this text file instead ("" = none)
    score_pattern: str = DEFAULT_PATTERN  # regex whose group 1 is the score; the last match counts
    score_min: float = 0.0  # the rubric's worst score (reward 0)
    score_max: float = 10.0  # the rubric's best score (reward 1)
    error_score: float = 0.0  # the reward of a completion whose judging failed after retries
    max_concurrency: int = 8  # requests in flight at once
    timeout_s: float = 60.0  # per request
    max_retries: int = 2  # more tries after a timeout, lost connection, HTTP 429/5xx, bad JSON
    backoff_s: float = 1.0  # wait before retry k (k = 0, 1, ...): backoff_s * 2**k
    cache_size: int = 100_000  # verdicts kept in memory, least recently used dropped (0: none)
    max_reply_tokens: int = 256  # the judge's reply length cap (max_tokens of the request)

    def __post_init__(self):
        if self.rubric and self.rubric_file:
            raise ValueError("JudgeConfig.rubric and rubric_file are both set: give the rubric "
                             "text or a file, not both")
        if self.rubric and "{completion}" not in self.rubric:
            raise ValueError("JudgeConfig.rubric must contain {completion} (and may use {prompt}, "
                             "{reference})")
        if not self.score_max > self.score_min:
            raise ValueError(f"JudgeConfig.score_max={self.score_max} must be > score_min="
                             f"{self.score_min}")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as e:
            raise ValueError(f"JudgeConfig.score_pattern is not a regex ({e})") from None
        if groups < 1:
            raise ValueError("JudgeConfig.score_pattern needs a group around the number, e.g. "
                             r"'Score: (\d+)'")
        for name in ("max_concurrency", "max_reply_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"JudgeConfig.{name}={getattr(self, name)} must be >= 1")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.backoff_s < 0 or self.cache_size < 0:
            raise ValueError("JudgeConfig.timeout_s must be > 0, max_retries, backoff_s and "
                             "cache_size >= 0")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One judging outcome: the normalised score, or the failure's kind and reason."""

    score: float | None  # in [0, 1]; None when judging failed
    reason: str  # the judge's reply (shortened) or why it failed
    raw: float | None = None  # the score as the judge wrote it
    error: str = ""  # the failure's kind ("" when it scored)


class _Counts:
    """Thread-safe counters, handed out and reset by ``take``."""

    NAMES = ("scored", "errors", "requests", "retries", "cache_hits")

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)
        self._kinds: collections.Counter[str] = collections.Counter()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._values[name] += n

    def fail(self, kind: str) -> None:
        with self._lock:
            self._kinds[kind] += 1

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            values, kinds = self._values, dict(self._kinds)
            self._values, self._kinds = dict.fromkeys(self.NAMES, 0), collections.Counter()
        return values, kinds


def load_rubric(config: JudgeConfig) -> str:
    """The rubric template: ``rubric``, the text of ``rubric_file``, or ``DEFAULT_RUBRIC``."""
    if not config.rubric_file:
        return config.rubric or DEFAULT_RUBRIC
    try:
        with open(os.path.expanduser(config.rubric_file), encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config.judge.rubric_file={config.rubric_file!r} cannot be read "
                          f"({e.strerror}); point it at a text file with the rubric") from None
    if "{completion}" not in text:
        raise ConfigError(f"config.judge.rubric_file={config.rubric_file!r} has no {{completion}} "
                          "placeholder: the judge would never see the answer")
    return text


def fill_rubric(rubric: str, prompt: str, completion: str, reference: str) -> str:
    """``rubric`` with its three placeholders replaced (in one pass: a completion that contains
    "{reference}" is not filled in again)."""
    values = dict(zip(PLACEHOLDERS, (prompt, completion, reference)))
    return re.sub("|".join(map(re.escape, PLACEHOLDERS)), lambda m: values[m.group(0)], rubric)


def parse_score(text: str, config: JudgeConfig) -> Verdict:
    """The verdict in the judge's reply ``text``: the last ``score_pattern`` match, normalised."""
    matches = list(re.finditer(config.score_pattern, text))
    shown = " ".join(text.split())[:200]
    if not matches:
        return Verdict(None, f"no score in the judge's reply: {shown!r}", error="unparsable")
    try:
        raw = float(matches[-1].group(1))
    except (TypeError, ValueError):
        return Verdict(None, f"score {matches[-1].group(1)!r} is not a number", error="unparsable")
    if not config.score_min <= raw <= config.score_max:
        return Verdict(None, f"score {raw:g} outside [{config.score_min:g}, {config.score_max:g}]",
                       raw=raw, error="out_of_range")
    score = (raw - config.score_min) / (config.score_max - config.score_min)
    return Verdict(score, f"judge {raw:g}: {shown}", raw=raw)


def cache_key(model: str, rubric: str, prompt: str, completion: str, reference: str) -> str:
    """SHA-256 of the five inputs that decide a verdict at temperature 0."""
    text = json.dumps([model, rubric, prompt, completion, reference], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def classify(exc: BaseException) -> tuple[str, bool]:
    """(the failure's kind, whether to retry) of an exception raised by a request."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "timeout", True
    if isinstance(exc, openai.APIConnectionError):
        return "connection", True
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        return f"http_{status}", status in (408, 429) or status >= 500
    if isinstance(exc, (ValueError, openai.APIResponseValidationError)):  # JSONDecodeError too
        return "malformed", True
    return "error", False


def reply_text(response: Any) -> str | None:
    """The first choice's message text of a chat completion, or None when the reply lacks one."""
    choices = getattr(response, "choices", None)
    if not choices:
        return None
    content = getattr(getattr(choices[0], "message", None), "content", None)
    return content if isinstance(content, str) else None


def _api_key(config: JudgeConfig) -> str:
    """The key from ``api_key_env``; a placeholder when none is named (local servers take any)."""
    if not config.api_key_env:
        return "EMPTY"
    key = os.environ.get(config.api_key_env, "")
    if not key:
        raise ConfigError(f"config.judge.api_key_env={config.api_key_env!r} names an environment "
                          "variable that is not set: export it, or leave api_key_env empty for a "
                          "server that takes no key")
    return key


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _outcome(future: concurrent.futures.Future) -> Verdict:
    try:
        return future.result()
    except Exception as exc:  # a fault of the judging itself must not end the run either
        return Verdict(None, f"judging raised {_one_line(exc)}", error="error")


class JudgeReward:
    """Grades completions with an LLM judge behind an OpenAI-compatible endpoint (see the module
    docstring); ``take_metrics()`` hands its counts to the run's step record."""

    def __init__(self, config: JudgeConfig | None = None, **overrides: Any):
        import openai

        self.config = cfg = dataclasses.replace(config or JudgeConfig(), **overrides)
        if not (cfg.base_url and cfg.model):
            raise ConfigError(f"config.judge.base_url={cfg.base_url!r} and config.judge.model="
                              f"{cfg.model!r}: train.reward='judge' needs both, the endpoint "
                              "(e.g. 'http://127.0.0.1:30000/v1') and the model it serves")
        self.rubric = load_rubric(cfg)
        self._client = openai.OpenAI(base_url=cfg.base_url, api_key=_api_key(cfg),
                                     timeout=cfg.timeout_s, max_retries=0)
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.max_concurrency, "judge")
        self._cache: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
        self._lock = threading.Lock()  # the cache and the kinds already logged
        self._logged: set[str] = set()
        self._counts = _Counts()

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        return self.batch([completion], [sample])[0]

    def batch(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        items = [self._item(c, s) for c, s in zip(completions, samples)]
        verdicts: dict[str, Verdict] = {}
        todo: dict[str, str] = {}  # key -> the judge's message, each once
        for key, message in items:
            if key not in verdicts and key not in todo:
                cached = self._cached(key)
                if cached is None:
                    todo[key] = message
                else:
                    verdicts[key] = cached
        futures = {key: self._pool.submit(self._judge, message) for key, message in todo.items()}
        for key, future in futures.items():
            verdicts[key] = _outcome(future)
            self._keep(key, verdicts[key])
        results = [self._result(verdicts[key], key in todo) for key, _ in items]
        failed = [verdicts[key].error for key, _ in items if verdicts[key].error]
        self._counts.add(scored=len(items), errors=len(failed), cache_hits=len(items) - len(todo))
        for kind in failed:
            self._counts.fail(kind)
        return results

    def take_metrics(self) -> dict[str, float]:
        """Counts since the last call (evaluation's judging included), for the step record:
        ``reward/judge_scored`` completions, ``_errors`` of them given ``error_score``,
        ``_error_rate``, ``_requests`` sent (retries included), ``_retries``, ``_cache_hits``
        (completions judged without a request), ``reward/judge_errors/<kind>``."""
        values, kinds = self._counts.take()
        out = {f"reward/judge_{name}": float(n) for name, n in values.items()}
        out["reward/judge_error_rate"] = values["errors"] / max(values["scored"], 1)
        out.update({f"reward/judge_errors/{kind}": float(n) for kind, n in sorted(kinds.items())})
        return out

    def _item(self, completion: Any, sample: Mapping[str, Any]) -> tuple[str, str]:
        """(cache key, the judge's message) of one completion."""
        prompt, text = str(sample.get("prompt", "") or ""), str(completion)
        reference = sample.get("answer")
        reference = "" if reference is None else str(reference)
        key = cache_key(self.config.model, self.rubric, prompt, text, reference)
        return key, fill_rubric(self.rubric, prompt, text, reference)

    def _cached(self, key: str) -> Verdict | None:
        with self._lock:
            verdict = self._cache.get(key)
            if verdict is not None:
                self._cache.move_to_end(key)
            return verdict

    def _keep(self, key: str, verdict: Verdict) -> None:
        """Caches a verdict with a score (a failure is asked again next time); logs the first
        failure of each kind with its reason."""
        size = self.config.cache_size
        with self._lock:
            if not verdict.error:
                if size:
                    self._cache[key] = verdict
                    while len(self._cache) > size:
                        self._cache.popitem(last=False)
                return
            if verdict.error in self._logged:
                return
            self._logged.add(verdict.error)
        log.warning("judge reward: %s (%s); scored %g, further %r failures are only counted "
                        "(reward/judge_errors)", verdict.error, verdict.reason,
                        self.config.error_score, verdict.error)

    def _result(self, verdict: Verdict, requested: bool) -> RewardResult:
        extra: dict[str, Any] = {"cached": not requested}
        if verdict.raw is not None:
            extra["judge_score"] = verdict.raw
        if verdict.error:
            extra["judge_error"] = verdict.error
            return RewardResult(self.config.error_score, verdict.reason, extra)
        return RewardResult(float(verdict.score), verdict.reason, extra)

    def _judge(self, message: str) -> Verdict:
        """One completion's verdict, retrying what may pass on another try; never raises."""
        cfg = self.config
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self._counts.add(retries=1)
                time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            self._counts.add(requests=1)
            text, kind, reason, retry = self._request(message)
            if text is not None:
                return parse_score(text, cfg)
            if not retry:
                break
        tries = f"{attempt + 1} {'try' if attempt == 0 else 'tries'}"
        return Verdict(None, f"judge failed ({kind}) after {tries}: {reason}", error=kind)

    def _request(self, message: str) -> tuple[str | None, str, str, bool]:
        """(the reply's text, or None with the failure's kind, reason and whether to retry)."""
        try:
            response = self._client.chat.completions.create(
                model=self.config.model, messages=[{"role": "user", "content": message}],
                temperature=0.0, max_tokens=self.config.max_reply_tokens)
        except Exception as exc:  # every failure of a request is a counted reward error
            kind, retry = classify(exc)
            return None, kind, _one_line(exc), retry
        text = reply_text(response)
        if text is None:
            return None, "malformed", "the reply holds no choices[0].message.content", True
        return text, "", "", False

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> JudgeReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
