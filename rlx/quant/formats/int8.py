"""Format "int8": int8 values with one symmetric (absmax) scale per output column, as int8
servers keep them.

Served as its dequantized floats (``hf``), as SGLang's ``w8a8_int8`` (int8 activations per token)
or as compressed-tensors ``pack-quantized`` 8-bit channel weights.
"""

import jax.numpy as jnp
import numpy as np

from rlx.quant.formats import compressed
from rlx.quant.formats.base import Codec, Format, channel_block, channel_how


def _bytes(q, k: int, n: int) -> float:
    return 1.0 + jnp.dtype(q.scale_dtype).itemsize / k


def _mode(q) -> str:
    return "int8_token"


def _config(q) -> dict:
    if q.serving == "w8a8_int8":
        return {"quant_method": "w8a8_int8"}
    return compressed.config(q, compressed.int_weights(q, 8, False), None, "pack-quantized")


def _to_serving(leaves: dict, name: str, q) -> dict:
    """w8a8_int8: ``X.weight`` int8 ``[out, in]``, ``X.weight_scale`` ``[out, 1]``; else
    compressed-tensors 8-bit ``pack-quantized``."""
    if q.serving == "w8a8_int8":
        return {f"{name}.weight": np.ascontiguousarray(leaves["values"].T),
                f"{name}.weight_scale": np.ascontiguousarray(leaves["scale"].T)}
    return compressed.pack_quantized(leaves["values"], leaves, name, 8)


INT8 = Format(
    name="int8", summary="int8, one scale per output column",
    serving=("hf", "w8a8_int8", "compressed-tensors"), quantizes=True,
    how=channel_how(jnp.int8), block=channel_block, int8_channel=True,
    activations="int8", activation_mode=_mode, bytes_per_param=_bytes,
    codec=Codec(_config, _to_serving))
