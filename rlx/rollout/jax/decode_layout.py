"""The built-in engine's own layout of float projection weights: ``[out, in]`` on XLA:CPU
(``PlatformPolicy.decode_layout``).

A decode step multiplies few rows (one token per sequence) by every projection. XLA:CPU runs that
product faster with the weight stored ``[out, in]`` and the activations transposed around it
(``rlx.models.mixed.matmul_out_in``: XLA:CPU picks a faster kernel for that form).
Where the engine keeps its own copy of a weight anyway (the learner donates its trainable
variables each update), it stores that copy's float ``Linear`` kernels transposed and, for a head
tied to the embedding (already ``[vocab, d]``), multiplies it the same way. Kernels it shares with
the learner (LoRA mode's frozen base) keep the learner's ``[in, out]``: one copy of the base
outweighs a faster product on one backend. The learner's model is never changed.

Quantized kernels (``QTensor``, GGUF blocks) keep their layout; their few-row products read the
packed values (``rlx.quant``).
Layer math is unchanged; only the order of the f32 sums inside a product differs, so log-probs
agree with the learner's to rounding (the engine's parity tests hold at their 1e-5 tolerance).

``LAYOUTS``: ``"out_in"`` (the CPU default), ``"in_out"`` (the learner's layout; the default
elsewhere, where XLA's layout assignment already picks the product's kernel).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rlx.models.decoder import Transformer
from rlx.models.layers import Linear
from rlx.models.mixed import is_low_precision
from rlx.platform.policy import PlatformPolicy, current

LAYOUTS = ("auto", "out_in", "in_out")


def resolve_layout(layout: str, policy: PlatformPolicy | None = None) -> str:
    """``auto`` -> the platform ``policy``'s ``decode_layout`` (by default
    ``rlx.platform.current()``'s: ``out_in`` on XLA:CPU, ``in_out`` elsewhere); checks the name."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout {layout!r} is not one of {LAYOUTS}")
    if layout == "auto":
        return (policy or current()).decode_layout
    return layout


def _transposed(kernel: nnx.Variable) -> nnx.Variable:
    """The kernel with its last two axes swapped (a scanned model's layer axis stays first)."""
    axes = kernel.get_metadata().get("logical_axes")
    meta = {"logical_axes": tuple(axes[:-2]) + (axes[-1], axes[-2])} if axes is not None else {}
    return kernel.replace(jnp.swapaxes(kernel[...], -1, -2), **meta)


def _transposable(node) -> bool:
    """Whether the ``out_in`` layout transposes ``node``'s kernel: a float ``Linear`` stored
    ``[in, out]`` (quantized kernels keep their layout)."""
    return isinstance(node, Linear) and node.kernel_layout == "in_out" and isinstance(
        node.kernel, nnx.Variable)


def out_in_kernels(model: nnx.Module) -> frozenset[tuple]:
    """The variable paths of the kernels ``to_out_in`` transposes (none kept)."""
    return frozenset(tuple(p) + ("kernel",) for p, node in nnx.iter_graph(model)
                     if _transposable(node))


def to_out_in(model: nnx.Module, keep: frozenset[tuple] = frozenset()) -> frozenset[tuple]:
    """Transpose ``model``'s float ``Linear`` kernels in place (``kernel_layout="out_in"``), except
    those at ``keep`` paths, and let a tied f32 head use the same product; returns the paths of the
    transposed kernels."""
    paths = []
    for path, node in nnx.iter_graph(model):
        if _transposable(node) and tuple(path) + ("kernel",) not in keep:
            node.kernel = _transposed(node.kernel)
            node.kernel_layout = "out_in"
            paths.append(tuple(path) + ("kernel",))
        elif isinstance(node, Transformer) and node.lm_head is None:
            node.tied_head_out_in = not is_low_precision(node.precision.dtype)
    return frozenset(paths)


def transpose_update(state: nnx.State, paths: frozenset[tuple]) -> nnx.State:
    """New values for some variables (learner layout) in the engine's layout: the kernels at
    ``paths`` transposed, everything else as given."""
    if not paths:
        return state
    flat = [(p, _transposed(v) if tuple(p) in paths else v) for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)
