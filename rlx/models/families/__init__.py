"""Model families as specs: one module per transformers ``model_type`` (llama, qwen2, qwen3,
mixtral, qwen2_moe, qwen3_moe, deepseek_v3 with Kimi-K2, deepseek_v32 and glm_moe_dsa (DeepSeek
sparse attention), glm4_moe, gpt_oss, kimi_k25: the
language model of Kimi-K2.5 / K2.6's vision-language checkpoints, and qwen3_next: gated DeltaNet
layers among gated attention ones), each a ``FamilySpec``
(``rlx.models.families.spec``), and the registry the generic readers and writers ask.

Adding a family is one new module with its ``SPEC`` (and its parity test), listed in
``_MODULES`` below; nothing else in rlx names a family.

A family whose decoder is not ``rlx.models.decoder.Transformer`` (DeepSeek-V4: hyper-connection
streams and compressed attention, ``rlx.models.deepseek_v4``) has no ``SPEC``: it is listed in
``OWN_DECODERS`` by its HF class with the function that loads a folder of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rlx.models.families import deepseek_v4
from rlx.models.families import (deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, gpt_oss,
                                 kimi_k25, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe,
                                 qwen3_next)
from rlx.models.families.spec import (ATTENTION_KINDS, GQA_TARGETS, MLA_TARGETS, MLP_KINDS,
                                      FamilySpec, GGUFArch, MoENames, Multimodal)
from rlx.models.hparams import ModelConfig

_MODULES = (llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3, glm4_moe, gpt_oss,
            kimi_k25, deepseek_v32, glm_moe_dsa, qwen3_next)

FAMILIES: dict[str, FamilySpec] = {m.SPEC.model_type: m.SPEC for m in _MODULES}  # by model_type
BY_ARCHITECTURE: dict[str, FamilySpec] = {a: s for s in FAMILIES.values() for a in s.architectures}
# HF class name -> model_type, for every class rlx reads
SUPPORTED_ARCHITECTURES: dict[str, str] = {a: s.model_type for a, s in BY_ARCHITECTURE.items()}
# published config.json values by checkpoint id, over all families
PRESETS: dict[str, dict[str, Any]] = {k: v for s in FAMILIES.values() for k, v in s.presets.items()}
# GGUF general.architecture -> family
GGUF_ARCHS: dict[str, FamilySpec] = {s.gguf.name: s for s in FAMILIES.values() if s.gguf is not None}
# HF class -> load(path, dtype, param_dtype) of a family with a decoder of its own (docstring)
OWN_DECODERS: dict[str, Callable[..., Any]] = {deepseek_v4.ARCH: deepseek_v4.load}
# ... and its to_hf(model, path), by the class its model's record names (``cfg.architecture``)
OWN_WRITERS: dict[str, Callable[..., None]] = {deepseek_v4.ARCH: deepseek_v4.to_hf}


def own_decoder(hf: Mapping[str, Any]) -> Callable[..., Any] | None:
    """The loader of a ``config.json`` whose class has a decoder of its own, else None."""
    return next((OWN_DECODERS[a] for a in hf.get("architectures") or [] if a in OWN_DECODERS),
                None)


def own_writer(model: Any) -> Callable[..., None] | None:
    """The writer of a model with a decoder of its own (its record: ``model.cfg``), else None."""
    return OWN_WRITERS.get(getattr(getattr(model, "cfg", None), "architecture", None))


def family_of(cfg: ModelConfig) -> FamilySpec:
    """The family of a model config (by its HF class)."""
    return BY_ARCHITECTURE[cfg.architecture]


def written_architecture(cfg: ModelConfig) -> str:
    """The class rlx writes ``cfg``'s model as: its own, or for the language model of a
    vision-language checkpoint the causal-LM class of that language model."""
    mm = family_of(cfg).multimodal
    return cfg.architecture if mm is None else mm.text_architecture


__all__ = ["FAMILIES", "BY_ARCHITECTURE", "SUPPORTED_ARCHITECTURES", "PRESETS", "GGUF_ARCHS",
           "family_of", "written_architecture", "OWN_DECODERS", "OWN_WRITERS", "own_decoder", "own_writer", "FamilySpec", "GGUFArch", "MoENames", "Multimodal",
           "ATTENTION_KINDS", "MLP_KINDS", "GQA_TARGETS", "MLA_TARGETS"]
