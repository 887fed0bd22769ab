"""The llama.cpp side of ``python -m rlx.bench rollout``: llama-cpp-python on the same GGUF file.

It runs in its own interpreter (the llama.cpp environment of ``rlx.bench.peer_envs``, which builds
llama-cpp-python from its source distribution), so this module imports nothing outside the
standard library at import time and nothing of rlx but the harness's worker.

The model is SmolLM2-135M-Instruct's GGUF Q4_1 file itself, the file rlx's ``rlx-q4_1`` side loads.
Every call generates exactly ``new`` tokens for every prompt from the shared prompt token ids (no
end-of-sequence stop: llama.cpp's generators never stop by themselves, the loops below count),
greedy (argmax) or sampled (temperature 1, no top-k / top-p / min-p truncation, seeded):

- batch 1: the high-level API, ``Llama.generate`` on one prompt, its prompt cache reset before
  every call (no prefill is ever reused across repetitions);
- batch > 1: the batched decoding API (``llama_batch_init`` / ``llama_decode`` with one sequence id
  per prompt, ``n_seq_max`` = the batch): one prefill of every prompt in one batch, then one
  decode per step with one token per sequence, each picked by ``llama_sampler_sample`` from that
  sequence's logits, as llama.cpp's own batched example does.

Both paths run without flash attention (the high-level API's default; the context API's own
default, "auto", turns it on), so they compute the same numbers: a prompt's greedy tokens are the
same alone and in a batch. Threads: ``threads`` for both generation and batch processing (0: every
core); llama.cpp's OpenMP threads sleep when idle, as rlx's do (``rlx.bench.harness.BASE_ENV``).
Figures are those of ``rlx.bench.rollout_sides`` (tokens, wall and CPU seconds, rows).
"""

from __future__ import annotations

import itertools
import os
import time

CASES = ("greedy", "sampled")


def _figures(seconds: float, cpu_s: float, rows: list[list[int]], new: int) -> dict:
    counts = [len(r) for r in rows]
    if any(c != new for c in counts):
        raise RuntimeError(f"llama.cpp: rows produced other than {new} tokens: {counts[:5]}")
    return {"tokens": int(sum(counts)), "seconds": seconds, "cpu_s": cpu_s, "rows": len(rows)}


def _timed(fn, *args) -> tuple[list[list[int]], float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    rows = fn(*args)
    return rows, time.perf_counter() - wall, time.process_time() - cpu


def llama_cpp_rollout(gguf: str, prompts: list[list[int]], new: int, threads: int = 0):
    """Worker factory: ``run(case)`` generating ``new`` tokens for every prompt with llama.cpp."""
    generate = make_generator(gguf, prompts, new, threads)
    seeds = itertools.count()

    def run(case: str) -> dict:
        if case not in CASES:
            raise ValueError(f"case {case!r} is not one of {CASES}")
        rows, seconds, cpu_s = _timed(generate, case, next(seeds))
        return _figures(seconds, cpu_s, rows, new)

    return run


def make_generator(gguf: str, prompts: list[list[int]], new: int, threads: int = 0):
    """``generate(case, seed) -> rows``: ``new`` token ids per prompt, through the high-level API
    for one prompt and the batched API for more."""
    threads = threads or os.cpu_count() or 1
    if len(prompts) == 1:
        return _single(gguf, prompts[0], new, threads)
    return _Batched(gguf, prompts, new, threads)


def _single(gguf: str, prompt: list[int], new: int, threads: int):
    """Batch 1 through ``Llama.generate``."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=len(prompt) + new + 1, n_batch=max(len(prompt), 8),
                n_threads=threads, n_threads_batch=threads, verbose=False)

    def generate(case: str, seed: int) -> list[list[int]]:
        llm.reset()  # the next call prefills the prompt again
        llm.set_seed(seed)
        temp = 0.0 if case == "greedy" else 1.0
        tokens = llm.generate(prompt, temp=temp, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                              repeat_penalty=1.0)
        return [list(itertools.islice(tokens, new))]

    return generate


class _Batched:
    """Batch > 1 through llama.cpp's batched decoding API: one sequence id per prompt."""

    def __init__(self, gguf: str, prompts: list[list[int]], new: int, threads: int):
        import llama_cpp as lib

        self.lib, self.prompts, self.new = lib, prompts, new
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(gguf.encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        longest, n = max(map(len, prompts)), len(prompts)
        params = lib.llama_context_default_params()
        params.n_seq_max = n
        params.n_ctx = n * (longest + new + 1)  # each sequence its own share of the cache
        params.n_batch = params.n_ubatch = max(sum(map(len, prompts)), n)  # one prefill call
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as ``Llama`` by default
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lib.llama_batch_init(params.n_batch, 0, 1)

    def _sampler(self, case: str, seed: int):
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if case == "greedy":
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:  # temperature 1 over the whole vocabulary
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain

    def _fill(self, items: list[tuple[int, int, int, bool]]) -> None:
        """Put (token, position, sequence, wants logits) items into the batch and decode it."""
        b = self.batch
        for k, (token, pos, seq, logits) in enumerate(items):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = token, pos, 1, logits
            b.seq_id[k][0] = seq
        b.n_tokens = len(items)
        code = self.lib.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def __call__(self, case: str, seed: int) -> list[list[int]]:
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        sampler = self._sampler(case, seed)
        try:
            items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(self.prompts)
                     for j, t in enumerate(p)]
            self._fill(items)
            outputs = [i for i, item in enumerate(items) if item[3]]  # batch index per sequence
            rows: list[list[int]] = [[] for _ in self.prompts]
            for step in range(self.new):
                tokens = [lib.llama_sampler_sample(sampler, self.ctx, i) for i in outputs]
                for row, token in zip(rows, tokens):
                    row.append(token)
                if step + 1 < self.new:
                    self._fill([(t, len(p) + step, s, True)
                                for s, (t, p) in enumerate(zip(tokens, self.prompts))])
                    outputs = list(range(len(self.prompts)))
            return rows
        finally:
            lib.llama_sampler_free(sampler)
