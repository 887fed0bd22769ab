"""The records a shipped checkpoint layout declares: ``Layout`` (how one checkpoint stores its
quantized linears), ``Tensors`` (the tensor names and dtypes of one quantized linear), and
``LayoutReader`` (which ``quantization_config`` it recognises, its supported-description lines,
its parser), with the helpers their parsers share.

A parser that cannot honour a config it recognises raises ``Refused(method, why)``; the registry
(``rlx.quant.formats.layouts.registry.layout``) turns it into the ``QuantConfigError`` that lists
what every reader reads.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Callable

from rlx.quant.formats.base import Format


class Refused(Exception):
    """A recognised ``quantization_config`` a reader cannot honour: its method and why."""

    def __init__(self, method, why: str):
        super().__init__(why)
        self.method, self.why = method, why


@dataclasses.dataclass(frozen=True)
class Tensors:
    """The tensors of one quantized linear ``X`` (suffixes after ``X.``) and the values' dtypes."""

    values: str  # "weight" | "weight_packed"
    values_dtypes: tuple[str, ...]  # safetensors dtypes of the values ("F8_E4M3", "I8", "I32")
    scale: str  # "weight_scale_inv" | "weight_scale"
    packed: bool = False  # values are int32 words of 32/bits values each along ``in``
    shape: str | None = None  # "weight_shape": [out, in] of packed values
    zero: str | None = None  # "weight_zero_point": packed zero points (asymmetric values)
    scale_dtypes: tuple[str, ...] = ("F32", "BF16", "F16")  # safetensors dtypes of the scales
    scale2: str | None = None  # "weight_scale_2": one f32 scale per matrix over the block scales


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one checkpoint stores its quantized linears (``rlx.quant.shipped``'s docstring)."""

    method: str  # quant_method
    format: Format  # rlx's QTensor format of the values
    tensors: Tensors  # the tensors of a quantized linear
    bits: int  # 8 | 4
    strategy: str  # "block" | "channel" | "group" | "tensor"
    group: int | None  # values per scale along ``in`` (strategy "group")
    symmetric: bool
    act: str  # the activation mode (rlx.models.layers.quantize_activations)
    # the QuantConfig fields (beside format, serving, modules, scale_dtype) of a run-level config
    # whose serving export writes these values back; None: no run-level config does
    quant_fields: tuple[tuple[str, object], ...] | None = None
    ignore: tuple[str, ...] = ()  # modules left float
    # "ct": exact names or "re:" regexes | "hf": modules_to_not_convert | "glob": fnmatch patterns
    ignore_style: str = "ct"
    targets: tuple[str, ...] = ("Linear",)
    # its quantized linears are fused expert stacks ``X`` (gpt-oss ``experts.gate_up_proj``)
    # stored as ``X_<values>`` / ``X_<scale>`` (``rlx.quant.shipped_fused``); else per linear
    fused: bool = False

    @property
    def fmt(self) -> str:
        """The name of rlx's QTensor format of the values."""
        return self.format.name

    @property
    def scale_key(self) -> str:
        return self.tensors.scale

    def quantizes(self, module: str) -> bool:
        """Whether linear ``module`` (HF name, no ``.weight``) is stored quantized."""
        if not any(t == "Linear" or _ct_match(t, module) for t in self.targets):
            return False
        if self.ignore_style == "hf":
            return not any(_hf_match(p, module) for p in self.ignore)
        if self.ignore_style == "glob":  # ModelOpt's exclude_modules: fnmatch wildcards
            return not any(fnmatch.fnmatchcase(module, p) for p in self.ignore)
        return not any(_ct_match(p, module) for p in self.ignore)

    def block(self, k: int, n: int) -> tuple[int, int]:
        """The scale block ``(bk, bn)`` of a ``[k, n]`` kernel."""
        return {"block": (128, 128), "channel": (k, 1), "tensor": (k, n)}.get(self.strategy,
                                                                            (self.group, 1))

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The file's scale shape for a HF ``[n, k]`` weight (``tensor``: one of several)."""
        bk, bn = self.block(k, n)
        return (-(-n // bn), -(-k // bk))


@dataclasses.dataclass(frozen=True)
class LayoutReader:
    """One family of shipped checkpoint layouts: the ``quant_method`` values it recognises, the
    lines that say what it reads (for refusals), and its parser (``quantization_config`` ->
    ``Layout``, or ``Refused``)."""

    name: str
    quant_methods: tuple[str, ...]
    supported: tuple[str, ...]
    parse: Callable[[dict], Layout]

    def recognises(self, qc: dict) -> bool:
        return qc.get("quant_method") in self.quant_methods


@dataclasses.dataclass(frozen=True)
class FileReader:
    """A checkpoint file that is its own quantized layout (no ``quantization_config``): its
    suffix, its supported-description line, the rlx format and serving layout of its blocks, and
    ``quantized(path)``: whether its linear weights are block-quantized (else they are floats)."""

    name: str
    suffix: str
    supported: str
    format: Format
    serving: str
    quantized: Callable[[str], bool]


def _ct_match(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _hf_match(pattern: str, name: str) -> bool:
    """transformers' ``should_convert_module`` (a pattern from the start up to a module boundary,
    as a regex with that boundary, or as a suffix)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return re.match(rf"(?:{pattern}){boundary}", name) is not None or name.endswith(pattern)
