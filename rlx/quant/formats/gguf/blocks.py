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
would change the last bit).

On device these three types are stored *planar*: each row's bytes permuted so that the f16
headers of all its blocks come first and the 32 int8 / 16 nibble bytes of each block follow
(``to_planar`` / ``from_planar``; same bytes, same shape). XLA:CPU reads a block's interleaved
bytes one by one; planar rows let the few-row product (``rows_product``) decode a tile of output
rows with contiguous loads, into a float tile that stays in cache, and multiply it there: the
packed bytes are read once per product instead of writing and re-reading a float matrix. Q5_0 / Q5_1 and the K-quants Q2_K .. Q6_K (the types llama.cpp's
``_S`` / ``_M`` / ``_L`` mixes are made of) decode in ``rlx.quant.formats.gguf.kquants``. qwix
has no notion of these block formats, hence these modules.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array

from rlx.models.mixed import FEW_ROWS
from rlx.platform.cpu import kernels as cpu_kernels
from rlx.platform.policy import current
from rlx.quant.formats.gguf.kquants import DECODERS, f16, rounded
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


# planar types: header bytes per block (f16 d; Q4_1: f16 d, f16 m)
PLANAR = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}
TILE_ROWS = 256  # rows_product: most output rows decoded per tile (a [256, K] f32 tile)


def to_planar(blocks, qtype: str):
    """File blocks ``[..., R, nb * bytes]`` -> planar rows: each f16 header field of every block
    (``d`` of all blocks, then ``m``), then the payloads; numpy or jax."""
    if qtype not in PLANAR:
        return blocks
    h, nbytes = PLANAR[qtype], BLOCK_BYTES[qtype]
    lead = blocks.shape[:-1]
    b = blocks.reshape(*lead, blocks.shape[-1] // nbytes, nbytes)
    parts = [b[..., j:j + 2].reshape(*lead, -1) for j in range(0, h, 2)]
    parts.append(b[..., h:].reshape(*lead, -1))
    return np.concatenate(parts, -1) if isinstance(blocks, np.ndarray) else jnp.concatenate(parts, -1)


def from_planar(planar, qtype: str):
    """Inverse of ``to_planar``: the file's block bytes."""
    if qtype not in PLANAR:
        return planar
    h, nbytes = PLANAR[qtype], BLOCK_BYTES[qtype]
    lead, nb = planar.shape[:-1], planar.shape[-1] // nbytes
    fields = [planar[..., j * nb:(j + 2) * nb].reshape(*lead, nb, 2) for j in range(0, h, 2)]
    fields.append(planar[..., nb * h:].reshape(*lead, nb, nbytes - h))
    cat = np.concatenate if isinstance(planar, np.ndarray) else jnp.concatenate
    return cat(fields, -1).reshape(*lead, -1)


def _planar_parts(p: Array, qtype: str) -> tuple[list[Array], Array]:
    """Planar rows ``[..., R, nb * bytes]`` -> (the f32 header fields ``[..., R, nb, 1]``,
    payload bytes ``[..., R, nb, bytes - h]``)."""
    h, nbytes = PLANAR[qtype], BLOCK_BYTES[qtype]
    lead, nb = p.shape[:-1], p.shape[-1] // nbytes
    fields = [jax.lax.bitcast_convert_type(p[..., j * nb:(j + 2) * nb].reshape(*lead, nb, 2),
                                           jnp.float16).astype(jnp.float32)[..., None]
              for j in range(0, h, 2)]
    return fields, p[..., nb * h:].reshape(*lead, nb, nbytes - h)


def _planar_values(p: Array, qtype: str) -> Array:
    """Planar rows -> f32 ``[..., R, nb, 32]`` values, bit for bit as the block decoders."""
    hdr, q = _planar_parts(p, qtype)
    d = hdr[0]
    if qtype == "Q8_0":
        return jax.lax.bitcast_convert_type(q, jnp.int8).astype(jnp.float32) * d
    nib = _nibbles(q)
    if qtype == "Q4_0":
        return d * (nib - 8.0)
    return rounded(d * nib) + hdr[1]


def _tile_parts(tile: Array, qtype: str) -> tuple[Array, ...]:
    """One tile of planar rows ``[T, nb * bytes]`` -> its decoded f32 weights: Q8_0 one
    ``[T, nb, 32]``; Q4_x ``[T, nb, 16]`` per half-block (low nibbles: elements 0..15; high:
    16..31). Not bit-identical to the file's rounding for Q4_1 (no barrier: it would cost a
    pass), so the products agree with the dequantized ones to f32 rounding."""
    hdr, q = _planar_parts(tile, qtype)
    d = hdr[0]
    if qtype == "Q8_0":
        return (jax.lax.bitcast_convert_type(q, jnp.int8).astype(jnp.float32) * d,)
    lo, hi = (q & 0x0F).astype(jnp.float32), (q >> 4).astype(jnp.float32)
    if qtype == "Q4_0":
        return d * (lo - 8.0), d * (hi - 8.0)
    m = hdr[1]
    return d * lo + m, d * hi + m


def _tile(n: int) -> int:
    """The largest divisor of ``n`` up to ``TILE_ROWS``."""
    return max(t for t in range(1, min(n, TILE_ROWS) + 1) if n % t == 0)


def rows_product(planar: Array, qtype: str, x: Array) -> Array:
    """``x @ W.T`` (f32 ``[R, K]`` -> ``[R, N]``) for the ``[N, K]`` matrix ``W`` of planar rows
    ``[N, nb * bytes]``, one tile of output rows at a time (``jax.lax.map``): each tile is decoded
    into a float ``[T, K]`` tile in cache and multiplied there (Q4_x: one product per half of
    the blocks, the nibbles' order)."""
    n, r = planar.shape[0], x.shape[0]
    t = _tile(n)
    xb = x.reshape(r, -1, 32)
    xs = (x,) if qtype == "Q8_0" else (xb[..., :16].reshape(r, -1), xb[..., 16:].reshape(r, -1))

    def one(tile):  # [T, nb * bytes] -> [R, T]
        parts = _tile_parts(tile, qtype)
        return sum(jnp.einsum("rk,tk->rt", xp, w.reshape(t, -1)) for xp, w in zip(xs, parts))

    y = jax.lax.map(one, planar.reshape(n // t, t, planar.shape[-1]))  # [N/T, R, T]
    return jnp.moveaxis(y, 0, 1).reshape(r, n)


def dequantize_blocks(blocks: Array, qtype: str) -> Array:
    """uint8 ``[..., R, nblocks * block_bytes]`` -> f32 ``[..., R, nblocks * block_elements]``."""
    _, nbytes, decode = KEPT[qtype]
    b = blocks.reshape(*blocks.shape[:-1], blocks.shape[-1] // nbytes, nbytes)  # [..., R, nb, bytes]
    return decode(b).reshape(*blocks.shape[:-1], -1)


class GGUFTensor(nnx.Module):
    """A frozen GGUF-quantized matrix: blocks ``[..., N, bytes]`` over the contraction axis K
    (``PLANAR`` types stored planar, ``to_planar``; ``file_blocks()`` gives the file's bytes).

    ``kernel=True``: the logical matrix is an rlx kernel ``[K, N]`` (HF ``[out, in]`` transposed);
    ``kernel=False``: it is ``[N, K]`` as stored (an embedding ``[vocab, d]``).
    """

    def __init__(self, qtype: str, hf_shape, blocks, axes, kernel: bool):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"GGUF type {qtype} is not kept quantized; supported: {sorted(BLOCK_BYTES)}")
        self.fmt, self.qtype, self.kernel = "gguf", qtype, kernel
        self.hf_shape = tuple(hf_shape)  # [..., N, K]
        self.shape = self.hf_shape[:-2] + self.hf_shape[::-1][:2] if kernel else self.hf_shape
        self.blocks = QuantWeight(to_planar(blocks, qtype),
                                  logical_axes=None if axes is None else tuple(axes))

    def file_blocks(self) -> Array:
        """The blocks in the file's byte order."""
        return from_planar(self.blocks[...], self.qtype)

    def _rows(self, blocks: Array) -> Array:
        """Stored rows ``[..., R, bytes]`` -> f32 ``[..., R, K]``."""
        if self.qtype in PLANAR:
            return _planar_values(blocks, self.qtype).reshape(*blocks.shape[:-1], -1)
        return dequantize_blocks(blocks, self.qtype)

    def dequantize(self, dtype=jnp.float32) -> Array:
        w = self._rows(self.blocks[...])  # [..., N, K]
        return (jnp.swapaxes(w, -1, -2) if self.kernel else w).astype(dtype)

    def _few_rows(self, x: Array, dtype, out_dtype) -> Array | None:
        """``x @ W.T`` for the stored ``[N, K]`` matrix ``W`` where it applies: a 2-D planar
        tensor, f32 compute, at most ``FEW_ROWS`` rows, on XLA:CPU (the native kernel of
        ``rlx.platform.cpu.kernels`` where it runs, else ``rows_product``); else None."""
        rows = math.prod(x.shape[:-1])
        if (self.qtype not in PLANAR or len(self.hf_shape) != 2 or rows > FEW_ROWS
                or jnp.dtype(dtype) != jnp.float32 or not current().few_row_products):
            return None
        x2 = x.reshape(rows, -1).astype(jnp.float32)
        blocks = self.blocks[...]
        if cpu_kernels.available():
            qtype = self.qtype
            y = cpu_kernels.with_reference_gradient(
                lambda v, b: cpu_kernels.gguf_product(b, qtype, v),
                lambda v, b: rows_product(b, qtype, v), x2, blocks)
        else:
            y = rows_product(blocks, self.qtype, x2)
        return y.astype(out_dtype).reshape(*x.shape[:-1], -1)

    def product(self, x: Array, dtype, out_dtype) -> Array | None:
        """``x @ kernel`` reading the blocks (``rows_product``) for a decode step's few rows on
        XLA:CPU; None elsewhere: the caller dequantizes the blocks inside the jitted matmul."""
        return self._few_rows(x, dtype, out_dtype) if self.kernel else None

    def head_product(self, h: Array, dtype) -> Array | None:
        """``h @ W.T`` for an embedding ``W`` used as the tied output head, as ``product``."""
        return None if self.kernel else self._few_rows(h, dtype, dtype)

    def take(self, ids: Array, dtype) -> Array:
        """Rows ``ids`` of an embedding: gather the blocks first, dequantize only those."""
        if self.kernel:
            return jnp.take(self.dequantize(dtype), ids, axis=0)
        return self._rows(jnp.take(self.blocks[...], ids, axis=0)).astype(dtype)

    def leaves(self) -> dict[str, Array]:
        return {"blocks": self.blocks[...]}
