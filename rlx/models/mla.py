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

Decoding caches the latent (``rlx.models.kv_cache``): per token and layer the ``kv_lora_rank``
latent and the ``qk_rope_head_dim`` shared key that ``latent_kv`` returns, not every head's key and
value (at DeepSeek-V3's shape 512 + 64 = 576 numbers instead of 128 heads' 192-wide keys and
128-wide values, 40,960). A decode step (one new token
per row) absorbs ``kv_b_proj`` as DeepSeek's inference does (the paper's section 2.1.2): the
query's position-free part times ``kv_b_proj``'s key block is a query over the latent, so the
scores are ``(q_nope W_k) latent^T + q_rope k_rope^T`` and the output ``((probs latent) W_v)``,
with no per-head key or value ever formed (``absorbed``). A call with several new tokens (a
prefill, a teacher-forced score) is compute-bound and runs the training path's order instead:
it expands the cached latents into per-head keys and values (``expanded``). Both write the
latent. A LoRA adapter on ``kv_b_proj`` is folded into the absorbed blocks (``kv_b_blocks``); a
W8A8 activation quantizer on it quantizes the cached latents per token as the ``Linear`` does; with
an adapter as well (whose input is not quantized) the base's blocks meet the quantized latents and
the adapter's delta the plain ones, two absorbed terms (``_absorbed_parts``): no decode step
forms per-head keys or values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from rlx.kernels.attention import MASK_VALUE, attend, attention_mask
from rlx.kernels.attention.context import ContextSplit
from rlx.kernels.attention.paged import block_pages_for, online_pages
from rlx.models.hparams import ModelConfig
from rlx.models.kv_cache import KVCache
from rlx.models.layers import Linear, RMSNorm, quantize_activations, rotate, weight_value
from rlx.models.paged_kv import PagedKVCache, per_device, pool_specs, rows_spec

# which cached slots the new tokens see: (their segment ids, the slots' segment ids, their
# positions, the slots' positions), each [b, t] or [b, s] (rlx.kernels.attention.attend)
Seen = tuple[Array, Array, Array, Array]


class MLAttention(nnx.Module):
    """MLA with the interface of ``rlx.models.decoder.Attention``: ``__call__(x, positions,
    segment_ids, angles, adapter)`` and ``decode(..., kv, cache, adapter)``; ``angles`` are the
    forward pass's rotary angles for ``qk_rope_head_dim`` (``Transformer.rope_angles``)."""

    def __init__(self, cfg: ModelConfig, p, rngs, layer: int = 0):  # every MLA layer alike
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
        self.sharding = None  # an AttentionSharding where a mesh runs an opaque kernel (parallel)

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

    def kv_b_blocks(self, dtype, adapter: bool = True, base: bool = True
                    ) -> tuple[Float[Array, "c h n"], Float[Array, "c h v"]]:
        """``kv_b_proj``'s kernel split per head into its key block ``[kv_lora_rank, h,
        qk_nope_head_dim]`` and value block ``[kv_lora_rank, h, v_head_dim]``: the matrices an
        absorbed decode folds into the query and the output. A quantized kernel is dequantized, an
        ``[out, in]`` engine copy read back as ``[in, out]``, and with ``adapter`` an attached
        LoRA adapter's ``scaling * A B`` is added (in f32, rounded once): the adapter is linear,
        so its delta is its output for the identity (dropout is off in the eval-mode decode).
        ``base=False``: the adapter's delta alone."""
        m, lin = self.mla, self.kv_b_proj
        lora = adapter and lin.lora is not None
        if base:
            w = weight_value(lin.kernel, jnp.float32 if lora else dtype)
            w = w.T if lin.kernel_layout == "out_in" else w  # [c, h * (n + v)]
        else:
            w = jnp.zeros((), jnp.float32)
        if lora and lin.lora.rotates:  # OFT: (c R) W for the latent c, so R W
            w = lin.lora.fold(w).astype(dtype)
        elif lora:
            eye = jnp.eye(m.kv_lora_rank, dtype=lin.dtype)
            w = (w + lin.lora(eye, jnp.float32).astype(jnp.float32)).astype(dtype)
        w = w.reshape(m.kv_lora_rank, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]

    def _absorbed_parts(self, dtype, adapter: bool):
        """``absorbed``'s terms: (key block, value block, whether that term's latent is the
        activation-quantized one). One term, the base with the adapter folded in, unless a W8A8
        quantizer feeds the base a quantized latent while an active adapter sees the latent as
        it is: then the base on the quantized latent and the adapter's delta on the plain one
        (both linear in the latent, so each absorbs on its own)."""
        lin = self.kv_b_proj
        if lin.act_quant == "none" or not (adapter and lin.lora is not None):
            return [(*self.kv_b_blocks(dtype, adapter), True)]
        return [(*self.kv_b_blocks(dtype, False), True),
                (*self.kv_b_blocks(dtype, True, base=False), False)]

    def _qkv(self, x, angles, adapter: bool):
        """Queries, keys and values of a sequence over itself. Under context parallelism the
        latents are gathered over the context devices and expanded on each (``rlx.kernels.
        attention.context``): per token 576 numbers move at DeepSeek-V3's shape, not every
        head's key and value."""
        q_nope, q_rope = self.queries(x, angles, adapter)
        latent, k_rope = self.latent_kv(x, angles, adapter)
        if self.sharding is not None and self.sharding.context is not None:
            split = ContextSplit(self.sharding)
            latent, k_rope = (split.whole(a) for a in (latent, k_rope))
        keys, values = self.expand_kv(latent, k_rope, adapter)
        return jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1), keys, values

    def _out(self, out: Float[Array, "b t h v"], adapter: bool) -> Float[Array, "b t d"]:
        b, t = out.shape[:2]
        return self.o_proj(out.reshape(b, t, self.num_heads * self.mla.v_head_dim), adapter)

    def __call__(self, x, positions, segment_ids, angles, adapter: bool = True):
        q, k, v = self._qkv(x, angles, adapter)
        out = attend(q, k, v, segment_ids, segment_ids, positions, positions, scale=self.scale,
                     causal_columns=True, sharding=self.sharding)
        return self._out(out, adapter)

    def decode(self, x, positions, segment_ids, angles, kv, cache: KVCache, adapter: bool = True,
               order=None):
        """Attention of ``t`` new tokens over the latent cache; ``kv`` = this layer's (shared
        rotary keys ``[b, r, s]``, latents ``[b, s, c]``), both written at ``cache.index``.
        One token per row (a decode step) is ``absorbed``, more are ``expanded``; returns (out,
        the layer's new (keys, latents)) like ``Attention.decode`` (``order``: its context-
        parallel token order)."""
        latent, k_rope = self.latent_kv(x, angles, adapter)  # [b, t, c], [b, t, 1, r]
        if order is not None:
            latent, k_rope = (order.in_slot_order(a) for a in (latent, k_rope))
        new = (k_rope[:, :, 0], latent)
        q_nope, q_rope = self.queries(x, angles, adapter)  # [b, t, h, n], [b, t, h, r]
        if x.shape[1] == 1 and isinstance(cache, PagedKVCache):  # the pages read in place
            out, kv = self.absorbed_paged(q_nope, q_rope, kv, new, cache, positions,
                                          segment_ids, adapter)
            return self._out(out, adapter), kv
        if isinstance(cache, PagedKVCache):  # a prefill: the pages gathered per row
            (rope_keys, latents), kv = self._paged_view(kv, new, cache)
        else:
            kv = cache.store(kv, new)
            rope_keys, latents = cache.view(kv)  # [b, r, s], [b, s, c]
        seen = (segment_ids, cache.segment_ids, positions, cache.positions)
        if x.shape[1] == 1:
            out = self.absorbed(q_nope, q_rope, rope_keys, latents, seen, adapter)
        else:  # [b, t, h, v]
            out = self.expanded(q_nope, q_rope, rope_keys, latents, seen, adapter,
                                context=order is not None)
        return self._out(out, adapter), kv

    def expanded(self, q_nope: Float[Array, "b t h n"], q_rope: Float[Array, "b t h r"],
                 rope_keys: Float[Array, "b r s"], latents: Float[Array, "b s c"],
                 seen: Seen, adapter: bool = True, context: bool = False
                 ) -> Float[Array, "b t h v"]:
        """Attention over the cached latents expanded into per-head keys and values
        (``expand_kv``), as the training forward pass computes it (``attend``: blockwise over
        a long cache); ``context``: the queries' tokens are split over the context devices."""
        k_rope = jnp.swapaxes(rope_keys, 1, 2)[:, :, None, :]  # [b, s, 1, r]
        keys, values = self.expand_kv(latents, k_rope, adapter)  # [b, s, h, qk], [b, s, h, v]
        q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)  # [b, t, h, qk]
        return attend(q, keys, values, *seen, scale=self.scale,
                      sharding=self.sharding if context else None)

    def absorbed(self, q_nope: Float[Array, "b t h n"], q_rope: Float[Array, "b t h r"],
                 rope_keys: Float[Array, "b r s"], latents: Float[Array, "b s c"],
                 seen: Seen, adapter: bool = True, mask=None) -> Float[Array, "b t h v"]:
        """``expanded``'s attention with ``kv_b_proj`` absorbed (``kv_b_blocks``): scores
        ``(q_nope W_k) . latent + q_rope . k_rope``, output ``(probs . latent) W_v``; scores and
        softmax in f32 (``_absorbed_parts``: one such term, or two under W8A8 with an
        adapter). The ``t`` tokens' heads are one ``[t * h]`` query axis, so each product is
        one batched matrix product per row over the whole cache. ``mask`` ``[b, t, s]``: the
        keys each query attends (default: those ``seen`` allows; DSA: its selection too)."""
        b, t, h, _ = q_nope.shape
        dtype = q_nope.dtype
        plain = latents.astype(dtype)  # [b, s, c]
        quantized = quantize_activations(plain, self.kv_b_proj.act_quant)
        parts = self._absorbed_parts(dtype, adapter)
        f32 = dict(preferred_element_type=jnp.float32)
        q_rot = q_rope.astype(dtype).reshape(b, t * h, -1)  # [b, th, r]
        scores = jnp.einsum("bqr,brs->bqs", q_rot, rope_keys.astype(dtype), **f32)
        for q_lat, (_, _, quant) in zip(_latent_queries(q_nope, parts), parts):
            scores = scores + jnp.einsum("bqc,bsc->bqs", q_lat.reshape(b, t * h, -1),
                                         quantized if quant else plain, **f32)
        scores = scores.reshape(b, t, h, -1) * self.scale  # [b, t, h, s]
        mask = attention_mask(*seen) if mask is None else mask  # [b, t, s]: a row per query
        scores = jnp.where(mask[:, :, None, :], scores, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype).reshape(b, t * h, -1)
        return _latent_values([jnp.einsum("bqs,bsc->bqc", probs, quantized if quant else plain
                                          ).reshape(b, t, h, -1) for _, _, quant in parts], parts)

    def _paged_view(self, kv: tuple, new: tuple, cache: PagedKVCache):
        """``new`` written into the latent pages, and the rows' pages gathered into the dense
        cache's layout (``PagedKVCache.view``), on each device's rows and pages (``per_device``).
        Returns ((rope keys ``[b, r, s]``, latents ``[b, s, c]``), the layer's pools)."""
        def step(c, kv, new):
            kv = c.store(kv, new)
            return c.view(kv), kv

        sh, specs, out_specs = self.sharding, None, None
        if sh is not None:
            specs = ((rows_spec(sh, 3), rows_spec(sh, 3)),)
            out_specs = ((rows_spec(sh, 3), rows_spec(sh, 3)), pool_specs(sh, kv))
        return per_device(step, sh, cache, kv, (new,), specs, out_specs)

    def absorbed_paged(self, q_nope: Float[Array, "b t h n"], q_rope: Float[Array, "b t h r"],
                       kv: tuple, new: tuple, cache: PagedKVCache, positions, segment_ids,
                       adapter: bool = True) -> tuple[Float[Array, "b t h v"], tuple]:
        """``absorbed`` over the latent pages where they lie, after writing ``new`` (rotary
        key, latent) into them: the queries are projected here, the pages read on each
        device's rows and pages (``_paged_latents``), the value blocks applied after. Returns
        (out, the layer's pools)."""
        b, t, h, _ = q_nope.shape
        dtype = q_nope.dtype
        parts = self._absorbed_parts(dtype, adapter)
        heads_first = lambda x: jnp.swapaxes(x, 1, 2).reshape(b, h * t, -1)  # noqa: E731
        q_rot = heads_first(q_rope.astype(dtype))  # [b, ht, r]
        q_lats = tuple(map(heads_first, _latent_queries(q_nope, parts)))
        quants = tuple(quant for _, _, quant in parts)
        lats, kv = self._paged_latents(q_rot, q_lats, quants, kv, new, cache, positions,
                                       segment_ids, t)
        lats = [jnp.transpose(lat[:, 0], (0, 2, 1, 3)).astype(dtype)  # -> [b, t, h, c]
                for lat in lats]
        return _latent_values(lats, parts), kv

    def _paged_latents(self, q_rot, q_lats: tuple, quants: tuple, kv: tuple, new: tuple,
                       cache: PagedKVCache, positions, segment_ids, t: int):
        """``absorbed_paged``'s page reads (``rlx.kernels.attention.paged``: blocks of pages,
        online softmax in f32): each block's scores are ``absorbed``'s, its terms the
        probabilities times the block's latents (per part: ``quants`` whether the latents are
        quantized). Returns the per-part ``[b, 1, h, t, c]`` and the layer's pools."""
        act, c, scale = self.kv_b_proj.act_quant, self.mla.kv_lora_rank, self.scale
        f32 = dict(preferred_element_type=jnp.float32)

        def step(cache, kv, new, q_rot, q_lats, positions, segment_ids):
            kv = cache.store(kv, new)
            rope_pool, latent_pool = kv  # [P, r, page], [P, page, c]
            b, ht, dtype = q_rot.shape[0], q_rot.shape[1], q_rot.dtype
            h = ht // t

            def load(pages):  # the block's rotary keys [b, n, r, page] and latents [b, k, c]
                plain = latent_pool[pages].astype(dtype).reshape(b, -1, c)
                return rope_pool[pages].astype(dtype), {True: quantize_activations(plain, act),
                                                        False: plain}

            def score(block):
                rope, latents = block
                s = jnp.einsum("bqr,bnrp->bqnp", q_rot, rope, **f32).reshape(b, ht, -1)
                for q_lat, quant in zip(q_lats, quants):
                    s = s + jnp.einsum("bqc,bsc->bqs", q_lat, latents[quant], **f32)
                return (s * scale).reshape(b, 1, h, t, -1)

            def term(quant):
                return lambda p, block: jnp.einsum(
                    "bqs,bsc->bqc", p.astype(dtype).reshape(b, ht, -1), block[1][quant],
                    **f32).reshape(b, 1, h, t, c)

            lats = online_pages(load, score, [term(q) for q in quants], cache.table,
                                cache.ends, positions, segment_ids, page_size=cache.page_size,
                                block_pages=block_pages_for(cache.page_size),
                                out_shapes=[(b, 1, h, t, c)] * len(quants))
            return tuple(lats), kv

        sh, specs, out_specs = self.sharding, None, None
        if sh is not None:
            heads = sh.heads_for(self.num_heads)
            query = rows_spec(sh, 3, (1, heads))  # [b, h * t, x]: heads first
            specs = ((rows_spec(sh, 3), rows_spec(sh, 3)), query, (query,) * len(q_lats),
                     rows_spec(sh, 2), rows_spec(sh, 2))
            out_specs = ((rows_spec(sh, 5, (2, heads)),) * len(quants), pool_specs(sh, kv))
        return per_device(step, sh, cache, kv, (new, q_rot, q_lats, positions, segment_ids),
                          specs, out_specs)


def _latent_queries(q_nope: Float[Array, "b t h n"], parts) -> tuple:
    """Each absorbed part's queries in the latent space, ``q_nope W_k``: ``[b, t, h, c]``."""
    return tuple(jnp.einsum("bthn,chn->bthc", q_nope, w_k) for w_k, _, _ in parts)


def _latent_values(lats, parts) -> Float[Array, "b t h v"]:
    """The heads' outputs from each part's attended latents ``[b, t, h, c]``: the sum of
    ``lat W_v``."""
    return sum(jnp.einsum("bthc,chv->bthv", lat, w_v) for lat, (_, w_v, _) in zip(lats, parts))
