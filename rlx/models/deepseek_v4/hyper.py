"""Manifold-constrained hyper-connections (mHC; Xie et al. 2026, DeepSeek-V4 section 2.2).

The residual stream is ``hc_mult`` parallel copies ``[b, t, n, d]`` instead of one. Before each
attention or MLP block a ``HyperConnection`` reads all streams (flattened to ``n * d``, an
unweighted RMSNorm, one projection ``fn`` to ``2n + n^2`` numbers per token) and makes three
mixings: ``pre = sigmoid(.) + eps`` collapses the streams into the block's input,
``post = 2 sigmoid(.)`` spreads the block's output back over the streams, and ``comb``, a
row-softmax (``+ eps``) pushed towards a doubly-stochastic matrix by ``hc_sinkhorn_iters``
Sinkhorn-Knopp normalisations (columns first, then rows and columns ``iters - 1`` times, each
denominator ``+ eps``), mixes the input streams into the output streams:
``out[k] = post[k] * block + sum_j comb[j, k] * streams[j]``. ``HyperHead`` collapses the streams
once more (``pre`` alone) before the final norm. Each of the three mixings has its own scale
(``scale[0..2]``) on the projection and its own bias (``base``). Everything here runs in f32, as
transformers keeps these modules in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from rlx.models.layers import param


def unweighted_rms(x: Float[Array, "... d"], eps: float) -> Float[Array, "... d"]:
    """``x / rms(x)`` in f32 (no weight)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def sinkhorn(comb: Float[Array, "... n n"], iters: int, eps: float) -> Float[Array, "... n n"]:
    """Columns normalised, then ``iters - 1`` rounds of rows and columns (denominators + eps)."""
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


class HyperConnection(nnx.Module):
    """The mixings of one block (module docstring): ``fn [(2+n)n, n*d]``, ``base [(2+n)n]``,
    ``scale [3]``."""

    def __init__(self, d: int, n: int, iters: int, eps: float, norm_eps: float, rngs):
        m = (2 + n) * n
        self.fn = param(rngs, (m, n * d), jnp.float32, (None, None))
        self.base = param(None, (m,), jnp.float32, (None,), "zeros")
        self.scale = param(None, (3,), jnp.float32, (None,), "ones")
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps

    def __call__(self, streams: Float[Array, "b t n d"]):
        """``(post [b, t, n], comb [b, t, n, n], collapsed [b, t, d])``."""
        b, t, n, d = streams.shape
        mixes = unweighted_rms(streams.reshape(b, t, n * d), self.norm_eps) @ self.fn[...].T
        pre_w, post_w, comb_w = mixes[..., :n], mixes[..., n:2 * n], mixes[..., 2 * n:]
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(pre_w * scale[0] + base[:n]) + self.eps
        post = 2 * jax.nn.sigmoid(post_w * scale[1] + base[n:2 * n])
        logits = (comb_w * scale[2] + base[2 * n:]).reshape(b, t, n, n)
        comb = sinkhorn(jax.nn.softmax(logits, axis=-1) + self.eps, self.iters, self.eps)
        collapsed = jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32))
        return post, comb, collapsed.astype(streams.dtype)


def expand(streams: Float[Array, "b t n d"], block: Float[Array, "b t d"], post, comb
           ) -> Float[Array, "b t n d"]:
    """``out[k] = post[k] * block + sum_j comb[j, k] * streams[j]`` in ``streams``' dtype."""
    dtype = streams.dtype
    mixed = jnp.einsum("btjk,btjd->btkd", comb.astype(dtype), streams)
    return post.astype(dtype)[..., None] * block.astype(dtype)[:, :, None, :] + mixed


class HyperHead(nnx.Module):
    """The final collapse of the streams: ``hc_fn [n, n*d]``, ``hc_base [n]``, ``hc_scale [1]``."""

    def __init__(self, d: int, n: int, eps: float, norm_eps: float, rngs):
        self.hc_fn = param(rngs, (n, n * d), jnp.float32, (None, None))
        self.hc_base = param(None, (n,), jnp.float32, (None,), "zeros")
        self.hc_scale = param(None, (1,), jnp.float32, (None,), "ones")
        self.eps, self.norm_eps = eps, norm_eps

    def __call__(self, streams: Float[Array, "b t n d"]) -> Float[Array, "b t d"]:
        b, t, n, d = streams.shape
        mixes = unweighted_rms(streams.reshape(b, t, n * d), self.norm_eps) @ self.hc_fn[...].T
        pre = jax.nn.sigmoid(mixes * self.hc_scale[...] + self.hc_base[...]) + self.eps
        return jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32)).astype(streams.dtype)
