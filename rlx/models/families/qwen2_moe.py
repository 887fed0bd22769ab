"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's biased GQA, softmax-routed experts (top-k gates
not renormalised by default) and one shared expert scaled by a sigmoid gate."""

from __future__ import annotations

import functools
from typing import Any

from rlx.models.families.common import qwen_moe_from_hf, qwen_moe_to_hf
from rlx.models.families.spec import GQA_TARGETS, FamilySpec, GGUFArch
from rlx.models.hparams import ModelConfig


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return qwen_moe_to_hf(cfg) | {"shared_expert_intermediate_size": cfg.moe.shared_intermediate_size,
                                  "qkv_bias": cfg.qkv_bias}


SPEC = FamilySpec(
    model_type="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    attention="gqa",
    mlp="moe",
    lora_targets=GQA_TARGETS,
    qkv_bias_default=True,
    moe_from_hf=functools.partial(qwen_moe_from_hf, shared=True),
    moe_to_hf=_moe_to_hf,
    # llama.cpp does not renormalise qwen2moe's top-k gates (as its config.json says)
    gguf=GGUFArch("qwen2moe", permute_qk=False, extra_config=(
        ("use_sliding_window", False), ("max_window_layers", 0), ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()), ("norm_topk_prob", False)), shared_expert=True),
)
