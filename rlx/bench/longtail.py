"""``python -m rlx.bench rollout --lengths longtail``: the built-in engine on RL's long-tailed
completion lengths.

The mix (``--batch`` requests, default 64): SmolLM2-135M-Instruct, its GGUF Q4_1 base as it ships
plus a rank-16 LoRA adapter on every projection (mode B), chat prompts of which 3 in 4 ask for a
one-word answer and 1 in 4 for a long essay, sampled at temperature 0.8 up to ``--new`` (256)
tokens, each request ending at the model's end-of-turn token. Most completions end within a few
tokens, a quarter run to the cap. The same requests at *uniform* length ignore the end-of-turn
token: every completion runs to the cap.

For each batching of the engine (``config.rollout.jax.batching``: "continuous" and "lockstep")
the table gives useful tokens per second (completion tokens returned, over wall-clock time) on
the mix and at uniform length, their ratio (1.0: the long tail costs nothing), and for
continuous batching its decode-slot occupancy on the mix. Uniform length is also run at 16
requests (the first 16 of the mix), where the two batchings should be level. Compilation is
excluded (``--warmup`` rounds first); figures are medians of ``--repeats`` rounds, in which the
two batchings take turns.

Beside it, a real SGLang server (its CPU backend batches continuously) on rlx's f32 export of the
same model (it serves no GGUF base with a LoRA adapter) gets the same token ids and settings:
its own mix-over-uniform ratio is the peer's figure (``rlx.bench.sglang_setup``; skipped, with
the reason, where its environment is missing). ``--sides sglang`` runs that side alone, an
``rlx-...`` side the engine's rows alone.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

CHAT_ONE_WORD = ("Answer with one word only. What is the capital of {}?",
                 "Answer with one word only. What colour is {}?")
CHAT_ESSAY = "Write a long, detailed essay about the history of {}."
TOPICS = ("France", "Japan", "Brazil", "Egypt", "Canada", "India", "Italy", "Kenya",
          "Mexico", "Norway", "Peru", "Spain", "Chile", "Ghana", "Nepal", "Poland")
MODES = ("continuous", "lockstep")


@dataclasses.dataclass(frozen=True)
class LongTail:
    """The mix: ``batch`` requests up to ``new`` tokens, 1 in ``essay_every`` an essay."""

    batch: int = 64
    new: int = 256
    temperature: float = 0.8
    essay_every: int = 4
    lora_rank: int = 16
    seed: int = 0


def chat_prompts(tokenizer, w: LongTail) -> list[list[int]]:
    """``w.batch`` chat prompts: every ``essay_every``-th asks for an essay, the rest for one
    word (topics cycle)."""
    out = []
    for i in range(w.batch):
        topic = TOPICS[i % len(TOPICS)]
        text = (CHAT_ESSAY.format(topic) if i % w.essay_every == w.essay_every - 1
                else CHAT_ONE_WORD[(i // len(TOPICS)) % 2].format(topic))
        out.append(list(tokenizer.encode_chat([{"role": "user", "content": text}])))
    return out


def _timed(engine, prompts, sampling) -> tuple[float, int]:
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    return time.perf_counter() - start, sum(len(r.completion_ids) for r in out)


def measure(w: LongTail, repeats: int, warmup: int, small: int = 16) -> list[dict]:
    """One row per batching mode (module docstring)."""
    from rlx.bench.workloads import load_model
    from rlx.rollout.jax.config import JaxSection
    from rlx.rollout.jax.engine import JaxEngine
    from rlx.types import Prompt, SamplingParams

    model, tokenizer = load_model("smollm2", "q4_1", w.lora_rank, seed=w.seed)
    ids = chat_prompts(tokenizer, w)
    prompts = [Prompt(f"q{i}", tuple(p)) for i, p in enumerate(ids)]
    stop = SamplingParams(max_new_tokens=w.new, temperature=w.temperature, seed=w.seed,
                          stop_token_ids=(tokenizer.eos_id,))
    uniform = dataclasses.replace(stop, stop_token_ids=())
    cases = {"mix": (prompts, stop), "uniform": (prompts, uniform),
             f"uniform{small}": (prompts[:small], uniform)}
    engines = {m: JaxEngine(model, tokenizer=tokenizer, settings=JaxSection(batching=m))
               for m in MODES}
    figures = {m: {k: [] for k in cases} for m in MODES}
    occupancy: dict[str, list] = {m: [] for m in MODES}
    for r in range(warmup + repeats):  # the modes alternate: a drifting machine hits both
        for mode, engine in engines.items():
            took = []
            for case, (ps, sampling) in cases.items():
                seconds, tokens = _timed(engine, ps, sampling)
                took.append(f"{case} {seconds:.1f} s")
                if r >= warmup:
                    figures[mode][case].append((seconds, tokens))
                    stats = engine.batching_stats()
                    if case == "mix" and stats is not None:
                        occupancy[mode].append(stats.occupancy)
            print(f"round {r}, {mode}: " + ", ".join(took), file=sys.stderr, flush=True)
    for engine in engines.values():
        engine.close()
    return [_row(m, figures[m], occupancy[m], small) for m in MODES]


def _row(mode: str, figures: dict, occupancy: list, small: int) -> dict:
    def rate(case):
        return statistics.median(t / s for s, t in figures[case])

    mix, uniform = rate("mix"), rate("uniform")
    return {"batching": mode, "mix_tokens": figures["mix"][0][1],
            "mix_seconds": statistics.median(s for s, _ in figures["mix"]),
            "mix_tok_s": mix, "uniform_tok_s": uniform, "ratio": mix / uniform,
            f"uniform{small}_tok_s": rate(f"uniform{small}"),
            "occupancy": statistics.median(occupancy) if occupancy else None}


def sglang_rows(w: LongTail, setup, root: str, repeats: int, warmup: int) -> list[dict]:
    """The SGLang row: the same requests, served by a server on rlx's f32 export."""
    import os

    from rlx.bench.rollout_sides import sglang_generate
    from rlx.bench.sglang_setup import sglang_server
    from rlx.bench.workloads import export_hf, load_model

    _, tokenizer = load_model("smollm2", "f32")
    ids, folder = chat_prompts(tokenizer, w), os.path.join(root, "smollm2-hf")
    export_hf("smollm2", folder)
    params = {"max_new_tokens": w.new, "temperature": w.temperature, "top_p": 1.0, "top_k": -1}
    cases = {"mix": (ids, {**params, "stop_token_ids": [tokenizer.eos_id]}),
             "uniform": (ids, {**params, "ignore_eos": True}),
             "uniform16": (ids[:16], {**params, "ignore_eos": True})}
    with sglang_server(setup, folder, root) as (url, _):
        figures: dict[str, list] = {k: [] for k in cases}
        for r in range(warmup + repeats):
            for case, (batch, sampling) in cases.items():
                start = time.perf_counter()
                tokens = sum(sglang_generate(url, batch, {**sampling, "sampling_seed": w.seed},
                                             3600))
                seconds = time.perf_counter() - start
                if r >= warmup:
                    figures[case].append((seconds, tokens))
    return [_row("SGLang f32 (continuous)", figures, [], 16)]


def markdown(rows: list[dict], w: LongTail, small: int = 16) -> str:
    head = (f"| batching | mix: tokens, s | mix tok/s | uniform tok/s ({w.batch} req) | ratio | "
            f"uniform tok/s ({small} req) | slot occupancy (mix) |")
    lines = [head, "|" + " --- |" * 7]
    for r in rows:
        occ = "" if r["occupancy"] is None else f"{r['occupancy']:.2f}"
        lines.append(f"| {r['batching']} | {r['mix_tokens']}, {r['mix_seconds']:.1f} | "
                     f"{r['mix_tok_s']:.1f} | {r['uniform_tok_s']:.1f} | {r['ratio']:.2f} | "
                     f"{r[f'uniform{small}_tok_s']:.1f} | {occ} |")
    return "\n".join(lines)
