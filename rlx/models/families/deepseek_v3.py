"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; also Kimi-K2, whose checkpoints say
``model_type="kimi_k2"`` over the same class, and DeepSeek-V2-Lite shapes without ``q_lora_rank``):
multi-head latent attention, a sigmoid router with correction bias and group-limited top-k,
ungated shared experts, the first ``first_k_dense_replace`` layers dense."""

from __future__ import annotations

import functools
from typing import Any

from rlx.models.families.common import SIGMOID_CHOICES, sigmoid_moe_from_hf, sigmoid_moe_to_hf
from rlx.models.families.spec import MLA_TARGETS, FamilySpec, MoENames
from rlx.models.hparams import ModelConfig

# transformers' defaults for the optional fields of DeepseekV3Config
_DEFAULTS = {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
             "first_k_dense_replace": 3, "norm_topk_prob": True}

PRESETS = {
    # multi-head latent attention, 256 experts in 8 groups (top-4 groups, top-8 experts), the
    # first 3 layers dense; the release stores FP8 128x128 blocks (its one multi-token-prediction
    # layer is not part of rlx's model)
    "deepseek-ai/DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4, "first_k_dense_replace": 3, "moe_layer_freq": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {
            "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    },
    # DeepSeek-V3's architecture with 64 heads, 384 experts in one group and one dense layer
    "moonshotai/Kimi-K2-Instruct": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0, "rope_scaling": {
            "type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 163584, "eos_token_id": 163585,
    },
}


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The sigmoid MoE fields, the router choices and ``moe_layer_freq`` (SGLang's DeepseekV2
    model reads it)."""
    out = sigmoid_moe_to_hf(cfg)
    out.update({k: v[0] for k, v in SIGMOID_CHOICES}, moe_layer_freq=1)
    return out


SPEC = FamilySpec(
    model_type="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    attention="mla",
    mlp="moe",
    lora_targets=MLA_TARGETS,
    presets=PRESETS,
    aliases=("kimi_k2",),
    choices=SIGMOID_CHOICES,
    moe_from_hf=functools.partial(sigmoid_moe_from_hf, defaults=_DEFAULTS),
    moe_to_hf=_moe_to_hf,
    moe_names=MoENames(shared="shared_experts"),
    peft_remaps_mlp_names=True,
)
