"""The contenders of ``python -m rlx.bench rollout``, each built inside its own worker process.

Every factory returns ``run(case)`` with ``case`` "greedy" (argmax) or "sampled" (temperature 1,
no top-k / top-p truncation); one call generates exactly ``new`` tokens for every prompt (end of
sequence never stops a row) and returns ``{"tokens", "seconds", "rows"}`` with the tokens actually
produced, with the wall time and the CPU time (``cpu_s``: every thread of the side's process, or of
the SGLang server's process group; on a shared machine the CPU time per token is the steadier
measure of the work a side needs). A side that produced another count raises, so no ratio is ever
computed over unequal work.

- ``rlx_rollout``: ``JaxEngine.generate``, with its sampler log-probs (as RL needs them) or,
  ``logprobs=False``, without (as for evaluation, and as HF ``generate`` computes none).
- ``hf_rollout``: transformers ``generate`` on the rlx-exported HF folder, f32, dynamic KV cache,
  ``min_new_tokens = max_new_tokens`` and no EOS; no log-probs (plain ``generate``).
- ``sglang_rollout``: one batched ``/generate`` request (all prompts as ``input_ids``) to a running
  server, ``ignore_eos``, ``return_logprob`` (what rlx's SGLang engine asks for); the time includes
  the HTTP round trip.
"""

from __future__ import annotations

import itertools
import time

CASES = ("greedy", "sampled")


def _check_case(case: str) -> None:
    if case not in CASES:
        raise ValueError(f"case {case!r} is not one of {CASES}")


def _figures(seconds: float, cpu_s: float | None, counts: list[int], new: int, side: str) -> dict:
    wrong = [(i, c) for i, c in enumerate(counts) if c != new]
    if wrong:
        raise RuntimeError(f"{side}: rows produced other than {new} tokens (row, count): {wrong[:5]}")
    out = {"tokens": int(sum(counts)), "seconds": seconds, "rows": len(counts)}
    if cpu_s is not None:
        out["cpu_s"] = cpu_s
    return out


class _Clock:
    """Wall and CPU seconds of one call; CPU time of this process (every thread) or of a
    server's process group (``pgid``)."""

    def __init__(self, pgid: int = 0):
        self.pgid = pgid

    def _cpu(self) -> float:
        if self.pgid:
            from rlx.bench.sglang_setup import group_cpu_s

            return group_cpu_s(self.pgid)
        return time.process_time()

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc):
        self.seconds, self.cpu_s = time.perf_counter() - self.wall, self._cpu() - self.cpu


def rlx_rollout(model: str, base: str, lora_rank: int, prompts: list[list[int]], new: int,
                hf_config: dict | None = None, logprobs: bool = True):
    """rlx's built-in engine on ``model`` with its base in ``base`` (+ LoRA when ``lora_rank``)."""
    from rlx.bench.workloads import load_model
    from rlx.rollout.jax.engine import JaxEngine
    from rlx.types import Prompt, SamplingParams

    m, tokenizer = load_model(model, base, lora_rank, hf_config=hf_config)
    engine = JaxEngine(m, tokenizer=tokenizer)
    requests = [Prompt(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
    seeds = itertools.count()

    def run(case: str) -> dict:
        _check_case(case)
        sampling = SamplingParams(max_new_tokens=new, temperature=0.0 if case == "greedy" else 1.0,
                                  seed=next(seeds), logprobs=logprobs)
        with _Clock() as c:
            out = engine.generate(requests, sampling)
        return _figures(c.seconds, c.cpu_s, [len(r.completion_ids) for r in out], new, "rlx")

    return run


def hf_rollout(folder: str, prompts: list[list[int]], new: int, threads: int = 0):
    """transformers ``generate`` (torch, f32) on the HF folder rlx exported."""
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    seeds = itertools.count()

    def run(case: str) -> dict:
        _check_case(case)
        kw = (dict(do_sample=False) if case == "greedy"
              else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0))
        torch.manual_seed(next(seeds))
        with _Clock() as c, torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 eos_token_id=None, pad_token_id=0, **kw)
        return _figures(c.seconds, c.cpu_s, [out.shape[1] - ids.shape[1]] * ids.shape[0], new,
                        "transformers")

    return run


def sglang_rollout(url: str, prompts: list[list[int]], new: int, load_folder: str = "",
                   server_pgid: int = 0, timeout_s: float = 1800.0):
    """Requests to the SGLang server at ``url``; with ``load_folder`` it first loads those weights
    (an attached server then serves exactly the bench's model). ``server_pgid``: the launched
    server's process group, whose CPU time is then measured (0: unknown, attached server)."""
    import requests

    if load_folder:
        r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": load_folder},
                          timeout=timeout_s)
        if r.status_code != 200 or not r.json().get("success", False):
            raise RuntimeError(f"SGLang at {url} refused the weights at {load_folder}: {r.text[:300]}")
        requests.post(f"{url}/flush_cache", timeout=timeout_s)
    seeds = itertools.count()

    def run(case: str) -> dict:
        _check_case(case)
        params = {"max_new_tokens": new, "ignore_eos": True,
                  "temperature": 0.0 if case == "greedy" else 1.0, "top_p": 1.0, "top_k": -1}
        if case == "sampled":
            params["sampling_seed"] = next(seeds)
        with _Clock(server_pgid) as c:
            counts = sglang_generate(url, prompts, params, timeout_s, return_logprob=True)
        return _figures(c.seconds, c.cpu_s if server_pgid else None, counts, new, "sglang")

    return run


def sglang_generate(url: str, prompts: list[list[int]], params: dict, timeout_s: float,
                    **extra) -> list[int]:
    """One ``/generate`` call of the SGLang server at ``url`` on token ids with
    ``sampling_params`` ``params``; returns each completion's token count."""
    import requests

    payload = {"input_ids": prompts, "sampling_params": params, **extra}
    r = requests.post(f"{url}/generate", json=payload, timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"SGLang /generate answered {r.status_code}: {r.text[:300]}")
    return [int(o["meta_info"]["completion_tokens"]) for o in r.json()]
