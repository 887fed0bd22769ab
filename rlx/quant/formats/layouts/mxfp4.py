"""transformers' MXFP4 layout (``quant_method: mxfp4``), as gpt-oss ships its experts: per layer
``mlp.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, D/32, 16]`` (the fused, interleaved gate/up
outputs; two E2M1 codes a byte, the even input in the low nibble) with ``..._scales`` uint8
``[E, 2I, D/32]`` (E8M0), and ``down_proj_blocks`` ``[E, D, I/32, 16]`` / ``down_proj_scales``
``[E, D, I/32]``. Only the routed experts are quantized (transformers converts nothing else);
the modules in ``modules_to_not_convert`` stay float. Read as rlx's ``mxfp4`` format, weights
only (activations are not quantized).
"""

from __future__ import annotations

from rlx.quant.formats.layouts.base import Layout, LayoutReader, Refused, Tensors
from rlx.quant.formats.mxfp4 import BLOCK, MXFP4

TENSORS = Tensors(values="blocks", values_dtypes=("U8",), scale="scales")
EXPERTS = r"re:.*\.experts$"  # the fused expert modules transformers converts


def parse(qc: dict) -> Layout:
    method = qc.get("quant_method")
    for key in ("block_size", "group_size"):
        if qc.get(key, BLOCK) != BLOCK:
            raise Refused(method, f"{key}={qc.get(key)} (MXFP4 scales blocks of {BLOCK} values)")
    return Layout(method, MXFP4, TENSORS, 4, "group", BLOCK, True, "none", None,
                  tuple(qc.get("modules_to_not_convert") or ()), "hf", (EXPERTS,), fused=True)


READER = LayoutReader(
    name="mxfp4", quant_methods=("mxfp4",),
    supported=("quant_method 'mxfp4': E2M1 experts in blocks of 32 with E8M0 scales, "
               "*_blocks / *_scales (gpt-oss)",),
    parse=parse)
