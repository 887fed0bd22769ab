"""The decoder: one nnx model for Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3
(multi-head latent attention, ``rlx.models.mla``), GLM-4.5, gpt-oss (per-layer sliding windows
and attention sinks, ``Attention``) and Qwen3-Next (gated DeltaNet layers, ``rlx.models.deltanet``,
in a Block's ``self_attn`` place; an output gate on its attention).

Each ``Block`` composes the layer kinds its ``ModelConfig`` names, never a family: GQA ``Attention``,
``MLAttention`` or ``DSAttention`` (MLA with DeepSeek sparse attention's indexer, ``rlx.models.dsa``,
whose index selection the layer loop carries to GLM-5's "shared" layers; ``attention_kind``) and a
dense or sparse MLP (``mlp_kind``; DeepSeek / GLM: the first ``first_k_dense_replace`` layers dense).
The rotary angles are computed once per forward pass for the config's ``rotary_dim``, scaled by
YaRN's temperature where the rope has one.

``Transformer(input_ids, positions=None, segment_ids=None, attention_mask=None) -> logits [B,T,V]``.
With neither ``positions`` nor ``segment_ids``, the batch is taken as unpadded. ``attention_mask``
(1 = real token, HF style) is turned into segment ids and, when positions are absent, into per-row
positions counted over real tokens only, so left padding is exact. Packed batches pass
``segment_ids`` (1, 2, ... per packed sequence, 0 for padding) and positions restarting per segment.

The same module serves the learner and the built-in sampler; ``hidden_states`` and ``logits`` are
exposed separately so the learner can compute log-probs chunk by chunk without [B, T, V] logits.
``decode`` runs the same modules over a ``KVCache`` (``rlx.models.kv_cache``); only the attention's
key/value source differs (GQA: cached per-head keys and values; MLA: cached latents, with
``kv_b_proj`` absorbed into a decode step's products, ``rlx.models.mla``).

The layers are either a list (``layers``, a Python loop) or, after ``rlx.models.stack.stack_layers``,
``stacks`` of same-structure layers whose variables carry a leading layer axis, run with ``lax.scan``
(``run_layers``; ``decode`` scans the stacked KV cache the same way).

``adapter`` (default True) on every call enables the LoRA adapters attached by ``rlx.quant.apply_lora``;
``adapter=False`` gives the frozen base, i.e. the reference policy, from the same weights and the same
jitted function (pass it as a static argument). Without adapters the flag changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from rlx.kernels.attention import attend
from rlx.kernels.attention.context import ContextSplit
from rlx.kernels.attention.paged import block_pages_for, gqa_paged
from rlx.models.hparams import ModelConfig
from rlx.models.kv_cache import KVCache
from rlx.models.layers import Linear, RMSNorm, param, rope_angles, rope_inv_freq, rotate, weight_value
from rlx.models.mixed import (FEW_ROWS, is_low_precision, matmul_feature_major, matmul_out_in,
                              mixed_einsum)
from rlx.models.deltanet import GatedDeltaNet
from rlx.models.dsa import DSAttention, mix, mix_decode, no_selection
from rlx.models.mla import MLAttention
from rlx.models.moe import DenseMLP, SparseMoE
from rlx.models.paged_kv import PagedKVCache, per_device, pool_specs, rows_spec
from rlx.models.stack import is_stacked, layer_counts, scan


class Routes(NamedTuple):
    """The MoE routing of a forward pass: the experts each token went to in every MoE layer, in
    layer order (``[b, t, layers, k]``; None for a model without MoE layers), and the (token,
    expert) pairs a dispatch capacity dropped, summed over layers."""

    experts: Int[Array, "b t l k"] | None
    dropped: Int[Array, ""]


def _layer_call(call, layer, x, rep, remat: bool, policy):
    """``call(layer, x, rep)`` for one unrolled layer; ``remat``: as a ``jax.checkpoint`` of the
    layer's variables and input (with checkpoint ``policy``)."""
    if not remat:
        return call(layer, x, rep)
    graphdef, state = nnx.split(layer)
    return jax.checkpoint(lambda st, x, rep: call(nnx.merge(graphdef, st), x, rep),
                          policy=policy)(state, x, rep)


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # float dtypes by config name


@dataclasses.dataclass(frozen=True)
class Precision:
    """``dtype``: compute dtype; ``param_dtype``: storage dtype of trainable/full parameters."""

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    moe_impl: str = "ragged"  # one of rlx.models.moe.MOE_IMPLS

    @classmethod
    def named(cls, dtype: str, param_dtype: str, moe_impl: str = "ragged") -> "Precision":
        """From the names a config uses (keys of ``DTYPES``)."""
        return cls(dtype=DTYPES[dtype], param_dtype=DTYPES[param_dtype], moe_impl=moe_impl)


class Attention(nnx.Module):
    """Grouped-query attention (optional q/k/v and o biases, q/k RMSNorm, partial rotary, a
    sliding window, attention sinks).

    Layer ``layer``'s window is ``ModelConfig.window(layer)`` (gpt-oss's sliding layers); with
    ``attention_sinks`` each head has a learned logit ``sinks[h]`` that joins its softmax's
    denominator (a virtual key with a zero value). Both are arguments of ``attend`` and of the
    paged decode, so every attention path honours them."""

    def __init__(self, cfg: ModelConfig, p: Precision, rngs, layer: int = 0):
        d, hd = cfg.hidden_size, cfg.head_dim
        kw = dict(dtype=p.dtype, param_dtype=p.param_dtype, rngs=rngs)
        gate = 2 if cfg.attention_output_gate else 1  # per head: [query, output gate]
        self.q_proj = Linear(d, cfg.num_heads * hd * gate, ("embed", "heads"), bias=cfg.qkv_bias,
                             **kw)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(cfg.num_heads * hd, d, ("heads", "embed"), bias=cfg.o_bias, **kw)
        norm = dict(dtype=p.dtype, param_dtype=p.param_dtype, centered=cfg.centered_norms)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, **norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, **norm) if cfg.qk_norm else None
        self.sinks = (param(rngs, (cfg.num_heads,), p.param_dtype, ("heads",))
                      if cfg.attention_sinks else None)
        self.window, self.gated = cfg.window(layer), cfg.attention_output_gate
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.sharding = None  # an AttentionSharding where a mesh runs an opaque kernel (parallel)

    def _sinks(self):
        """The sinks' logits in f32 ``[h]``, or None."""
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def linears(self) -> tuple[Linear, ...]:
        """Every projection of the layer (for quantization and LoRA)."""
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    def _qkv(self, x, angles, adapter: bool):
        """Projected queries, keys, values ``[b, t, heads, d]``, queries and keys rotated by
        ``angles`` (the forward pass's ``Transformer.rope_angles``), and the output gate's
        logits ``[b, t, heads * d]`` (None without ``attention_output_gate``)."""
        b, t, _ = x.shape
        q = self.q_proj(x, adapter).reshape(b, t, self.num_heads, -1)
        q, gate = (q, None) if not self.gated else (q[..., :self.head_dim], q[..., self.head_dim:])
        k = self.k_proj(x, adapter).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, adapter).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, angles), rotate(k, angles), v, gate

    def _out(self, out, adapter: bool, gate=None):
        b, t = out.shape[:2]
        out = out.reshape(b, t, self.num_heads * self.head_dim)
        if gate is not None:  # Qwen3-Next: sigmoid(gate) scales each head's output
            out = (out * jax.nn.sigmoid(gate.reshape(b, t, -1).astype(jnp.float32))).astype(out.dtype)
        return self.o_proj(out, adapter)

    def __call__(self, x, positions, segment_ids, angles, adapter: bool = True):
        q, k, v, gate = self._qkv(x, angles, adapter)
        out = attend(q, k, v, segment_ids, segment_ids, positions, positions, causal_columns=True,
                     window=self.window, sinks=self._sinks(), sharding=self.sharding)
        return self._out(out, adapter, gate)  # [b, t, h, d] -> [b, t, D]

    def decode(self, x, positions, segment_ids, angles, kv, cache: KVCache, adapter: bool = True,
               order: ContextSplit | None = None):
        """Attention of ``t`` new tokens over the cache; ``kv`` = this layer's (keys, values).

        ``cache`` already records the new tokens' positions/segments; returns (out, (keys, values)).
        ``order``: the new tokens come in this context-parallel order, split over the context
        devices (``Transformer.decode_routed``); their keys and values are put back in slot order
        and gathered before they are written.
        """
        q, k, v, gate = self._qkv(x, angles, adapter)
        if isinstance(cache, PagedKVCache) and order is None:  # the pages read in place
            out, kv = self._paged(q, k, v, kv, cache, positions, segment_ids)
            return self._out(out, adapter, gate), kv
        k, v = (k, v) if order is None else (order.in_slot_order(a) for a in (k, v))
        kv = cache.store(kv, (k, v))
        keys, values = cache.view(kv)  # [b, kv, d, s], [b, kv, s, d]
        out = attend(q, keys, values, segment_ids, cache.segment_ids, positions, cache.positions,
                     window=self.window, sinks=self._sinks(), kv_major=True,
                     sharding=None if order is None else self.sharding)
        return self._out(out, adapter, gate), kv

    def _paged(self, q, k, v, kv, cache: PagedKVCache, positions, segment_ids):
        """Write ``k`` / ``v`` into the pages and attend over them (``gqa_paged``), on each
        device's rows, pages and KV heads under a mesh (``per_device``)."""
        window, sinks = self.window, self._sinks()

        def step(c, kv, q, k, v, positions, segment_ids, *sink):
            kv = c.store(kv, (k, v))
            return gqa_paged(q, *kv, c.table, c.ends, positions, segment_ids,
                             block_pages=block_pages_for(c.page_size), window=window,
                             sinks=sink[0] if sink else None), kv

        sh = self.sharding
        heads = None if sh is None else sh.heads_for(self.num_kv_heads)
        args = (q, k, v, positions, segment_ids) + (() if sinks is None else (sinks,))
        specs = out_specs = None
        if sh is not None:
            tokens = rows_spec(sh, 4, (2, heads))
            specs = (tokens, tokens, tokens, rows_spec(sh, 2), rows_spec(sh, 2))
            specs += () if sinks is None else (PartitionSpec(heads),)  # a device's heads' sinks
            out_specs = (tokens, pool_specs(sh, kv, heads))
        return per_device(step, sh, cache, kv, args, specs, out_specs, heads)


def _dense_mlp(cfg: ModelConfig, p: Precision, rngs) -> DenseMLP:
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype=p.dtype,
                    param_dtype=p.param_dtype, rngs=rngs)


def _sparse_mlp(cfg: ModelConfig, p: Precision, rngs) -> SparseMoE:
    return SparseMoE(cfg.hidden_size, cfg.moe, impl=p.moe_impl, dtype=p.dtype,
                     param_dtype=p.param_dtype, rngs=rngs)


# the layer kinds a Block is composed of (ModelConfig.attention_kind / mlp_kind -> builder)
ATTENTION_LAYERS = {"gqa": Attention, "mla": MLAttention, "dsa": DSAttention, "linear": GatedDeltaNet}
MLP_LAYERS = {"dense": _dense_mlp, "moe": _sparse_mlp}


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, p: Precision, rngs):
        norm = dict(dtype=p.dtype, param_dtype=p.param_dtype, centered=cfg.centered_norms)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        # the token mixer: a gated DeltaNet in a linear-attention layer (Qwen3-Next), else attention
        kind = "linear" if cfg.is_linear_layer(layer) else cfg.attention_kind
        self.self_attn = ATTENTION_LAYERS[kind](cfg, p, rngs, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.mlp = MLP_LAYERS[cfg.mlp_kind(layer)](cfg, p, rngs)

    def __call__(self, x, positions, segment_ids, angles, adapter: bool = True):
        return self.routed(x, positions, segment_ids, angles, adapter)[0]

    def routed(self, x, positions, segment_ids, angles, adapter: bool = True, replay=None,
               sel=None):
        """``(x, experts, dropped, sel)``: the layer's output, for a MoE layer the experts each
        token went to (``replay``: these, ``[b, t, k]``) and the pairs a capacity dropped, and
        the DSA index selection handed on (``sel``, ``rlx.models.dsa.mix``)."""
        a, sel = mix(self.self_attn, self.input_layernorm(x), positions, segment_ids, angles,
                     adapter, sel)
        return (*self._mlp(x + a, adapter, replay), sel)

    def _mlp(self, x, adapter: bool, replay):
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoE):
            r = self.mlp.routed(h, adapter, replay)
            return x + r.out, r.experts, r.dropped
        return x + self.mlp(h, adapter), None, None

    def decode(self, x, positions, segment_ids, angles, kv, cache: KVCache, adapter: bool = True):
        """``__call__`` with cached attention; returns (x, this layer's updated (keys, values))."""
        x, _, _, kv, _ = self.decode_routed(x, positions, segment_ids, angles, kv, cache, adapter)
        return x, kv

    def decode_routed(self, x, positions, segment_ids, angles, kv, cache: KVCache,
                      adapter: bool = True, order: ContextSplit | None = None, sel=None):
        """``decode`` that also returns the MoE routing and selection (``routed``): ``(x,
        experts, dropped, kv, sel)``; ``order``: the tokens' context-parallel order."""
        a, kv, sel = mix_decode(self.self_attn, self.input_layernorm(x), positions, segment_ids,
                                angles, kv, cache, adapter, order, sel)
        return (*self._mlp(x + a, adapter, None), kv, sel)


class Transformer(nnx.Module):
    """Decoder-only LM. ``rngs=None`` builds zero weights to be filled by a loader."""

    def __init__(self, cfg: ModelConfig, precision: Precision = Precision(), rngs: nnx.Rngs | None = None):
        p = precision
        self.config, self.precision = cfg, p
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), p.param_dtype, ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, i, p, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=p.dtype,
                            param_dtype=p.param_dtype, centered=cfg.centered_norms)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), bias=False,
            dtype=p.dtype, param_dtype=p.param_dtype, rngs=rngs)
        self.tied_head_out_in = False  # set by the rollout engine (rlx.rollout.jax.decode_layout)
        self.unroll_decode = False  # decode unstacks the layers (rlx.models.stack.decode_model)
        # an AttentionSharding whose context axis splits the tokens (rlx.models.parallel), or None
        self.sharding = None

    def hidden_states(
        self, input_ids: Int[Array, "b t"], positions: Int[Array, "b t"] | None = None,
        segment_ids: Int[Array, "b t"] | None = None, attention_mask: Int[Array, "b t"] | None = None,
        adapter: bool = True, replay: Int[Array, "b t l k"] | None = None,
    ) -> Float[Array, "b t d"]:
        """Final-norm hidden states ``[B, T, D]``; ``replay``: the experts of every token in
        every MoE layer (routing replay, ``run_layers``)."""
        positions, segment_ids = resolve_positions(input_ids, positions, segment_ids, attention_mask)
        return self.forward(input_ids, positions, segment_ids, adapter, replay=replay)[0]

    def forward(self, input_ids: Int[Array, "b t"], positions: Int[Array, "b t"],
                segment_ids: Int[Array, "b t"], adapter: bool = True, remat: bool = False,
                policy=None, replay: Int[Array, "b t l k"] | None = None
                ) -> tuple[Float[Array, "b t d"], Routes]:
        """Final-norm hidden states and the MoE routing (``routed_layers``). Under context
        parallelism (``sharding.context``) the layers run on each row's tokens in zig-zag order,
        folded into rows split over the context devices (``rlx.kernels.attention.context.
        ContextSplit``); inputs and outputs are in the natural order."""
        if self._context_shards() == 1:
            x, angles = self.embed_tokens(input_ids), self.rope_angles(positions)
            x, routes = self.routed_layers(x, positions, segment_ids, angles, adapter, remat,
                                           policy, replay)
            return self.norm(x), routes
        split, t = ContextSplit(self.sharding), input_ids.shape[1]
        ids, pos, seg = (split.enter(a) for a in (input_ids, positions, segment_ids))
        rep = None if replay is None else split.enter(replay, fill=-1)  # -1: the router picks
        x = split.split(self.embed_tokens(ids))
        x, routes = self.routed_layers(x, pos, seg, self.rope_angles(pos), adapter, remat, policy,
                                       rep)
        leave = lambda a: None if a is None else split.leave(a, t)  # noqa: E731
        return self.norm(leave(x)), Routes(leave(routes.experts), routes.dropped)

    def run_layers(self, x: Float[Array, "b t d"], positions, segment_ids, angles,
                   adapter: bool = True, remat: bool = False, policy=None,
                   replay: Int[Array, "b t l k"] | None = None) -> Float[Array, "b t d"]:
        """Every layer over ``x`` (no final norm): a Python loop over ``layers``, or a scan over
        each of ``stacks`` (``rlx.models.stack``). ``remat``: each layer a ``jax.checkpoint``
        with ``policy`` (``config.train.remat``). ``replay``: see ``routed_layers``."""
        return self.routed_layers(x, positions, segment_ids, angles, adapter, remat, policy,
                                  replay)[0]

    def routed_layers(self, x: Float[Array, "b t d"], positions, segment_ids, angles,
                      adapter: bool = True, remat: bool = False, policy=None,
                      replay: Int[Array, "b t l k"] | None = None
                      ) -> tuple[Float[Array, "b t d"], Routes]:
        """``run_layers`` and the MoE routing it took: the experts of every token in each MoE
        layer, in layer order (``replay``, when given, fixes them) and the pairs dropped. The
        layers carry ``x`` and the DSA index selection (``rlx.models.dsa.no_selection``)."""
        def call(layer, carry, rep):  # carry: (x, the DSA index selection)
            x, experts, dropped, sel = layer.routed(carry[0], positions, segment_ids, angles,
                                                    adapter, rep, carry[1])
            return (x, sel), (experts, dropped)

        parts, dropped, j = [], jnp.zeros((), jnp.int32), 0
        x = (x, no_selection(self.config, *x.shape[:2], x.shape[1]))
        for unit, count in self._units():
            moe = isinstance(unit.block.mlp if is_stacked(self) else unit.mlp, SparseMoE)
            rep = None if replay is None or not moe else replay[:, :, j:j + count]
            if is_stacked(self):
                x, (experts, drops) = scan(unit, x, None if rep is None else jnp.moveaxis(
                    rep, 2, 0), call, policy, remat)
                experts = None if experts is None else jnp.moveaxis(experts, 0, 2)
            else:
                x, (experts, drops) = _layer_call(call, unit, (self._split_rows(x[0]), x[1]),
                                                  rep, remat, policy)
                experts = None if experts is None else experts[:, :, None]
            if moe:
                parts.append(experts)
                dropped, j = dropped + jnp.sum(drops), j + count
        return self._split_rows(x[0]), Routes(jnp.concatenate(parts, axis=2) if parts else None,
                                              dropped)

    def _split_rows(self, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        """``x`` constrained to its rows split over the batch axes (``sharding.batch``), where
        they divide them and no context split folds the rows: an unrolled layer then runs on its
        device's rows, the FSDP-sharded weights gathered (what ``rlx.plan`` models), not the
        rows gathered (rlx/bench/README.md, "Memory per process across hosts")."""
        sh = self.sharding
        if sh is None or not sh.batch or self._context_shards() > 1:
            return x
        if x.shape[0] % math.prod(sh.mesh.shape[a] for a in sh.batch):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(sh.mesh, PartitionSpec(sh.batch)))

    def _units(self):
        """``(stack, layers)`` per stack of a stacked model, ``(layer, 1)`` per layer of an
        unrolled one."""
        if is_stacked(self):
            return [(s, s.count) for s in self.stacks]
        return [(layer, 1) for layer in self.layers]

    def decode(
        self, input_ids: Int[Array, "b t"], positions: Int[Array, "b t"], segment_ids: Int[Array, "b t"],
        cache: KVCache, adapter: bool = True,
    ) -> tuple[Float[Array, "b t d"], KVCache]:
        """Final-norm hidden states of ``t`` new tokens written at ``cache.index``, and the new cache.

        Prefill passes the (left-padded) prompts, each decode step one token per row; the modules
        and their math are those of ``hidden_states`` (see ``rlx.models.kv_cache``).
        """
        hidden, cache, _ = self.decode_routed(input_ids, positions, segment_ids, cache, adapter)
        return hidden, cache

    def decode_routed(self, input_ids: Int[Array, "b t"], positions: Int[Array, "b t"],
                      segment_ids: Int[Array, "b t"], cache: KVCache, adapter: bool = True
                      ) -> tuple[Float[Array, "b t d"], KVCache, Routes]:
        """``decode`` and the MoE routing of the new tokens (``routed_layers``): their experts and
        the (token, expert) pairs a dispatch capacity dropped."""
        cache = cache.record(positions, segment_ids)
        t = input_ids.shape[1]
        order = self._decode_order(t)
        if order is not None:
            input_ids, positions, segment_ids = (order.enter(a)
                                                 for a in (input_ids, positions, segment_ids))
        x, angles = self.embed_tokens(input_ids), self.rope_angles(positions)

        def call(layer, carry, kv):  # carry: (x, the DSA index selection)
            x, experts, drops, kv, sel = layer.decode_routed(
                carry[0], positions, segment_ids, angles, kv, cache, adapter, order, carry[1])
            return (x, sel), (kv, experts, drops)

        if cache.stacks != layer_counts(self):
            raise ValueError(f"Transformer.decode: the cache's layers per stack {cache.stacks} "
                             f"are not the model's {layer_counts(self)}; make the cache with "
                             "KVCache.zeros(..., rlx.models.stack.layer_counts(model))")
        keys, values, parts, dropped = [], [], [], jnp.zeros((), jnp.int32)
        x = (x, no_selection(self.config, *input_ids.shape, cache.positions.shape[1]))
        for (unit, _), k, v in zip(self._units(), cache.keys, cache.values):
            if is_stacked(self):  # a stack: its layers' buffers
                x, ((k, v), experts, drops) = scan(unit, x, (k, v), call)
            else:
                x, ((k, v), experts, drops) = call(unit, x, (k, v))
            keys.append(k)
            values.append(v)
            if experts is not None:
                parts.append(jnp.moveaxis(experts, 0, 2) if is_stacked(self) else experts[:, :, None])
                dropped = dropped + jnp.sum(drops)
        routes, x = Routes(jnp.concatenate(parts, axis=2) if parts else None, dropped), x[0]
        if order is not None:
            x = order.leave(x, t)
            routes = routes._replace(experts=None if routes.experts is None
                                     else order.leave(routes.experts, t))
        return self.norm(x), cache.advance(keys, values, t), routes

    def _decode_order(self, t: int) -> ContextSplit | None:
        """The context-parallel layout of a cached call's ``t`` new tokens (a prefill or a
        scored chunk): zig-zag and folded over the context devices where they are several and
        ``t`` splits into ``2 x`` their number of chunks; else None (every device runs it all)."""
        shards = self._context_shards()
        return None if shards == 1 or t % (2 * shards) else ContextSplit(self.sharding)

    def _context_shards(self) -> int:
        """Devices each row's tokens are split over (``sharding.context``; 1 without)."""
        return 1 if self.sharding is None else self.sharding.context_shards

    def rope_angles(self, positions: Int[Array, "b t"]) -> tuple[Array, Array]:
        """The rotary cosines and sines every layer uses (``rlx.models.layers.rope_angles``), for
        ``config.rotary_dim`` and times the rope's ``cos_sin_scale``."""
        rope = self.config.rope
        return rope_angles(positions, rope_inv_freq(rope, self.config.rotary_dim), rope.cos_sin_scale())

    def embed_tokens(self, input_ids: Int[Array, "b t"]) -> Float[Array, "b t d"]:
        """Embedding rows in the compute dtype (a quantized embedding dequantizes only these rows)."""
        dtype = self.precision.dtype
        if isinstance(self.embed, nnx.Variable):
            return jnp.take(self.embed[...], input_ids, axis=0).astype(dtype)
        return self.embed.take(input_ids, dtype)

    def logits(self, h: Float[Array, "... d"], adapter: bool = True) -> Float[Array, "... v"]:
        """Project hidden states to vocabulary logits (tied or separate head). A tied head in a
        low-precision compute dtype returns its f32 accumulator (every consumer takes the
        log-softmax in f32; rounding [tokens, V] logits to bf16 and back cost time and bits)."""
        if self.lm_head is not None:
            return self.lm_head(h, adapter)
        if not isinstance(self.embed, nnx.Variable):  # a quantized embedding may read its bytes
            y = self.embed.head_product(h, h.dtype)
            if y is not None:
                return y
        w = weight_value(self.embed, h.dtype)  # [V, D]
        if self.tied_head_out_in:
            return matmul_out_in(h, w, h.dtype)
        if not is_low_precision(h.dtype):
            return jnp.einsum("...d,vd->...v", h, w)
        flat = mixed_einsum("nd,vd->nv", h.reshape(-1, h.shape[-1]), w, jnp.float32)  # [N, V]
        return flat.reshape(*h.shape[:-1], -1)

    def vocab_major_logits(self, h: Float[Array, "n d"], adapter: bool = True
                           ) -> Float[Array, "v n"] | None:
        """``logits(h).T`` computed as ``W @ h^T`` when the head is a plain float ``[V, D]``
        matrix (the engine's tied f32 head, or an untied head in its ``out_in`` layout without
        bias, adapter or activation quantization) and there are at most ``FEW_ROWS`` rows; else
        None. A decode step reduces over the vocabulary, and this layout skips the transpose of
        the ``[V, n]`` product back to rows."""
        if h.shape[0] > FEW_ROWS:
            return None
        if self.lm_head is None:
            if not self.tied_head_out_in or not isinstance(self.embed, nnx.Variable):
                return None  # a quantized embedding's own product (``logits``)
            return matmul_feature_major(h, weight_value(self.embed, h.dtype), h.dtype)
        head = self.lm_head
        if head.kernel_layout != "out_in" or head.bias is not None or head.act_quant != "none" or (
                adapter and head.lora is not None):
            return None
        return matmul_feature_major(h, weight_value(head.kernel, head.dtype), head.dtype)

    def __call__(self, input_ids, positions=None, segment_ids=None, attention_mask=None, adapter: bool = True):
        return self.logits(self.hidden_states(input_ids, positions, segment_ids, attention_mask, adapter), adapter)


def resolve_positions(input_ids, positions, segment_ids, attention_mask):
    """Fill in positions / segment ids from an HF-style attention mask or an unpadded batch."""
    b, t = input_ids.shape
    if segment_ids is None:
        segment_ids = (jnp.ones((b, t), jnp.int32) if attention_mask is None
                       else attention_mask.astype(jnp.int32))
    if positions is None:
        if attention_mask is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        else:
            positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    return positions.astype(jnp.int32), segment_ids.astype(jnp.int32)
