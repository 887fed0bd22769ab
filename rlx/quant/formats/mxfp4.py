"""Format "mxfp4": OCP Microscaling FP4 as gpt-oss ships its experts. E2M1 values
(``rlx.quant.formats.e2m1``) in blocks of 32 along the input, one E8M0 scale per block (a power
of two, stored as its biased exponent byte ``e``: ``scale = 2^(e - 127)``), packed two codes a
byte along K (even element in the low nibble)::

    w[k, n] = e2m1(code[k, n]) * 2^(e[k // 32, n] - 127)

4.25 bits per weight. Quantized from float weights with qwix's ``mxfp4`` (per block
``scale = 2^ceil(log2(absmax / 6))``, so no value clips; values rounded to the nearest E2M1,
ties to even). The learner's product is W4A16: the values are dequantized inside the jitted
matmul, activations stay in the compute dtype, as SGLang's ``mxfp4`` MoE path serves gpt-oss
(weights only). Served here as its dequantized floats (``hf``); the shipped layout is read and
written back by ``rlx.quant.formats.layouts.mxfp4``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlx.quant.formats import e2m1
from rlx.quant.formats.base import Format, QuantConfigError

BLOCK = 32  # values per E8M0 scale
BIAS = 127  # E8M0 exponent bias


def _how(ndim: int, q) -> tuple:
    lead = tuple(range(ndim - 2))
    return "mxfp4", lead + (ndim - 1,), ((ndim - 2, BLOCK),), "absmax"


def _block(shape: tuple, k: int, n: int, q) -> tuple[int, int]:
    if k % BLOCK:
        raise QuantConfigError(f"mxfp4 scales blocks of {BLOCK} inputs; the input dimension {k} "
                               f"of a {shape} matrix is not a multiple of {BLOCK}")
    return (BLOCK, 1)


def scale_encode(scale: jax.Array) -> jax.Array:
    """Power-of-two f32 scales -> their E8M0 bytes (the f32 exponent field: same bias)."""
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    return ((bits >> 23) & 0xFF).astype(jnp.uint8)


def scale_decode(e: jax.Array) -> jax.Array:
    """E8M0 bytes -> f32 scales ``2^(e - 127)``."""
    return jnp.ldexp(jnp.ones(e.shape, jnp.float32), e.astype(jnp.int32) - BIAS)


def _bytes(q, k: int, n: int) -> float:
    return 0.5 + 1.0 / BLOCK


MXFP4 = Format(
    name="mxfp4", summary="E2M1 (FP4) in blocks of 32 along the input, one E8M0 scale each",
    serving=("hf",), quantizes=True, values_per_byte=2, how=_how, block=_block,
    encode=e2m1.encode, decode=e2m1.decode, integers=None, scale_encode=scale_encode,
    scale_decode=scale_decode, bytes_per_param=_bytes, e2m1_blocks=True)
