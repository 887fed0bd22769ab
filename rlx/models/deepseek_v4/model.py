"""The DeepSeek-V4 decoder (``DeepseekV4ForCausalLM``): embeddings copied into ``hc_mult``
residual streams, blocks of attention (``rlx.models.deepseek_v4.attention``) and a mixture of experts
(``rlx.models.deepseek_v4.hash_moe``) each entered and left through a hyper-connection
(``rlx.models.deepseek_v4.hyper``), the streams collapsed (``HyperHead``), RMS-normalised and projected by an
untied ``head``.

A block: ``post, comb, x = attn_hc(h)``; ``h = expand(h, attn(attn_norm(x)), post, comb)``; the
same with ``ffn_hc``, ``ffn_norm`` and the MoE (which also reads the token ids: hash layers route
by them). Rows hold one sequence each from column 0 (``rlx.models.deepseek_v4.compressor``); padding on the
right is masked by ``segment_ids`` (0) and gives every real token the logits of the unpadded row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from rlx.models.deepseek_v4.hash_moe import V4MoE
from rlx.models.deepseek_v4.hyper import HyperConnection, HyperHead, expand
from rlx.models.decoder import Routes
from rlx.models.layers import Linear, RMSNorm, param
from rlx.models.deepseek_v4.attention import LayerCache, V4Attention, V4Attn, empty_cache

HASH, ROUTED = "hash_moe", "moe"  # mlp_layer_types values
MLP_LAYER_TYPES = (HASH, ROUTED)


@dataclasses.dataclass(frozen=True)
class V4Config:
    """Everything the DeepSeek-V4 decoder's shapes and arithmetic depend on."""

    vocab_size: int
    hidden_size: int
    attn: V4Attn
    layer_types: tuple[str, ...]  # one of rlx.models.deepseek_v4.attention.LAYER_TYPES per layer
    mlp_layer_types: tuple[str, ...]  # one of MLP_LAYER_TYPES per layer
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str  # a key of rlx.models.deepseek_v4.hash_moe.SCORING
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int = 0  # MTP layers of the checkpoint (never read: the family)
    # config.json's rope_parameters ({"main", "compress"} tables) and the fields it carries
    # through unchanged, as sorted (key, value) pairs, for writing the config back
    rope_tables: tuple = ()
    extra: tuple = ()
    architecture: str = "DeepseekV4ForCausalLM"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


class V4Block(nnx.Module):
    """One decoder block (module docstring)."""

    def __init__(self, cfg: V4Config, i: int, *, dtype, param_dtype, rngs):
        d, n, norm = cfg.hidden_size, cfg.hc_mult, dict(dtype=jnp.float32, param_dtype=jnp.float32)
        hc = (d, n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, rngs)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, **norm)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps, **norm)
        self.self_attn = V4Attention(cfg.attn, cfg.layer_types[i], dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs)
        self.mlp = V4MoE(d, cfg.moe_intermediate_size, cfg.n_routed_experts,
                         cfg.num_experts_per_tok, cfg.vocab_size,
                         hashed=cfg.mlp_layer_types[i] == HASH, scoring=cfg.scoring_func,
                         scale=cfg.routed_scaling_factor, limit=cfg.swiglu_limit, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, h: Float[Array, "b t n d"], ids, positions, segment_ids, adapter: bool = True):
        post, comb, x = self.attn_hc(h)
        x = self.self_attn(self.attn_norm(x).astype(self.dtype), positions, segment_ids, adapter)
        h = expand(h, x, post, comb)
        return self._ffn(h, ids, adapter)

    def _ffn(self, h, ids, adapter: bool):
        post, comb, x = self.ffn_hc(h)
        x = self.mlp(self.ffn_norm(x).astype(self.dtype), ids, adapter)
        return expand(h, x, post, comb)

    def step(self, h: Float[Array, "b t n d"], ids, positions, segment_ids, cache: LayerCache,
             adapter: bool = True):
        """The block over new tokens against the attention's decode cache."""
        post, comb, x = self.attn_hc(h)
        x, cache = self.self_attn.step(self.attn_norm(x).astype(self.dtype), positions,
                                       segment_ids, cache, adapter)
        return self._ffn(expand(h, x, post, comb), ids, adapter), cache


class DeepseekV4(nnx.Module):
    """The causal LM: ``__call__(input_ids, positions, segment_ids)`` -> logits ``[b, t, V]``."""

    def __init__(self, cfg: V4Config, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        d = cfg.hidden_size
        self.embed = param(rngs, (cfg.vocab_size, d), param_dtype, ("vocab", "embed"))
        self.layers = nnx.List([V4Block(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.hc_head = HyperHead(d, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps, rngs)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=jnp.float32, param_dtype=jnp.float32)
        self.head = Linear(d, cfg.vocab_size, ("embed", "vocab"), bias=False, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
        self.cfg, self.dtype = cfg, dtype

    def hidden_states(self, input_ids: Int[Array, "b t"], positions, segment_ids,
                      adapter: bool = True, remat: bool = False, policy=None
                      ) -> Float[Array, "b t d"]:
        """Final-norm hidden states; ``remat``: each block a ``jax.checkpoint`` (with checkpoint
        ``policy``), its activations recomputed in the backward pass."""
        x = self.embed[...].astype(self.dtype)[input_ids]
        h = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.cfg.hc_mult, x.shape[-1]))
        for layer in self.layers:
            if remat:  # a checkpoint of the block's variables and input
                graphdef, state = nnx.split(layer)
                h = jax.checkpoint(lambda st, h: nnx.merge(graphdef, st)(
                    h, input_ids, positions, segment_ids, adapter), policy=policy)(state, h)
            else:
                h = layer(h, input_ids, positions, segment_ids, adapter)
        return self.norm(self.hc_head(h)).astype(self.dtype)

    def forward(self, input_ids: Int[Array, "b t"], positions: Int[Array, "b t"],
                segment_ids: Int[Array, "b t"], adapter: bool = True, remat: bool = False,
                policy=None, replay=None) -> tuple[Float[Array, "b t d"], Routes]:
        """The learner's entry (``rlx.learner.step.model_forward``): final-norm hidden states
        and the routing taken. Nothing is dropped (every expert runs on its tokens) and no
        routing is reported or replayed: a ``replay`` is refused."""
        if replay is not None:
            raise ValueError("routing replay (config.train.routing_replay) is not implemented "
                             "for DeepSeek-V4's hash and sqrtsoftplus routers; switch it off")
        h = self.hidden_states(input_ids, positions, segment_ids, adapter, remat, policy)
        return h, Routes(None, jnp.zeros((), jnp.int32))

    @property
    def lm_head(self) -> Linear:
        """The untied output projection, as ``rlx.learner.step.logprob_head`` reads it."""
        return self.head

    def logits(self, h: Float[Array, "... d"], adapter: bool = True) -> Float[Array, "... v"]:
        """Vocabulary logits of final hidden states (``hidden_states``)."""
        return self.head(h, adapter)

    def empty_cache(self, batch: int, length: int) -> tuple[LayerCache, ...]:
        """Zero decode caches of ``length`` positions, one per layer."""
        return tuple(empty_cache(layer.self_attn, batch, length, self.dtype)
                     for layer in self.layers)

    def step(self, input_ids: Int[Array, "b t"], positions: Int[Array, "b t"],
             segment_ids: Int[Array, "b t"], caches: tuple[LayerCache, ...],
             adapter: bool = True):
        """Logits of ``t`` new tokens per row at ``positions`` (a prefill, left-padded or not,
        or a decode step; ``segment_ids`` 0 marks padding) against the caches of the earlier
        ones, and the caches with the new tokens written: the logits of the full forward pass
        over the row."""
        x = self.embed[...].astype(self.dtype)[input_ids]
        h = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.cfg.hc_mult, x.shape[-1]))
        out = []
        for layer, cache in zip(self.layers, caches):
            h, cache = layer.step(h, input_ids, positions, segment_ids, cache, adapter)
            out.append(cache)
        h = self.norm(self.hc_head(h)).astype(self.dtype)
        return self.logits(h, adapter), tuple(out)

    def __call__(self, input_ids: Int[Array, "b t"], positions=None, segment_ids=None,
                 attention_mask=None, adapter: bool = True) -> Float[Array, "b t v"]:
        b, t = input_ids.shape
        if segment_ids is None:
            segment_ids = (jnp.ones((b, t), jnp.int32) if attention_mask is None
                           else attention_mask.astype(jnp.int32))
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return self.logits(self.hidden_states(input_ids, positions, segment_ids, adapter), adapter)
