"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): GQA with q/k/v biases (``qkv_bias`` defaults to True),
dense SwiGLU MLPs."""

from __future__ import annotations

from rlx.models.families.common import QWEN_SPECIAL_TOKENS
from rlx.models.families.spec import GQA_TARGETS, FamilySpec, GGUFArch

PRESETS = {
    "Qwen/Qwen2.5-1.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "torch_dtype": "bfloat16", **QWEN_SPECIAL_TOKENS,
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16", **QWEN_SPECIAL_TOKENS,
    },
}

SPEC = FamilySpec(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    attention="gqa",
    mlp="dense",
    lora_targets=GQA_TARGETS,
    presets=PRESETS,
    qkv_bias_default=True,
    gguf=GGUFArch("qwen2", permute_qk=False, extra_config=(
        ("use_sliding_window", False), ("max_window_layers", 0))),
)
