"""Blockwise attention in plain XLA: an online softmax forward and a recomputing backward.

``blockwise_attention`` computes grouped-query softmax attention (``h`` query heads, ``kv`` key
and value heads, values possibly narrower or wider than keys, as MLA's are) without any
``[t, s]`` score, probability or mask tensor. Queries are cut into ``nq`` blocks of ``bq`` tokens
and keys/values into ``nk`` blocks of ``bk`` slots (FlashAttention, arXiv:2205.14135, and its
second version's loop order, arXiv:2307.08691, in XLA loops rather than a fused kernel):

* forward: for each query block, a loop over the key blocks keeps each query's running maximum
  ``m``, normaliser ``l`` and un-normalised output ``acc`` (f32), rescaling them by
  ``exp(m_old - m_new)`` as a block raises the maximum. It returns the output and each query's
  log-sum-exp ``lse = m + log l``.
* backward (a custom VJP): with ``D = rowsum(dO * O)``, each key block loops over the query
  blocks, rebuilds ``P = exp(S - lse)`` from the saved ``lse``, and accumulates
  ``dV += P^T dO``, ``dS = P * (dO V^T - D)``, ``dK += dS^T Q``, ``dQ += dS K``.

Live memory beyond the inputs and outputs is one ``[b, h, bq, bk]`` block of scores and a few
``O(t)`` accumulators per head: linear in the sequence length for fixed blocks.

The mask is built per block from per-token vectors, never stored whole: a query attends a key
of the same non-zero segment (0 marks padding and empty cache slots) whose position is not
after its own; ``causal_columns`` adds column causality (a sequence over itself, HF's mask:
key column ``<=`` query column) and lets both passes skip the key blocks wholly to the right of a
query block's last column; ``window`` keeps only keys less than ``window`` positions back
(sliding-window layers); ``sinks`` are per-head logits of a virtual key with a zero value that
joins every query's softmax (attention sinks). A block pair that its mask wholly removes (padding,
another packed sequence, the future in a cache) is skipped at run time. A query that attends
nothing returns zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rlx.kernels.attention.local import head_sinks, in_window, sink_start

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # a masked score: exp underflows to 0
_F32 = dict(preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a blockwise attention call: its blocks, scale and mask kind."""

    block_q: int  # query tokens per block
    block_k: int  # key slots per block
    groups: int  # query heads per key/value head
    scale: float
    causal_columns: bool = False
    window: int | None = None

    def key_blocks(self, i: Int[Array, ""], nk: int) -> Int[Array, ""]:
        """How many leading key blocks query block ``i`` can see (all without column
        causality)."""
        if not self.causal_columns:
            return jnp.asarray(nk)
        return jnp.minimum(nk, ((i + 1) * self.block_q - 1) // self.block_k + 1)

    def first_query_block(self, j: Int[Array, ""]) -> Int[Array, ""]:
        """The first query block that can see key block ``j``."""
        return (j * self.block_k) // self.block_q if self.causal_columns else jnp.asarray(0)

    def mask(self, qs, qp, ks, kp, i, j) -> Array:
        """``[b, bq, bk]`` mask of query block ``i`` (segments ``qs``, positions ``qp``: ``[b,
        bq]``) over key block ``j`` (``ks``, ``kp``: ``[b, bk]``)."""
        allowed = ((qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
                   & (kp[:, None, :] <= qp[:, :, None]))
        allowed &= in_window(qp[:, :, None], kp[:, None, :], self.window)
        if self.causal_columns:
            rows = i * self.block_q + jnp.arange(self.block_q)
            cols = j * self.block_k + jnp.arange(self.block_k)
            allowed &= (cols[None, :] <= rows[:, None])[None]
        return allowed


def blockwise_attention(
    q: Float[Array, "b t h d"], k: Float[Array, "b s kv d"], v: Float[Array, "b s kv dv"],
    q_segments: Int[Array, "b t"], kv_segments: Int[Array, "b s"],
    q_positions: Int[Array, "b t"], kv_positions: Int[Array, "b s"], *,
    scale: float | None = None, causal_columns: bool = False, window: int | None = None,
    sinks: Float[Array, " h"] | None = None, block_q: int = 512, block_k: int = 512,
    kv_major: bool = False,
) -> Float[Array, "b t h dv"]:
    """Softmax attention of ``q`` over ``k``/``v`` under the segment/position mask (module
    docstring), in blocks of at most ``block_q`` queries and ``block_k`` keys. ``scale``
    multiplies the scores (default ``1 / sqrt(d)``). ``kv_major``: ``k`` and ``v`` come in the KV
    cache's layouts, keys ``[b, kv, d, s]`` and values ``[b, kv, s, dv]``
    (``rlx.models.kv_cache``). Differentiable in ``q``, ``k``, ``v`` and ``sinks``."""
    b, t, h, d = q.shape
    kv = k.shape[1] if kv_major else k.shape[2]
    s = k.shape[-1] if kv_major else k.shape[1]
    bq, nq = block_split(t, block_q)
    bk, nk = block_split(s, block_k)
    spec = MaskSpec(bq, bk, h // kv, float(1 / math.sqrt(d) if scale is None else scale),
                    causal_columns, window)
    qb = _query_blocks(q, kv, bq, nq)
    kb, vb = _key_blocks(k, v, bk, nk, kv_major)
    qs, qp = (_token_blocks(x, bq, nq) for x in (q_segments, q_positions))
    ks, kp = (_token_blocks(x, bk, nk) for x in (kv_segments, kv_positions))
    sink = None if sinks is None else head_sinks(sinks, kv)
    out = _attend(spec, qb, kb.astype(q.dtype), vb.astype(q.dtype), qs, qp, ks, kp, sink)
    return _from_query_blocks(out, b, t, h)


def block_split(n: int, block: int) -> tuple[int, int]:
    """``(size, count)`` of the blocks that cover ``n`` tokens with blocks of at most ``block``:
    as few blocks as ``block`` allows, of equal sizes rounded up to a multiple of 8 (the last is
    padded)."""
    count = max(1, -(-n // block))
    size = -(-n // count)
    return (-(-size // 8) * 8 if size > 8 else size), count


def _pad_to(x, axis: int, length: int):
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _query_blocks(q, kv: int, bq: int, nq: int):
    """``[b, t, h, d]`` -> ``[nq, b, kv, g * bq, d]``: a KV head's ``g`` query heads of one block
    as one operand (row ``gi * bq + token``)."""
    b, _, h, d = q.shape
    q = _pad_to(q, 1, nq * bq).reshape(b, nq, bq, kv, h // kv, d)
    return jnp.transpose(q, (1, 0, 3, 4, 2, 5)).reshape(nq, b, kv, h // kv * bq, d)


def _from_query_blocks(out, b: int, t: int, h: int):
    """``_query_blocks``' inverse for the output ``[nq, b, kv, g * bq, dv]``."""
    nq, _, kv, gbq, dv = out.shape
    g = h // kv
    out = out.reshape(nq, b, kv, g, gbq // g, dv)
    return jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, -1, h, dv)[:, :t]


def _key_blocks(k, v, bk: int, nk: int, kv_major: bool):
    """Keys and values as ``[nk, b, kv, bk, d]`` blocks."""
    if kv_major:  # keys [b, kv, d, s], values [b, kv, s, dv]
        b, kv, d, _ = k.shape
        k = _pad_to(k, 3, nk * bk).reshape(b, kv, d, nk, bk)
        kb = jnp.transpose(k, (3, 0, 1, 4, 2))
        v = _pad_to(v, 2, nk * bk)
        vb = jnp.moveaxis(v.reshape(b, kv, nk, bk, v.shape[-1]), 2, 0)
        return kb, vb
    b, _, kv, d = k.shape

    def blocks(x):
        x = _pad_to(x, 1, nk * bk).reshape(b, nk, bk, kv, x.shape[-1])
        return jnp.transpose(x, (1, 0, 3, 2, 4))

    return blocks(k), blocks(v)


def _token_blocks(x, size: int, count: int):
    """Per-token ``[b, n]`` vectors as ``[count, b, size]`` (padding: segment 0)."""
    b = x.shape[0]
    return jnp.moveaxis(_pad_to(x.astype(jnp.int32), 1, count * size).reshape(b, count, size), 1, 0)


def _scores(spec: MaskSpec, qb, kb, mask):
    """Masked f32 scores ``[b, kv, g * bq, bk]`` of one block pair."""
    b, kv, gbq, _ = qb.shape
    s = jnp.einsum("bkqd,bksd->bkqs", qb, kb, **_F32) * spec.scale
    s = s.reshape(b, kv, spec.groups, spec.block_q, -1)
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    return s.reshape(b, kv, gbq, -1)


def _expand(mask, kv: int, groups: int):
    """A ``[b, bq, bk]`` block mask broadcast to the scores' ``[b, kv, g * bq, bk]``."""
    b, bq, bk = mask.shape
    return jnp.broadcast_to(mask[:, None, None], (b, kv, groups, bq, bk)).reshape(b, kv, -1, bk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(spec, qb, kb, vb, qs, qp, ks, kp, sink):
    return _forward(spec, qb, kb, vb, qs, qp, ks, kp, sink)[0]


def _forward(spec: MaskSpec, qb, kb, vb, qs, qp, ks, kp, sink):
    """Outputs ``[nq, b, kv, g * bq, dv]`` and log-sum-exps ``[nq, b, kv, g * bq]``."""
    nk = kb.shape[0]
    _, b, kv, gbq, _ = qb.shape
    dv = vb.shape[-1]

    def query_block(_, xs):
        qi, qsi, qpi, i = xs
        if sink is None:
            m0, l0 = jnp.full((b, kv, gbq), MASK_VALUE, jnp.float32), jnp.zeros((b, kv, gbq))
        else:  # the sink: a key of logit `sink` and value 0
            m0, l0 = sink_start(jnp.repeat(sink, spec.block_q, axis=1), (b, kv, gbq))

        def key_block(j, carry):
            mask = spec.mask(qsi, qpi, ks[j], kp[j], i, j)
            update = functools.partial(_online_update, spec, qi, kb[j], vb[j], mask)
            return jax.lax.cond(jnp.any(mask), update, lambda c: c, carry)

        init = (m0, l0, jnp.zeros((b, kv, gbq, dv), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, spec.key_blocks(i, nk), key_block, init)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -MASK_VALUE)
        return None, (out.astype(qb.dtype), lse)

    nq = qb.shape[0]
    _, (out, lse) = jax.lax.scan(query_block, None, (qb, qs, qp, jnp.arange(nq)))
    return out, lse


def _online_update(spec: MaskSpec, qi, kj, vj, mask, carry):
    """The running (max, normaliser, output) after one more key block."""
    m, l, acc = carry
    s = _scores(spec, qi, kj, mask)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(_expand(mask, *qi.shape[1:2], spec.groups), jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkqs,bksd->bkqd", p.astype(vj.dtype), vj, **_F32)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv


def _attend_fwd(spec, qb, kb, vb, qs, qp, ks, kp, sink):
    out, lse = _forward(spec, qb, kb, vb, qs, qp, ks, kp, sink)
    return out, (qb, kb, vb, qs, qp, ks, kp, sink, out, lse)


def _attend_bwd(spec: MaskSpec, res, dout):
    qb, kb, vb, qs, qp, ks, kp, sink, out, lse = res
    nq, nk = qb.shape[0], kb.shape[0]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [nq, b, kv, gbq]

    def key_block(dq, xs):
        kj, vj, ksj, kpj, j = xs

        def query_block(i, carry):
            mask = spec.mask(qs[i], qp[i], ksj, kpj, i, j)
            update = functools.partial(_grad_update, spec, i,
                                       (qb[i], kj, vj, dout[i], lse[i], delta[i]), mask)
            return jax.lax.cond(jnp.any(mask), update, lambda c: c, carry)

        zeros = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32))
        dq, dk, dv = jax.lax.fori_loop(spec.first_query_block(j), nq, query_block, (dq, *zeros))
        return dq, (dk.astype(kb.dtype), dv.astype(vb.dtype))

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(key_block, dq0, (kb, vb, ks, kp, jnp.arange(nk)))
    dsink = None
    if sink is not None:  # d lse / d sink = p_sink, and the sink's value is 0: -sum p_sink * D
        p_sink = jnp.exp(jnp.repeat(sink, spec.block_q, axis=1)[None, None] - lse)
        dsink = -jnp.sum(p_sink * delta, axis=(0, 1)).reshape(sink.shape[0], sink.shape[1], -1)
        dsink = dsink.sum(axis=-1)
    nones = (None,) * 4
    return (dq.astype(qb.dtype), dk, dv, *nones, dsink)


def _grad_update(spec: MaskSpec, i, blocks, mask, carry):
    """The gradient accumulators after one more (query block ``i``, key block) pair."""
    qi, kj, vj, doi, lsei, di = blocks
    dq, dk, dv = carry
    s = _scores(spec, qi, kj, mask)
    p = jnp.where(_expand(mask, *qi.shape[1:2], spec.groups), jnp.exp(s - lsei[..., None]), 0.0)
    dv = dv + jnp.einsum("bkqs,bkqd->bksd", p.astype(doi.dtype), doi, **_F32)
    dp = jnp.einsum("bkqd,bksd->bkqs", doi, vj, **_F32)
    ds = (p * (dp - di[..., None]) * spec.scale).astype(qi.dtype)
    dk = dk + jnp.einsum("bkqs,bkqd->bksd", ds, qi, **_F32)
    dqi = jnp.einsum("bkqs,bksd->bkqd", ds, kj, **_F32)
    dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dqi, i, axis=0)
    return dq, dk, dv


_attend.defvjp(_attend_fwd, _attend_bwd)
