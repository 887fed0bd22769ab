"""``python -m rlx.bench NAME [args]``: run one benchmark by name."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "rollout": "rlx.bench.rollout",  # generation tokens/s: rlx JAX engine vs HF generate vs SGLang
    "learner": "rlx.bench.learner",  # one GRPO update: rlx mode B vs PyTorch + PEFT with TRL's loss
    "e2e": "rlx.bench.e2e",  # samples/s of whole RL steps: rlx vs TRL GRPOTrainer
    "sync": "rlx.bench.sync",  # update done -> engine serves the new policy; bytes moved
    "quant": "rlx.bench.quant",  # per-format layer error and decode tokens/s
    "products": "rlx.bench.products",  # bare matrix products of a decode step: XLA vs PyTorch
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m rlx.bench {{{'|'.join(BENCHMARKS)}}} [args]", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
