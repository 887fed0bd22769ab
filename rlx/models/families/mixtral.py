"""Mixtral (``MixtralForCausalLM``): GQA, every layer a softmax-routed MoE whose experts are named
``block_sparse_moe.experts.{e}.w1 / w3 / w2`` (gate / up / down) in its checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlx.models.families.common import req
from rlx.models.families.spec import GQA_TARGETS, FamilySpec, MoENames
from rlx.models.hparams import ModelConfig, MoEConfig


def _moe_from_hf(hf: Mapping[str, Any], layers: int) -> MoEConfig:
    return MoEConfig(
        num_experts=req(hf, "num_local_experts"),
        top_k=req(hf, "num_experts_per_tok"),
        intermediate_size=req(hf, "intermediate_size"),
        norm_topk_prob=True,
        sparse_layers=tuple(range(layers)),
    )


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {"num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k}


SPEC = FamilySpec(
    model_type="mixtral",
    architectures=("MixtralForCausalLM",),
    attention="gqa",
    mlp="moe",
    lora_targets=GQA_TARGETS,
    moe_from_hf=_moe_from_hf,
    moe_to_hf=_moe_to_hf,
    moe_names=MoENames(block="block_sparse_moe", experts=(
        ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))),
)
