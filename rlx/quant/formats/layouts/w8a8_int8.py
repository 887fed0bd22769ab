"""SGLang's ``w8a8_int8`` layout: ``X.weight`` int8 ``[out, in]`` and ``X.weight_scale``
``[out, 1]`` (one scale per output channel, symmetric), int8 activations per token; the modules
in ``modules_to_not_convert`` (or ``ignore``) stay float. Read as rlx's int8 format.
"""

from __future__ import annotations

from rlx.quant.formats.int8 import INT8
from rlx.quant.formats.layouts.base import Layout, LayoutReader, Tensors

TENSORS = Tensors(values="weight", values_dtypes=("I8",), scale="weight_scale")


def parse(qc: dict) -> Layout:
    return Layout(qc.get("quant_method"), INT8, TENSORS, 8, "channel", None, True, "int8_token",
                  (), tuple(qc.get("modules_to_not_convert") or qc.get("ignore") or ()), "hf")


READER = LayoutReader(name="w8a8_int8", quant_methods=("w8a8_int8",),
                      supported=("quant_method 'w8a8_int8'",), parse=parse)
