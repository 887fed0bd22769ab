"""compressed-tensors layouts (``quant_method: compressed-tensors``, one scheme for every quantized
linear, compressed, dense, no KV cache scheme or transform), one ``Scheme`` per weights kind:

- ``pack-quantized`` int4 / int8 (channel or group, symmetric or not; Kimi-K2-Thinking):
  ``X.weight_packed`` int32 ``[out, ceil(in*bits/32)]`` (lowest bits first, value +
  2^(bits-1)), ``X.weight_scale`` ``[out, groups]`` (channel: 1), ``X.weight_shape``
  ``[out, in]``, asymmetric: ``X.weight_zero_point`` int32 ``[ceil(out*bits/32), groups]``;
- ``float-quantized`` fp8: ``X.weight`` e4m3, ``X.weight_scale`` ``[out, 1]`` (channel), ``[1]``
  (tensor) or ``[ceil(out/128), ceil(in/128)]`` (block);
- ``int-quantized`` int8 (channel, symmetric; W8A8 int8): ``X.weight`` int8, ``X.weight_scale``
  ``[out, 1]``;
- ``nvfp4-pack-quantized`` (4-bit float, strategy ``tensor_group``, group 16): ``X.weight_packed``
  uint8 ``[out, in/2]`` (two E2M1 codes a byte, even input low), ``X.weight_scale`` e4m3
  ``[out, in/16]``, ``X.weight_global_scale`` f32 ``[1]`` (``w = e2m1 * scale / global``), and
  ``X.input_global_scale`` (unread).

Activations are quantized dynamically (fp8 per token or per 128-group, int8 per token) or not at
all; NVFP4's FP4 activations (W4A4 on the server) are not: rlx's forward is W4A16 over them. The
modules in ``ignore`` stay float.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rlx.quant.formats.base import Format
from rlx.quant.formats.fp8 import FP8
from rlx.quant.formats.int4 import INT4
from rlx.quant.formats.int8 import INT8
from rlx.quant.formats.layouts.base import Layout, LayoutReader, Refused, Tensors
from rlx.quant.formats.nvfp4 import BLOCK as NVFP4_BLOCK
from rlx.quant.formats.nvfp4 import NVFP4_CT

METHOD = "compressed-tensors"


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One kind of compressed-tensors weights: the (``format``, weights ``type``) pairs it reads,
    its supported-description line, which bits / strategies it accepts, a check of what else it
    refuses (after the shared ones), and what a config it accepts becomes."""

    keys: tuple[tuple[str, str], ...]
    supported: str
    accepts: Callable[[dict], bool]  # the weights scheme -> whether its bits / strategy fit
    check: Callable[[dict], None]  # the weights scheme -> None, or Refused
    fmt: Callable[[int], Format]  # bits -> rlx's format of the values
    tensors: Callable[[bool], Tensors]  # symmetric -> the tensors of a quantized linear
    # (bits, strategy, group, symmetric) -> Layout.quant_fields
    quant_fields: Callable[[int, str, int | None, bool], tuple | None]


def _nothing(w: dict) -> None:
    return None


def _symmetric_float(w: dict) -> None:
    if not w.get("symmetric", True):
        raise Refused(METHOD, "asymmetric fp8 weights")


def _packed_fields(bits: int, strategy: str, group: int | None, symmetric: bool):
    if bits == 8 and strategy == "channel" and symmetric:
        return ()
    if bits == 4 and strategy == "group":
        return (("group_size", group), ("symmetric", symmetric))
    return None


def _float_fields(bits: int, strategy: str, group: int | None, symmetric: bool):
    if strategy in ("block", "channel"):
        return (("fp8_granularity", "block128" if strategy == "block" else "channel"),)
    return None


PACKED = Scheme(
    keys=(("pack-quantized", "int"),),
    supported="compressed-tensors 'pack-quantized' int4 / int8, channel or group strategy, "
              "symmetric or not (Kimi-K2-Thinking)",
    accepts=lambda w: w.get("num_bits") in (4, 8) and w.get("strategy") in ("channel", "group"),
    check=_nothing, fmt=lambda bits: INT4 if bits == 4 else INT8,
    tensors=lambda symmetric: Tensors(
        values="weight_packed", values_dtypes=("I32",), scale="weight_scale", packed=True,
        shape="weight_shape", zero=None if symmetric else "weight_zero_point"),
    quant_fields=_packed_fields)
FLOAT = Scheme(
    keys=(("float-quantized", "float"), ("naive-quantized", "float")),
    supported="compressed-tensors 'float-quantized' fp8 (tensor, channel or 128x128 block "
              "strategy)",
    accepts=lambda w: (w.get("num_bits") == 8
                       and w.get("strategy") in ("channel", "tensor", "block")),
    check=_symmetric_float, fmt=lambda bits: FP8,
    tensors=lambda symmetric: Tensors(values="weight", values_dtypes=("F8_E4M3",),
                                      scale="weight_scale"),
    quant_fields=_float_fields)
INT = Scheme(
    keys=(("int-quantized", "int"), ("naive-quantized", "int")),
    supported="compressed-tensors 'int-quantized' int8 (channel, symmetric)",
    accepts=lambda w: (w.get("num_bits") == 8 and w.get("strategy") == "channel"
                       and w.get("symmetric", True)),
    check=_nothing, fmt=lambda bits: INT8,
    tensors=lambda symmetric: Tensors(values="weight", values_dtypes=("I8",), scale="weight_scale"),
    quant_fields=lambda bits, strategy, group, symmetric: ())


def _nvfp4_group(w: dict) -> None:
    if w.get("group_size") != NVFP4_BLOCK:
        raise Refused(METHOD, f"nvfp4 group_size={w.get('group_size')} (NVFP4 scales blocks of "
                              f"{NVFP4_BLOCK})")


NVFP4 = Scheme(
    keys=(("nvfp4-pack-quantized", "float"),),
    supported="compressed-tensors 'nvfp4-pack-quantized' (E2M1, e4m3 scales per 16, "
              "weight_global_scale)",
    accepts=lambda w: w.get("num_bits") == 4 and w.get("strategy") == "tensor_group",
    check=_nvfp4_group, fmt=lambda bits: NVFP4_CT,
    tensors=lambda symmetric: Tensors(
        values="weight_packed", values_dtypes=("U8",), scale="weight_scale",
        scale_dtypes=("F8_E4M3",), scale2="weight_global_scale"),
    quant_fields=lambda bits, strategy, group, symmetric: None)
SCHEMES = (PACKED, FLOAT, INT, NVFP4)


def _scheme(qc: dict) -> dict:
    """The one ``config_groups`` scheme, after the checks every compressed-tensors layout shares."""
    if qc.get("quantization_status", "compressed") != "compressed":
        raise Refused(METHOD, f"quantization_status={qc.get('quantization_status')!r} (rlx reads "
                              "compressed checkpoints)")
    for key in ("kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise Refused(METHOD, f"{key} is set (rlx does not quantize the KV cache or rotate "
                                  "weights)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise Refused(METHOD, f"sparsity format {sparsity.get('format')!r}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise Refused(METHOD, f"{len(groups)} config_groups (rlx reads one scheme for all "
                              "quantized linears)")
    scheme = next(iter(groups.values()))
    if scheme.get("output_activations"):
        raise Refused(METHOD, "output_activations are quantized")
    return scheme


def parse(qc: dict) -> Layout:
    scheme = _scheme(qc)
    w = scheme.get("weights") or {}
    key = (qc.get("format"), w.get("type"))
    kind = next((s for s in SCHEMES if key in s.keys), None)
    bits, strategy = w.get("num_bits"), w.get("strategy")
    what = f"format {key[0]!r} with {bits}-bit {w.get('type')} weights, strategy {strategy!r}"
    if kind is None or not kind.accepts(w):
        raise Refused(METHOD, what)
    if w.get("dynamic") or w.get("actorder"):
        raise Refused(METHOD, f"{what} and dynamic={w.get('dynamic')} actorder={w.get('actorder')}")
    group = w.get("group_size") if strategy in ("group", "tensor_group") else None
    if strategy == "group" and not (isinstance(group, int) and group >= 2 and group % 2 == 0):
        raise Refused(METHOD, f"group_size={group} (rlx reads even group sizes)")
    if strategy == "block" and list(w.get("block_structure") or []) != [128, 128]:
        raise Refused(METHOD, f"block_structure={w.get('block_structure')} (rlx reads 128x128)")
    kind.check(w)
    symmetric = bool(w.get("symmetric", True))
    return Layout(METHOD, kind.fmt(bits), kind.tensors(symmetric), bits, strategy, group,
                  symmetric, _activations(scheme.get("input_activations")),
                  kind.quant_fields(bits, strategy, group, symmetric),
                  tuple(qc.get("ignore") or ()), "ct", tuple(scheme.get("targets") or ("Linear",)))


def _activations(a: dict | None) -> str:
    if not a or (a.get("type"), a.get("num_bits"), a.get("strategy")) == ("float", 4, "tensor_group"):
        return "none"  # NVFP4's FP4 activations: the learner's forward is W4A16
    kind = (a.get("type"), a.get("num_bits"), a.get("strategy"), bool(a.get("dynamic")),
            bool(a.get("symmetric", True)))
    modes = {("float", 8, "token", True, True): "fp8_token",
             ("int", 8, "token", True, True): "int8_token"}
    if kind[:4] == ("float", 8, "group", True) and a.get("group_size") == 128:
        return "fp8_group128"
    if kind not in modes:
        raise Refused(METHOD, f"input_activations {a} (rlx quantizes activations dynamically: fp8 "
                              "per token or per 128-group, int8 per token, symmetric)")
    return modes[kind]


READER = LayoutReader(name="compressed_tensors", quant_methods=(METHOD,),
                      supported=tuple(s.supported for s in SCHEMES), parse=parse)


def write_back_nvfp4(leaves: dict, name: str) -> dict:
    """``nvfp4-pack-quantized`` tensors of one linear ``name`` from its rlx storage leaves (numpy
    ``values`` ``[K/2, N]``, ``scale`` ``[K/16, N]``, ``scale2`` ``[1, 1]``: the global scale),
    byte for byte as read (``input_global_scale`` is not kept)."""
    import numpy as np

    return {f"{name}.weight_packed": np.ascontiguousarray(leaves["values"].T),
            f"{name}.weight_scale": np.ascontiguousarray(leaves["scale"].T),
            f"{name}.weight_global_scale": np.asarray(leaves["scale2"]).reshape(1)}
