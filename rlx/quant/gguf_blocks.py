"""GGUF Q4_0 / Q4_1 / Q8_0 tensors kept block-for-block and dequantized inside the jitted graph.

A GGUF file is itself a deployment format, so the base is not requantized: the uint8 blocks from
``read_gguf(...).raw(name)`` (one row of blocks per output row, rows already in HF order) go to
device unchanged. Each block covers 32 consecutive inputs of one row (llama.cpp ``ggml-quants``):

- Q8_0, 34 bytes: f16 ``d``, 32 x int8 ``q``:          ``y = q * d``
- Q4_0, 18 bytes: f16 ``d``, 16 bytes of nibbles:      ``y = (nibble - 8) * d``
- Q4_1, 20 bytes: f16 ``d``, f16 ``m``, 16 bytes:      ``y = nibble * d + m``

Nibble ``j`` of byte ``i`` (low ``j = 0``, high ``j = 1``) is element ``16 j + i`` of the block.
Arithmetic is f32 as in ``gguf.quants.dequantize``; the Q4_1 product and sum are computed as two
rounded operations (the reduce-precision barrier keeps XLA from fusing them into one FMA, which
would change the last bit). qwix has no notion of these block formats, hence this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array

from rlx.quant.tensors import QuantWeight

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _f16(b: Array) -> Array:
    """``[..., 2]`` little-endian bytes -> f32 ``[..., 1]``."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)[..., None]


def _nibbles(qs: Array) -> Array:
    """``[..., 16]`` bytes -> ``[..., 32]`` values in [0, 16) as f32 (low nibbles first)."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.float32)


def dequantize_blocks(blocks: Array, qtype: str) -> Array:
    """uint8 ``[..., R, nblocks * block_bytes]`` -> f32 ``[..., R, nblocks * 32]``."""
    nbytes = BLOCK_BYTES[qtype]
    b = blocks.reshape(*blocks.shape[:-1], blocks.shape[-1] // nbytes, nbytes)  # [..., R, nb, bytes]
    d = _f16(b[..., 0:2])
    if qtype == "Q8_0":
        y = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32) * d
    elif qtype == "Q4_0":
        y = d * (_nibbles(b[..., 2:]) - 8.0)
    else:
        prod = jax.lax.reduce_precision(d * _nibbles(b[..., 4:]), exponent_bits=8, mantissa_bits=23)
        y = jax.lax.optimization_barrier(prod) + _f16(b[..., 2:4])
    return y.reshape(*blocks.shape[:-1], -1)


class GGUFTensor(nnx.Module):
    """A frozen GGUF-quantized matrix: blocks ``[..., N, bytes]`` over the contraction axis K.

    ``kernel=True``: the logical matrix is an rlx kernel ``[K, N]`` (HF ``[out, in]`` transposed);
    ``kernel=False``: it is ``[N, K]`` as stored (an embedding ``[vocab, d]``).
    """

    def __init__(self, qtype: str, hf_shape, blocks, axes, kernel: bool):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"GGUF type {qtype} is not kept quantized; supported: {sorted(BLOCK_BYTES)}")
        self.fmt, self.qtype, self.kernel = "gguf", qtype, kernel
        self.hf_shape = tuple(hf_shape)  # [..., N, K]
        self.shape = self.hf_shape[:-2] + self.hf_shape[::-1][:2] if kernel else self.hf_shape
        self.blocks = QuantWeight(blocks, logical_axes=None if axes is None else tuple(axes))

    def dequantize(self, dtype=jnp.float32) -> Array:
        w = dequantize_blocks(self.blocks[...], self.qtype)  # [..., N, K]
        return (jnp.swapaxes(w, -1, -2) if self.kernel else w).astype(dtype)

    def product(self, x: Array, dtype, out_dtype) -> None:
        """None: a GGUF kernel's product dequantizes its blocks inside the jitted matmul."""
        return None

    def take(self, ids: Array, dtype) -> Array:
        """Rows ``ids`` of an embedding: gather the blocks first, dequantize only those."""
        if self.kernel:
            return jnp.take(self.dequantize(dtype), ids, axis=0)
        return dequantize_blocks(jnp.take(self.blocks[...], ids, axis=0), self.qtype).astype(dtype)

    def leaves(self) -> dict[str, Array]:
        return {"blocks": self.blocks[...]}
