"""NVIDIA ModelOpt's NVFP4 export (``quant_method: modelopt``, ``quant_algo: NVFP4``,
``group_size: 16``; in ``config.json``'s ``quantization_config`` or, from older exports, in
``hf_quant_config.json``'s ``quantization``): per quantized linear ``X.weight`` uint8
``[out, in/2]`` (two E2M1 codes a byte, the even input in the low nibble), ``X.weight_scale``
float8 e4m3 ``[out, in/16]``, ``X.weight_scale_2`` f32 (one per matrix) and ``X.input_scale``
(the activations' global scale of SGLang's W4A4 ``modelopt_fp4`` path; rlx's forward is W4A16 and
does not read it). ``exclude_modules`` / ``ignore`` (fnmatch patterns) stay float. Read as rlx's
``nvfp4`` format: ``w = e2m1 * weight_scale * weight_scale_2``.
"""

from __future__ import annotations

import numpy as np

from rlx.quant.formats.layouts.base import Layout, LayoutReader, Refused, Tensors
from rlx.quant.formats.nvfp4 import BLOCK, NVFP4

TENSORS = Tensors(values="weight", values_dtypes=("U8",), scale="weight_scale",
                  scale_dtypes=("F8_E4M3",), scale2="weight_scale_2")


def parse(qc: dict) -> Layout:
    method = qc.get("quant_method")
    algo = qc.get("quant_algo")
    if algo != "NVFP4":
        raise Refused(method, f"quant_algo={algo!r} (rlx reads NVFP4)")
    if qc.get("group_size", BLOCK) != BLOCK:
        raise Refused(method, f"group_size={qc.get('group_size')} (NVFP4 scales blocks of {BLOCK})")
    ignore = tuple(qc.get("exclude_modules") or ()) + tuple(qc.get("ignore") or ())
    return Layout(method, NVFP4, TENSORS, 4, "group", BLOCK, True, "none", None, ignore, "glob")


READER = LayoutReader(
    name="modelopt", quant_methods=("modelopt",),
    supported=("quant_method 'modelopt' with quant_algo 'NVFP4' and group_size 16: uint8 weight, "
               "e4m3 weight_scale, f32 weight_scale_2 (ModelOpt's NVFP4 export)",),
    parse=parse)


def write_back(leaves: dict, name: str) -> dict:
    """ModelOpt's tensors of one quantized linear ``name`` from its rlx storage leaves (numpy
    ``values`` ``[K/2, N]``, ``scale`` ``[K/16, N]``, ``scale2`` ``[1, 1]``), byte for byte as
    read (``input_scale`` is not kept)."""
    return {f"{name}.weight": np.ascontiguousarray(leaves["values"].T),
            f"{name}.weight_scale": np.ascontiguousarray(leaves["scale"].T),
            f"{name}.weight_scale_2": np.asarray(leaves["scale2"]).reshape(())}
