"""DeepSeek-V4's attention (paper section 2.3): shared-KV multi-query attention over a sliding
window, in compressed layers joined by compressed entries (``rlx.models.deepseek_v4.compressor``).

Queries: ``q_b_proj(q_norm(q_a_proj(x)))`` split into heads, each RMS-normalised without a weight
(the latent ``q_norm`` output also feeds the indexer). One key per token, ``kv_norm(kv_proj(x))``,
is also the value. Both rotate their trailing ``rope_dim`` channels (``rlx.models.deepseek_v4.rope``:
``main`` angles in sliding layers, ``compress`` angles in compressed ones). A query sees the keys
of its own sequence fewer than ``sliding_window`` positions back and, in a compressed layer, the
entries of complete windows before it (``compressed_sparse_attention``: only those its indexer
keeps; ``heavily_compressed_attention``: all). A learned sink per head joins every softmax's
denominator (``attn_sink``); the scale is ``head_dim^-1/2``. The output's rope channels rotate
back at the query's position; the grouped low-rank output projection maps each of ``o_groups``
head groups through its own ``[H * head_dim / G, o_lora_rank]`` block (``wo_a``) and the
concatenation through ``o_b_proj``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rlx.kernels.attention import gqa_attention
from rlx.models.deepseek_v4.compressor import Compressor, Indexer, visible
from rlx.models.deepseek_v4.hyper import unweighted_rms
from rlx.models.layers import Linear, RMSNorm, param
from rlx.models.deepseek_v4.rope import Angles, angles, rotate_tail

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
LAYER_TYPES = (SLIDING, CSA, HCA)


@dataclasses.dataclass(frozen=True)
class V4Attn:
    """The attention sizes of a DeepSeek-V4 model."""

    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_rates: tuple[tuple[str, int], ...]  # layer type -> rate
    index_heads: int
    index_head_dim: int
    index_topk: int
    eps: float
    main_freqs: tuple[float, ...]  # rope_dim // 2 inverse frequencies of the "main" table
    compress_freqs: tuple[float, ...]  # ... of the "compress" table
    compress_scale: float = 1.0  # the "compress" table's cos/sin factor

    def rate(self, kind: str) -> int:
        return dict(self.compress_rates)[kind]

    def rope(self, positions: Int[Array, "b t"], compressed: bool) -> Angles:
        if compressed:
            return angles(positions, np.asarray(self.compress_freqs, np.float32), self.compress_scale)
        return angles(positions, np.asarray(self.main_freqs, np.float32), 1.0)


def sliding_mask(positions: Int[Array, "b t"], segment_ids: Int[Array, "b t"], window: int
                 ) -> Bool[Array, "b t t"]:
    """Same real sequence, causal, fewer than ``window`` positions back."""
    qp, kp = positions[:, :, None], positions[:, None, :]
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] != 0)
    return same & (kp <= qp) & (qp - kp < window)


class V4Attention(nnx.Module):
    """One layer's attention (module docstring) of ``kind`` (one of ``LAYER_TYPES``)."""

    def __init__(self, a: V4Attn, kind: str, *, dtype, param_dtype, rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(dtype=jnp.float32, param_dtype=jnp.float32)
        self.q_a_proj = Linear(a.hidden, a.q_lora_rank, ("embed", "q_lora"), **kw)
        self.q_norm = RMSNorm(a.q_lora_rank, a.eps, **norm)
        self.q_b_proj = Linear(a.q_lora_rank, a.heads * a.head_dim, ("q_lora", "heads"), **kw)
        self.kv_proj = Linear(a.hidden, a.head_dim, ("embed", None), **kw)
        self.kv_norm = RMSNorm(a.head_dim, a.eps, **norm)
        group_in = a.heads * a.head_dim // a.o_groups
        self.wo_a = param(rngs, (a.o_groups, group_in, a.o_lora_rank), param_dtype,
                          (None, "heads", None))
        self.o_b_proj = Linear(a.o_groups * a.o_lora_rank, a.hidden, (None, "embed"), **kw)
        self.attn_sink = param(rngs, (a.heads,), jnp.float32, ("heads",))
        self.compressor = nnx.data(None if kind == SLIDING else Compressor(
            a.hidden, a.head_dim, a.rate(kind), kind == CSA, param_dtype, rngs))
        self.indexer = nnx.data(None if kind != CSA else Indexer(
            a.hidden, a.q_lora_rank, a.index_heads, a.index_head_dim, a.index_topk, a.rate(kind),
            rngs))
        self.a, self.kind, self.dtype = a, kind, dtype

    def _compressed(self, x, q_latent, positions, segment_ids):
        """The compressed entries ``[b, w, head_dim]`` and the mask ``[b, t, w]`` over them."""
        sources = self.compressor.sources(x)
        isources = None if self.indexer is None else self.indexer.compressor.sources(x)
        allowed = (segment_ids != 0)[:, :, None]
        return self._entries(x, q_latent, positions, sources, isources, allowed)

    def _entries(self, x, q_latent, positions, sources, isources, allowed):
        """Entries pooled from ``sources`` (every position's compressor projections) and the
        queries' mask over them: complete windows before each query (and ``allowed``), in a
        sparse layer only those the indexer keeps."""
        a, rate = self.a, self.compressor.rate
        b, n = x.shape[0], sources[0].shape[1] // rate
        starts = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * rate, (b, n))
        entries = self.compressor.pool(*sources, a.eps, a.rope(starts, True))
        allowed = visible(positions, n, rate) & allowed
        if self.indexer is not None:
            allowed = self.indexer.select(x, q_latent, a.eps, a.rope(positions, True),
                                          a.rope(starts, True), allowed, isources)
        return entries, allowed

    def _project(self, x, positions, adapter: bool):
        """Rotated queries ``[b, t, h, hd]``, their latent, the rotated shared keys
        ``[b, t, hd]`` and the angles."""
        a = self.a
        b, t, _ = x.shape
        rope = a.rope(positions, self.kind != SLIDING)
        q_latent = self.q_norm(self.q_a_proj(x, adapter))
        q = self.q_b_proj(q_latent, adapter).reshape(b, t, a.heads, a.head_dim)
        q = rotate_tail(unweighted_rms(q, a.eps).astype(q.dtype), *rope)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x, adapter))[:, :, None, :], *rope)
        return q, q_latent, kv[:, :, 0, :].astype(q.dtype), rope

    def _attend(self, q, keys, mask, rope, adapter: bool):
        """Sink attention over ``keys`` (also the values), rotated back, grouped output."""
        a = self.a
        b, t = q.shape[:2]
        out = gqa_attention(q, keys[:, :, None, :], keys[:, :, None, :], mask,
                            scale=a.head_dim ** -0.5, sinks=self.attn_sink[...])  # [b, t, h, hd]
        out = rotate_tail(out, rope[0], -rope[1])
        grouped = out.reshape(b, t, a.o_groups, -1)
        low = jnp.einsum("btgi,gir->btgr", grouped, self.wo_a[...].astype(grouped.dtype))
        return self.o_b_proj(low.reshape(b, t, -1), adapter)

    def __call__(self, x: Float[Array, "b t d"], positions: Int[Array, "b t"],
                 segment_ids: Int[Array, "b t"], adapter: bool = True) -> Float[Array, "b t d"]:
        q, q_latent, kv, rope = self._project(x, positions, adapter)
        mask = sliding_mask(positions, segment_ids, self.a.window)
        if self.compressor is not None:
            entries, allowed = self._compressed(x, q_latent, positions, segment_ids)
            kv = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
            mask = jnp.concatenate([mask, allowed], axis=2)
        return self._attend(q, kv, mask, rope, adapter)

    def step(self, x: Float[Array, "b t d"], positions: Int[Array, "b t"],
             segment_ids: Int[Array, "b t"], cache: "LayerCache", adapter: bool = True
             ) -> tuple[Float[Array, "b t d"], "LayerCache"]:
        """``t`` new tokens per row at ``positions`` (a prefill or a decode step) against the
        layer's cache of every earlier position (``LayerCache``, indexed by position, so left
        padding is as good as right); returns the cache with the real tokens written (padding,
        ``segment_ids`` 0, is not). Each row holds one sequence; the compressed entries are
        pooled again from the cached sources, so a window that a new token completes joins at
        once."""
        q, q_latent, kv, rope = self._project(x, positions, adapter)
        rows = jnp.arange(x.shape[0])[:, None]
        slots = jnp.where(segment_ids != 0, positions, cache.kv.shape[1])  # padding: dropped
        put = lambda buf, new: None if buf is None else buf.at[rows, slots].set(  # noqa: E731
            new.astype(buf.dtype), mode="drop")
        cache = LayerCache(put(cache.kv, kv), *(
            (None, None) if self.compressor is None else
            tuple(put(c, v) for c, v in zip(cache[1:3], self.compressor.sources(x)))), *(
            (None, None) if self.indexer is None else
            tuple(put(c, v) for c, v in zip(cache[3:5], self.indexer.compressor.sources(x)))))
        kp, qp = jnp.arange(cache.kv.shape[1])[None, None, :], positions[:, :, None]
        mask = (kp <= qp) & (qp - kp < self.a.window)
        keys = cache.kv
        if self.compressor is not None:
            isources = None if self.indexer is None else (cache.ikv, cache.igate)
            entries, allowed = self._entries(x, q_latent, positions, (cache.ckv, cache.cgate),
                                             isources, True)
            keys = jnp.concatenate([keys, entries.astype(keys.dtype)], axis=1)
            mask = jnp.concatenate([mask, allowed], axis=2)
        return self._attend(q, keys.astype(q.dtype), mask, rope, adapter), cache


class LayerCache(NamedTuple):
    """A layer's decode cache over ``S`` positions: the rotated shared keys ``kv`` ``[b, S, hd]``
    and, in compressed layers, the compressor's (``ckv``, ``cgate``) and the indexer's
    (``ikv``, ``igate``) projections of every position ``[b, S, c]`` (None where the layer has
    none)."""

    kv: Array
    ckv: Array | None = None
    cgate: Array | None = None
    ikv: Array | None = None
    igate: Array | None = None


def empty_cache(layer: V4Attention, batch: int, length: int, dtype) -> LayerCache:
    """A zero ``LayerCache`` of ``length`` positions for ``layer``."""
    zeros = lambda c: jnp.zeros((batch, length, c), dtype)  # noqa: E731
    comp = layer.compressor
    return LayerCache(zeros(layer.a.head_dim),
                      *((None, None) if comp is None else (zeros(comp.wkv.shape[-1]),) * 2),
                      *((None, None) if layer.indexer is None else
                        (zeros(layer.indexer.compressor.wkv.shape[-1]),) * 2))
