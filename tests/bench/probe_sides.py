"""Benchmark sides for the harness tests that must import in an interpreter without rlx's
dependencies or pytest (standard library only)."""

import os
import sys


def interpreter_side():
    """A side that reports the interpreter its worker runs and where rlx was imported from."""
    import rlx

    return lambda: {"python": sys.executable, "rlx": os.path.abspath(rlx.__file__),
                    "path": os.environ.get("PYTHONPATH", "")}


def llama_rows(gguf: str, prompts: list[list[int]], new: int):
    """Greedy rows of llama.cpp's batched path and of its one-prompt path, prompt by prompt."""
    from rlx.bench.llama_cpp_peer import make_generator

    batched = make_generator(gguf, prompts, new)("greedy", 0)
    alone = [make_generator(gguf, [p], new)("greedy", 0)[0] for p in prompts]
    return lambda: {"batched": batched, "alone": alone}
