"""Mixed-precision products: low-precision operands, f32 accumulation, forward and backward.

With a bf16 (or f16) compute dtype every product of the model multiplies low-precision operands
and accumulates in f32 (``preferred_element_type``), rounding the result once. Plain autodiff
breaks that in the backward pass: the cotangent of an f32-accumulated product is f32, so the
transposed products mix f32 with bf16 and XLA upcasts both operands to f32. On XLA:CPU with
AMX / AVX512-BF16 that f32 product cannot use the bf16 units and runs several times slower than
the bf16 one, which made a bf16 train step barely faster than an f32 one. ``mixed_einsum`` has a
custom VJP that rounds the cotangent to the operands' dtype first and runs both transposed
products the same way (what torch autocast and the usual GPU/TPU recipes do). Products in f32 are
plain ``jnp.einsum`` calls, unchanged.

Only 2-D products (projections, LoRA, the tied lm-head) go through here: XLA:CPU runs those in its
XNNPACK fusions, which take bf16 x bf16 -> f32. A batched product (attention) may instead land in
its generic dot thunk, which refuses that type combination ("Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32", seen in the KV-cache decode), so attention keeps its own
einsums.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_low_precision(dtype) -> bool:
    return jnp.dtype(dtype) in LOW_PRECISION


def mixed_einsum(spec: str, a: Array, b: Array, out_dtype=None) -> Array:
    """``jnp.einsum(spec, a, b)`` for two operands of one dtype, accumulated in f32 and returned in
    ``out_dtype`` (default: the operands' dtype). ``spec`` is explicit (``"ij,jk->ik"``, no
    ellipsis) and every index of one operand appears in the other operand or the output."""
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if not is_low_precision(a.dtype):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)
    return _mixed(spec, out_dtype, a, b)


def matmul(x: Array, w: Array, dtype, out_dtype=None) -> Array:
    """``x @ w`` (``[..., d] x [d, f]``) in the compute ``dtype``; leading dims flattened to one
    row axis so the transposed products contract a single axis (no transposed copies).
    ``out_dtype`` (default ``dtype``): f32 returns a low-precision product's accumulator."""
    x, w = x.astype(dtype), w.astype(dtype)
    if not is_low_precision(dtype):
        return jnp.einsum("...d,df->...f", x, w)
    y = _mixed("nd,df->nf", jnp.dtype(out_dtype or dtype), x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*x.shape[:-1], w.shape[-1])


FEW_ROWS = 32  # matmul_out_in's transposed product up to this many rows, a plain one above


def matmul_out_in(x: Array, w: Array, dtype, out_dtype=None) -> Array:
    """``x @ w.T`` for a kernel stored ``[f, d]``; with at most ``FEW_ROWS`` rows computed as
    ``(w @ x^T)^T``.

    On XLA:CPU a decode step's products ``[rows, d] x [d, f]`` with few rows run faster as
    ``[f, d] x [d, rows]``: XLA:CPU picks a faster kernel for that form. Both transposes, of
    the activations only, sit behind ``optimization_barrier``: without them XLA folds them into
    the product's dimension numbers and picks the slow kernel again. With many rows (a prefill, a
    decode step of a large batch) the transposes cost more than they gain, so above ``FEW_ROWS``
    rows the product is ``x @ w.T`` directly.
    """
    rows = math.prod(x.shape[:-1])
    if rows > FEW_ROWS:
        flat = x.astype(dtype).reshape(rows, x.shape[-1])
        y = mixed_einsum("nd,fd->nf", flat, w.astype(dtype), out_dtype)  # [rows, f]
        return y.reshape(*x.shape[:-1], w.shape[0])
    y = jax.lax.optimization_barrier(matmul_feature_major(x, w, dtype, out_dtype)).T  # [rows, f]
    return y.reshape(*x.shape[:-1], w.shape[0])


def matmul_feature_major(x: Array, w: Array, dtype, out_dtype=None) -> Array:
    """``(x @ w.T)^T``, ``[f, rows]``, for a kernel stored ``[f, d]``: ``w @ x^T`` with the
    activations' transpose behind an ``optimization_barrier`` (XLA would otherwise fold it into
    the product's dimension numbers and pick the slower few-rows kernel again). Consumers that
    reduce over ``f`` (the engine's greedy pick over the vocabulary) take this layout directly."""
    x, w = x.astype(dtype), w.astype(dtype)
    xt = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)  # [d, rows]
    if is_low_precision(dtype):
        return _mixed("fd,dn->fn", jnp.dtype(out_dtype or dtype), w, xt)
    return jnp.einsum("fd,dn->fn", w, xt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mixed(spec: str, out_dtype, a: Array, b: Array) -> Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _mixed_fwd(spec, out_dtype, a, b):
    return _mixed(spec, out_dtype, a, b), (a, b)


def _mixed_bwd(spec, out_dtype, residuals, g):
    a, b = residuals
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    g = g.astype(a.dtype)  # rounded like the operands: the product stays low-precision
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{out},{sa}->{sb}", g, a, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


_mixed.defvjp(_mixed_fwd, _mixed_bwd)
