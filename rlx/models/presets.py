"""Architectures of known checkpoints, offline: the ``config.json`` values of their public releases.

Recipes in ``configs/`` name a checkpoint a user downloads (``model.path``); a machine without
it (CI, a laptop) still needs the architecture to build a shrunken random copy
(``model.shrink``) or to plan memory. ``write_preset_folder`` writes a weightless HF folder
(``config.json`` + optionally a tokenizer) that ``model.shrink`` and ``rlx.plan`` read like the
real checkpoint folder. Only architecture fields are kept; values are those of the published
``config.json`` files (Qwen2.5 Instruct releases, Qwen3 hybrid-thinking releases, DeepSeek-V3,
Kimi-K2-Instruct, GLM-4.5-Air).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

_QWEN_SPECIAL = {"bos_token_id": 151643, "eos_token_id": 151645}

PRESETS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-1.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "torch_dtype": "bfloat16", **_QWEN_SPECIAL,
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16", **_QWEN_SPECIAL,
    },
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", **_QWEN_SPECIAL,
    },
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", **_QWEN_SPECIAL,
    },
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


def find_preset(path: str) -> str | None:
    """The preset a ``model.path`` names: an exact id, or a folder ending in the id or its name.

    ``"Qwen/Qwen3-8B"``, ``"/ckpt/Qwen/Qwen3-8B"`` and ``"~/models/qwen3-8b/"`` all give
    ``"Qwen/Qwen3-8B"``; anything else gives None.
    """
    tail = path.rstrip("/").lower()
    for name in PRESETS:
        low = name.lower()
        if tail == low or tail.endswith("/" + low) or os.path.basename(tail) == low.split("/")[-1]:
            return name
    return None


def preset_config(name: str) -> dict[str, Any]:
    """A copy of the ``config.json`` dict of preset ``name`` (KeyError lists the known ones)."""
    if name not in PRESETS:
        raise KeyError(f"no architecture preset {name!r}; known: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def write_preset_folder(name: str, folder: str, *, tokenizer=None,
                        overrides: dict[str, Any] | None = None) -> str:
    """Write ``config.json`` of preset ``name`` (with ``overrides``) into ``folder``, plus
    ``tokenizer`` (an ``rlx.models.tokenizer.Tokenizer``) when given; returns ``folder``.

    With a stand-in tokenizer pass ``overrides={"vocab_size": tok.vocab_size, "bos_token_id": ...,
    "eos_token_id": ...}`` (``tokenizer_overrides`` builds that dict) so ids stay in range.
    """
    cfg = {**preset_config(name), **(overrides or {}), "_name_or_path": name}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


def tokenizer_overrides(tokenizer) -> dict[str, Any]:
    """``config.json`` fields that make a preset consistent with a stand-in tokenizer."""
    return {"vocab_size": tokenizer.vocab_size, "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id}


__all__ = ["PRESETS", "find_preset", "preset_config", "write_preset_folder", "tokenizer_overrides"]
