"""``UpdatePerShape`` compiles an update ``(state, ...) -> (state, ...)`` that donates the state but
not its frozen part: the frozen base goes in as an argument of its own, is not donated and does not
come out (the new state gets the very same arrays back). A donated buffer is deleted even where the
step passes it through unchanged, and a passed-through argument that is not donated is copied into
a new output buffer; either would make whoever shares the base (the built-in engine samples from
it) hold a deleted array or a second copy. Programs compile once per shape
(``rlx.platform.compiled.CompiledPerShape``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from rlx.platform.compiled import CompiledPerShape


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
