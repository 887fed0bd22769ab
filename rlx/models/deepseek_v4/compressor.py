"""DeepSeek-V4's KV compressors and lightning indexer (paper section 2.3).

A compressor turns every ``rate`` consecutive tokens of a sequence into one key/value entry:
``kv = x @ wkv``, ``gate = x @ wgate + ape`` (a learned bias per slot of the window), and the entry
is the per-channel softmax(gate)-weighted sum of the window's ``kv``, RMS-normalised (``norm``) and
rotated (``rlx.models.deepseek_v4.rope``, ``compress`` table) at the window's first position ``w * rate``.
Heavily compressed attention (HCA) uses non-overlapping windows (``kv`` of width ``head_dim``).
Compressed sparse attention (CSA) projects to ``2 * head_dim``: the first half of each token is
its contribution to the *next* window, the second half to its own, so entry ``w`` pools ``2 *
rate`` slots (window ``w - 1``'s first halves, window ``w``'s second halves; window 0's missing
half has weight 0). A query at position ``p`` sees the entries of complete windows,
``w < (p + 1) // rate`` (``visible``).

The indexer (CSA only) keeps, per query, the ``index_topk`` visible entries it scores highest
(``select``): its own overlapping compressor at ``index_head_dim``, queries ``wq_b`` on the
attention's query latent (rotated with the ``compress`` table), and the score
``sum_h w_h nh^-1/2 relu(q_h . k) ihd^-1/2`` with ``w = x @ weights_proj``, in f32.

Windows are counted from column 0 of a row, so rows hold one sequence each starting there
(right padding); the tokens of a window a query sees are all real. The compressor weights are
``nnx.Param`` (trained in mode A through the attention that reads them; frozen in mode B, as
every base weight); the indexer's are ``IndexerWeight`` buffers, frozen in both modes: the
top-k choice carries no gradient, and DeepSeek trains the indexer with its own loss (a KL
divergence to the main attention's scores), which rlx does not implement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rlx.models.dsa import IndexerWeight
from rlx.models.deepseek_v4.hyper import unweighted_rms
from rlx.models.layers import param
from rlx.models.deepseek_v4.rope import Angles, rotate_tail


def _indexer_weight(rngs, shape, init="normal") -> IndexerWeight:
    value = param(rngs, shape, jnp.float32, (None,) * len(shape), init)[...]
    return IndexerWeight(value, logical_axes=(None,) * len(shape))


class Compressor(nnx.Module):
    """One compressor's weights: ``wkv``, ``wgate`` ``[d, c]``, ``ape`` ``[rate, c]``, ``norm``
    ``[head]`` with ``c = head`` (HCA) or ``2 * head`` (``overlap``, CSA)."""

    def __init__(self, d: int, head: int, rate: int, overlap: bool, param_dtype, rngs,
                 frozen: bool = False):
        c = 2 * head if overlap else head
        if frozen:
            make = lambda shape, init="normal": _indexer_weight(rngs, shape, init)  # noqa: E731
        else:
            make = lambda shape, init="normal": param(  # noqa: E731
                rngs, shape, param_dtype if init == "normal" else jnp.float32, (None,) * len(shape),
                init)
        self.wkv, self.wgate = make((d, c)), make((d, c))
        self.ape = make((rate, c), "zeros")
        self.norm = make((head,), "ones")
        self.rate, self.overlap, self.head = rate, overlap, head

    def sources(self, x: Float[Array, "b t d"]) -> tuple[Array, Array]:
        """Each token's projections ``kv``, ``gate`` ``[b, t, c]`` (what a decode cache keeps)."""
        return x @ self.wkv[...].astype(x.dtype), x @ self.wgate[...].astype(x.dtype)

    def pool(self, kv: Float[Array, "b t c"], gate: Float[Array, "b t c"], eps: float,
             rope: Angles) -> Float[Array, "b w h"]:
        """The entries of the ``t // rate`` complete windows of the sources; ``rope``: the
        ``compress`` angles at each window's first position."""
        b, t, c = kv.shape
        r, n = self.rate, t // self.rate
        kv, gate = kv[:, :n * r].reshape(b, n, r, c), gate[:, :n * r].reshape(b, n, r, c)
        gate = gate.astype(jnp.float32) + self.ape[...].astype(jnp.float32)
        if self.overlap:
            h = self.head
            prev = lambda a, fill: jnp.pad(a[:, :-1, :, :h], ((0, 0), (1, 0), (0, 0), (0, 0)),  # noqa: E731
                                           constant_values=fill)
            kv = jnp.concatenate([prev(kv, 0.0), kv[..., h:]], axis=2)
            gate = jnp.concatenate([prev(gate, -jnp.inf), gate[..., h:]], axis=2)
        pooled = jnp.sum(kv.astype(jnp.float32) * jax.nn.softmax(gate, axis=2), axis=2)
        normed = unweighted_rms(pooled, eps) * self.norm[...].astype(jnp.float32)
        return rotate_tail(normed[:, :, None, :], *rope)[:, :, 0, :].astype(kv.dtype)

    def __call__(self, x: Float[Array, "b t d"], eps: float, rope: Angles
                 ) -> Float[Array, "b w h"]:
        """The entries of the ``t // rate`` complete windows of ``x``."""
        return self.pool(*self.sources(x), eps, rope)


def visible(positions: Int[Array, "b t"], n: int, rate: int) -> Bool[Array, "b t w"]:
    """Entries ``w`` of complete windows before each query: ``w < (p + 1) // rate``."""
    return jnp.arange(n)[None, None, :] < ((positions + 1) // rate)[:, :, None]


class Indexer(nnx.Module):
    """The lightning indexer of one CSA layer (module docstring); frozen buffers."""

    def __init__(self, d: int, q_rank: int, heads: int, head: int, topk: int, rate: int, rngs):
        self.compressor = Compressor(d, head, rate, True, jnp.float32, rngs, frozen=True)
        self.wq_b = _indexer_weight(rngs, (q_rank, heads * head))
        self.weights_proj = _indexer_weight(rngs, (d, heads))
        self.heads, self.head, self.topk = heads, head, topk

    def select(self, x: Float[Array, "b t d"], q_latent: Float[Array, "b t r"], eps: float,
               query_rope: Angles, key_rope: Angles, allowed: Bool[Array, "b t w"],
               sources: tuple[Array, Array] | None = None) -> Bool[Array, "b t w"]:
        """The visible entries each query keeps: its ``topk`` best by the indexer's score.
        ``sources``: the compressor's cached projections of every position (decoding), else
        those of ``x``."""
        sources = self.compressor.sources(x) if sources is None else sources
        keys = self.compressor.pool(*sources, eps, key_rope).astype(jnp.float32)  # [b, w, ihd]
        b, t, _ = x.shape
        q = (q_latent.astype(jnp.float32) @ self.wq_b[...]).reshape(b, t, self.heads, self.head)
        q = rotate_tail(q, *query_rope)
        scores = jax.nn.relu(jnp.einsum("bthc,bwc->bthw", q, keys)) * self.head ** -0.5
        weights = (x.astype(jnp.float32) @ self.weights_proj[...]) * self.heads ** -0.5
        index = jnp.einsum("bthw,bth->btw", scores, weights)
        index = jnp.where(allowed, index, -jnp.inf)
        if index.shape[-1] == 0:
            return allowed
        k = min(self.topk, index.shape[-1])
        _, top = jax.lax.top_k(index, k)  # [b, t, k]
        picked = jnp.zeros(index.shape, bool).at[
            jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], top].set(True)
        return jax.lax.stop_gradient(picked & allowed)
