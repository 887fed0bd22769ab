"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3).

Per token, one projection ``kv_a_proj_with_mqa`` gives a ``kv_lora_rank`` latent (RMS-normalised:
``kv_a_layernorm``) and a ``qk_rope_head_dim`` rotary key shared by every head. ``kv_b_proj``
expands the latent into each head's position-free key part (``qk_nope_head_dim``) and its value
(``v_head_dim``). Queries come from ``q_a_proj -> q_a_layernorm -> q_b_proj`` (or one ``q_proj``
when ``q_lora_rank`` is None) and split into a position-free part and a rotary part. A head's
key is ``[k_nope_h, k_rope]`` and its query ``[q_nope_h, q_rope_h]``; the softmax scale is
``qk_head_dim ** -0.5`` times ``RopeConfig.softmax_mscale`` (YaRN's ``mscale_all_dim``
temperature squared, transformers' ``yarn_apply_mscale``).

``rope_interleave`` (DeepSeek's weights, transformers' default): the rotary dimensions hold
interleaved pairs ``(x0, x1), (x2, x3), ...``. Rotating them is the same as de-interleaving
(evens, then odds) and applying the rotate-half rotation; query and key both come out in that
de-interleaved order, as in transformers' ``apply_rotary_pos_emb_interleave``, and their product
does not depend on the order.

This module is the training / full-sequence path, and ``decode`` over the per-head ``KVCache``
(keys and values expanded per head, not absorbed). Departure from the paper's inference form:
nothing is absorbed here. The seams for a latent cache are ``latent_kv`` (what such a cache
holds per token: the normalised latent and the rotated shared key) and ``queries``, with
``expand_kv`` the one place ``kv_b_proj`` turns latents into per-head keys and values; an
absorbed decode multiplies ``q_nope`` by ``kv_b_proj``'s key block and the attention output by
its value block instead (see ``kv_b_blocks``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from rlx.models.hparams import ModelConfig
from rlx.models.kv_cache import KVCache, write_slots
from rlx.models.layers import (Linear, RMSNorm, attention_mask, causal_attention, gqa_attention,
                               rotate, weight_value)


class MLAttention(nnx.Module):
    """MLA with the interface of ``rlx.models.decoder.Attention``: ``__call__(x, positions,
    segment_ids, angles, adapter)`` and ``decode(..., kv, cache, adapter)``; ``angles`` are the
    forward pass's rotary angles for ``qk_rope_head_dim`` (``Transformer.rope_angles``)."""

    def __init__(self, cfg: ModelConfig, p, rngs):
        m, d, h = cfg.mla, cfg.hidden_size, cfg.num_heads
        kw = dict(dtype=p.dtype, param_dtype=p.param_dtype, rngs=rngs)
        norm = dict(dtype=p.dtype, param_dtype=p.param_dtype)
        if m.q_lora_rank is None:
            self.q_proj = Linear(d, h * m.qk_head_dim, ("embed", "heads"), bias=False, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(d, m.q_lora_rank, ("embed", "q_lora"), bias=cfg.qkv_bias, **kw)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, **norm)
            self.q_b_proj = Linear(m.q_lora_rank, h * m.qk_head_dim, ("q_lora", "heads"),
                                   bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(d, m.kv_lora_rank + m.qk_rope_head_dim,
                                         ("embed", "kv_lora"), bias=cfg.qkv_bias, **kw)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, **norm)
        self.kv_b_proj = Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim),
                                ("kv_lora", "heads"), bias=False, **kw)
        self.o_proj = Linear(h * m.v_head_dim, d, ("heads", "embed"), bias=cfg.qkv_bias, **kw)
        self.mla, self.num_heads = m, h
        self.scale = m.qk_head_dim ** -0.5 * cfg.rope.softmax_mscale()

    def linears(self) -> tuple[Linear, ...]:
        """Every projection of the layer (for quantization and LoRA)."""
        qs = (self.q_proj,) if self.q_proj is not None else (self.q_a_proj, self.q_b_proj)
        return (*qs, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj)

    def _rope(self, x: Float[Array, "b t h r"], angles) -> Float[Array, "b t h r"]:
        if self.mla.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> evens, then odds
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rotate(x, angles)

    def queries(self, x: Float[Array, "b t d"], angles, adapter: bool = True
                ) -> tuple[Float[Array, "b t h n"], Float[Array, "b t h r"]]:
        """Per-head query parts: position-free ``q_nope`` and rotated ``q_rope``."""
        b, t, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x, adapter)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, adapter)), adapter)
        q = q.reshape(b, t, self.num_heads, self.mla.qk_head_dim)
        nope = self.mla.qk_nope_head_dim
        return q[..., :nope], self._rope(q[..., nope:], angles)

    def latent_kv(self, x: Float[Array, "b t d"], angles, adapter: bool = True
                  ) -> tuple[Float[Array, "b t c"], Float[Array, "b t 1 r"]]:
        """What MLA caches per token: the normalised latent ``kv_a_layernorm(c_kv)`` ``[b, t,
        kv_lora_rank]`` and the rotated key shared by all heads ``[b, t, 1, qk_rope_head_dim]``."""
        compressed = self.kv_a_proj_with_mqa(x, adapter)
        rank = self.mla.kv_lora_rank
        latent = self.kv_a_layernorm(compressed[..., :rank])
        return latent, self._rope(compressed[..., None, rank:], angles)

    def expand_kv(self, latent: Float[Array, "b s c"], k_rope: Float[Array, "b s 1 r"],
                  adapter: bool = True) -> tuple[Float[Array, "b s h k"], Float[Array, "b s h v"]]:
        """Per-head keys ``[k_nope_h, k_rope]`` and values from the latents (``kv_b_proj``)."""
        b, s, _ = latent.shape
        m, h = self.mla, self.num_heads
        kv = self.kv_b_proj(latent, adapter).reshape(b, s, h, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, values = kv[..., :m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
        k_rope = jnp.broadcast_to(k_rope.astype(k_nope.dtype), (b, s, h, m.qk_rope_head_dim))
        return jnp.concatenate([k_nope, k_rope], axis=-1), values

    def kv_b_blocks(self, dtype) -> tuple[Float[Array, "c h n"], Float[Array, "c h v"]]:
        """``kv_b_proj``'s base kernel split per head into its key block ``[kv_lora_rank, h,
        qk_nope_head_dim]`` and value block ``[kv_lora_rank, h, v_head_dim]`` (the matrices an
        absorbed decode folds into the query and the output; a LoRA adapter on ``kv_b_proj`` is
        not included)."""
        m = self.mla
        w = weight_value(self.kv_b_proj.kernel, dtype).reshape(
            m.kv_lora_rank, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]

    def _qkv(self, x, angles, adapter: bool):
        q_nope, q_rope = self.queries(x, angles, adapter)
        keys, values = self.expand_kv(*self.latent_kv(x, angles, adapter), adapter)
        return jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1), keys, values

    def _out(self, out: Float[Array, "b t h v"], adapter: bool) -> Float[Array, "b t d"]:
        b, t = out.shape[:2]
        return self.o_proj(out.reshape(b, t, self.num_heads * self.mla.v_head_dim), adapter)

    def __call__(self, x, positions, segment_ids, angles, adapter: bool = True):
        q, k, v = self._qkv(x, angles, adapter)
        mask = attention_mask(segment_ids, segment_ids, positions, positions)
        return self._out(causal_attention(q, k, v, mask, scale=self.scale), adapter)

    def decode(self, x, positions, segment_ids, angles, kv, cache: KVCache, adapter: bool = True):
        """Attention of ``t`` new tokens over the per-head cache (keys ``qk_head_dim`` wide, values
        ``v_head_dim``); returns (out, (keys, values)) like ``Attention.decode``."""
        q, k, v = self._qkv(x, angles, adapter)
        keys = write_slots(kv[0], k, cache.index, keys=True)  # [b, h, qk, s]
        values = write_slots(kv[1], v, cache.index, keys=False)  # [b, h, s, v]
        mask = attention_mask(segment_ids, cache.segment_ids, positions, cache.positions)
        out = gqa_attention(q, keys, values, mask, kv_major=True, scale=self.scale)
        return self._out(out, adapter), (keys, values)
