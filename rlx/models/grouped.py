"""Grouped matrix products over frozen quantized expert stacks, one expert's weight at a time.

``jax.lax.ragged_dot`` has native kernels on TPU and GPU; on XLA:CPU it runs the product of
every row with every expert and masks the result, and a quantized stack is first dequantized whole
(``[E, K, N]`` in float for each projection). ``grouped_matmul`` computes the same
``y[r] = x[r] @ w[expert(r)]`` (rows sorted by expert, ``group_sizes[e]`` rows for expert ``e``,
rows past their sum zero) by visiting the (row tile, expert) pairs the groups actually cover, in
order: at most ``tiles + E - 1`` pairs, of which the empty ones are skipped. Each expert's matrix
is dequantized once per call, when the walk reaches it (consecutive pairs of one expert reuse it),
so a layer holds one expert's float matrix instead of the stack's. The gradient with respect to
``x`` is the same walk over the transposed matrices (``custom_vjp``; nothing is saved but the
group sizes); the stack itself is frozen (quantized tensors are never trained).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int


def tile_rows(m: int, experts: int) -> int:
    """Rows per tile: about the mean group size (a power of two in [8, 128])."""
    mean = max(1, -(-m // max(experts, 1)))
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def _pairs(group_sizes: Array, m: int, tile: int):
    """(tile, expert, valid) of every pair the groups cover, padded to ``tiles + E - 1``."""
    g = group_sizes.shape[0]
    tiles = -(-m // tile)
    ends = jnp.cumsum(group_sizes)
    total = ends[-1]
    lo = jnp.arange(tiles) * tile
    hi = jnp.minimum(lo + tile, total) - 1
    first = jnp.minimum(jnp.searchsorted(ends, lo, side="right"), g - 1)
    last = jnp.minimum(jnp.searchsorted(ends, hi, side="right"), g - 1)
    count = jnp.where(lo < total, last - first + 1, 0)
    upto = jnp.cumsum(count)
    p = jnp.arange(tiles + g - 1)
    t = jnp.minimum(jnp.searchsorted(upto, p, side="right"), tiles - 1)
    valid = p < upto[-1]
    e = jnp.clip(first[t] + p - (upto[t] - count[t]), 0, g - 1)  # padding pairs: skipped
    return t, e, valid, ends - group_sizes, ends


def _expert(a: Array, i) -> Array:
    """``a[i]``. The barrier ties the stack to the (varying) index: XLA:CPU widens an fp8 operand
    of a slice to a wider float, and inside a decode loop it would hoist that conversion of the
    whole stack out of the loop, a float copy of every expert."""
    a, i = jax.lax.optimization_barrier((a, i))
    return jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _walk(x: Array, leaves, graphdef, group_sizes: Array, transpose: bool) -> Array:
    """``sum over pairs`` of the masked tile products (``transpose``: with ``w[e]^T``)."""
    m, k = x.shape
    tile = tile_rows(m, group_sizes.shape[0])
    tiles = -(-m // tile)
    xp = jnp.pad(x, ((0, tiles * tile - m), (0, 0)))
    t, e, valid, starts, ends = _pairs(group_sizes, m, tile)

    def weight(i):
        one = jax.tree.map(lambda a: _expert(a, i), leaves)
        w = nnx.merge(graphdef, one).dequantize(x.dtype)  # [K, N]
        return w.T if transpose else w

    w0 = weight(e[0])  # the first pair's matrix (inside shard_map: typed like every later one)

    def body(carry, pair):
        out, w, prev = carry
        ti, ei, ok = pair
        w = jax.lax.cond(ok & (ei != prev), lambda: weight(ei), lambda: w)
        rows = ti * tile + jnp.arange(tile)
        mask = (rows >= starts[ei]) & (rows < ends[ei]) & ok

        def add(out):
            xt = jax.lax.dynamic_slice_in_dim(xp, ti * tile, tile)
            y = jnp.dot(xt, w, preferred_element_type=jnp.float32) * mask[:, None]
            cur = jax.lax.dynamic_slice_in_dim(out, ti * tile, tile)
            return jax.lax.dynamic_update_slice_in_dim(out, cur + y, ti * tile, 0)
        out = jax.lax.cond(ok, add, lambda o: o, out)
        return (out, w, jnp.where(ok, ei, prev)), None

    zero = jnp.where(False, xp[:, :1], 0).astype(jnp.float32)  # [rows, 1], typed like x
    init = (zero + jnp.where(False, w0[:1], 0).astype(jnp.float32), w0, e[0])
    (out, _, _), _ = jax.lax.scan(body, init, (t, e, valid))
    return out[:m].astype(x.dtype)


def _zeros_like(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


def grouped_matmul(x: Float[Array, "m k"], weights: nnx.Module, group_sizes: Int[Array, " e"]
                   ) -> Float[Array, "m n"]:
    """``jax.lax.ragged_dot(x, weights.dequantize(x.dtype), group_sizes)`` without dequantizing
    the stack whole; ``weights``: a frozen quantized ``[E, K, N]`` stack (any module whose leaves
    all lead with ``E`` and whose ``dequantize(dtype)`` gives its float matrix)."""
    graphdef, leaves = nnx.split(weights)

    @jax.custom_vjp
    def product(x, leaves, group_sizes):
        return _walk(x, leaves, graphdef, group_sizes, False)

    def forward(x, leaves, group_sizes):
        return product(x, leaves, group_sizes), (leaves, group_sizes)

    def backward(res, dy):
        leaves, group_sizes = res
        dx = _walk(dy, leaves, graphdef, group_sizes, True)
        return dx, jax.tree.map(_zeros_like, leaves), _zeros_like(group_sizes)

    product.defvjp(forward, backward)
    return product(x, leaves, group_sizes)


__all__ = ["grouped_matmul", "tile_rows"]
