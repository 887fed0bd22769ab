"""The records a quantized format and a serving layout declare, and the storage helpers they share.

A ``Format`` is everything rlx knows about one base representation: how its values are stored
(``values_per_byte`` along K, the scale block, zero points), how they are made from float weights
(qwix's ``how`` and ``encode``) and read back (``decode``, ``integers``), which serving layouts
carry its exact values, what the planner counts per parameter, and its constraints (groups,
asymmetry). ``QTensor``, ``QuantConfig``, the loaders, the run checks, export and the planner read
these fields; none of them compares format names. A ``ServingLayout`` is the same for a layout
servers load (what it writes, which activations the server quantizes, what it can keep).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from jaxtyping import Array

from rlx.errors import ConfigError


class QuantConfigError(ConfigError):
    """A quantization or LoRA setting rlx cannot honour; the message names the field."""


def pack_nibbles(u: Array) -> Array:
    """``[..., K, N]`` values in [0, 16) -> ``[..., K/2, N]`` uint8 (row 2i low, 2i+1 high)."""
    u = u.astype(jnp.uint8)
    return u[..., 0::2, :] | (u[..., 1::2, :] << 4)


def unpack_nibbles(p: Array) -> Array:
    """Inverse of ``pack_nibbles``: ``[..., K/2, N]`` uint8 -> ``[..., K, N]`` uint8."""
    both = jnp.stack([p & 0x0F, p >> 4], axis=-2)  # [..., K/2, 2, N]
    return both.reshape(*p.shape[:-2], 2 * p.shape[-2], p.shape[-1])


@dataclasses.dataclass(frozen=True)
class Params:
    """The ``QuantConfig`` fields a format's hooks read (``QuantConfig`` itself has them too)."""

    group_size: int = 64
    symmetric: bool = True
    fp8_granularity: str = "channel"
    scale_dtype: str = "float32"


def as_f32(v: Array) -> Array:
    """Stored values that are the quantized values themselves (int8, fp8) as f32."""
    return v.astype(jnp.float32)


def same(v):
    """Stored values that are the quantized values themselves."""
    return v


def channel_block(shape: tuple, k: int, n: int, q) -> tuple[int, int]:
    """One scale per output column: the block ``(K, 1)``."""
    return (k, 1)


def group_block(shape: tuple, k: int, n: int, q) -> tuple[int, int]:
    """One scale per ``q.group_size`` values along K; refuses a size that does not divide K."""
    if k % q.group_size:
        raise QuantConfigError(
            f"group_size={q.group_size} does not divide the input dimension {k} of a {shape} "
            "matrix; pick a group size that divides every layer's input size")
    return (q.group_size, 1)


def channel_how(qtype) -> Callable:
    """qwix's ``how`` for one scale per output column (and per leading matrix)."""
    def how(ndim: int, q) -> tuple:
        lead = tuple(range(ndim - 2))
        return qtype, lead + (ndim - 1,), (), "absmax"
    return how


def group_how(qtype) -> Callable:
    """qwix's ``how`` for ``q.group_size`` groups along K; asymmetric groups calibrate min/max."""
    def how(ndim: int, q) -> tuple:
        lead = tuple(range(ndim - 2))
        return (qtype, lead + (ndim - 1,), ((ndim - 2, q.group_size),),
                "absmax" if q.symmetric else "minmax")
    return how


def times(scale: Array, scale2: Array) -> Array:
    """Block scales times a second-level scale (ModelOpt's ``weight_scale_2``)."""
    return scale * scale2


def none_mode(q) -> str:
    return "none"


def no_bytes(q, k: int, n: int) -> float:
    return 0.0


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a format's values are written in the quantized serving layouts it carries (all but
    the dequantized and the source-file ones)."""

    quantization_config: Callable  # (QuantConfig) -> config.json's quantization_config
    # (storage leaves of one [K, N] linear, its HF name, QuantConfig) -> {tensor name: array}
    to_serving: Callable


@dataclasses.dataclass(frozen=True)
class Format:
    """One base format (``config.quant.format``); see the module docstring."""

    name: str
    summary: str  # one line, for messages and docs
    serving: tuple[str, ...]  # serving layouts that carry its exact values (the first: default)
    # what the base is: float weights, values rlx quantizes from float weights, a GGUF file's
    # blocks kept as stored, or the checkpoint's own representation (resolved when loaded)
    float_base: bool = False
    quantizes: bool = False
    keeps_file_blocks: bool = False
    from_checkpoint: bool = False
    # storage of a quantized base (QTensor): values per stored byte along K, scale blocks,
    # zero points (asymmetric: allowed with QuantConfig.symmetric=False), groups along K
    values_per_byte: int = 1
    grouped: bool = False
    asymmetric: bool = False
    # (ndim, Params or QuantConfig) -> qwix's (qtype, channelwise axes, tiled axes, calibration)
    how: Callable | None = None
    # (shape, K, N, Params or QuantConfig) -> the scale block (bk, bn) of a [K, N] matrix
    block: Callable | None = None
    encode: Callable = same  # qwix's quantized values -> stored values (packing)
    decode: Callable = as_f32  # stored values -> f32 quantized values (before zero and scale)
    # f32 scales (qwix's) -> stored scales (None: stored in QuantConfig.scale_dtype), and back:
    # MXFP4 keeps its E8M0 scales as their exponent bytes
    scale_encode: Callable | None = None
    scale_decode: Callable = as_f32
    # f32 [K, N] -> {"values", "scale", "scale2"} where the format quantizes by its own formula
    # instead of qwix's (NVFP4's two-level scales, as ModelOpt computes them)
    quantize: Callable | None = None
    # (f32 block scales, stored second-level scale) -> the scales the values are multiplied by
    combine_scale2: Callable = times
    # stored values -> the quantized values as numbers exact in bf16 (at most 8 significant
    # bits); None where they are not (a table lookup): then no bf16 dequantize and no product
    # on the stored values
    integers: Callable | None = same
    int8_channel: bool = False  # int8 values: the native int8 channel kernel's operands
    # E2M1 codes packed two a byte with one 1-byte scale per block and column (MXFP4, NVFP4):
    # the native FP4 kernel's operands
    e2m1_blocks: bool = False
    activations: str = ""  # value kind a W8A8 server quantizes activations for ("int8", "fp8")
    activation_mode: Callable = none_mode  # (QuantConfig) -> rlx.models.layers activation mode
    # (QuantConfig, K, N) -> stored bytes per weight of a [K, N] matrix, scales and zero points
    # included (the planner's figure; its state sizes count the very leaves)
    bytes_per_param: Callable = no_bytes
    codec: Codec | None = None  # its quantized serving layouts (None: only "hf" / its own file)


@dataclasses.dataclass(frozen=True)
class ServingLayout:
    """One layout servers load (``config.quant.serving``)."""

    name: str
    summary: str
    servers: tuple[str, ...]  # the servers that load it
    dequantized: bool = False  # writes the base as float weights (no quantization_config)
    source_file: bool = False  # serves the checkpoint file the base was loaded from
    quantized_embeddings: bool = False  # embeddings and lm_head may stay quantized
    experts_only: bool = False  # can leave attention and dense MLPs float (modules="experts")
    symmetric_only: bool = False  # needs symmetric weights
    activations: tuple[str, ...] = ()  # value kinds whose activations the server quantizes
    moe_lora: bool = False  # SGLang serves LoRA on MoE experts over it
