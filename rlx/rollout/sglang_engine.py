"""Rollouts from SGLang servers through the native ``/generate`` API.

Requests go out concurrently (a thread pool; one HTTP request per sample) and are dispatched
round-robin over the healthy servers. A connection error or timeout marks that server suspect,
the request is re-sent to another healthy server with exponential backoff, and results are keyed
by ``(prompt, sample)`` so nothing is dropped or counted twice. When no server is left, a
``RolloutError`` names every server and what it answered.

Weight sync: mode B hot-loads a PEFT adapter exported by rlx under a new name per policy version
(``/load_lora_adapter``) and unloads the previous one (an unloaded name can silently come back from
its old path, so names are never reused); mode A reloads full weights from an rlx export
(``/update_weights_from_disk``). Every response's ``weight_version`` is checked.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

from rlx.rollout.base import Prompt, RolloutError, SamplingParams
from rlx.types import Rollout


class SGLangEngine:
    """Client for one or more SGLang servers (attach by URL, or pass ``SGLangServer.url``s)."""

    def __init__(self, urls: Sequence[str], *, request_timeout_s: float = 600.0,
                 max_retries: int = 4, concurrency: int = 64, backoff_s: float = 0.5,
                 weight_version: int | None = None):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.healthy = {u: True for u in self.urls}
        self.timeout, self.max_retries, self.backoff = request_timeout_s, max_retries, backoff_s
        self.pool = ThreadPoolExecutor(max_workers=concurrency)
        self._rr = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()
        self.adapter: str | None = None  # name of the loaded LoRA adapter (mode B)
        self.retries = 0  # requests re-sent after a connection failure (a metric)
        self.weight_version = (self._set_version(str(weight_version)) if weight_version is not None
                               else self._server_version())

    # --- dispatch -------------------------------------------------------------------------
    def _pick(self, avoid: set[str]) -> str:
        with self._lock:
            for _ in range(len(self.urls)):
                url = self.urls[next(self._rr)]
                if self.healthy[url] and url not in avoid:
                    return url
        alive = [u for u in self.urls if self.healthy[u]]
        if alive:
            return alive[0]
        raise RolloutError(f"no healthy SGLang server left among {self.urls}; check their logs")

    def _post(self, path: str, payload: dict) -> dict:
        """POST to one server with retries on other servers; raises RolloutError when all fail."""
        errors: list[str] = []
        tried: set[str] = set()
        for attempt in range(self.max_retries + 1):
            url = self._pick(tried)
            try:
                r = requests.post(f"{url}{path}", json=payload, timeout=self.timeout)
            except requests.RequestException as e:
                errors.append(f"{url}: {type(e).__name__}")
                tried.add(url)
                with self._lock:
                    self.retries += 1
                self._mark(url)
                time.sleep(self.backoff * 2 ** attempt)
                continue
            if r.status_code != 200:
                raise RolloutError(f"SGLang {url}{path} answered {r.status_code}: {r.text[:300]}")
            return r.json()
        raise RolloutError(f"SGLang request {path} failed on every attempt: {'; '.join(errors)}")

    def _mark(self, url: str) -> None:
        """After a failure: keep the server only if /health still answers."""
        try:
            ok = requests.get(f"{url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            ok = False
        self.healthy[url] = ok

    def _broadcast(self, path: str, payload: dict) -> list[dict]:
        out = []
        for url in [u for u in self.urls if self.healthy[u]]:
            r = requests.post(f"{url}{path}", json=payload, timeout=self.timeout)
            if r.status_code != 200:
                raise RolloutError(f"SGLang {url}{path} answered {r.status_code}: {r.text[:300]}")
            try:
                out.append(r.json())
            except ValueError:  # some admin endpoints answer plain text
                out.append({"text": r.text})
        return out

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Rollout]:
        jobs = [(p, j) for p in prompts for j in range(sampling.n)]
        futures = [self.pool.submit(self._one, p, j, sampling) for p, j in jobs]
        return [f.result() for f in futures]

    def _one(self, prompt: Prompt, j: int, sampling: SamplingParams) -> Rollout:
        payload = {"input_ids": [int(t) for t in prompt.token_ids], "return_logprob": True,
                   "sampling_params": sampling_payload(sampling, j)}
        if self.adapter is not None:
            payload["lora_path"] = self.adapter
        out = self._post("/generate", payload)
        return self._to_rollout(prompt, j, out)

    def _to_rollout(self, prompt: Prompt, j: int, out: dict) -> Rollout:
        meta = out.get("meta_info", {})
        entries = meta.get("output_token_logprobs") or []
        version = str(meta.get("weight_version", self.weight_version))
        if version != self.weight_version:
            raise RolloutError(f"SGLang served weight_version {version!r} but rlx expects "
                               f"{self.weight_version!r}: the server's weights are stale")
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        return Rollout(
            prompt_uid=prompt.uid, prompt_ids=np.asarray(prompt.token_ids, np.int32),
            completion_ids=np.asarray([e[1] for e in entries], np.int32),
            sampler_logp=np.asarray([e[0] for e in entries], np.float32),
            finish_reason="length" if finish == "length" else "stop",
            weight_version=_version_number(version), sample_index=j)

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        """Log-probs SGLang assigns to the tokens after each prompt (teacher-forced)."""
        futures = [self.pool.submit(self._score_one, [int(t) for t in ids], int(p)) for ids, p in sequences]
        return [f.result() for f in futures]

    def _score_one(self, ids: list[int], prompt_len: int) -> np.ndarray:
        payload = {"input_ids": ids, "return_logprob": True, "logprob_start_len": prompt_len - 1,
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        if self.adapter is not None:
            payload["lora_path"] = self.adapter
        meta = self._post("/generate", payload)["meta_info"]
        entries = meta["input_token_logprobs"]  # first entry is the prompt's last token (no logp)
        return np.asarray([e[0] for e in entries[1:]], np.float32)

    # --- weights --------------------------------------------------------------------------
    def load_adapter(self, path: str, version: int) -> None:
        """Mode B: hot-load the PEFT adapter at ``path`` as policy ``version``; unload the old one."""
        name = f"policy-{version}"
        self._broadcast("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        old, self.adapter = self.adapter, name
        if old is not None and old != name:
            self._broadcast("/unload_lora_adapter", {"lora_name": old})
        self.weight_version = self._set_version(str(version))

    def loaded_adapters(self) -> dict[str, set[str]]:
        """LoRA adapter names each healthy server holds (from its /v1/models listing)."""
        out = {}
        for url in [u for u in self.urls if self.healthy[u]]:
            cards = requests.get(f"{url}/v1/models", timeout=30).json().get("data", [])
            out[url] = {c["id"] for c in cards if c.get("parent")}
        return out

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Mode A: reload full weights from an rlx HF export at ``path``."""
        for res in self._broadcast("/update_weights_from_disk",
                                   {"model_path": path, "weight_version": str(version)}):
            if not res.get("success", False):
                raise RolloutError(f"SGLang refused the weights at {path}: {res.get('message')}")
        self._broadcast("/flush_cache", {})
        self.weight_version = self._server_version()
        if self.weight_version != str(version):
            raise RolloutError(f"after loading {path}, SGLang reports weight_version "
                               f"{self.weight_version!r}, expected {version!r}")

    def _set_version(self, version: str) -> str:
        self._broadcast("/update_weight_version", {"new_version": version, "abort_all_requests": False})
        return self._server_version()

    def _server_version(self) -> str:
        versions = set()
        for url in [u for u in self.urls if self.healthy[u]]:
            try:
                info = requests.get(f"{url}/model_info", timeout=30).json()
                versions.add(str(info.get("weight_version")))
            except (requests.RequestException, ValueError) as e:
                raise RolloutError(f"SGLang {url} does not answer /model_info: {e}") from None
        if len(versions) > 1:
            raise RolloutError(f"SGLang servers disagree on weight_version: {sorted(versions)}")
        return versions.pop() if versions else "unknown"

    def health(self) -> bool:
        for url in self.urls:
            self._mark(url)
        return any(self.healthy.values())

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def sampling_payload(s: SamplingParams, sample_index: int) -> dict:
    """SGLang ``sampling_params`` for one sample (seeded per sample when a seed is given)."""
    out: dict = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                 "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop_strings),
                 "skip_special_tokens": False, "no_stop_trim": True}
    if s.top_p is not None:
        out["top_p"] = s.top_p
    if s.top_k is not None:
        out["top_k"] = s.top_k
    if s.seed is not None:
        out["sampling_seed"] = s.seed + sample_index
    return out


def _version_number(version: str) -> int:
    """rlx publishes policy versions as their learner step; a fresh server reports 'default'."""
    return int(version) if version.lstrip("-").isdigit() else 0
