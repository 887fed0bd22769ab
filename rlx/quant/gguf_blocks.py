"""GGUF tensors kept block-for-block and dequantized inside the jitted graph.

A GGUF file is itself a deployment format, so the base is not requantized: the uint8 blocks from
``read_gguf(...).raw(name)`` (one row of blocks per output row, rows already in HF order) go to
device unchanged. Each block covers 32 (K-quants: 256) consecutive inputs of one row (llama.cpp
``ggml-quants``); the legacy 4- and 8-bit types:

- Q8_0, 34 bytes: f16 ``d``, 32 x int8 ``q``:          ``y = q * d``
- Q4_0, 18 bytes: f16 ``d``, 16 bytes of nibbles:      ``y = (nibble - 8) * d``
- Q4_1, 20 bytes: f16 ``d``, f16 ``m``, 16 bytes:      ``y = nibble * d + m``

Nibble ``j`` of byte ``i`` (low ``j = 0``, high ``j = 1``) is element ``16 j + i`` of the block.
Arithmetic is f32 as in ``gguf.quants.dequantize``; the Q4_1 product and sum are computed as two
rounded operations (the reduce-precision barrier keeps XLA from fusing them into one FMA, which
would change the last bit). Q5_0 / Q5_1 and the K-quants Q2_K .. Q6_K (the types llama.cpp's
``_S`` / ``_M`` / ``_L`` mixes are made of) decode in ``rlx.quant.gguf_kquants``. qwix has no
notion of these block formats, hence these modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array

from rlx.quant.gguf_kquants import DECODERS, f16, rounded
from rlx.quant.tensors import QuantWeight


def _nibbles(qs: Array) -> Array:
    """``[..., 16]`` bytes -> ``[..., 32]`` values in [0, 16) as f32 (low nibbles first)."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.float32)


def _q8_0(b: Array) -> Array:
    return jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32) * f16(b[..., 0:2])


def _q4_0(b: Array) -> Array:
    return f16(b[..., 0:2]) * (_nibbles(b[..., 2:]) - 8.0)


def _q4_1(b: Array) -> Array:
    return rounded(f16(b[..., 0:2]) * _nibbles(b[..., 4:])) + f16(b[..., 2:4])


# type -> (elements per block, bytes per block, decoder of [..., nb, bytes] -> [..., nb, elements])
KEPT = {"Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), **DECODERS}
BLOCK_BYTES = {t: nbytes for t, (_, nbytes, _) in KEPT.items()}  # the GGUF types kept as blocks


def dequantize_blocks(blocks: Array, qtype: str) -> Array:
    """uint8 ``[..., R, nblocks * block_bytes]`` -> f32 ``[..., R, nblocks * block_elements]``."""
    _, nbytes, decode = KEPT[qtype]
    b = blocks.reshape(*blocks.shape[:-1], blocks.shape[-1] // nbytes, nbytes)  # [..., R, nb, bytes]
    return decode(b).reshape(*blocks.shape[:-1], -1)


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
