"""Tiny randomly initialised HF transformers models of every family rlx supports.

Weights are drawn with a large init range so that logits are O(1) and a wrong layout, a missing
bias or a wrong routing rule shows up far above the parity tolerance.
"""

from __future__ import annotations

import os

import torch
import transformers

_COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
               max_position_embeddings=256)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    llama3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "llama": transformers.LlamaConfig(**_COMMON, rope_parameters=llama3, tie_word_embeddings=False),
        "llama_tied": transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "qwen2": transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
        "mixtral": transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **_COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1]),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **_COMMON, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8,
            norm_topk_prob=True),
    }


FAMILIES = tuple(_configs())


def _extra_configs() -> dict[str, transformers.PretrainedConfig]:
    """Shapes for servers whose CPU kernels want widths in multiples of 64 (SGLang's LoRA pool)."""
    wide = dict(_COMMON, hidden_size=64, intermediate_size=128)
    return {"llama_wide": transformers.LlamaConfig(**wide, tie_word_embeddings=False)}


def make_hf_model(family: str, root: str) -> str:
    """Create, save and return the folder of a tiny HF model of ``family`` (cached under root)."""
    path = os.path.join(root, family)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = {**_configs(), **_extra_configs()}[family]
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # norms are initialised to exactly 1; perturb them to catch mix-ups
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
                if name.endswith("bias"):
                    p.add_(0.5 * torch.randn_like(p))
        model.save_pretrained(path)
    return path


def hf_logits(path: str, ids, attention_mask=None, position_ids=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kw = {}
    if attention_mask is not None:
        kw["attention_mask"] = torch.tensor(attention_mask)
    if position_ids is not None:
        kw["position_ids"] = torch.tensor(position_ids)
    with torch.no_grad():
        return model(torch.tensor(ids), **kw).logits.float().numpy()
