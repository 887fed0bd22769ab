"""gpt-oss (``GptOssForCausalLM``): GQA with q/k/v and o biases, a learned attention sink per
head, sliding-window layers alternating with full ones (``layer_types``, ``sliding_window``),
YaRN, and a MoE in every layer: a biased router whose top-k logits are softmaxed (the same gates
as softmax over all experts, top-k, renormalised: ``norm_topk_prob``), experts with biases and
gpt-oss's clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``), stored as one fused, interleaved
``gate_up_proj`` ``[E, D, 2I]`` and a ``down_proj`` ``[E, I, D]`` per layer.

Refused before any weight is read: a ``layer_types`` entry other than ``sliding_attention`` /
``full_attention``, a list whose length is not ``num_hidden_layers``, sliding layers without a
positive ``sliding_window``. The published checkpoints ship MXFP4 experts
(``quantization_config``): float loading refuses them (``rlx.models.hf.check_float_checkpoint``);
``quant.format="shipped"`` keeps them as stored (``rlx.quant.formats.layouts.mxfp4``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlx.models.families.common import refuse_unless, req
from rlx.models.families.spec import GQA_TARGETS, FamilySpec, MoENames
from rlx.models.hparams import ModelConfig, ModelConfigError, MoEConfig

LAYER_TYPES = ("sliding_attention", "full_attention")  # layer_types values rlx implements
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # GptOssConfig's defaults

PRESETS = {
    "openai/gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "attention_bias": True,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096},
        "swiglu_limit": SWIGLU_LIMIT, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": 200002, "torch_dtype": "bfloat16",
    },
}


def _layer_types(hf: Mapping[str, Any]) -> list[str]:
    """``layer_types`` as transformers fills it in (sliding on even layers), checked."""
    layers = int(req(hf, "num_hidden_layers"))
    types = hf.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(layers)]
    for t in types:
        refuse_unless("layer_types[...]", t, LAYER_TYPES, "GptOssForCausalLM")
    if len(types) != layers:
        raise ModelConfigError(f"config.json layer_types has {len(types)} entries; "
                               f"num_hidden_layers={layers} needs one per layer")
    return list(types)


def _extra_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    biased = bool(hf.get("attention_bias", True))
    sliding = tuple(i for i, t in enumerate(_layer_types(hf)) if t == "sliding_attention")
    window = hf.get("sliding_window", 128)
    return {"qkv_bias": biased, "o_bias": biased, "attention_sinks": True,
            "sliding_window": None if window is None else int(window), "sliding_layers": sliding}


def _extra_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.qkv_bias != cfg.o_bias or not cfg.attention_sinks:
        raise ModelConfigError("GptOssForCausalLM has sinks and biases on all of q/k/v/o or on "
                               f"none; got qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}, "
                               f"attention_sinks={cfg.attention_sinks}")
    return {"attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window,
            "layer_types": [LAYER_TYPES[0] if i in cfg.sliding_layers else LAYER_TYPES[1]
                            for i in range(cfg.num_layers)]}


def _moe_from_hf(hf: Mapping[str, Any], layers: int) -> MoEConfig:
    return MoEConfig(
        num_experts=int(req(hf, "num_local_experts")),
        top_k=int(req(hf, "num_experts_per_tok")),
        intermediate_size=int(req(hf, "intermediate_size")),
        norm_topk_prob=True,  # softmax over the top-k logits
        sparse_layers=tuple(range(layers)),
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", SWIGLU_LIMIT)),
        swiglu_alpha=float(hf.get("swiglu_alpha", SWIGLU_ALPHA)),
    )


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.moe
    if (m.router != "softmax" or not m.norm_topk_prob or not (m.router_bias and m.expert_bias)
            or m.swiglu_limit is None or m.shared_intermediate_size
            or m.sparse_layers != tuple(range(cfg.num_layers))):
        raise ModelConfigError(f"GptOssForCausalLM needs biased softmax-top-k experts with the "
                               f"clamped SwiGLU in every layer; got {m}")
    return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "intermediate_size": m.intermediate_size, "swiglu_limit": m.swiglu_limit,
            "swiglu_alpha": m.swiglu_alpha}


SPEC = FamilySpec(
    model_type="gpt_oss",
    architectures=("GptOssForCausalLM",),
    attention="gqa",
    mlp="moe",
    lora_targets=GQA_TARGETS,
    presets=PRESETS,
    qkv_bias_default=True,
    moe_from_hf=_moe_from_hf,
    extra_from_hf=_extra_from_hf,
    extra_to_hf=_extra_to_hf,
    moe_to_hf=_moe_to_hf,
    moe_names=MoENames(router="router", fused=True),
)
