"""``python -m rlx.bench NAME [args]``: run one benchmark by name."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "quant": "rlx.bench.quant",  # quantization error of each base format vs f32 (markdown table)
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m rlx.bench {{{'|'.join(BENCHMARKS)}}} [args]", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
