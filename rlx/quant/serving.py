"""The frozen base in the checkpoint layouts SGLang loads, and back, value for value.

One quantized linear ``W`` (HF ``[out, in]``; rlx storage ``[K=in, N=out]``) under HF name ``X``:

============================  =====================================================================
rlx base -> serving           tensors written (``quantization_config`` in ``config.json``)
============================  =====================================================================
int8 -> ``w8a8_int8``         ``X.weight`` int8 [out, in], ``X.weight_scale`` [out, 1]
                              (``quant_method: w8a8_int8``; activations int8 per token, dynamic)
int8 / int4 ->                ``X.weight_packed`` int32 [out, in*bits/32] (8 nibbles or 4 bytes per
``compressed-tensors``        int32 along ``in``, value + 2^(bits-1), lowest bits first),
                              ``X.weight_scale`` [out, in/group] (int8: [out, 1]),
                              ``X.weight_zero_point`` int32 [ceil(out/8), in/group] (asymmetric int4,
                              packed along ``out``), ``X.weight_shape`` [out, in]
                              (``format: pack-quantized``, weight-only WNA16)
fp8 channel -> ``fp8`` or     ``X.weight`` e4m3 [out, in], ``X.weight_scale`` [out, 1]
``compressed-tensors``        (``format: float-quantized``, activations fp8 per token, dynamic)
fp8 block128 -> ``fp8``       ``X.weight`` e4m3 [out, in], ``X.weight_scale_inv`` [ceil(out/128),
                              ceil(in/128)] (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
                              activations fp8 per 1x128 group, dynamic; DeepSeek/Qwen FP8 layout)
gguf -> ``gguf``              the GGUF file itself
any -> ``hf``                 dequantized float weights (``X.weight``), no quantization_config
============================  =====================================================================

Each format writes its own layouts (its ``codec``, ``rlx.quant.formats``); this module picks the
one ``QuantConfig.serving`` names. Scales are written in the dtype they are stored in (``QuantConfig.scale_dtype``); a server that
casts them to a lower precision model dtype only keeps the values when that dtype holds them, so
serve a bf16 model from ``scale_dtype="bfloat16"``. Routers, norms, embeddings and lm_head are
written as float tensors under their HF names.
"""

from __future__ import annotations

import numpy as np

from rlx.quant.config import QuantConfig
from rlx.quant.formats.compressed import pack_int32, unpack_int32  # noqa: F401 (re-exported)


def quantization_config(q: QuantConfig) -> dict | None:
    """The ``config.json`` ``quantization_config`` for the serving layout of ``q`` (None where it
    writes float weights or serves the source file)."""
    layout = q.serving_spec
    if layout.dequantized or layout.source_file:
        return None
    return q.spec.codec.quantization_config(q)


def to_serving(leaves: dict[str, np.ndarray], name: str, q: QuantConfig) -> dict[str, np.ndarray]:
    """Serving tensors of one 2-D quantized linear (storage ``[K, N]`` leaves) under HF prefix ``name``."""
    return q.spec.codec.to_serving(leaves, name, q)


__all__ = ["pack_int32", "quantization_config", "to_serving", "unpack_int32"]
