"""Qwen3 (``Qwen3ForCausalLM``): GQA with per-head q/k RMSNorm, dense SwiGLU MLPs;
``attention_bias`` would also bias ``o_proj`` and is refused."""

from __future__ import annotations

from rlx.models.families.common import QWEN_SPECIAL_TOKENS
from rlx.models.families.spec import GQA_TARGETS, FamilySpec, GGUFArch

PRESETS = {
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", **QWEN_SPECIAL_TOKENS,
    },
}

SPEC = FamilySpec(
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    attention="gqa",
    mlp="dense",
    lora_targets=GQA_TARGETS,
    presets=PRESETS,
    output_biased=True,
    qk_norm=True,
    gguf=GGUFArch("qwen3", permute_qk=False, extra_config=(
        ("attention_bias", False), ("use_sliding_window", False), ("max_window_layers", 0))),
)
