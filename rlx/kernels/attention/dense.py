"""Dense attention: every score of a (query, key) pair materialised, for short sequences and one-
token decode steps (``rlx.kernels.attention.attend`` chooses; longer sequences run blockwise).

A query attends a key of the same non-zero segment (0 marks padding and empty cache slots) whose
position is not after its own (``attention_mask``); a sequence over itself is also column-causal
(``causal_attention``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rlx.kernels.attention.blockwise import MASK_VALUE as _MASK_VALUE
from rlx.kernels.attention.local import head_sinks, sink_softmax


def attention_mask(
    q_segments: Int[Array, "b t"], kv_segments: Int[Array, "b s"],
    q_positions: Int[Array, "b t"], kv_positions: Int[Array, "b s"],
) -> Bool[Array, "b t s"]:
    """Causal-by-position, same-segment, non-padding mask."""
    same = q_segments[:, :, None] == kv_segments[:, None, :]
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    real = (q_segments[:, :, None] != 0) & (kv_segments[:, None, :] != 0)
    return same & causal & real


def gqa_attention(
    q: Float[Array, "b t h d"], k: Float[Array, "b s kv d"], v: Float[Array, "b s kv dv"],
    mask: Bool[Array, "b t s"], kv_major: bool = False, scale: float | None = None,
    sinks: Float[Array, " h"] | None = None,
) -> Float[Array, "b t h dv"]:
    """Grouped-query softmax attention; scores and softmax in f32. ``scale`` multiplies the
    scores (default ``1 / sqrt(d)``); values may be narrower or wider than keys (MLA);
    ``sinks``: per-head logits in the softmax's denominator (``rlx.kernels.attention.local``).

    ``kv_major``: ``k`` and ``v`` come in the KV cache's layouts, keys ``[b, kv, d, s]`` and values
    ``[b, kv, s, d]`` (``rlx.models.kv_cache``; both products read them without a transposed copy),
    instead of ``[b, s, kv, d]``.

    The ``g`` query heads that share a KV head are one ``[g * t, d]`` operand, so each (row, KV head)
    is one product of ``g * t`` queries, which XLA:CPU runs faster forward and backward than a
    product with ``g`` and ``t`` as separate free dimensions.
    """
    b, t, h, d = q.shape
    kv, dv = (k.shape[1] if kv_major else k.shape[2]), v.shape[-1]
    if kv_major and t == 1:
        return _one_query_attention(q, k, v, mask, scale, sinks)
    k, v = k.astype(q.dtype), v.astype(q.dtype)  # a wider cache (`kv_cache.cache_dtype`)
    g = h // kv
    key_spec = "bkqd,bkds->bkqs"  # the cache's keys, slots minor
    if not kv_major:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [b, kv, s, d]
        key_spec = "bkqd,bksd->bkqs"
    # a KV head's g query heads as one [g * t, d] operand: one product per (row, KV head)
    qg = query_groups(q, kv)
    scores = jnp.einsum(key_spec, qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, g, t, -1)  # [b, kv, g, t, s]
    scores = scores / math.sqrt(d) if scale is None else scores * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    sink = None if sinks is None else head_sinks(sinks, kv)[None, :, :, None]  # [1, kv, g, 1]
    probs = sink_softmax(scores, sink).astype(v.dtype).reshape(b, kv, g * t, -1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v).reshape(b, kv, g, t, dv)
    return from_query_groups(out)


def query_groups(q: Float[Array, "b t h d"], kv: int) -> Float[Array, "b kv gt d"]:
    """A KV head's ``g`` query heads as one ``[g * t, d]`` operand (row ``gi * t + token``)."""
    b, t, h, d = q.shape
    return jnp.transpose(q.reshape(b, t, kv, h // kv, d), (0, 2, 3, 1, 4)).reshape(b, kv, -1, d)


def from_query_groups(out: Float[Array, "b kv g t dv"]) -> Float[Array, "b t h dv"]:
    """Per-(KV head, query head, token) outputs back to ``[b, t, h, dv]``."""
    b, kv, g, t, dv = out.shape
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, kv * g, dv)


CAUSAL_BLOCKS = 4  # most query blocks of `causal_attention`
CAUSAL_BLOCK_MIN = 32  # fewest query tokens per block


def causal_attention(
    q: Float[Array, "b t h d"], k: Float[Array, "b t kv d"], v: Float[Array, "b t kv dv"],
    mask: Bool[Array, "b t t"], scale: float | None = None,
    sinks: Float[Array, " h"] | None = None,
) -> Float[Array, "b t h dv"]:
    """``gqa_attention`` of a sequence over itself, column-causal: token ``i`` attends token ``j``
    where ``mask`` allows it and ``j <= i`` (HF's causal mask; rlx's batches order each segment's
    positions along the columns, so ``mask`` alone already implies it for them).

    The queries are split into up to ``CAUSAL_BLOCKS`` blocks, and the block of columns
    ``[a, e)`` multiplies the keys ``[0, e)`` only: with 4 blocks 62.5% of the scores' work and
    memory. On XLA:CPU the scores' element-wise work, not the products, dominates training
    attention at SmolLM2-135M's shapes, so its time falls with the scores' size.
    """
    t = q.shape[1]
    cols = jnp.arange(t)
    mask = mask & (cols[None, :] <= cols[:, None])[None]  # [b, t, t]
    blocks = tuple(causal_blocks(t))
    if len(blocks) == 1:
        return gqa_attention(q, k, v, mask, scale=scale, sinks=sinks)
    outs = [gqa_attention(qb, k[:, :e], v[:, :e], mask[:, a:e, :e], scale=scale, sinks=sinks)
            for qb, (a, e) in zip(_split_tokens(q, blocks), blocks)]
    return jnp.concatenate(outs, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _split_tokens(x, blocks):
    """``x[:, a:e]`` for the disjoint ``blocks``, whose cotangents concatenate back (autodiff
    padded each block's cotangent to the whole sequence and added the pads: three full-size
    adds per layer, in bf16 each with a conversion pair on XLA:CPU)."""
    return tuple(x[:, a:e] for a, e in blocks)


def _split_fwd(x, blocks):
    return _split_tokens(x, blocks), None


def _split_bwd(blocks, _, gs):
    return (jnp.concatenate(gs, axis=1),)


_split_tokens.defvjp(_split_fwd, _split_bwd)


def causal_blocks(t: int) -> list[tuple[int, int]]:
    """``causal_attention``'s query blocks ``[a, e)`` of a ``t``-token sequence: up to
    ``CAUSAL_BLOCKS`` of at least ``CAUSAL_BLOCK_MIN`` tokens, bounds at multiples of 8. Block
    ``[a, e)`` scores ``(e - a) * e`` query-key pairs (the memory planner counts them)."""
    n = max(1, min(CAUSAL_BLOCKS, t // CAUSAL_BLOCK_MIN))
    bounds = sorted({min(t, -(-(t * i // n) // 8) * 8) for i in range(n + 1)})
    return list(zip(bounds, bounds[1:]))


def _one_query_attention(
    q: Float[Array, "b 1 h d"], k: Float[Array, "b kv d s"], v: Float[Array, "b kv s dv"],
    mask: Bool[Array, "b 1 s"], scale: float | None = None,
    sinks: Float[Array, " h"] | None = None,
) -> Float[Array, "b 1 h dv"]:
    """``gqa_attention`` of one new token per row over a KV-head-major cache (a decode step).

    The same math with the query axis dropped from both products: XLA:CPU then runs them as
    ``[kv, g, d] x [kv, s, d]`` batched products instead of a generic dot with a transposed
    output, which speeds up the engine's decode step.
    """
    b, _, h, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, d)  # [b, kv, g, d]
    scores = jnp.einsum("bkgd,bkds->bkgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d) if scale is None else scores * scale
    scores = jnp.where(mask[:, None, :, :], scores, _MASK_VALUE)
    sink = None if sinks is None else head_sinks(sinks, kv)[None]  # [1, kv, g]
    probs = sink_softmax(scores, sink).astype(q.dtype)  # [b, kv, g, s]
    out = jnp.einsum("bkgs,bksd->bkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, 1, h, v.shape[-1])
