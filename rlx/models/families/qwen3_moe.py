"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's GQA with q/k norms, softmax-routed experts, no
shared expert. transformers 5 fuses its experts, so PEFT exports its MLP adapters by weight."""

from __future__ import annotations

import functools

from rlx.models.families.common import QWEN_SPECIAL_TOKENS, qwen_moe_from_hf, qwen_moe_to_hf
from rlx.models.families.spec import GQA_TARGETS, FamilySpec, GGUFArch

PRESETS = {
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", **QWEN_SPECIAL_TOKENS,
    },
}

SPEC = FamilySpec(
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    attention="gqa",
    mlp="moe",
    lora_targets=GQA_TARGETS,
    presets=PRESETS,
    output_biased=True,
    qk_norm=True,
    moe_from_hf=functools.partial(qwen_moe_from_hf, shared=False),
    moe_to_hf=qwen_moe_to_hf,
    # llama.cpp renormalises qwen3moe's top-k gates, as Qwen3-MoE's config.json says
    gguf=GGUFArch("qwen3moe", permute_qk=False, extra_config=(
        ("attention_bias", False), ("use_sliding_window", False), ("max_window_layers", 0),
        ("decoder_sparse_step", 1), ("mlp_only_layers", ()), ("norm_topk_prob", True))),
    peft_remaps_mlp_names=True,
)
