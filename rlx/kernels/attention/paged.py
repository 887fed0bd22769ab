"""Attention of new tokens over a paged KV cache, reading each row's pages where they lie.

A row's cache is the pages its table lists (``rlx.models.paged_kv``): slot ``j`` of the row is
offset ``j % page`` of page ``table[r, j // page]``. ``online_pages`` walks the table in
blocks of ``block_pages`` pages, gathering one block of keys and values at a time, and keeps an
online softmax (running maximum, normaliser and un-normalised output, f32; FlashAttention's,
arXiv:2205.14135) over the blocks in table order. The loop runs as many blocks as the longest
row of the call fills, not the table's width, and no ``[rows, slots]`` copy of the cache is
made.

Every row's numbers are its own: a block is a fixed number of slots, the blocks are visited in
the same order whatever the call, and a block past a row's end is an exact no-op for it (its
scores are masked: the running maximum stays, every rescale is ``exp(0) = 1``, every added term
is 0). A sequence's attention is therefore bit-identical alone or beside longer rows, with any
table width: the continuous-batching engine's batch invariance rests on it.

A block is read once (``load(pages)``: the rows' pages of the pools, ``[b, n, ...]`` as they
lie; the products read a block's pages and slots as two axes, with no copy into one slot axis);
its scores are ``score(block) -> [b, x, g, t, slots]`` and its output term
``values(probs, block) -> [b, x, g, t, dv]`` per value kind: grouped-query attention
(``gqa_paged``: ``x`` KV heads of ``g`` query heads each) and multi-head latent attention's
absorbed decode (``rlx.models.mla``: one latent shared by every head) give their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rlx.kernels.attention.blockwise import MASK_VALUE
from rlx.kernels.attention.dense import from_query_groups, query_groups
from rlx.kernels.attention.local import head_sinks, in_window, sink_start
from rlx.platform.policy import PlatformPolicy, current

_F32 = dict(preferred_element_type=jnp.float32)

Load = Callable[[Int[Array, "b n"]], Any]
Score = Callable[[Any], Float[Array, "b x g t k"]]
Values = Callable[[Float[Array, "b x g t k"], Any], Float[Array, "b x g t v"]]


def block_mask(pos: Int[Array, " k"], ends: Int[Array, " b"], q_positions: Int[Array, "b t"],
               q_segments: Int[Array, "b t"], window: int | None) -> Array:
    """``[b, 1, 1, t, k]``: which of a block's slots (``pos``) each query sees: written
    (before its row's end), not after the query's position, within ``window``; a padding query
    (segment 0) sees nothing."""
    allowed = ((pos[None, None, :] < ends[:, None, None])
               & (pos[None, None, :] <= q_positions[:, :, None])
               & (q_segments[:, :, None] != 0))
    allowed &= in_window(q_positions[:, :, None], pos[None, None, :], window)
    return allowed[:, None, None]


def online_pages(load: Load, score: Score, values: Sequence[Values], table: Int[Array, "b m"],
                 ends: Int[Array, " b"], q_positions: Int[Array, "b t"],
                 q_segments: Int[Array, "b t"], *, page_size: int, block_pages: int,
                 out_shapes: Sequence[tuple[int, ...]], window: int | None = None,
                 sinks: Float[Array, "..."] | None = None
                 ) -> tuple[Float[Array, "b x g t v"], ...]:
    """The normalised outputs (one per ``values``, of ``out_shapes`` ``(b, x, g, t, dv)``, f32)
    of the softmax of ``score`` over each row's first ``ends`` slots (module docstring); a
    query that sees nothing returns zeros. ``window``: keys fewer than that many positions
    back; ``sinks``: logits (broadcast to ``(b, x, g, t)``) in every softmax's denominator
    (``rlx.kernels.attention.local``)."""
    b, m = table.shape
    nb = -(-m // block_pages)
    table = jnp.pad(table, ((0, 0), (0, nb * block_pages - m)))  # page 0: never read unmasked
    width = block_pages * page_size
    blocks = jnp.minimum(nb, (jnp.max(ends) + width - 1) // width)
    shape = out_shapes[0][:-1]

    def body(j, carry):
        big, norm, accs = carry
        block = load(jax.lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1))
        pos = j * width + jnp.arange(width, dtype=jnp.int32)
        seen = block_mask(pos, ends, q_positions, q_segments, window)
        s = jnp.where(seen, score(block), MASK_VALUE)
        new = jnp.maximum(big, jnp.max(s, axis=-1))
        rescale = jnp.exp(big - new)
        p = jnp.where(seen, jnp.exp(s - new[..., None]), 0.0)
        accs = tuple(a * rescale[..., None] + f(p, block) for a, f in zip(accs, values))
        return new, norm * rescale + jnp.sum(p, axis=-1), accs

    start = ((jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32))
             if sinks is None else sink_start(sinks, shape))
    init = (*start, tuple(jnp.zeros(s, jnp.float32) for s in out_shapes))
    _, norm, accs = jax.lax.fori_loop(0, blocks, body, init)
    inv = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)[..., None]
    return tuple(a * inv for a in accs)


def gqa_paged(q: Float[Array, "b t h d"], keys: Float[Array, "P kv d page"],
              values: Float[Array, "P kv page dv"], table: Int[Array, "b m"],
              ends: Int[Array, " b"], q_positions: Int[Array, "b t"],
              q_segments: Int[Array, "b t"], *, block_pages: int, scale: float | None = None,
              window: int | None = None, sinks: Float[Array, " h"] | None = None
              ) -> Float[Array, "b t h dv"]:
    """Grouped-query attention of ``q`` over the pages of ``table`` (keys slots-minor, values
    ``[page, dv]``: ``rlx.models.paged_kv``'s GQA pools), rows ``ends`` slots long; ``window``
    and per-head ``sinks`` as in ``online_pages``."""
    b, t, h, d = q.shape
    kv, page, dv = keys.shape[1], keys.shape[-1], values.shape[-1]
    g = h // kv
    scale = 1 / math.sqrt(d) if scale is None else scale
    qg = query_groups(q, kv)  # [b, kv, g * t, d]

    def load(pages):  # [b, n, kv, d, page], [b, n, kv, page, dv]
        return keys[pages].astype(q.dtype), values[pages].astype(q.dtype)

    def score(block):
        s = jnp.einsum("bkqd,bnkdp->bkqnp", qg, block[0], **_F32)
        return (s * scale).reshape(b, kv, g, t, -1)

    def out(p, block):
        p = p.astype(q.dtype).reshape(b, kv, g * t, -1, page)
        return jnp.einsum("bkqnp,bnkpd->bkqd", p, block[1], **_F32).reshape(b, kv, g, t, dv)

    (o,) = online_pages(load, score, (out,), table, ends, q_positions, q_segments,
                        page_size=page, block_pages=block_pages,
                        out_shapes=((b, kv, g, t, dv),), window=window,
                        sinks=None if sinks is None else head_sinks(sinks, kv)[None, :, :, None])
    return from_query_groups(o).astype(q.dtype)


def block_pages_for(page_size: int, policy: PlatformPolicy | None = None) -> int:
    """Pages per block: the platform's ``paged_attention_block`` slots' worth, at least one
    page."""
    return max(1, (policy or current()).paged_attention_block // page_size)
