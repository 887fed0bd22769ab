"""Programs compiled once per argument signature, with the compiler's freed memory handed back.

XLA's compiler (LLVM on CPU) allocates much memory in small blocks while it compiles a train step and frees
them when it is done, but glibc keeps freed small blocks inside the process's heap. The step's
temporary buffers, allocated right after, are fresh large allocations, so the process's peak
resident memory holds both. ``release_free_heap`` returns the free pages (glibc ``malloc_trim``;
a no-op where the C library has none), and ``CompiledPerShape`` calls it after every compilation,
before the new program first runs, which lowers both the resident memory after compiling and the
update's peak.

The learner's steps and the built-in engine's programs both compile through it.
"""


from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from typing import Any

import jax


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_heap() -> bool:
    """Collect garbage, then return the heap's free pages to the OS; False where unsupported."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _signature(args: tuple) -> tuple:
    """What a compiled program is specific to: tree structure, shapes, dtypes (weak or not),
    shardings."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)),
                        getattr(x, "weak_type", False), getattr(x, "sharding", None))
                       for x in leaves)


class CompiledPerShape:
    """A ``jax.jit`` function compiled ahead of time once per argument signature, the compiler's
    freed memory returned (``release_free_heap``) before the program first runs. Called like the
    function; ``lower`` is the function's own; ``compilations()`` counts the programs."""

    def __init__(self, jitted: Any):
        self._jitted = jitted
        self._programs: dict[tuple, Any] = {}

    def lower(self, *args):
        return self._jitted.lower(*args)

    def precompile(self, *args) -> Any:
        """The program for ``args`` (compiled now if new), without running it."""
        key = _signature(args)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._jitted.lower(*args).compile()
            release_free_heap()
        return program

    def __call__(self, *args):
        return self.precompile(*args)(*args)

    def compilations(self) -> int:
        return len(self._programs)
