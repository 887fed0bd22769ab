"""GLM-4.5 (``Glm4MoeForCausalLM``): GQA with rotary on part of each head
(``partial_rotary_factor`` defaults to 0.5 as in transformers), optional q/k norms
(``use_qk_norm``), DeepSeek-V3's sigmoid router and ungated shared experts."""

from __future__ import annotations

import functools
from typing import Any

from rlx.models.families.common import SIGMOID_CHOICES, sigmoid_moe_from_hf, sigmoid_moe_to_hf
from rlx.models.families.spec import GQA_TARGETS, FamilySpec, MoENames
from rlx.models.hparams import ModelConfig

# transformers' defaults for the optional fields of Glm4MoeConfig
_DEFAULTS = {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
             "first_k_dense_replace": 1, "norm_topk_prob": True}

PRESETS = {
    # GQA (96 query / 8 KV heads of 128, qkv bias, rotary on half of each head), 128 experts,
    # the first layer dense
    "zai-org/GLM-4.5-Air": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
        "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True,
        "use_qk_norm": False, "n_routed_experts": 128, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
        "rope_scaling": None, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
    },
}


def _extra_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias, "use_qk_norm": cfg.qk_norm,
            "partial_rotary_factor": cfg.rope.partial_rotary_factor}


SPEC = FamilySpec(
    model_type="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    attention="gqa",
    mlp="moe",
    lora_targets=GQA_TARGETS,
    presets=PRESETS,
    choices=SIGMOID_CHOICES,
    qk_norm="use_qk_norm",
    partial_rotary=0.5,
    moe_from_hf=functools.partial(sigmoid_moe_from_hf, defaults=_DEFAULTS),
    extra_to_hf=_extra_to_hf,
    moe_to_hf=sigmoid_moe_to_hf,
    moe_names=MoENames(shared="shared_experts"),
    peft_remaps_mlp_names=True,
)
