"""Fault-tolerant requests to a set of SGLang servers (used by ``SGLangEngine``).

What can go wrong with a server, and what happens then:

- **It dies or refuses connections** (connection error, HTTP 5xx): the request is re-sent to
  another server; the failed one is taken out of rotation unless ``/health`` still answers.
- **It hangs** (no answer within ``request_timeout_s``): the same, the timeout counts as a failure.
- **It serves other weights** (a response's ``weight_version`` is not rlx's, or the request was
  aborted by a weight change): the response is discarded, never returned, and rlx's current
  weights are loaded onto that server again (``restore``: the recorded export, adapter and
  version), then the request is re-sent. A server that keeps changing (``max_resyncs`` re-syncs
  within one call) or cannot be restored is taken out of rotation.

A request gives up after ``max_retries`` failures (exponential backoff from ``backoff_s``); when
no server is left the ``RolloutError`` lists every server with what happened to it and says what
to do. A server out of rotation is probed at the start of each call (``revive``): if it answers
again (restarted, or resumed after a stall) its weights are restored before it serves again.

Each request returns exactly one answer: a retried request's earlier attempt is abandoned (its
connection closed) and never counted, so a batch keyed by ``(prompt, sample)`` loses nothing and
counts nothing twice. A per-server epoch, moved at the start and the end of every restore,
discards answers that overlapped a restore (a sample generated partly with other weights).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import requests

from rlx.rollout.errors import RolloutError

log = logging.getLogger(__name__)

REVIVE_EVERY_S = 30.0  # how often a server out of rotation that does not answer is asked again

_ADVICE = ("What to do: check each server's log; restart a crashed server (rlx takes a server "
           "that answers again back and re-loads its weights); a server that hangs or answers too "
           "slowly needs fewer concurrent requests or a larger "
           "config.rollout.sglang.request_timeout_s; more servers (rollout.sglang.num_servers or "
           "urls) let a run survive the loss of one.")


@dataclasses.dataclass
class Call:
    """One ``generate``/``score`` call: once one of its requests failed for good, the others
    stop."""

    failed: threading.Event = dataclasses.field(default_factory=threading.Event)
    resyncs: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def check(self) -> None:
        if self.failed.is_set():
            raise RolloutError("cancelled: another request of the same call failed")

    def pause(self, seconds: float) -> None:
        """Back off before a retry (returns early when the call has failed)."""
        self.failed.wait(seconds)


class ServerSet:
    """Rotation, health and weight bookkeeping of the servers one engine talks to.

    ``version``: the ``weight_version`` every answer must carry. ``restore(url)``: loads rlx's
    current weights onto one server (None: rlx has loaded none it could reload). ``processes``:
    the launched servers by URL (``alive()``, ``describe()``), for clearer errors.
    """

    def __init__(self, urls: Sequence[str], *, timeout_s: float, max_retries: int,
                 backoff_s: float, max_resyncs: int, processes: Mapping[str, Any] | None = None):
        self.urls = list(urls)
        self.healthy = {u: True for u in self.urls}
        self.faults: dict[str, str] = {}  # the last thing that went wrong, per server
        self.timeout, self.max_retries, self.backoff = timeout_s, max_retries, backoff_s
        self.max_resyncs = max_resyncs
        self.processes = dict(processes or {})
        self.version: str | None = None
        self.restore: Callable[[str], None] | None = None
        self.retries = 0  # requests re-sent after a failure
        self.resyncs = 0  # servers whose weights were re-loaded
        self._epoch = {u: 0 for u in self.urls}  # odd while a restore runs
        self._quiet_until: dict[str, float] = {}  # no /health probe of a silent server before
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()

    # --- rotation -------------------------------------------------------------------------
    def live(self) -> list[str]:
        return [u for u in self.urls if self.healthy[u]]

    def pick(self, avoid: set[str]) -> str:
        """The next live server (round robin), preferring ones not in ``avoid`` and not being
        re-synced; raises when none is live."""
        while True:
            with self._lock:
                live = self.live()
                if not live:
                    raise self.none_left()
                start = next(self._turn)
                order = [live[(start + i) % len(live)] for i in range(len(live))]
                ready = [u for u in order if self._epoch[u] % 2 == 0]
                for url in [u for u in ready if u not in avoid] + ready:
                    return url
            with self._sync_lock:  # every live server is being re-synced: wait for it
                pass

    def none_left(self) -> RolloutError:
        lines = "\n".join(f"  {u}: {self.faults.get(u, 'out of rotation')}" for u in self.urls)
        return RolloutError(f"no SGLang server left to serve rollouts:\n{lines}\n{_ADVICE}")

    def fail(self, url: str, what: str, probe: bool = True) -> None:
        """Record what went wrong with ``url``; it stays in rotation only if ``/health`` still
        answers (``probe``) and its process is not visibly dead or stopped."""
        process = self.processes.get(url)
        detail = process.describe() if process is not None else None
        alive = probe and detail is None and self._answers(url)
        with self._lock:
            self.faults[url] = what + (f"; {detail}" if detail else "")
            was, self.healthy[url] = self.healthy[url], alive
        if was and not alive:
            log.warning("SGLang %s taken out of rotation: %s", url, self.faults[url])

    def _answers(self, url: str) -> bool:
        """Whether ``/health`` answers (SGLang generates one token for it: a second or more)."""
        try:
            return requests.get(f"{url}/health", timeout=min(10.0, self.timeout)).status_code == 200
        except requests.RequestException:
            return False

    def revive(self) -> None:
        """Take back servers out of rotation that answer again, after restoring their weights
        (a server that did not answer is asked again after ``REVIVE_EVERY_S``)."""
        for url in [u for u in self.urls if not self.healthy[u]]:
            process = self.processes.get(url)
            if process is not None and process.describe() is not None:  # exited or stopped
                continue
            if time.monotonic() < self._quiet_until.get(url, 0.0):
                continue
            if not self._answers(url):
                self._quiet_until[url] = time.monotonic() + REVIVE_EVERY_S
                continue
            with self._sync_lock:
                if not self._restored(url):
                    continue
            with self._lock:
                self.healthy[url] = True
            log.warning("SGLang %s answers again: weights re-loaded, back in rotation", url)

    # --- weights --------------------------------------------------------------------------
    def resync(self, url: str, epoch: int, served: str, call: Call) -> None:
        """``url`` answered with weights other than rlx's: restore them once per epoch, at most
        ``max_resyncs`` times per call; otherwise take the server out of rotation."""
        with self._sync_lock:
            if self._epoch[url] != epoch or not self.healthy[url]:
                return  # another request already handled it
            if call.resyncs[url] >= self.max_resyncs:
                self.fail(url, f"still serves weight_version {served!r} instead of rlx's "
                               f"{self.version!r} after {call.resyncs[url]} re-loads: another "
                               "process keeps changing its weights (do not share servers "
                               "between runs)", probe=False)
                return
            call.resyncs[url] += 1
            log.warning("SGLang %s serves weight_version %r, rlx's is %r: re-loading rlx's "
                        "weights there", url, served, self.version)
            if not self._restored(url, served):
                return
            with self._lock:
                self.resyncs += 1

    def _restored(self, url: str, served: str | None = None) -> bool:
        """Load rlx's weights onto ``url`` (epoch odd meanwhile; the caller holds the sync lock);
        False (and out of rotation) when that is impossible or fails."""
        with self._lock:
            self._epoch[url] += 1
        try:
            if self.restore is None:
                raise RolloutError("no way to load rlx's weights is known")
            self.restore(url)
            return True
        except (RolloutError, requests.RequestException) as e:
            what = f"serves weight_version {served!r}, not rlx's {self.version!r}; " if served \
                else ""
            self.fail(url, f"{what}re-loading rlx's weights failed: {e}", probe=False)
            log.warning("SGLang %s: %s", url, self.faults[url])
            return False
        finally:
            with self._lock:
                self._epoch[url] += 1

    def version_on(self, url: str) -> str | None:
        try:
            return str(requests.get(f"{url}/model_info", timeout=min(30.0, self.timeout))
                       .json().get("weight_version"))
        except (requests.RequestException, ValueError):
            return None

    # --- requests -------------------------------------------------------------------------
    def post(self, path: str, payload: dict, call: Call) -> dict:
        """POST a generation request; returns an answer made with rlx's current weights."""
        failures, stale, avoid, errors = 0, 0, set(), []
        while True:
            call.check()
            url = self.pick(avoid)
            epoch = self._epoch[url]
            outcome, value = self._send(url, path, payload)
            if outcome == "ok" and self._epoch[url] == epoch and epoch % 2 == 0:
                return value
            if outcome == "fault":
                failures += 1
                avoid.add(url)
                errors.append(f"{url}: {value}")
                with self._lock:
                    self.retries += 1
                self.fail(url, value)
                if failures > self.max_retries:
                    raise RolloutError(f"SGLang request {path} failed {failures} times: "
                                       f"{'; '.join(errors)}\n{_ADVICE}")
                call.pause(self.backoff * 2 ** (failures - 1))
                continue
            stale += 1  # other weights answered, the request was aborted, or a restore overlapped
            if stale > 2 * self.max_resyncs + 2:
                raise RolloutError(f"SGLang {url}{path}: {stale} answers in a row came from "
                                   f"weights other than rlx's weight_version {self.version!r}")
            if outcome == "stale":
                self.resync(url, epoch, value, call)

    def _send(self, url: str, path: str, payload: dict) -> tuple[str, Any]:
        """("ok", answer) | ("stale", the served version: re-sync) | ("again", why: send again)
        | ("fault", what happened)."""
        try:
            r = requests.post(f"{url}{path}", json=payload, timeout=self.timeout)
            out = r.json() if r.status_code == 200 else None
        except requests.Timeout:
            return "fault", (f"no answer to {path} within {self.timeout:g} s "
                             "(config.rollout.sglang.request_timeout_s)")
        except requests.RequestException as e:
            return "fault", f"{path} failed: {type(e).__name__}"
        except ValueError:
            return "fault", f"{path} answered something that is not JSON: {r.text[:200]!r}"
        if r.status_code >= 500:
            return "fault", f"{path} answered {r.status_code}: {r.text[:200]}"
        if out is None:  # 4xx: a missing adapter (after a restart or an unload), or a bad request
            served = self.version_on(url)
            if served is not None and served != self.version:
                return "stale", served
            if "lora_path" in payload and "lora" in r.text.lower():
                return "stale", f"{served} without rlx's adapter"
            raise RolloutError(f"SGLang {url}{path} refused the request ({r.status_code}): "
                               f"{r.text[:300]}")
        meta = out.get("meta_info", {})
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return "again", "aborted"  # by a weight change: its answer shows which, if any
        served = str(meta.get("weight_version", self.version))
        return ("ok", out) if served == self.version else ("stale", served)

    def broadcast(self, path: str, payload: dict) -> list[dict]:
        """POST to every live server (weight loads); a server that fails is taken out of
        rotation (it is re-synced when it answers again); a refusal raises."""
        out = []
        for url in self.live():
            try:
                r = requests.post(f"{url}{path}", json=payload, timeout=self.timeout)
            except requests.RequestException as e:
                self.fail(url, f"{path} failed: {type(e).__name__}", probe=False)
                continue
            if r.status_code != 200:
                raise RolloutError(f"SGLang {url}{path} answered {r.status_code}: {r.text[:300]}")
            try:
                out.append(r.json())
            except ValueError:  # some admin endpoints answer plain text
                out.append({"text": r.text})
        if not self.live():
            raise self.none_left()
        return out

    def versions(self) -> set[str]:
        """The weight_version each live server reports (a server that does not answer is taken
        out of rotation)."""
        found = set()
        for url in self.live():
            version = self.version_on(url)
            if version is None:
                self.fail(url, "/model_info does not answer", probe=False)
            else:
                found.add(version)
        if not self.live():
            raise self.none_left()
        return found
