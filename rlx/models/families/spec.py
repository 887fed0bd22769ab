"""The record that describes one model family (``FamilySpec``) and the pieces it is made of.

A family is what transformers calls a ``model_type``: the ``config.json`` classes it reads
(``architectures``), its layer kinds (attention: ``"gqa"``, ``"mla"`` or ``"dsa"``; MLP:
``"dense"`` or ``"moe"``), how its ``config.json`` options map onto
``rlx.models.hparams.ModelConfig`` and back, how its MoE tensors are named, its default LoRA targets, the published sizes of its checkpoints
(presets) and, where llama.cpp has one, its GGUF architecture. The generic readers and writers
(``rlx.models.config``, ``rlx.models.hf``, ``rlx.models.gguf``, ``rlx.models.presets``) ask the
spec; none of them names a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from rlx.models.hparams import ATTENTION_KINDS, MLP_KINDS, ModelConfig, MoEConfig

# LoRA targets (keys of rlx.quant.config.TARGET_MODULES) that adapt every projection of a model
GQA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # every projection of a GQA model
MLA_TARGETS = ("q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")  # ... of an MLA model


@dataclasses.dataclass(frozen=True)
class MoENames:
    """HF tensor names of a sparse layer, below ``model.layers.{i}``."""

    block: str = "mlp"  # the sparse block (Mixtral: "block_sparse_moe")
    # rlx expert projection -> HF name under ``{block}.experts.{e}`` (Mixtral: w1 / w3 / w2)
    experts: tuple[tuple[str, str], ...] = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"),
                                            ("down_proj", "down_proj"))
    shared: str = "shared_expert"  # the shared expert(s) (DeepSeek / GLM: "shared_experts")
    router: str = "gate"  # the router (gpt-oss: "router")
    # the experts as one stacked tensor per projection, ``experts.gate_up_proj`` ``[E, in, 2f]``
    # (gate and up columns interleaved) and ``experts.down_proj`` ``[E, f, in]`` (gpt-oss)
    fused: bool = False


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp's GGUF architecture ``name`` stores this family."""

    name: str  # the GGUF ``general.architecture``
    permute_qk: bool  # llama.cpp permuted q/k rows for rope
    extra_config: tuple[tuple[str, Any], ...] = ()  # config.json fields the metadata does not hold
    shared_expert: bool = False  # Qwen2-MoE's gated shared expert (ffn_*_shexp)
    # q/k/v biases, q/k norms and routed experts (3-D ffn_*_exps tensors in every layer) are the
    # family's own (FamilySpec.qkv_bias_default, qk_norm, mlp), read from the spec


@dataclasses.dataclass(frozen=True)
class Multimodal:
    """A vision-language checkpoint of which rlx loads and trains the language model alone: where
    that model's ``config.json`` fields and tensors sit, the parts it skips and the causal-LM
    class its language model is written as."""

    text_architecture: str  # the causal-LM class of the language model (what rlx writes)
    text_config: str = "text_config"  # config.json field holding the language model's config
    text_model_types: tuple[str, ...] = ()  # model_type values of that config rlx reads
    weight_prefix: str = "language_model."  # before each language-model tensor's causal-LM name
    # config.json fields of the parts rlx does not run (the vision tower and its projector)
    vision_fields: tuple[str, ...] = ("vision_config",)
    vision_weights: tuple[str, ...] = ("vision_tower.", "mm_projector.")  # their tensor prefixes
    # top-level config.json fields, with the wrapper class's defaults, that override the text
    # config's (transformers ties lm_head by the wrapper's tie_word_embeddings, True when absent)
    top_level: tuple[tuple[str, Any], ...] = (("tie_word_embeddings", True),)


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One model family: everything rlx knows of a transformers ``model_type``.

    Reading ``config.json``: options with alternatives rlx does not implement are refused first
    (``choices``; ``output_biased``: transformers' ``attention_bias`` also biases ``o_proj``,
    which rlx's GQA lacks, so it must be False); ``qkv_bias`` defaults to ``qkv_bias_default``;
    ``qk_norm`` is a constant or the name of the ``config.json`` field that switches it;
    ``partial_rotary`` is the default ``partial_rotary_factor`` (None: whole heads rotate and a
    partial factor is refused); ``moe_from_hf(hf, layers)`` reads the sparse MLP;
    ``extra_from_hf(hf)`` returns ``ModelConfig`` fields of the family's own (gpt-oss: biases,
    sinks, sliding layers), over the common ones. Writing: ``extra_to_hf(cfg)`` and
    ``moe_to_hf(cfg)`` add the family's own fields to the common ones.
    """

    model_type: str  # transformers' model_type, written to config.json
    architectures: tuple[str, ...]  # config.json classes read as this family; the first is written
    attention: str  # one of ATTENTION_KINDS: ModelConfig.attention_kind of its models
    mlp: str  # one of MLP_KINDS: "moe" when some layers are sparse (ModelConfig.mlp_kind)
    lora_targets: tuple[str, ...]  # the targets that adapt every projection
    presets: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other model_type values of its checkpoints (Kimi-K2: kimi_k2)
    choices: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # field -> values rlx implements
    output_biased: bool = False
    qkv_bias_default: bool = False
    qk_norm: bool | str = False
    partial_rotary: float | None = None
    moe_from_hf: Callable[[Mapping[str, Any], int], MoEConfig] | None = None
    extra_from_hf: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    extra_to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    moe_to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    moe_names: MoENames = MoENames()
    gguf: GGUFArch | None = None
    # peft 0.21 reads target_modules' MLP names as the fused experts of this family (transformers 5
    # fuses them), so its MLP adapters are exported by weight (rlx.io.export)
    peft_remaps_mlp_names: bool = False
    multimodal: Multimodal | None = None

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS or self.mlp not in MLP_KINDS:
            raise ValueError(f"{self.model_type}: attention {self.attention!r} / mlp {self.mlp!r} "
                             f"not in {ATTENTION_KINDS} / {MLP_KINDS}")
        if (self.mlp == "moe") != (self.moe_from_hf is not None):
            raise ValueError(f"{self.model_type}: a moe family reads its experts (moe_from_hf)")
        if self.gguf is not None and not isinstance(self.qk_norm, bool):
            raise ValueError(f"{self.model_type}: a GGUF file's q/k norms are the family's constant "
                             "(qk_norm True or False), not a config.json field")


__all__ = ["ATTENTION_KINDS", "MLP_KINDS", "GQA_TARGETS", "MLA_TARGETS", "MoENames", "GGUFArch",
           "Multimodal", "FamilySpec"]
