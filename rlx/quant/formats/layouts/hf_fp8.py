"""transformers' fp8 layout (``quant_method: fp8``, ``weight_block_size: [128, 128]``, e4m3,
dynamic activations), as DeepSeek-V3, Kimi-K2 and Qwen3-*-FP8 ship: ``X.weight`` e4m3
``[out, in]`` and ``X.weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``; the modules in
``modules_to_not_convert`` stay float. Read as rlx's fp8 format in 128x128 blocks, with fp8
activations per 1x128 group.
"""

from __future__ import annotations

from rlx.quant.formats.fp8 import FP8
from rlx.quant.formats.layouts.base import Layout, LayoutReader, Refused, Tensors

TENSORS = Tensors(values="weight", values_dtypes=("F8_E4M3",), scale="weight_scale_inv")


def parse(qc: dict) -> Layout:
    method = qc.get("quant_method")
    if list(qc.get("weight_block_size") or []) != [128, 128]:
        raise Refused(method, f"weight_block_size={qc.get('weight_block_size')} (rlx reads "
                              "128x128 blocks)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise Refused(method, f"fmt={qc.get('fmt')!r} (rlx reads e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise Refused(method, f"activation_scheme={qc.get('activation_scheme')!r} (static "
                              "activation scales are not supported)")
    return Layout(method, FP8, TENSORS, 8, "block", None, True, "fp8_group128",
                  (("fp8_granularity", "block128"),),
                  tuple(qc.get("modules_to_not_convert") or ()), "hf")


READER = LayoutReader(
    name="hf_fp8", quant_methods=("fp8",),
    supported=("quant_method 'fp8' with weight_block_size [128, 128], e4m3 and dynamic "
               "activations (DeepSeek-V3, Kimi-K2, Qwen3-*-FP8)",),
    parse=parse)
