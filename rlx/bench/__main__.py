"""``python -m rlx.bench NAME [args]``: run one benchmark by name.

``python -m rlx.bench --help`` (or ``-h``) lists the benchmarks, one line each, and exits 0; no
name or an unknown one prints the same list to stderr and exits 2. ``NAME --help`` shows that
benchmark's own options.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Benchmark(NamedTuple):
    module: str  # imported only when the benchmark runs; has main(argv) -> int
    summary: str  # the one line --help shows


BENCHMARKS = {
    "rollout": Benchmark(
        "rlx.bench.rollout",
        "generation tokens/s: rlx JAX engine vs HF generate, SGLang and llama.cpp",
    ),
    "learner": Benchmark(
        "rlx.bench.learner",
        "one GRPO update: rlx LoRA mode vs PyTorch + PEFT with TRL's loss, and Tunix",
    ),
    "e2e": Benchmark(
        "rlx.bench.e2e", "samples/s of whole RL steps: rlx vs TRL GRPOTrainer and Tunix GRPOLearner"
    ),
    "sync": Benchmark("rlx.bench.sync", "update done -> engine serves the new policy; bytes moved"),
    "quant": Benchmark("rlx.bench.quant", "per-format layer error and decode tokens/s"),
    "products": Benchmark(
        "rlx.bench.products", "bare matrix products of a decode step: XLA vs PyTorch"
    ),
    "bigload": Benchmark(
        "rlx.bench.bigload", "write a DeepSeek-shaped FP8 checkpoint, load it shipped: GB/s, peak RSS"
    ),
    "moe": Benchmark(
        "rlx.bench.moe", "one MoE layer fwd+bwd on 8 CPU devices: dense path vs token dispatch"
    ),
    "replay": Benchmark(
        "rlx.bench.replay", "sampler/learner mismatch of a shrunken MoE run, routing replay off/on"
    ),
    "longctx": Benchmark(
        "rlx.bench.longctx", "train step and prefill at 1k-32k tokens: seconds, tokens/s, memory"
    ),
    "hosts": Benchmark(
        "rlx.bench.hosts", "peak memory per process of a full-mode run: 1 x 8 vs 2 x 4 devices"
    ),
    "compile": Benchmark(
        "rlx.bench.compile", "train-step compile time, 4 vs 32 layers: scanned vs unrolled"
    ),
}

_HELP = ("-h", "--help")


def listing() -> str:
    """Usage line and one line per benchmark."""
    width = max(map(len, BENCHMARKS))
    lines = [
        "usage: python -m rlx.bench NAME [args]  (NAME --help: that benchmark's options)",
        "",
        "benchmarks:",
    ]
    lines += [f"  {name:<{width}}  {b.summary}" for name, b in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] in _HELP:
        print(listing())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        if argv:
            print(f"unknown benchmark {argv[0]!r}", file=sys.stderr)
        print(listing(), file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[argv[0]].module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
