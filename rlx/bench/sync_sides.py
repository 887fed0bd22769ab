"""The contenders of ``python -m rlx.bench sync``, each built inside its own worker process.

One call of a side's ``run()`` is one policy update: new weights are made first (the learner's
update is done: for an adapter, fresh random LoRA values; for full weights, every parameter scaled
by ``1 + 1e-3 * version``), then the clock runs from handing them over until the engine has
answered a probe request (one greedy token with its log-prob, on a fixed prompt) with the new
policy. The answer is checked: its log-prob must differ from the previous version's (and SGLang
must report the new ``weight_version``). Figures: ``seconds`` (the whole sync), its phases,
``bytes`` moved (what was copied or written for the engine) and ``logp_change``.

- ``rlx_sync``: the built-in engine takes the values in memory (``JaxEngine.update_weights``):
  only the ``nnx.LoRAParam`` state (``kind="adapter"``, LoRA mode) or every parameter (``"full"``).
- ``sglang_adapter_sync``: rlx exports the adapter as PEFT (``rlx.io.export.export_peft``) and SGLang
  hot-loads it under a new name (``/load_lora_adapter``, the old one unloaded, new version set),
  as rlx's SGLang engine does in LoRA mode.
- ``sglang_full_sync``: rlx exports every weight (``export_merged``, f32 safetensors) and SGLang
  reloads them (``/update_weights_from_disk``, then ``/flush_cache``): full mode with
  ``rollout.sglang.weight_sync="disk"``.
- ``sglang_memory_sync``: the same weights sent in memory, in buckets through shared memory
  (``rlx.rollout.sglang.tensors``, ``/update_weights_from_tensor`` in a weight-update session):
  full mode's default.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time

import numpy as np


def _lora_values(model, version: int):
    """Random adapter values for ``version`` (what an optimizer step would leave)."""
    import jax
    from flax import nnx

    state = nnx.state(model, nnx.LoRAParam)
    key = jax.random.key(version)
    leaves, tree = jax.tree.flatten(state)
    fresh = [0.02 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
             for i, x in enumerate(leaves)]
    return jax.block_until_ready(jax.tree.unflatten(tree, fresh))


def _scaled(base_state, version: int):
    import jax

    factor = np.float32(1.0 + 1e-3 * version)
    return jax.block_until_ready(jax.tree.map(lambda x: x * factor, base_state))


def state_nbytes(state) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)))


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _changed(previous: float | None, logp: float, side: str) -> float:
    if previous is not None and logp == previous:
        raise RuntimeError(f"{side}: the probe's log-prob did not change after the update "
                           "(the engine still serves the old policy)")
    return 0.0 if previous is None else abs(logp - previous)


def rlx_sync(model: str, kind: str, lora_rank: int, probe: list[int], hf_config: dict | None = None):
    """The built-in engine, updated in memory with an adapter (``kind="adapter"``) or all weights."""
    from flax import nnx

    from rlx.bench.workloads import load_model
    from rlx.rollout.jax.engine import JaxEngine
    from rlx.types import Prompt, SamplingParams

    m, tokenizer = load_model(model, "f32", lora_rank if kind == "adapter" else 0, hf_config=hf_config)
    engine = JaxEngine(m, tokenizer=tokenizer)
    base = nnx.state(m, nnx.Param)
    prompt, greedy = Prompt("probe", tuple(probe)), SamplingParams(max_new_tokens=1, temperature=0.0)
    versions, last = itertools.count(1), [None]

    def run() -> dict:
        v = next(versions)
        new = _lora_values(m, v) if kind == "adapter" else _scaled(base, v)
        t0 = time.perf_counter()
        engine.update_weights(new, v)
        t1 = time.perf_counter()
        (out,) = engine.generate([prompt], greedy)
        t2 = time.perf_counter()
        if out.weight_version != v:
            raise RuntimeError(f"rlx answered with weight_version {out.weight_version}, expected {v}")
        change = _changed(last[0], float(out.sampler_logp[0]), f"rlx {kind}")
        last[0] = float(out.sampler_logp[0])
        return {"seconds": t2 - t0, "handover_s": t1 - t0, "first_request_s": t2 - t1,
                "bytes": state_nbytes(new), "logp_change": change}

    return run


def post(url: str, path: str, payload: dict, timeout_s: float = 1800.0) -> dict:
    import requests

    r = requests.post(f"{url}{path}", json=payload, timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"SGLang {path} answered {r.status_code}: {r.text[:300]}")
    try:
        return r.json()
    except ValueError:
        return {"text": r.text}


def _probe(url: str, probe: list[int], version: int, adapter: str | None) -> float:
    """Serve the probe; check the server's ``weight_version``; the token's log-prob."""
    payload = {"input_ids": probe, "return_logprob": True,
               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    if adapter:
        payload["lora_path"] = adapter
    meta = post(url, "/generate", payload)["meta_info"]
    if str(meta.get("weight_version")) != str(version):
        raise RuntimeError(f"SGLang answered with weight_version {meta.get('weight_version')!r}, "
                           f"expected {version}")
    return float(meta["output_token_logprobs"][0][0])


def sglang_adapter_sync(url: str, model: str, lora_rank: int, probe: list[int], workdir: str,
                        first_version: int = 1000, hf_config: dict | None = None):
    """Adapter hot-load on the SGLang server at ``url`` (launched with LoRA enabled)."""
    from flax import nnx

    from rlx.bench.workloads import load_model
    from rlx.io.export import export_peft
    from rlx.quant import LoraConfig

    m, _ = load_model(model, "f32", lora_rank, hf_config=hf_config)
    lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank)
    versions, state = itertools.count(first_version), {"name": None, "path": None, "logp": None}

    def run() -> dict:
        v = next(versions)
        nnx.update(m, _lora_values(m, v))
        t0 = time.perf_counter()
        path = export_peft(m, lora, os.path.join(workdir, f"adapter-{v}"), str(v))
        t1 = time.perf_counter()
        name = f"bench-{v}"
        post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if state["name"]:
            post(url, "/unload_lora_adapter", {"lora_name": state["name"]})
        post(url, "/update_weight_version", {"new_version": str(v), "abort_all_requests": False})
        t2 = time.perf_counter()
        logp = _probe(url, probe, v, name)
        t3 = time.perf_counter()
        change = _changed(state["logp"], logp, "SGLang adapter")
        if state["path"]:
            shutil.rmtree(state["path"], ignore_errors=True)
        state.update(name=name, path=path, logp=logp)
        return {"seconds": t3 - t0, "export_s": t1 - t0, "load_s": t2 - t1, "first_request_s": t3 - t2,
                "bytes": folder_bytes(path), "logp_change": change}

    return run


def sglang_full_sync(url: str, model: str, probe: list[int], workdir: str, first_version: int = 2000,
                     hf_config: dict | None = None):
    """Full-weight reload from disk on the SGLang server at ``url``."""
    from flax import nnx

    from rlx.bench.workloads import load_model
    from rlx.io.export import export_merged

    m, _ = load_model(model, "f32", 0, hf_config=hf_config)
    base = nnx.state(m, nnx.Param)
    versions, last = itertools.count(first_version), [None]
    target = os.path.join(workdir, "full")

    def run() -> dict:
        v = next(versions)
        nnx.update(m, _scaled(base, v - first_version + 1))
        t0 = time.perf_counter()
        path = export_merged(m, target, str(v))
        t1 = time.perf_counter()
        res = post(url, "/update_weights_from_disk", {"model_path": path, "weight_version": str(v)})
        if not res.get("success", False):
            raise RuntimeError(f"SGLang refused the weights at {path}: {res}")
        post(url, "/flush_cache", {})
        t2 = time.perf_counter()
        logp = _probe(url, probe, v, None)
        t3 = time.perf_counter()
        change = _changed(last[0], logp, "SGLang full")
        last[0] = logp
        return {"seconds": t3 - t0, "export_s": t1 - t0, "load_s": t2 - t1, "first_request_s": t3 - t2,
                "bytes": folder_bytes(path), "logp_change": change}

    return run


def sglang_memory_sync(url: str, model: str, probe: list[int], bucket_mb: float = 512.0,
                       first_version: int = 3000, hf_config: dict | None = None):
    """Full weights in memory on the SGLang server at ``url`` (same host), as rlx's SGLang policy
    sends them with ``weight_sync="memory"``: buckets through one shared-memory buffer."""
    from flax import nnx

    from rlx.bench.workloads import load_model
    from rlx.io.export import merged_tensors
    from rlx.rollout.sglang.engine import SGLangEngine
    from rlx.rollout.sglang.tensors import SharedStaging, payloads

    m, _ = load_model(model, "f32", 0, hf_config=hf_config)
    base = nnx.state(m, nnx.Param)
    versions, last = itertools.count(first_version), [None]
    staging, engine = SharedStaging(), SGLangEngine([url])
    limit = int(bucket_mb * 2**20)
    nbytes = sum(x.nbytes for _, x in merged_tensors(m))  # the same every update

    def run() -> dict:
        v = next(versions)
        nnx.update(m, _scaled(base, v - first_version + 1))
        t0 = time.perf_counter()
        engine.load_tensors(payloads(staging, merged_tensors(m), limit), v)
        t1 = time.perf_counter()
        logp = _probe(url, probe, v, None)
        t2 = time.perf_counter()
        change = _changed(last[0], logp, "SGLang memory")
        last[0] = logp
        return {"seconds": t2 - t0, "load_s": t1 - t0, "first_request_s": t2 - t1,
                "bytes": nbytes, "logp_change": change}

    return run
