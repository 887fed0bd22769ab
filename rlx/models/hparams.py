"""Model hyper-parameters: the frozen records every module of the decoder family is built from.

``ModelConfig`` describes each supported decoder: Llama (incl. llama3 rope scaling), Qwen2 (qkv
bias), Qwen3 (q/k RMSNorm), Mixtral, Qwen2-MoE (shared expert with a sigmoid gate), Qwen3-MoE,
DeepSeek-V3 (multi-head latent attention, ``MLAConfig``; also Kimi-K2 and, with
``q_lora_rank=None``, DeepSeek-V2-Lite shapes), GLM-4.5 (GQA with partial rotary), gpt-oss
(sliding-window layers, attention sinks, an o_proj bias, biased experts with a clamped SwiGLU) and
Qwen3-Next (gated DeltaNet layers, ``LinearAttentionConfig``, among gated attention ones). The
translation from and to transformers' ``config.json`` lives in ``rlx.models.config`` and the
families' specs (``rlx.models.families``, which also name the HF classes); this module knows
nothing of HF field names beyond the comments, so the records can be built directly.

Derived sizes (``rotary_dim``, ``value_head_dim``, ``first_k_dense_replace``, ``num_params``)
are computed here, once, for the modules, the KV cache and the memory planner.
"""

from __future__ import annotations

import dataclasses
import math

ROPE_KINDS = ("default", "linear", "llama3", "yarn")  # rotary frequency scalings rlx implements
ROUTERS = ("softmax", "sigmoid")  # MoE router scoring functions
# grouped-query attention; multi-head latent attention; MLA with DeepSeek sparse attention's indexer
ATTENTION_KINDS = ("gqa", "mla", "dsa")
MLP_KINDS = ("dense", "moe")  # a SwiGLU MLP; routed experts (and shared ones)


class ModelConfigError(ValueError):
    """A model config that rlx cannot represent; the message names the field."""


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: ``default``, ``linear``, ``llama3`` or ``yarn`` frequency scaling, over the
    first ``partial_rotary_factor`` of each head (GLM-4.5: 0.5)."""

    theta: float = 10000.0
    kind: str = "default"  # one of ROPE_KINDS
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # yarn: rotations below which a frequency is divided by ``factor``
    mscale: float | None = None  # yarn: numerator temperature of the cos/sin scale
    mscale_all_dim: float | None = None  # yarn: denominator temperature; MLA also scales softmax
    attention_factor: float | None = None  # yarn: explicit cos/sin scale (overrides mscale)
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    partial_rotary_factor: float = 1.0  # fraction of a head's dimensions that rotate

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ModelConfigError(f"rope_type={self.kind!r} is not supported; rlx supports "
                                   f"{list(ROPE_KINDS)}")

    def cos_sin_scale(self) -> float:
        """transformers' ``attention_scaling``: the factor on the rotary cosines and sines (so the
        rotated part of every query-key product scales by its square). YaRN only, else 1."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """The factor MLA (DeepSeek) multiplies its softmax scale by, ``mscale(factor,
        mscale_all_dim) ** 2`` for a scaled rope with ``mscale_all_dim`` (transformers'
        ``yarn_apply_mscale``), else 1. GQA families do not use it."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    bottleneck, keys and values from one shared ``kv_lora_rank`` latent per token, and a
    ``qk_rope_head_dim`` rotary key shared by all heads."""

    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int  # per-head query/key dims without position
    qk_rope_head_dim: int  # per-head query dims / shared key dims that rotate
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek's weights lay them

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) over MLA: a lightning indexer per layer
    scores every earlier key for each query and the attention keeps the ``index_topk`` best
    (``rlx.models.dsa``); ``shared_layers`` (GLM-5's "shared" ``indexer_types``) have no indexer
    and attend under the selection of the most recent layer that has one."""

    index_topk: int  # keys kept per query
    index_head_dim: int  # width of the indexer's query heads and of its one key per token
    index_n_heads: int
    rope_interleave: bool  # the indexer's rotary pairs interleaved (GLM-5) or half-split (V3.2)
    shared_layers: tuple[int, ...] = ()  # layers reusing the previous indexer layer's selection


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next's ``linear_attention`` layers, ``rlx.models.deltanet``):
    each key head serves ``num_value_heads // num_key_heads`` value heads; a depthwise causal
    convolution of ``conv_kernel`` taps runs over the queries, keys and values."""

    layers: tuple[int, ...]  # the linear-attention layers; the others are full attention
    num_key_heads: int  # linear_num_key_heads
    num_value_heads: int  # linear_num_value_heads
    key_head_dim: int  # linear_key_head_dim
    value_head_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ModelConfigError(f"linear_num_value_heads={self.num_value_heads} must be a "
                                   f"multiple of linear_num_key_heads={self.num_key_heads}")
        if self.conv_kernel < 1:
            raise ModelConfigError(f"linear_conv_kernel_dim={self.conv_kernel} must be at least 1")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values side by side."""
        return 2 * self.key_dim + self.value_dim

    def num_params(self, d: int) -> int:
        """in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, the gated norm and out_proj."""
        nv = self.num_value_heads
        return (d * (2 * self.key_dim + 2 * self.value_dim) + d * 2 * nv
                + self.conv_dim * self.conv_kernel + 2 * nv + self.value_head_dim
                + self.value_dim * d)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse MLP: ``num_experts`` experts, ``top_k`` per token, optional shared experts.

    ``router="softmax"``: top-k of the softmax over all experts (Mixtral, Qwen). ``"sigmoid"``
    (DeepSeek-V3, GLM-4.5): top-k of the sigmoid scores plus ``correction_bias`` among the best
    ``topk_group`` of ``n_group`` expert groups; the gates are the uncorrected scores.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k gates to sum to 1
    shared_intermediate_size: int = 0  # 0: no shared expert; else the summed width of all of them
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w) scales the shared expert
    sparse_layers: tuple[int, ...] = ()  # layer indices with a sparse MLP; the others are dense
    router: str = "softmax"  # one of ROUTERS
    correction_bias: bool = False  # e_score_correction_bias: added for the choice of experts only
    n_group: int = 1  # expert groups (sigmoid router)
    topk_group: int = 1  # groups a token may pick its experts from
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' gates
    router_bias: bool = False  # gpt-oss: a bias on the router's logits
    expert_bias: bool = False  # gpt-oss: biases on every expert's gate, up and down projections
    # gpt-oss's clamped SwiGLU, ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
    # ``g = min(gate, l)`` (``rlx.models.moe.clamped_swiglu``); None: ``silu(gate) * up``
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702  # the sigmoid's gain of the clamped SwiGLU

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ModelConfigError(f"router scoring_func={self.router!r} is not supported; rlx "
                                   f"supports {list(ROUTERS)}")
        if self.router_bias and self.router != "softmax":
            raise ModelConfigError("a router bias is implemented for the softmax router only; "
                                   f"got router={self.router!r}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ModelConfigError(f"n_group={self.n_group} must divide n_routed_experts="
                                   f"{self.num_experts}")
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(f"topk_group={self.topk_group} must be in 1..n_group="
                                   f"{self.n_group}")
        if self.topk_group < self.n_group and per_group < 2:
            raise ModelConfigError(f"n_group={self.n_group} leaves {per_group} expert per group; "
                                   "group scores sum each group's best 2 experts")
        if not 1 <= self.top_k <= self.topk_group * per_group:
            raise ModelConfigError(f"num_experts_per_tok={self.top_k} must be in 1.."
                                   f"{self.topk_group * per_group} (topk_group x experts per group)")

    @property
    def num_shared_experts(self) -> int:
        """Ungated shared experts of ``intermediate_size`` each (DeepSeek's ``n_shared_experts``)."""
        n, rest = divmod(self.shared_intermediate_size, self.intermediate_size)
        if rest:
            raise ModelConfigError(f"shared expert width {self.shared_intermediate_size} is not a "
                                   f"multiple of moe_intermediate_size={self.intermediate_size}")
        return n


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (HF names in comments where they differ).

    With ``mla`` set, ``head_dim`` is the query/key head width ``qk_nope + qk_rope``, keys and
    values are per head (``num_kv_heads == num_heads``) and ``qkv_bias`` is DeepSeek's
    ``attention_bias`` (biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``).
    """

    architecture: str  # HF class name, e.g. "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False  # Qwen2 / Qwen2-MoE; attention_bias of Llama / GLM-4.5 / DeepSeek
    qk_norm: bool = False  # Qwen3 / Qwen3-MoE; GLM-4.5's use_qk_norm
    tie_word_embeddings: bool = False
    moe: MoEConfig | None = None
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # several (GLM-4.5) as a tuple: hashable
    hidden_act: str = "silu"
    mla: MLAConfig | None = None  # multi-head latent attention instead of GQA
    o_bias: bool = False  # a bias on o_proj (gpt-oss's attention_bias biases all four)
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit joins every softmax
    sliding_window: int | None = None  # keys fewer than this many positions back (sliding layers)
    sliding_layers: tuple[int, ...] = ()  # layer_types' "sliding_attention" layers
    dsa: DSAConfig | None = None  # DeepSeek sparse attention over ``mla`` (needs ``mla``)
    # Qwen3-Next: gated DeltaNet layers among the GQA ones, a sigmoid gate on each full
    # attention's output (q_proj also projects it) and RMSNorms scaling by ``1 + weight``
    linear_attention: LinearAttentionConfig | None = None
    attention_output_gate: bool = False
    centered_norms: bool = False

    def __post_init__(self):
        if self.dsa is not None and (self.mla is None or self.mla.q_lora_rank is None):
            raise ModelConfigError("DeepSeek sparse attention (index_topk) needs multi-head latent "
                                   "attention with a q_lora_rank: its indexer reads the q_a latent")
        if self.dsa is not None and 0 in self.dsa.shared_layers:
            raise ModelConfigError("layer 0 cannot share an earlier layer's index selection (no "
                                   "layer before it has an indexer); make it a full indexer layer")
        if self.sliding_layers and not self.sliding_window:
            raise ModelConfigError(f"sliding layers {list(self.sliding_layers)} need a positive "
                                   f"sliding_window; got {self.sliding_window!r}")

    def is_linear_layer(self, i: int) -> bool:
        """Layer ``i`` is a gated DeltaNet layer (``linear_attention``), not attention."""
        return self.linear_attention is not None and i in self.linear_attention.layers

    def window(self, i: int) -> int | None:
        """Layer ``i``'s attention window (``sliding_window`` for a sliding layer), else None."""
        return self.sliding_window if i in self.sliding_layers else None

    @property
    def rotary_dim(self) -> int:
        """Dimensions of a head that rotate: MLA's ``qk_rope_head_dim``, else ``head_dim`` times
        the rope's ``partial_rotary_factor`` (the rotary angles are computed for this width)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def value_head_dim(self) -> int:
        """Width of a value head (MLA's ``v_head_dim``; ``head_dim`` for GQA)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def position_limit(self) -> int:
        """The longest sequence the model was built for: ``max_position_embeddings``, or with a
        scaled rope (YaRN, linear, llama3) its ``factor x original_max_position_embeddings`` where
        that is longer (a YaRN rope added to a config.json that kept the original length)."""
        rope = self.rope
        if rope.kind == "default":
            return self.max_position_embeddings
        return max(self.max_position_embeddings,
                   int(rope.factor * rope.original_max_position_embeddings))

    @property
    def first_k_dense_replace(self) -> int | None:
        """``k`` when layers ``0..k-1`` are dense and the rest sparse (DeepSeek / GLM), else None."""
        sparse = self.moe.sparse_layers if self.moe is not None else ()
        k = self.num_layers - len(sparse)
        return k if tuple(sparse) == tuple(range(k, self.num_layers)) else None

    @property
    def attention_kind(self) -> str:
        """The attention layers' kind (one of ATTENTION_KINDS): ``"dsa"`` with ``dsa``, ``"mla"``
        with ``mla``, else GQA."""
        if self.dsa is not None:
            return "dsa"
        return "mla" if self.mla is not None else "gqa"

    @property
    def latent_cache_width(self) -> int:
        """Width of an MLA layer's cached per-token values: the latent (``kv_lora_rank``) and,
        with ``dsa``, the indexer's key beside it."""
        return self.mla.kv_lora_rank + (self.dsa.index_head_dim if self.dsa is not None else 0)

    def mlp_kind(self, i: int) -> str:
        """Layer ``i``'s MLP kind (one of MLP_KINDS): ``"moe"`` for a sparse layer, else dense."""
        return "moe" if self.is_sparse_layer(i) else "dense"

    def is_sparse_layer(self, i: int) -> bool:
        return self.moe is not None and i in self.moe.sparse_layers

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied; frozen buffers such as the router's
        correction bias are not parameters, as in transformers' ``num_parameters``)."""
        d, v = self.hidden_size, self.vocab_size
        attn = self._mla_params() if self.mla is not None else self._gqa_params()
        total = v * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(self.num_layers):
            mixer = (self.linear_attention.num_params(d) if self.is_linear_layer(i) else attn)
            total += mixer + 2 * d + self._mlp_params(i) + self._indexer_params(i)
        return total

    def _indexer_params(self, i: int) -> int:
        """wq_b, wk, k_norm (weight and bias) and weights_proj of layer ``i``'s indexer."""
        x = self.dsa
        if x is None or i in x.shared_layers:
            return 0
        return (self.mla.q_lora_rank * x.index_n_heads * x.index_head_dim
                + self.hidden_size * (x.index_head_dim + x.index_n_heads) + 2 * x.index_head_dim)

    def _gqa_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += d * hd * self.num_heads if self.attention_output_gate else 0
        attn += hd * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        attn += (d if self.o_bias else 0) + (self.num_heads if self.attention_sinks else 0)
        return attn + (2 * hd if self.qk_norm else 0)

    def _mla_params(self) -> int:
        m, d, h = self.mla, self.hidden_size, self.num_heads
        bias = 1 if self.qkv_bias else 0
        if m.q_lora_rank is None:
            q = d * h * m.qk_head_dim
        else:
            q = (d + 1 + bias) * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim
        kv = (d + bias) * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + h * m.v_head_dim * d + bias * d

    def _mlp_params(self, i: int) -> int:
        d = self.hidden_size
        if not self.is_sparse_layer(i):
            return 3 * d * self.intermediate_size
        m = self.moe
        n = m.num_experts * 3 * d * m.intermediate_size + d * m.num_experts
        n += m.num_experts if m.router_bias else 0
        n += m.num_experts * (2 * m.intermediate_size + d) if m.expert_bias else 0
        n += 3 * d * m.shared_intermediate_size + (d if m.shared_expert_gate else 0)
        return n


__all__ = ["ROPE_KINDS", "ROUTERS", "ATTENTION_KINDS", "MLP_KINDS", "ModelConfigError", "RopeConfig",
           "MLAConfig", "DSAConfig", "LinearAttentionConfig", "MoEConfig", "ModelConfig", "yarn_get_mscale"]
