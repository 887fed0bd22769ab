"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet linear-attention layers
(``rlx.models.deltanet``) mixed with gated full attention (GQA whose ``q_proj`` also projects a
sigmoid gate on each head's output, q/k RMSNorm, a quarter of each head rotating by default),
RMSNorms scaling by ``1 + weight``, and Qwen2-MoE's sparse MLP (softmax top-k experts, one
shared expert scaled by a sigmoid gate).

The layer kinds come from ``layer_types`` (``linear_attention`` / ``full_attention``) or, when
absent, from ``full_attention_interval`` (every n-th layer full) as transformers derives them.
Refused before any weight is read: another ``layer_types`` entry or a list whose length is not
``num_hidden_layers``, ``attention_bias`` (it would bias o_proj too), value heads that are not a
multiple of the key heads, a zero-width shared expert. The release's multi-token-prediction
tensors (``mtp.*``) are not part of rlx's model and are not read, as transformers skips them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlx.models.families.common import (QWEN_SPECIAL_TOKENS, qwen_moe_from_hf, qwen_moe_to_hf,
                                        refuse_unless, req)
from rlx.models.families.spec import GQA_TARGETS, FamilySpec
from rlx.models.hparams import LinearAttentionConfig, ModelConfig, ModelConfigError, MoEConfig

ARCH = "Qwen3NextForCausalLM"
LAYER_TYPES = ("linear_attention", "full_attention")  # layer_types values rlx implements
# Qwen3NextConfig's defaults of the linear-attention fields
LINEAR_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                   "linear_num_value_heads": 32, "full_attention_interval": 4}
# Qwen3NextConfig's defaults of the MoE fields
MOE_DEFAULTS = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "norm_topk_prob": True}

PRESETS = {
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": [ARCH], "model_type": "qwen3_next", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "partial_rotary_factor": 0.25,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", **QWEN_SPECIAL_TOKENS,
    },
}


def _get(hf: Mapping[str, Any], key: str) -> int:
    return int(hf[key] if hf.get(key) is not None else LINEAR_DEFAULTS[key])


def layer_types(hf: Mapping[str, Any]) -> list[str]:
    """``layer_types`` as transformers fills it in (every ``full_attention_interval``-th layer
    full), checked."""
    layers = int(req(hf, "num_hidden_layers"))
    types = hf.get("layer_types")
    if types is None:
        every = _get(hf, "full_attention_interval")
        types = [LAYER_TYPES[1] if (i + 1) % every == 0 else LAYER_TYPES[0] for i in range(layers)]
    for t in types:
        refuse_unless("layer_types[...]", t, LAYER_TYPES, ARCH)
    if len(types) != layers:
        raise ModelConfigError(f"config.json layer_types has {len(types)} entries; "
                               f"num_hidden_layers={layers} needs one per layer")
    return list(types)


def _extra_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    linear = tuple(i for i, t in enumerate(layer_types(hf)) if t == LAYER_TYPES[0])
    la = LinearAttentionConfig(
        layers=linear, num_key_heads=_get(hf, "linear_num_key_heads"),
        num_value_heads=_get(hf, "linear_num_value_heads"),
        key_head_dim=_get(hf, "linear_key_head_dim"),
        value_head_dim=_get(hf, "linear_value_head_dim"),
        conv_kernel=_get(hf, "linear_conv_kernel_dim"))
    return {"linear_attention": la, "attention_output_gate": True, "centered_norms": True}


def _extra_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    la = cfg.linear_attention
    if (la is None or not cfg.attention_output_gate or not cfg.centered_norms or cfg.qkv_bias
            or not cfg.qk_norm):
        raise ModelConfigError(f"{ARCH} needs gated DeltaNet layers, gated attention with q/k "
                               "norms and no biases, and 1 + weight RMSNorms; got "
                               f"linear_attention={la}, attention_output_gate="
                               f"{cfg.attention_output_gate}, centered_norms={cfg.centered_norms}")
    return {"layer_types": [LAYER_TYPES[0] if cfg.is_linear_layer(i) else LAYER_TYPES[1]
                            for i in range(cfg.num_layers)],
            "linear_conv_kernel_dim": la.conv_kernel, "linear_key_head_dim": la.key_head_dim,
            "linear_value_head_dim": la.value_head_dim, "linear_num_key_heads": la.num_key_heads,
            "linear_num_value_heads": la.num_value_heads, "attention_bias": False,
            "partial_rotary_factor": cfg.rope.partial_rotary_factor}


def _moe_from_hf(hf: Mapping[str, Any], layers: int) -> MoEConfig:
    hf = {**MOE_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    shared = hf["shared_expert_intermediate_size"]
    if int(shared) < 1:
        raise ModelConfigError(f"config.json shared_expert_intermediate_size={shared!r} is not "
                               f"supported for {ARCH}; its sparse layers have a shared expert "
                               "(a positive width)")
    return qwen_moe_from_hf(hf, layers, shared=True)


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.moe
    if m.router != "softmax" or not m.shared_expert_gate or m.router_bias or m.expert_bias:
        raise ModelConfigError(f"{ARCH} needs softmax-routed experts and a gated shared expert; "
                               f"got {m}")
    return qwen_moe_to_hf(cfg) | {"shared_expert_intermediate_size": m.shared_intermediate_size}


SPEC = FamilySpec(
    model_type="qwen3_next",
    architectures=(ARCH,),
    attention="gqa",
    mlp="moe",
    lora_targets=GQA_TARGETS,
    presets=PRESETS,
    choices=(("attention_bias", (False,)),),
    qk_norm=True,
    partial_rotary=0.25,
    moe_from_hf=_moe_from_hf,
    extra_from_hf=_extra_from_hf,
    extra_to_hf=_extra_to_hf,
    moe_to_hf=_moe_to_hf,
    peft_remaps_mlp_names=True,
)
