"""Decoders of GGUF's 5-bit legacy blocks and its K-quant super-blocks, on device.

Layouts as llama.cpp writes them (``ggml-common.h``); every value is reproduced bit for bit as
``gguf.quants.dequantize`` computes it (f32 arithmetic, each product rounded before a sum or a
difference, as the reference does):

- Q5_0, 22 bytes / 32: f16 ``d``, u32 ``qh`` (bit ``j``: 5th bit of element ``j``), 16 nibble
  bytes (element ``j < 16`` the low nibble of byte ``j``, ``j >= 16`` the high nibble of
  ``j - 16``): ``y = d * (q - 16)``.
- Q5_1, 24 bytes / 32: f16 ``d``, f16 ``m``, ``qh``, nibbles: ``y = d * q + m``.
- Q2_K, 84 bytes / 256: 16 scale bytes (low nibble scale, high nibble min of each 16-value
  sub-block), 64 bytes of 2-bit values, f16 ``d``, f16 ``dmin``:
  ``y = (d * sc) * q - (dmin * m)``.
- Q3_K, 110 bytes / 256: 32 bytes ``hmask``, 64 bytes of 2-bit values, 12 bytes of sixteen 6-bit
  scales (offset 32), f16 ``d``: ``y = (d * sc) * (q - 4 [hmask bit clear])``.
- Q4_K, 144 bytes / 256: f16 ``d``, f16 ``dmin``, 12 bytes of eight 6-bit scales and mins, 128
  nibble bytes: ``y = (d * sc) * q - (dmin * m)`` per 32-value sub-block.
- Q5_K, 176 bytes / 256: as Q4_K with 32 bytes of 5th bits before the nibbles.
- Q6_K, 210 bytes / 256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16
  ``d``: ``y = (d * sc) * (q - 32)`` per 16-value sub-block.

Each decoder maps uint8 ``[..., nb, block_bytes]`` to f32 ``[..., nb, block_elements]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array

QK = 256  # elements of a K-quant super-block


def f16(b: Array) -> Array:
    """``[..., 2]`` little-endian bytes -> f32 ``[..., 1]``."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)[..., None]


def rounded(x: Array) -> Array:
    """``x`` rounded to f32 and kept apart from what follows (no fused multiply-add), as the
    reference computes each product before its sum."""
    return jax.lax.optimization_barrier(
        jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23))


def _fields(b: Array, shifts: tuple[int, ...], mask: int, width: int) -> Array:
    """Bytes ``[..., n * width]`` -> ``[..., n * len(shifts) * width]``: for each run of ``width``
    bytes, its bit field at every shift in turn ((byte >> shift) & mask)."""
    runs = b.reshape(*b.shape[:-1], -1, 1, width)
    s = jnp.asarray(shifts, jnp.uint8).reshape(len(shifts), 1)
    return ((runs >> s) & mask).reshape(*b.shape[:-1], -1)


def _bits32(b: Array) -> Array:
    """4 bytes (a little-endian u32) -> its 32 bits, bit ``j`` at position ``j``."""
    return _fields(b, tuple(range(8)), 1, 1)  # byte i's bit j lands at 8 * i + j


def _q5(b: Array) -> Array:
    """``qh`` (4 bytes) and 16 nibble bytes -> 32 five-bit values as f32."""
    low = _fields(b[..., 4:20], (0, 4), 0x0F, 16)
    return (low | (_bits32(b[..., 0:4]) << 4)).astype(jnp.float32)


def q5_0(b: Array) -> Array:
    return f16(b[..., 0:2]) * (_q5(b[..., 2:]) - 16.0)


def q5_1(b: Array) -> Array:
    return rounded(f16(b[..., 0:2]) * _q5(b[..., 4:])) + f16(b[..., 2:4])


def _sub(values: Array, sub: int) -> Array:
    """``[..., 256]`` -> ``[..., 256 // sub, sub]``."""
    return values.reshape(*values.shape[:-1], QK // sub, sub)


def _flat(values: Array) -> Array:
    return values.reshape(*values.shape[:-2], QK)


def q2_k(b: Array) -> Array:
    scales, d, dmin = b[..., 0:16], f16(b[..., 80:82]), f16(b[..., 82:84])
    q = _sub(_fields(b[..., 16:80], (0, 2, 4, 6), 3, 32).astype(jnp.float32), 16)
    scale = rounded(d * (scales & 0x0F).astype(jnp.float32))[..., None]
    low = rounded(dmin * (scales >> 4).astype(jnp.float32))[..., None]
    return _flat(rounded(scale * q) - low)


def _q3_scales(s: Array) -> Array:
    """12 bytes -> sixteen signed 6-bit scales as f32."""
    low = _fields(s[..., 0:8], (0, 4), 0x0F, 8)
    high = _fields(s[..., 8:12], (0, 2, 4, 6), 3, 4)
    return ((low | (high << 4)).astype(jnp.int8) - 32).astype(jnp.float32)


def q3_k(b: Array) -> Array:
    d = f16(b[..., 108:110])
    low = _fields(b[..., 32:96], (0, 2, 4, 6), 3, 32).astype(jnp.int8)
    clear = _fields(b[..., 0:32], tuple(range(8)), 1, 32) ^ 1  # offset 4 where the bit is clear
    q = _sub((low - (clear << 2).astype(jnp.int8)).astype(jnp.float32), 16)
    return _flat(rounded(d * _q3_scales(b[..., 96:108]))[..., None] * q)


def _k_scales(s: Array) -> tuple[Array, Array]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (f32)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _k_affine(b: Array, q: Array) -> Array:
    """``(d * sc) * q - (dmin * m)`` over 8 sub-blocks of 32 (q: f32 ``[..., 256]``)."""
    sc, mn = _k_scales(b[..., 4:16])
    scale = rounded(f16(b[..., 0:2]) * sc)[..., None]
    low = rounded(f16(b[..., 2:4]) * mn)[..., None]
    return _flat(rounded(scale * _sub(q, 32)) - low)


def q4_k(b: Array) -> Array:
    return _k_affine(b, _fields(b[..., 16:144], (0, 4), 0x0F, 32).astype(jnp.float32))


def q5_k(b: Array) -> Array:
    low = _fields(b[..., 48:176], (0, 4), 0x0F, 32)
    high = _fields(b[..., 16:48], tuple(range(8)), 1, 32)
    return _k_affine(b, (low | (high << 4)).astype(jnp.float32))


def q6_k(b: Array) -> Array:
    low = _fields(b[..., 0:128], (0, 4), 0x0F, 64)
    high = _fields(b[..., 128:192], (0, 2, 4, 6), 3, 32)
    q = _sub(((low | (high << 4)).astype(jnp.int8) - 32).astype(jnp.float32), 16)
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    return _flat(rounded(f16(b[..., 208:210]) * sc)[..., None] * q)


# type -> (elements per block, bytes per block, decoder)
DECODERS = {
    "Q5_0": (32, 22, q5_0), "Q5_1": (32, 24, q5_1),
    "Q2_K": (QK, 84, q2_k), "Q3_K": (QK, 110, q3_k), "Q4_K": (QK, 144, q4_k),
    "Q5_K": (QK, 176, q5_k), "Q6_K": (QK, 210, q6_k),
}

__all__ = ["DECODERS", "QK", "f16", "rounded"]
