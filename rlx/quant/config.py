"""Frozen configuration of the base representation (``QuantConfig``) and of the adapter (``LoraConfig``).

The serving format decides the learner's forward: where the server quantizes activations too
(SGLang ``w8a8_int8``; ``fp8`` / fp8 ``compressed-tensors``, which are W8A8 with dynamic activation
scales), the learner fake-quantizes activations the same way (``activation_mode``); weight-only
formats keep activations in the compute dtype. A base format that the named serving format cannot
carry is refused when the config is built, with the allowed pairs in the message. The choices,
their pairs and constraints are the formats' own declarations (``rlx.quant.formats``).
"""

from __future__ import annotations

import dataclasses

from rlx.errors import one_of
from rlx.models.decoder import DTYPES
from rlx.models.families import GQA_TARGETS, MLA_TARGETS  # every projection of a GQA / MLA model
from rlx.quant import formats
from rlx.quant.formats import QuantConfigError

# LoRA targets: short name -> the projection it adapts (the rlx attribute, which is also the HF
# module name; the one list that apply_lora, the PEFT export, the config checks and SGLang's
# --lora-target-modules read). GQA attention has q/k/v/o; multi-head latent attention (DeepSeek-V3,
# Kimi-K2) has q_a/q_b (or a plain q without q_lora_rank), kv_a, kv_b and o; DeepSeek-V4's
# shared-KV attention q_a/q_b, kv (its one key-value projection) and o_b (the grouped output's
# second projection; the grouped first, wo_a, takes no adapter).
ATTN_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "q_a": "q_a_proj",
                "q_b": "q_b_proj", "kv_a": "kv_a_proj_with_mqa", "kv_b": "kv_b_proj",
                "kv": "kv_proj", "o_b": "o_b_proj"}
MLP_MODULES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # MLPs and MoE experts
TARGET_MODULES = {**ATTN_MODULES, **MLP_MODULES}
ATTN_TARGETS = tuple(ATTN_MODULES)
MLP_TARGETS = tuple(MLP_MODULES)
LORA_TARGETS = ATTN_TARGETS + MLP_TARGETS
QUANT_MODULES = ("all", "experts")  # QuantConfig.modules


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the frozen base is stored and which serving format it must match."""

    format: str = "none"  # one of rlx.quant.formats.names()
    group_size: int = 64  # int4 / nf4: values per scale along the input dimension
    symmetric: bool = True  # int4 only: False stores a zero point per group (min/max calibration)
    fp8_granularity: str = "channel"  # "channel" (one scale per output) | "block128" (128x128 tiles)
    scale_dtype: str = "float32"  # "float32" | "bfloat16" | "float16": scales are rounded to this
    quantize_embed: bool = False  # also quantize the token embedding
    quantize_lm_head: bool = False  # also quantize a separate (untied) lm_head
    serving: str = "hf"  # one of rlx.quant.formats.serving_names()
    # "all": every decoder linear and the MoE experts; "experts": the routed MoE experts only,
    # attention, dense and shared-expert MLPs stay float (Kimi-K2-Thinking's int4 release)
    modules: str = "all"

    def __post_init__(self):
        one_of("format", self.format, formats.names())
        one_of("serving", self.serving, formats.serving_names())
        one_of("modules", self.modules, QUANT_MODULES)
        one_of("fp8_granularity", self.fp8_granularity, ("channel", "block128"))
        one_of("scale_dtype", self.scale_dtype, ("float32", "bfloat16", "float16"))
        fmt, layout = self.spec, self.serving_spec
        if fmt.from_checkpoint:
            self._check_shipped()
        if self.group_size < 2 or self.group_size % 2:
            raise QuantConfigError(f"group_size={self.group_size} must be an even number >= 2")
        if not self.symmetric and not fmt.asymmetric:
            allowed = [f for f in formats.names() if formats.get(f).asymmetric]
            raise QuantConfigError(f"symmetric=False is only supported for format="
                                   f"{' / '.join(map(repr, allowed))}, not {self.format!r}")
        if not formats.carries(self.format, self.serving):
            raise QuantConfigError(
                f"serving={self.serving!r} cannot serve a {self.format!r} base as the same values; "
                f"for format={self.format!r} use one of {fmt.serving}")
        if (self.quantize_embed or self.quantize_lm_head) and not layout.quantized_embeddings:
            raise QuantConfigError(
                f"serving={self.serving!r} keeps embeddings and lm_head in float; set quantize_embed="
                "quantize_lm_head=False or serve the dequantized base (serving='hf')")
        if layout.symmetric_only and not self.symmetric:
            raise QuantConfigError(f"serving={self.serving!r} needs symmetric int8 weights")
        if self.modules == "experts" and (fmt.keeps_file_blocks or not layout.experts_only):
            raise QuantConfigError(
                f"modules='experts' keeps attention and dense MLPs float (written as a "
                f"compressed-tensors ignore list): it needs serving 'hf' or 'compressed-tensors' "
                f"and a format rlx quantizes, not format={self.format!r} serving={self.serving!r}")

    @property
    def spec(self) -> formats.Format:
        """The base format's record (``rlx.quant.formats``)."""
        return formats.get(self.format)

    @property
    def serving_spec(self) -> formats.ServingLayout:
        """The serving layout's record (``rlx.quant.formats``)."""
        return formats.serving(self.serving)

    def _check_shipped(self) -> None:
        """``format="shipped"`` takes everything else from the checkpoint: the other fields stay
        at their defaults (a value set there would do nothing)."""
        default = QuantConfig()
        set_ = [f.name for f in dataclasses.fields(self)
                if f.name != "format" and getattr(self, f.name) != getattr(default, f.name)]
        if set_:
            raise QuantConfigError(
                f"format='shipped' keeps the checkpoint's own representation, which fixes "
                f"{', '.join(set_)} (its serving layout included); leave "
                f"{'them' if len(set_) > 1 else 'it'} unset")

    @property
    def activation_mode(self) -> str:
        """How the learner quantizes activations to match the server: "none" | "int8_token" |
        "fp8_token" | "fp8_group128" (where the serving layout quantizes activations of this
        format's values: the format's ``activation_mode``)."""
        fmt = self.spec
        if fmt.activations and fmt.activations in self.serving_spec.activations:
            return fmt.activation_mode(self)
        return "none"


ADAPTER_KINDS = ("lora", "oft")  # LoraConfig.kind


@dataclasses.dataclass(frozen=True)
class OftConfig:
    """An OFT adapter's rotation (``rlx.quant.oft``), as PEFT 0.21's ``OFTConfig`` with
    ``oft_block_size`` set (``r=0``) and ``coft``, ``block_share``, ``module_dropout`` off."""

    block_size: int = 32  # b: every adapted input is rotated in blocks of b (b must divide it)
    cayley_neumann: bool = True  # PEFT's default: the Neumann series of the Cayley map, not solve
    neumann_terms: int = 5  # terms of that series (PEFT's num_cayley_neumann_terms)

    def __post_init__(self):
        if self.block_size < 2:
            raise QuantConfigError(f"oft.block_size={self.block_size} must be >= 2")
        if self.neumann_terms < 1:
            raise QuantConfigError(f"oft.neumann_terms={self.neumann_terms} must be >= 1")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The adapter on the chosen projections: ``kind="lora"``, low-rank ``W x + (alpha / rank) *
    B A dropout(x)``; ``kind="oft"``, a block-diagonal rotation of the input ``(x R) W``
    (``oft``; rank, alpha and dropout are LoRA's alone)."""

    kind: str = "lora"  # one of ADAPTER_KINDS
    oft: OftConfig = OftConfig()  # kind "oft": its block size and Cayley form
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input only (active in nnx train mode)
    targets: tuple[str, ...] = GQA_TARGETS  # keys of TARGET_MODULES (MLA models: MLA_TARGETS)
    experts: bool = True  # also adapt MoE experts (one adapter per expert, run batched)
    param_dtype: str = "float32"  # adapter storage dtype: a key of rlx.models.decoder.DTYPES
    # a HF PEFT LoRA folder to start from (an SFT adapter); in a run config its adapter_config.json
    # sets rank, alpha and targets (rlx.quant.peft_import)
    init_from: str = ""

    def __post_init__(self):
        if self.rank < 1:
            raise QuantConfigError(f"rank={self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise QuantConfigError(f"dropout={self.dropout} must be in [0, 1)")
        bad = [t for t in self.targets if t not in TARGET_MODULES]
        if bad or not self.targets:
            raise QuantConfigError(f"targets={list(self.targets)}: each must be one of {list(LORA_TARGETS)}")
        one_of("param_dtype", self.param_dtype, DTYPES)
        one_of("kind", self.kind, ADAPTER_KINDS)
        if self.kind == "oft" and self.init_from:
            raise QuantConfigError(f"init_from={self.init_from!r} warm-starts from a PEFT LoRA "
                                   "folder; kind='oft' starts from the identity (leave it unset)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def gate_up_rank(self) -> int:
        """The rank of MoE experts' gate and up adapters as exported: one block-diagonal adapter on
        HF's fused ``gate_up_proj`` (``rlx.io.export``), ``rank`` for each of gate and up adapted."""
        return self.rank * len({"gate", "up"} & set(self.targets))

    def served_rank(self, moe: bool) -> int:
        """The largest adapter rank a server loads for this adapter on a model with MoE experts
        (``moe``) or without: experts' gate + up as one adapter (``gate_up_rank``) or ``rank``."""
        return max(self.rank, self.gate_up_rank) if moe and self.experts else self.rank
