"""DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5): MLA (``rlx.models.mla``) whose queries
each attend only the ``index_topk`` keys a lightning indexer ranks highest.

The indexer (``Indexer``) has its own projections: ``wq_b`` turns MLA's normalised query latent
(``q_a_layernorm(q_a_proj(x))``) into ``index_n_heads`` query heads of ``index_head_dim``; ``wk``
gives one key per token, layer-normalised (``k_norm``, weight and bias, eps 1e-6);
``weights_proj`` a weight per head. The first ``qk_rope_head_dim`` dimensions of its queries and
keys rotate with the model's rotary angles: half-split pairs in DeepSeek-V3.2, interleaved pairs
in GLM-5 (``DSAConfig.rope_interleave``). A query's score of a key is
``sum_h w_h * H^-0.5 * relu(q_h . k * D^-0.5)``, in f32; among the keys the causal mask allows,
the top ``index_topk`` are kept (all of them where fewer are allowed). transformers' reference
computes the same (DeepSeek's Hadamard rotation of q and k preserves their products and its FP8
scoring is a precision choice, both left out there and here).

Here the selection is a boolean mask over the dense scores (``select_topk``: the top-k
indices scattered into a mask), joined to the causal mask of a dense attention: the computation of a short sequence on a CPU. A kernel path
would instead gather each query's top-k latents (FlashMLA's sparse decode, a Pallas gather on
TPU) and never form the other scores; ``select_topk``'s mask is the function it must compute.

Decoding caches the indexer's key beside MLA's latent in the layer's value buffer
(``ModelConfig.latent_cache_width``: ``kv_lora_rank + index_head_dim`` per token), so the dense
and paged caches store and view it with the latent; a decode step scores its query against the
cached keys, selects, and runs MLA's absorbed attention under that mask.

The indexer is a frozen buffer (``IndexerWeight``), trained neither in mode B (LoRA) nor in mode
A: the top-k indices carry no gradient, and DeepSeek trains the indexer with its own loss (a KL
divergence to the dense attention's distribution), which rlx does not implement.

GLM-5's "shared" layers (``DSAConfig.shared_layers``, from ``indexer_types``) have no indexer:
a shared layer attends under the selection of the most recent layer that has one, in the same
forward pass or decode step, as transformers hands the previous layer's top-k indices on. The
selection travels through rlx's layer loop with the hidden states (``mix`` / ``mix_decode``
take it and return it; ``no_selection`` starts it) as a boolean ``[b, t, s]`` mask, in the
carry of the scan over a stack too: full and shared layers differ in structure, so they fall in
different stacks, and each stack's scan carries the mask in and out (unrolling them instead
would give up the scan's one-body compile for GLM-5's alternating patterns). A model without
shared layers carries None. A shared layer's cache slots for the indexer key are written with
zeros (never read): every layer's value buffer keeps one width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float

from rlx.kernels.attention import attention_mask, gqa_attention
from rlx.models.hparams import ModelConfig
from rlx.models.layers import rotate
from rlx.models.mla import MLAttention
from rlx.models.moe import CorrectionBias
from rlx.models.paged_kv import PagedKVCache

NORM_EPS = 1e-6  # the indexer's k_norm (a LayerNorm) epsilon in both reference classes


class IndexerWeight(CorrectionBias):
    """A weight of the DSA indexer: a frozen buffer like the router's correction bias (never an
    ``nnx.Param``, so never trained nor differentiated; read from and written to HF checkpoints
    with the parameters, in f32)."""


def _weight(rngs, shape, dtype, axes, init: str = "normal") -> IndexerWeight:
    if init == "ones" or rngs is None:
        value = jnp.ones(shape, dtype) if init == "ones" else jnp.zeros(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return IndexerWeight(value, logical_axes=tuple(axes))


class Indexer(nnx.Module):
    """The lightning indexer of one layer (module docstring); every product in f32."""

    def __init__(self, cfg: ModelConfig, param_dtype, rngs):
        x, d, q_rank = cfg.dsa, cfg.hidden_size, cfg.mla.q_lora_rank
        self.wq_b = _weight(rngs, (q_rank, x.index_n_heads * x.index_head_dim), param_dtype,
                            ("q_lora", None))
        self.wk = _weight(rngs, (d, x.index_head_dim), param_dtype, ("embed", None))
        self.k_norm_weight = _weight(rngs, (x.index_head_dim,), param_dtype, (None,), "ones")
        self.k_norm_bias = _weight(rngs, (x.index_head_dim,), param_dtype, (None,), "zeros")
        self.weights_proj = _weight(rngs, (d, x.index_n_heads), param_dtype, ("embed", None))
        self.dsa, self.rope_dim = x, cfg.mla.qk_rope_head_dim

    def _rope(self, v: Float[Array, "b t h d"], angles) -> Float[Array, "b t h d"]:
        r = self.rope_dim
        rot = v[..., :r]
        if self.dsa.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> evens, then odds
            rot = jnp.concatenate([rot[..., 0::2], rot[..., 1::2]], axis=-1)
        return jnp.concatenate([rotate(rot, angles), v[..., r:]], axis=-1)

    def keys(self, x: Float[Array, "b t d"], angles) -> Float[Array, "b t k"]:
        """One layer-normalised, rotated key per token ``[b, t, index_head_dim]``."""
        k = x.astype(jnp.float32) @ self.wk[...].astype(jnp.float32)
        mean = k.mean(-1, keepdims=True)
        var = jnp.square(k - mean).mean(-1, keepdims=True)
        k = (k - mean) * jax.lax.rsqrt(var + NORM_EPS)
        k = k * self.k_norm_weight[...].astype(jnp.float32) + self.k_norm_bias[...].astype(
            jnp.float32)
        return self._rope(k[:, :, None], angles)[:, :, 0]

    def scores(self, x: Float[Array, "b t d"], q_resid: Float[Array, "b t q"], angles,
               keys: Float[Array, "b s k"]) -> Float[Array, "b t s"]:
        """Each query's index score of each key (module docstring), f32."""
        b, t, _ = x.shape
        n, dim = self.dsa.index_n_heads, self.dsa.index_head_dim
        q = (q_resid.astype(jnp.float32) @ self.wq_b[...].astype(jnp.float32)).reshape(b, t, n, dim)
        q = self._rope(q, angles)
        per_head = jax.nn.relu(jnp.einsum("bthk,bsk->bths", q, keys.astype(jnp.float32))
                               * dim ** -0.5)
        w = (x.astype(jnp.float32) @ self.weights_proj[...].astype(jnp.float32)) * n ** -0.5
        return jnp.einsum("bth,bths->bts", w, per_head)


def select_topk(scores: Float[Array, "b t s"], mask: Bool[Array, "b t s"], k: int
                ) -> Bool[Array, "b t s"]:
    """The ``k`` allowed keys (``mask``) of best score per query, or every allowed key where
    fewer than ``k`` are. Of keys tied at the ``k``-th score the earliest are kept (transformers'
    ``topk`` leaves that choice to its backend)."""
    masked = jnp.where(mask, scores, -jnp.inf)
    idx = jax.lax.top_k(masked, min(k, scores.shape[-1]))[1]  # [b, t, k]
    chosen = jnp.put_along_axis(jnp.zeros(scores.shape, bool), idx, True, axis=-1, inplace=False)
    return mask & chosen


class DSAttention(MLAttention):
    """MLA with the DSA indexer (module docstring), with ``MLAttention``'s interface; a layer of
    ``DSAConfig.shared_layers`` has no indexer (``indexer`` None) and reuses a selection."""

    def __init__(self, cfg: ModelConfig, p, rngs, layer: int = 0):
        super().__init__(cfg, p, rngs, layer)
        shared = layer in cfg.dsa.shared_layers
        self.indexer = None if shared else Indexer(cfg, p.param_dtype, rngs)
        self.index_topk, self.latent_rank = cfg.dsa.index_topk, cfg.mla.kv_lora_rank
        self.index_width = cfg.dsa.index_head_dim

    def _q_resid(self, x, adapter: bool):
        return self.q_a_layernorm(self.q_a_proj(x, adapter))

    def _queries(self, q_resid, angles, adapter: bool):
        b, t, _ = q_resid.shape
        q = self.q_b_proj(q_resid, adapter).reshape(b, t, self.num_heads, self.mla.qk_head_dim)
        nope = self.mla.qk_nope_head_dim
        return q[..., :nope], self._rope(q[..., nope:], angles)

    def _select(self, x, q_resid, angles, index_keys, mask, sel):
        """The keys each query attends: ``mask``'s top-k by this layer's index scores, or in a
        shared layer ``mask`` under ``sel``, the selection of the layer that last had an indexer."""
        if self.indexer is not None:
            return select_topk(self.indexer.scores(x, q_resid, angles, index_keys), mask,
                               self.index_topk)
        if sel is None:
            raise ValueError("a DSA layer without an indexer (indexer_types 'shared') attends "
                             "under an earlier layer's selection; run it inside the model's "
                             "layer loop (Transformer), after a full indexer layer")
        return mask & sel

    def __call__(self, x, positions, segment_ids, angles, adapter: bool = True):
        return self.selecting(x, positions, segment_ids, angles, adapter)[0]

    def selecting(self, x, positions, segment_ids, angles, adapter: bool = True, sel=None):
        """``__call__`` and the selection it attended under (to hand on; None when ``sel`` is
        None, the carry of a model without shared layers). ``sel``: the previous one."""
        if self.sharding is not None and self.sharding.context is not None:
            raise ValueError("DeepSeek sparse attention does not run under context parallelism "
                             "yet; set the mesh's context axis to 1")
        q_resid = self._q_resid(x, adapter)
        q_nope, q_rope = self._queries(q_resid, angles, adapter)
        latent, k_rope = self.latent_kv(x, angles, adapter)
        keys, values = self.expand_kv(latent, k_rope, adapter)
        t = x.shape[1]
        mask = attention_mask(segment_ids, segment_ids, positions, positions)
        mask &= jnp.tril(jnp.ones((t, t), bool))[None]  # a sequence over itself: causal columns
        index_keys = None if self.indexer is None else self.indexer.keys(x, angles)
        mask = self._select(x, q_resid, angles, index_keys, mask, sel)
        q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
        out = gqa_attention(q, keys, values, mask, scale=self.scale)
        return self._out(out, adapter), None if sel is None else mask

    def decode(self, x, positions, segment_ids, angles, kv, cache, adapter: bool = True,
               order=None):
        """``decode_selecting`` without a selection in or out. Returns (out, kv)."""
        return self.decode_selecting(x, positions, segment_ids, angles, kv, cache, adapter,
                                     order)[:2]

    def decode_selecting(self, x, positions, segment_ids, angles, kv, cache,
                         adapter: bool = True, order=None, sel=None):
        """``MLAttention.decode`` under the selection: the indexer's keys are written beside
        the latents (zeros in a shared layer); one token per row attends absorbed, more
        expanded. Returns (out, kv, the selection as ``selecting``)."""
        if order is not None:
            raise ValueError("DeepSeek sparse attention does not decode under context "
                             "parallelism yet; set the mesh's context axis to 1")
        latent, k_rope = self.latent_kv(x, angles, adapter)  # [b, t, c], [b, t, 1, r]
        index_keys = (jnp.zeros((*latent.shape[:2], self.index_width), latent.dtype)
                      if self.indexer is None
                      else self.indexer.keys(x, angles).astype(latent.dtype))  # [b, t, k]
        new = (k_rope[:, :, 0], jnp.concatenate([latent, index_keys], axis=-1))
        if isinstance(cache, PagedKVCache):
            (rope_keys, values), kv = self._paged_view(kv, new, cache)
        else:
            kv = cache.store(kv, new)
            rope_keys, values = cache.view(kv)  # [b, r, s], [b, s, c + k]
        latents, index_keys = values[..., :self.latent_rank], values[..., self.latent_rank:]
        seen = (segment_ids, cache.segment_ids, positions, cache.positions)
        q_resid = self._q_resid(x, adapter)
        q_nope, q_rope = self._queries(q_resid, angles, adapter)
        mask = self._select(x, q_resid, angles, index_keys, attention_mask(*seen), sel)
        if x.shape[1] == 1:
            out = self.absorbed(q_nope, q_rope, rope_keys, latents, seen, adapter, mask=mask)
        else:
            k_rope = jnp.swapaxes(rope_keys, 1, 2)[:, :, None, :]
            keys, vals = self.expand_kv(latents, k_rope, adapter)
            q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
            out = gqa_attention(q, keys, vals, mask, scale=self.scale)
        return self._out(out, adapter), kv, None if sel is None else mask


def mix(attn: nnx.Module, x, positions, segment_ids, angles, adapter: bool, sel):
    """A decoder layer's token mixer over ``x``: (out, selection). A DSA layer attends under,
    or makes, the index selection it hands on (``DSAttention.selecting``); any other kind
    passes ``sel`` through."""
    if isinstance(attn, DSAttention):
        return attn.selecting(x, positions, segment_ids, angles, adapter, sel)
    return attn(x, positions, segment_ids, angles, adapter), sel


def mix_decode(attn: nnx.Module, x, positions, segment_ids, angles, kv, cache, adapter: bool,
               order, sel):
    """``mix`` over a cache: (out, kv, selection) (``DSAttention.decode_selecting``)."""
    if isinstance(attn, DSAttention):
        return attn.decode_selecting(x, positions, segment_ids, angles, kv, cache, adapter,
                                     order, sel)
    return (*attn.decode(x, positions, segment_ids, angles, kv, cache, adapter, order), sel)


def no_selection(cfg: ModelConfig, b: int, t: int, s: int) -> Bool[Array, "b t s"] | None:
    """The selection carried into the first layer of a pass of ``t`` queries over ``s`` keys:
    None for a model without shared layers, else an empty mask (layer 0 has an indexer and
    replaces it)."""
    if cfg.dsa is None or not set(cfg.dsa.shared_layers) & set(range(cfg.num_layers)):
        return None
    return jnp.zeros((b, t, s), bool)
