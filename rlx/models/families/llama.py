"""Llama (``LlamaForCausalLM``): GQA with whole-head rotary (incl. llama3 frequency scaling), dense
SwiGLU MLPs. transformers' ``attention_bias`` also biases ``o_proj``, so it is refused; llama.cpp
stores its q/k rows permuted for rope (``rlx.models.gguf`` undoes it)."""

from __future__ import annotations

from typing import Any

from rlx.models.families.spec import GQA_TARGETS, FamilySpec, GGUFArch
from rlx.models.hparams import ModelConfig


def _extra_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias, "mlp_bias": False}


SPEC = FamilySpec(
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    attention="gqa",
    mlp="dense",
    lora_targets=GQA_TARGETS,
    output_biased=True,
    extra_to_hf=_extra_to_hf,
    gguf=GGUFArch("llama", permute_qk=True, extra_config=(
        ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1))),
)
