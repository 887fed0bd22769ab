"""Format "int8": int8 values with one symmetric (absmax) scale per output column, as int8
servers keep them.

Served as its dequantized floats (``hf``), as SGLang's ``w8a8_int8`` (int8 activations per token)
or as compressed-tensors ``pack-quantized`` 8-bit channel weights.
"""

import jax.numpy as jnp

from rlx.quant.formats.base import Format, channel_block, channel_how


def _bytes(q, k: int, n: int) -> float:
    return 1.0 + jnp.dtype(q.scale_dtype).itemsize / k


def _mode(q) -> str:
    return "int8_token"


INT8 = Format(
    name="int8", summary="int8, one scale per output column",
    serving=("hf", "w8a8_int8", "compressed-tensors"), quantizes=True,
    how=channel_how(jnp.int8), block=channel_block, int8_channel=True,
    activations="int8", activation_mode=_mode, bytes_per_param=_bytes)
