"""E2M1, the 4-bit float of MXFP4 and NVFP4 (OCP Microscaling spec v1.0): one sign bit, two
exponent bits (bias 1), one mantissa bit; no infinities, no NaN. Code ``c`` (a nibble) is
``(-1)^(c >> 3) * TABLE[c & 7]`` with magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 0 and 1 are
the subnormals 0 and 0.5).

Two codes share a byte, the even element in the low nibble (``base.pack_nibbles``): as gpt-oss's
``*_blocks`` (transformers' ``convert_moe_packed_tensors`` reads ``blocks & 0x0F`` as element
``2j`` and ``blocks >> 4`` as ``2j + 1``) and ModelOpt's NVFP4 ``weight`` store them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from rlx.quant.formats.base import pack_nibbles, unpack_nibbles

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TABLE = np.array(MAGNITUDES + tuple(-m for m in MAGNITUDES), np.float32)  # code -> value
MAX = 6.0  # the largest magnitude


def codes(values: Array) -> Array:
    """E2M1 values (``jnp.float4_e2m1fn``, what qwix's ``mxfp4`` / ``nvfp4`` quantization gives)
    -> their 4-bit codes as uint8."""
    return jax.lax.bitcast_convert_type(values.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)


def encode(values: Array) -> Array:
    """``[..., K, N]`` E2M1 values -> ``[..., K/2, N]`` uint8, two codes a byte (even row low)."""
    return pack_nibbles(codes(values))


def decode(stored: Array) -> Array:
    """Inverse of ``encode`` as f32 values ``[..., K, N]``."""
    return jnp.asarray(TABLE)[unpack_nibbles(stored).astype(jnp.int32)]


__all__ = ["MAGNITUDES", "MAX", "TABLE", "codes", "decode", "encode"]
