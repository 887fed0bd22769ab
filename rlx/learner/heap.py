"""Handing freed heap memory back to the operating system, and steps compiled once per shape.

XLA's compiler (LLVM on CPU) allocates much memory in small blocks while it compiles a train step and frees
them when it is done, but glibc keeps freed small blocks inside the process's heap. The step's
temporary buffers, allocated right after, are fresh large allocations, so the process's peak
resident memory holds both. ``release_free_heap`` returns the free pages (glibc ``malloc_trim``;
a no-op where the C library has none), and ``CompiledPerShape`` calls it after every compilation,
before the new program first runs, which lowers both the resident memory after compiling and the
update's peak (figures: rlx/bench/README.md, "Design measurements").

``UpdatePerShape`` compiles an update ``(state, ...) -> (state, ...)`` that donates the state but
not its frozen part: the frozen base goes in as an argument of its own, is not donated and does not
come out (the new state gets the very same arrays back). A donated buffer is deleted even where the
step passes it through unchanged, and a passed-through argument that is not donated is copied into
a new output buffer; either would make whoever shares the base (the built-in engine samples from
it) hold a deleted array or a second copy.
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


class UpdatePerShape:
    """``step(state, *rest) -> (new_state, *aux)`` compiled per shape (``CompiledPerShape``) with
    ``state`` donated except ``state.frozen`` (see the module docstring). ``in_shardings`` and
    ``out_shardings`` are ``step``'s own; ``lower`` takes ``step``'s arguments."""

    def __init__(self, step: Callable, *, in_shardings: tuple, out_shardings: tuple, **jit_kw):
        state_in, *rest_in = in_shardings
        state_out, *aux_out = out_shardings

        def apart(state, frozen, *rest):
            new, *aux = step(state.replace(frozen=frozen), *rest)
            return (new.replace(frozen=None), *aux)

        self._compiled = CompiledPerShape(jax.jit(
            apart, in_shardings=(state_in.replace(frozen=None), state_in.frozen, *rest_in),
            out_shardings=(state_out.replace(frozen=None), *aux_out), donate_argnums=(0,),
            **jit_kw))

    @staticmethod
    def _args(state, *rest) -> tuple:
        return (state.replace(frozen=None), state.frozen, *rest)

    def lower(self, *args):
        return self._compiled.lower(*self._args(*args))

    def precompile(self, *args) -> Any:
        return self._compiled.precompile(*self._args(*args))

    def __call__(self, state, *rest):
        new, *aux = self._compiled(*self._args(state, *rest))
        return (new.replace(frozen=state.frozen), *aux)

    def compilations(self) -> int:
        return self._compiled.compilations()
