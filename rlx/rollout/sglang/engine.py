"""Rollouts from SGLang servers through the native ``/generate`` API.

Requests go out concurrently (a thread pool; one HTTP request per sample) and are dispatched
round-robin over the servers in rotation (``rlx.rollout.dispatch``: a dead, hung or
failing server's requests are re-sent to another with exponential backoff, an answer made with
other weights than rlx's is discarded and that server re-synced, and a ``RolloutError`` naming
every server and what happened to it is raised when none is left). Results are keyed by
``(prompt, sample)``: each sample is one request with exactly one answer, so nothing is dropped
or counted twice.

Weight sync: LoRA mode hot-loads a PEFT adapter exported by rlx under a new name per policy version
(``/load_lora_adapter``) and unloads the previous one (an unloaded name can silently come back from
its old path, so names are never reused); full mode reloads full weights from an rlx export
(``/update_weights_from_disk``) or takes them in memory (``load_tensors``, a weight-update session
of ``/update_weights_from_tensor`` calls: ``rlx.rollout.sglang.tensors``). The engine records what
it loaded (the full weights or base from disk, how to send the weights in memory again, the
adapter, the version) so that a server that restarted or had its weights changed by
someone else can be given rlx's weights again (``_restore``). Every answer's ``weight_version``
is checked before it becomes a rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import requests

from rlx.rollout.errors import RolloutError
from rlx.rollout.dispatch import Call, ServerSet
from rlx.types import Prompt, Rollout, SamplingParams


class SGLangEngine:
    """Client for one or more SGLang servers (attach by URL, or pass ``SGLangServer.url``s;
    ``processes`` maps the URLs of launched servers to their ``SGLangServer`` for clearer
    errors)."""

    def __init__(self, urls: Sequence[str], *, request_timeout_s: float = 600.0,
                 max_retries: int = 4, concurrency: int = 64, backoff_s: float = 0.5,
                 max_resyncs: int = 2, weight_version: int | None = None,
                 processes: Mapping[str, Any] | None = None):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.servers = ServerSet(self.urls, timeout_s=request_timeout_s, max_retries=max_retries,
                                 backoff_s=backoff_s, max_resyncs=max_resyncs,
                                 processes={u.rstrip("/"): p for u, p in (processes or {}).items()})
        self.timeout = request_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=concurrency)
        self.adapter: str | None = None  # name of the loaded LoRA adapter (LoRA mode)
        self._adapter_path: str | None = None
        self._disk_path: str | None = None  # full weights (full mode) or the base (LoRA mode) served
        # full weights sent in memory: () -> (payloads, version, tp_size) of the current policy
        self.reload: Callable[[], tuple[Iterable[str], int, int]] | None = None
        self.servers.version = (self._set_version(str(weight_version))
                                if weight_version is not None else self._server_version())
        self.servers.restore = self._restore

    @property
    def weight_version(self) -> str:
        return self.servers.version

    @property
    def healthy(self) -> dict[str, bool]:
        return self.servers.healthy

    @property
    def retries(self) -> int:
        """Requests re-sent after a failure (a metric)."""
        return self.servers.retries

    @property
    def resyncs(self) -> int:
        """Servers given rlx's weights again after serving other ones (a metric)."""
        return self.servers.resyncs

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Rollout]:
        jobs = [(p, j) for p in prompts for j in range(sampling.n)]
        return self._map(lambda call, p, j: self._one(p, j, sampling, call), jobs)

    def _map(self, fn: Callable, jobs: Sequence[tuple]) -> list:
        """``fn(call, *job)`` for every job concurrently, results in job order; the first
        failure stops the others and is raised."""
        self.servers.revive()
        call = Call()
        futures = [self.pool.submit(fn, call, *job) for job in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            call.failed.set()
            for f in futures:
                f.cancel()
            raise

    def _one(self, prompt: Prompt, j: int, sampling: SamplingParams, call: Call) -> Rollout:
        payload = {"input_ids": [int(t) for t in prompt.token_ids], "return_logprob": True,
                   "sampling_params": sampling_payload(sampling, j)}
        if self.adapter is not None:
            payload["lora_path"] = self.adapter
        out = self.servers.post("/generate", payload, call)  # made with rlx's weight_version
        return self._to_rollout(prompt, j, out)

    def _to_rollout(self, prompt: Prompt, j: int, out: dict) -> Rollout:
        meta = out.get("meta_info", {})
        entries = meta.get("output_token_logprobs") or []
        version = str(meta.get("weight_version", self.weight_version))
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        return Rollout(
            prompt_uid=prompt.uid, prompt_ids=np.asarray(prompt.token_ids, np.int32),
            completion_ids=np.asarray([e[1] for e in entries], np.int32),
            sampler_logp=np.asarray([e[0] for e in entries], np.float32),
            finish_reason="length" if finish == "length" else "stop",
            weight_version=_version_number(version), sample_index=j)

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        """Log-probs SGLang assigns to the tokens after each prompt (teacher-forced)."""
        jobs = [([int(t) for t in ids], int(p)) for ids, p in sequences]
        return self._map(self._score_one, jobs)

    def _score_one(self, call: Call, ids: list[int], prompt_len: int) -> np.ndarray:
        payload = {"input_ids": ids, "return_logprob": True, "logprob_start_len": prompt_len - 1,
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        if self.adapter is not None:
            payload["lora_path"] = self.adapter
        meta = self.servers.post("/generate", payload, call)["meta_info"]
        entries = meta["input_token_logprobs"]  # first entry is the prompt's last token (no logp)
        return np.asarray([e[0] for e in entries[1:]], np.float32)

    # --- weights --------------------------------------------------------------------------
    def record_served(self, path: str) -> None:
        """The weights (full mode) or base (LoRA mode) the servers were launched from, at ``path``:
        what a re-sync loads first."""
        self._disk_path = path

    def load_adapter(self, path: str, version: int) -> None:
        """LoRA mode: hot-load the PEFT adapter at ``path`` as policy ``version``; unload the old one."""
        name = f"policy-{version}"
        self.servers.broadcast("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        old, self.adapter, self._adapter_path = self.adapter, name, path
        if old is not None and old != name:
            self.servers.broadcast("/unload_lora_adapter", {"lora_name": old})
        self.servers.version = self._set_version(str(version))

    def loaded_adapters(self) -> dict[str, set[str]]:
        """LoRA adapter names each server in rotation holds (from its /v1/models listing)."""
        out = {}
        for url in self.servers.live():
            cards = requests.get(f"{url}/v1/models", timeout=30).json().get("data", [])
            out[url] = {c["id"] for c in cards if c.get("parent")}
        return out

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Full mode: reload full weights from an rlx HF export at ``path``."""
        for res in self.servers.broadcast("/update_weights_from_disk",
                                          {"model_path": path, "weight_version": str(version)}):
            if not res.get("success", False):
                raise RolloutError(f"SGLang refused the weights at {path}: {res.get('message')}")
        self._disk_path = path
        self.servers.broadcast("/flush_cache", {})
        self.servers.version = self._server_version()
        if self.weight_version != str(version):
            raise RolloutError(f"after loading {path}, SGLang reports weight_version "
                               f"{self.weight_version!r}, expected {version!r}")

    def load_tensors(self, payloads: Iterable[str], version: int, tp_size: int = 1) -> None:
        """Full mode: new weights in memory as policy ``version``, one ``/update_weights_from_tensor``
        per payload (``rlx.rollout.sglang.tensors``; each is sent to every server before the next
        is made) inside one weight-update session of every server."""
        self._load_tensors(self.servers.broadcast, payloads, version, tp_size)
        self._disk_path = None
        self.servers.broadcast("/flush_cache", {})
        self.servers.version = self._set_version(str(version))

    @staticmethod
    def _load_tensors(post: Callable[[str, dict], list[dict]], payloads: Iterable[str],
                      version: int, tp_size: int) -> None:
        for res in post("/begin_weight_update", {}):
            if not res.get("success", False):
                raise RolloutError(f"SGLang refused /begin_weight_update: {res.get('message')}")
        try:
            for payload in payloads:
                for res in post("/update_weights_from_tensor", {
                        "serialized_named_tensors": [payload] * tp_size, "flush_cache": False}):
                    if not res.get("success", False):
                        raise RolloutError("SGLang refused weights sent in memory: "
                                           f"{res.get('message')}")
        finally:
            post("/end_weight_update", {})

    def _restore(self, url: str) -> None:
        """Give one server rlx's current weights again: the recorded weights or base from disk,
        the adapter, the version; aborts what it was generating meanwhile."""
        version = self.weight_version
        if self._disk_path is None and self._adapter_path is None and self.reload is None:
            served = self.servers.version_on(url)
            if served != version:
                raise RolloutError(f"it serves weight_version {served!r} and rlx has loaded no "
                                   "weights it could load again (a server attached with a given "
                                   "weight_version): restart the server or the run")
            return
        if self.reload is not None and self._disk_path is None:  # weights sent in memory
            try:
                self._load_tensors(lambda path, payload: [_admin(url, path, payload, self.timeout)],
                                   *self.reload())
            except (RolloutError, requests.RequestException):
                raise
            except Exception as e:  # noqa: BLE001 - e.g. the learner's arrays are gone: say so
                raise RolloutError(f"sending rlx's weights again failed ({type(e).__name__}: "
                                   f"{e}); the next update sends them") from e
        elif self._disk_path is not None:  # the cache is flushed below, once nothing runs
            res = _admin(url, "/update_weights_from_disk", {
                "model_path": self._disk_path, "weight_version": version,
                "abort_all_requests": True, "flush_cache": False}, self.timeout)
            if not res.get("success", False):
                raise RolloutError(f"it refused the weights at {self._disk_path}: "
                                   f"{res.get('message')}")
        if self._adapter_path is not None:
            self._restore_adapter(url)
        _admin(url, "/update_weight_version", {"new_version": version, "abort_all_requests": True},
               self.timeout)
        # aborted requests leave the running batch a moment later: the flush waits for that
        _admin(url, f"/flush_cache?timeout={self.timeout:g}", {}, self.timeout + 10.0)

    def _restore_adapter(self, url: str) -> None:
        """Load the current adapter unless the server holds it (same name and path); unload
        every other one."""
        listed = self._listed_adapters(url)
        if listed.get(self.adapter) != self._adapter_path:
            if self.adapter in listed:
                _admin(url, "/unload_lora_adapter", {"lora_name": self.adapter}, self.timeout)
            _admin(url, "/load_lora_adapter", {"lora_name": self.adapter,
                                               "lora_path": self._adapter_path}, self.timeout)
        for name in set(listed) - {self.adapter}:
            _admin(url, "/unload_lora_adapter", {"lora_name": name}, self.timeout)

    def _listed_adapters(self, url: str) -> dict[str, str]:
        """Adapter name -> path on one server (its /v1/models listing)."""
        try:
            cards = requests.get(f"{url}/v1/models", timeout=30).json().get("data", [])
        except ValueError as e:
            raise RolloutError(f"/v1/models did not answer JSON: {e}") from None
        return {c["id"]: c.get("root") for c in cards if c.get("parent")}

    def _set_version(self, version: str) -> str:
        self.servers.broadcast("/update_weight_version",
                               {"new_version": version, "abort_all_requests": False})
        return self._server_version()

    def _server_version(self) -> str:
        versions = self.servers.versions()
        if len(versions) > 1:
            raise RolloutError(f"SGLang servers disagree on weight_version: {sorted(versions)}")
        return versions.pop()

    def health(self) -> bool:
        """Whether some server answers ``/health`` (one that does not leaves the rotation; one
        that does comes back, with rlx's weights, at the next call)."""
        answering = False
        for url in self.urls:
            if _answers(url):
                answering = True
            else:
                self.servers.fail(url, "/health does not answer", probe=False)
        return answering

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def sampling_payload(s: SamplingParams, sample_index: int) -> dict:
    """SGLang ``sampling_params`` for one sample (seeded per sample when a seed is given)."""
    out: dict = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                 "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop_strings),
                 "skip_special_tokens": False, "no_stop_trim": True}
    if s.ignore_eos:
        out["ignore_eos"] = True
    if s.top_p is not None:
        out["top_p"] = s.top_p
    if s.top_k is not None:
        out["top_k"] = s.top_k
    if s.min_p is not None:
        out["min_p"] = s.min_p
    if s.seed is not None:
        out["sampling_seed"] = s.seed + sample_index
    return out


def _version_number(version: str) -> int:
    """rlx publishes policy versions as their learner step; a fresh server reports 'default'."""
    return int(version) if version.lstrip("-").isdigit() else 0


def _admin(url: str, path: str, payload: dict, timeout: float) -> dict:
    """POST an admin request to one server; raises RolloutError unless it answers 200."""
    r = requests.post(f"{url}{path}", json=payload, timeout=timeout)
    if r.status_code != 200:
        raise RolloutError(f"{path} answered {r.status_code}: {r.text[:300]}")
    try:
        return r.json()
    except ValueError:
        return {"text": r.text}


def _answers(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False
