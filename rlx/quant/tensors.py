"""Frozen quantized matrices, stored on device as they serve and dequantized inside the jitted matmul.

``QuantWeight`` is the nnx variable type of every frozen quantized leaf (packed integers, fp8 values,
scales, zero points, GGUF blocks). It is deliberately not an ``nnx.Param``: ``nnx.Param`` /
``nnx.LoRAParam`` filters select trainables and never touch it, and nothing differentiates through
integer leaves.

``QTensor`` holds one logical matrix (``[in, out]`` kernel, ``[E, in, out]`` experts, or a
``[vocab, d]`` embedding stored transposed) in kernel orientation ``[..., K, N]``, K being the
contraction axis along which groups and packing run::

    w[..., k, n] = (decode(values)[..., k, n] - zero[..., k // bk, n // bn]) * scale[..., k // bk, n // bn]

with ``(bk, bn)`` the scale block: int8 and fp8 "channel" ``(K, 1)`` (one scale per output), int4 /
nf4 ``(group, 1)``, fp8 "block128" ``(128, 128)`` (ceil-divided edges, as DeepSeek/Qwen FP8 files).
``decode`` is: int8 -> value; int4 -> nibble - 8; nf4 -> NF4 table[nibble]; fp8 e4m3 -> value;
mxfp4 / nvfp4 -> E2M1 value of the nibble (mxfp4's E8M0 scale bytes decode to ``2^(e - 127)``,
``Format.scale_decode``; nvfp4 multiplies a per-matrix ``scale2`` over its e4m3 block scales).
int4 and nf4 are packed two per byte along K (XLA:CPU would spend a byte on an int4 element):
row ``2i`` in the low nibble, row ``2i + 1`` in the high nibble. Each format declares these in its
record (``rlx.quant.formats``: ``how``, ``block``, ``encode``, ``decode``, ``integers``,
``values_per_byte``); this module reads the record and never the format's name.

The quantize math (calibration, scales, zero points, rounding, NF4 buckets) is qwix's
(the three stages of ``qwix.quantize``: calibrate, scale and zero point, values); qwix has no packed storage, no ceil-divided 128x128 tiles and no sharding
metadata, which is what this module adds. GGUF blocks live in ``rlx.quant.formats.gguf.blocks``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from qwix._src.core import qarray  # qwix's stages: not re-exported
from flax import nnx
from jaxtyping import Array

from rlx.models.mixed import FEW_ROWS, mixed_einsum
from rlx.platform.cpu import kernels as cpu_kernels
from rlx.platform.policy import current
from rlx.quant import formats
from rlx.quant.formats import QuantConfigError
from rlx.quant.formats.base import Params, pack_nibbles, unpack_nibbles  # noqa: F401 (re-exported)

# QTensor.product runs grouped scales inside the product for up to GROUPED_ROWS rows where the
# platform's policy says so (PlatformPolicy.grouped_products; XLA:CPU's batched dot takes no
# bf16 x bf16 -> f32, see rlx.models.mixed)
GROUPED_ROWS = 32
CHUNK_ROWS = 128  # QTensor._chunked_product: most K rows decoded per chunk (channel scales)
_SCALE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class QuantWeight(nnx.Variable):
    """A frozen leaf of a quantized base (never trained, never an ``nnx.Param``)."""


def expand_blocks(s: Array, k: int, n: int, bk: int, bn: int) -> Array:
    """Repeat a per-block ``[..., ceil(K/bk), ceil(N/bn)]`` array to ``[..., K, N]``."""
    if s.shape[-2] == 1 and s.shape[-1] == n:  # one scale per output column: broadcast
        return s
    return jnp.repeat(jnp.repeat(s, bk, axis=-2)[..., :k, :], bn, axis=-1)[..., :n]


class QTensor(nnx.Module):
    """A frozen int8 / int4 / nf4 / fp8 matrix (see the module docstring for the layout)."""

    def __init__(self, fmt: str, shape, values, scale, zero, block, axes, transposed: bool = False,
                 scale2=None):
        self.fmt, self.shape, self.block, self.transposed = fmt, tuple(shape), tuple(block), transposed
        self.values = QuantWeight(values, logical_axes=axes)
        self.scale = QuantWeight(scale, logical_axes=axes)
        self.zero = None if zero is None else QuantWeight(zero, logical_axes=axes)
        # a second, per-matrix f32 scale ``[..., 1, 1]`` over the block scales (NVFP4's
        # ``weight_scale_2``): w = decode(values) * scale * scale2
        self.scale2 = None if scale2 is None else QuantWeight(scale2, logical_axes=axes)

    @property
    def spec(self) -> formats.Format:
        """The format's record (``rlx.quant.formats``): storage, decode and product hooks."""
        return formats.get(self.fmt)

    @property
    def kn(self) -> tuple[int, int]:
        """(K, N) of the storage orientation."""
        return (self.shape[-1], self.shape[-2]) if self.transposed else (self.shape[-2], self.shape[-1])

    def decode(self) -> Array:
        """Quantized values as f32 ``[..., K, N]`` (before zero point and scale)."""
        return self._decode_values(self.values[...])

    def dequantize(self, dtype=jnp.float32) -> Array:
        """The logical matrix in ``dtype`` (computed in f32, one rounding at the end; or in bf16
        where that is the same rounding, ``_exact_in``)."""
        zero = None if self.zero is None else self.zero[...]
        return self._dequantize(self.values[...], self.scale[...], zero, self.kn[1], dtype)

    def _scales(self, scale: Array) -> Array:
        """Stored block scales (all, or gathered columns) -> f32, times ``scale2`` if any."""
        s = self.spec.scale_decode(scale)
        return s if self.scale2 is None else self.spec.combine_scale2(s, self.scale2[...])

    def _dequantize(self, v: Array, scale: Array, zero: Array | None, n: int, dtype) -> Array:
        """``dequantize`` of stored values, scales and zero points with ``n`` columns (all of
        them, or the columns ``take`` gathered)."""
        k = self.kn[0]
        bk, bn = self.block
        if self._exact_in(dtype):
            q = self.spec.integers(v).astype(dtype)  # integers of at most 8 bits / e4m3 values: exact in bf16
            w = q * expand_blocks(scale, k, n, bk, bn)
            return jnp.swapaxes(w, -1, -2) if self.transposed else w
        q = self._decode_values(v)
        if zero is not None:
            q = q - expand_blocks(zero.astype(jnp.float32), k, n, bk, bn)
        w = q * expand_blocks(self._scales(scale), k, n, bk, bn)
        w = jnp.swapaxes(w, -1, -2) if self.transposed else w
        return w.astype(dtype)

    def _exact_in(self, dtype) -> bool:
        """Whether ``dtype`` arithmetic gives the f32 path's bits: a bf16 result from bf16 scales,
        no zero point, int8 / int4 / fp8 values. Such a value has at most 8 significant bits and
        a bf16 scale 8, so their product is exact in f32 and rounded once to bf16 either way; a
        bf16 product rounds that same exact product once (formats whose ``integers`` hook gives
        such values). The bf16 path spares the f32 copy of
        the whole matrix (of an expert stack, per layer) that XLA otherwise writes."""
        return (jnp.dtype(dtype) == jnp.bfloat16 and self.zero is None
                and self.spec.integers is not None and self.scale[...].dtype == jnp.bfloat16)

    def take(self, ids: Array, dtype) -> Array:
        """Rows ``ids`` of the logical matrix (embedding lookup). A ``[vocab, d]`` embedding with
        one scale block per vocabulary row (int8 / fp8 channel, int4 / nf4 groups) gathers the
        stored columns of those rows and dequantizes only them, to the same values."""
        if self.transposed and self.block[1] == 1 and len(self.shape) == 2:
            flat = ids.reshape(-1)
            cols = lambda a: jnp.take(a, flat, axis=-1)  # noqa: E731
            zero = None if self.zero is None else cols(self.zero[...])
            w = self._dequantize(cols(self.values[...]), cols(self.scale[...]), zero, flat.shape[0],
                                 dtype)  # [ids, d]
            return w.reshape(*ids.shape, w.shape[-1])
        return jnp.take(self.dequantize(dtype), ids, axis=0)

    def head_product(self, h: Array, dtype) -> Array | None:
        """``h @ W.T`` for an int8 channel ``[vocab, d]`` embedding used as the tied output head:
        its stored ``[d, vocab]`` values with one scale per vocabulary row are the native int8
        kernel's operands (``rlx.platform.cpu.kernels``), for a decode step's few f32 rows on
        XLA:CPU; None (dequantize inside the product) elsewhere."""
        rows = math.prod(h.shape[:-1])
        if not self._native(rows, dtype, head=True):
            return None
        return self._native_product(h, rows, dtype)

    def product(self, x: Array, dtype, out_dtype) -> Array | None:
        """``x @ w`` for a 2-D kernel without materialising ``w``, or None where this format or
        shape keeps the dequantize-then-multiply path.

        The stored values enter the product in the compute ``dtype`` (int8, int4 and fp8 e4m3
        values are exact in bf16), accumulated in f32; each K-group's scale (and zero point) is
        applied to that accumulator: ``sum_g s_g * (x_g @ q_g - sum(x_g) * z_g)``. One group
        (channel scales) is one product for any number of rows; several groups (int4 groups, fp8
        128x128 tiles) are ``[rows, G, N]`` products summed over ``G``, used for a decode step's
        few rows on accelerators (``GROUPED_ROWS``; ``grouped_products``). The compiler then
        reads the packed weights inside the product instead of writing and re-reading a float
        copy of the matrix on every call. On XLA:CPU, which converts a product's operand into a
        float copy first, a decode step's few f32 rows take the native int8 channel or FP4
        kernel (``rlx.platform.cpu.kernels``) where it runs, else ``_chunked_product``.
        """
        k, n = self.kn
        bk, bn = self.block
        rows = math.prod(x.shape[:-1])
        groups = -(-k // bk)
        if self._native(rows, dtype):
            return self._native_product(x, rows, out_dtype)
        if self._native_fp4(rows, dtype):
            return self._native_fp4_product(x, rows, out_dtype)
        if self._chunks(rows, dtype):
            y = self._chunked_product(x.reshape(rows, k).astype(jnp.float32))
            return y.astype(out_dtype).reshape(*x.shape[:-1], n)
        if self.transposed or len(self.shape) != 2 or self.spec.integers is None or (
                groups > 1 and (rows > GROUPED_ROWS or k % bk
                                 or not current().grouped_products)):
            return None
        q = self.spec.integers(self.values[...]).astype(dtype)
        xr = x.reshape(rows, groups, k // groups).astype(dtype)  # one group: bk may exceed K
        scale = expand_blocks(self._scales(self.scale[...]), groups, n, 1, bn)  # [G, N]
        zero = None if self.zero is None else expand_blocks(
            self.zero[...].astype(jnp.float32), groups, n, 1, bn)
        if groups == 1:  # a plain 2-D product (XLA:CPU's fast path takes no batch axis)
            acc = mixed_einsum("rk,kn->rn", xr[:, 0], q, jnp.float32)
            if zero is not None:
                acc = acc - jnp.sum(xr[:, 0].astype(jnp.float32), -1, keepdims=True) * zero
            y = acc * scale
        else:
            acc = mixed_einsum("rgk,gkn->rgn", xr, q.reshape(groups, k // groups, n), jnp.float32)
            if zero is not None:
                acc = acc - jnp.sum(xr.astype(jnp.float32), -1)[..., None] * zero
            y = jnp.sum(acc * scale, axis=1)
        return y.astype(out_dtype).reshape(*x.shape[:-1], n)

    def _native(self, rows: int, dtype, head: bool = False) -> bool:
        """Whether ``rlx.platform.cpu.kernels`` multiplies these values: int8 with one scale per
        output and no zero point, a decode step's few f32 rows of a 2-D kernel (``head``: of a
        transposed embedding's stored ``[d, vocab]``), on XLA:CPU."""
        return (self.spec.int8_channel and self.zero is None and self.block == (self.kn[0], 1)
                and self.transposed == head and len(self.shape) == 2 and rows <= FEW_ROWS
                and jnp.dtype(dtype) == jnp.float32 and current().few_row_products
                and cpu_kernels.available())

    def _native_product(self, x: Array, rows: int, out_dtype) -> Array:
        """``(x @ values) * scale`` by the native int8 kernel, XLA's product for gradients."""
        k, n = self.kn
        y = cpu_kernels.with_reference_gradient(
            lambda v, q, s: cpu_kernels.int8_channel_product(q, s, v),
            lambda v, q, s: (v @ q.astype(jnp.float32)) * s.reshape(1, -1).astype(v.dtype),
            x.reshape(rows, k).astype(jnp.float32), self.values[...], self.scale[...])
        return y.astype(out_dtype).reshape(*x.shape[:-1], n)

    def _native_fp4(self, rows: int, dtype) -> bool:
        """Whether the native FP4 kernel (``rlx.platform.cpu.kernels.fp4_product``) multiplies
        these values: E2M1 codes with one 1-byte scale per block (``Format.e2m1_blocks``), a
        decode step's few f32 rows of a 2-D kernel, on XLA:CPU."""
        return (self.spec.e2m1_blocks and self.zero is None and not self.transposed
                and len(self.shape) == 2 and self.scale[...].dtype.itemsize == 1
                and rows <= FEW_ROWS and jnp.dtype(dtype) == jnp.float32
                and current().few_row_products and cpu_kernels.available())

    def _scale_table(self) -> Array:
        """f32 ``[256]``: the scale each stored scale byte stands for, as ``dequantize`` applies
        it (the format's ``scale_decode``, times ``scale2`` by its ``combine_scale2``)."""
        codes = jnp.arange(256, dtype=jnp.uint8).reshape(1, 256)
        stored = self.scale[...].dtype
        if stored != jnp.uint8:  # e4m3 scales: the 256 bit patterns as that type
            codes = jax.lax.bitcast_convert_type(codes, stored)
        return self._scales(codes).reshape(256).astype(jnp.float32)

    def _native_fp4_product(self, x: Array, rows: int, out_dtype) -> Array:
        """``x @ w`` by the native FP4 kernel, XLA's product of the same values for gradients."""
        k, n = self.kn
        scale = self.scale[...]
        bits = scale if scale.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(scale, jnp.uint8)
        decode = self.spec.decode

        def reference(v, q, s, table):
            w = decode(q) * jnp.repeat(table[s.astype(jnp.int32)], k // s.shape[0], axis=0)
            return v @ w

        y = cpu_kernels.with_reference_gradient(
            lambda v, q, s, table: cpu_kernels.fp4_product(q, s, table, v), reference,
            x.reshape(rows, k).astype(jnp.float32), self.values[...], bits, self._scale_table())
        return y.astype(out_dtype).reshape(*x.shape[:-1], n)

    def _chunks(self, rows: int, dtype) -> int:
        """K rows per chunk of ``_chunked_product`` (0: not used): a decode step's few rows of a
        2-D kernel, f32 compute, on XLA:CPU; one scale group per chunk where scales are grouped,
        else the largest divisor of K up to ``CHUNK_ROWS`` (even where two rows share a byte)."""
        k, _ = self.kn
        bk = self.block[0]
        if (self.transposed or len(self.shape) != 2 or rows > FEW_ROWS
                or jnp.dtype(dtype) != jnp.float32 or not current().few_row_products):
            return 0
        if bk < k:
            return bk if k % bk == 0 and bk % 2 == 0 else 0
        return max(c for c in range(2, min(k, CHUNK_ROWS) + 1, 2) if k % c == 0) if k % 2 == 0 else 0

    def _chunked_product(self, x: Array) -> Array:
        """``x @ w`` (f32 ``[R, K]`` -> ``[R, N]``), ``CHUNK_ROWS``-ish rows of K at a time
        (``jax.lax.scan``): each chunk's stored values are decoded into a float tile that stays
        in cache and multiplied there, so the packed values are read once and no float copy of
        ``w`` is written. Grouped scales (and zero points) scale each group's partial product:
        ``sum_g s_g * (x_g @ q_g - sum(x_g) * z_g)``; channel scales scale the sum."""
        (k, n), (bk, bn), rows = self.kn, self.block, x.shape[0]
        c = self._chunks(rows, jnp.float32)
        packed = self.spec.values_per_byte
        vals = self.values[...].reshape(k // c, c // packed, n)
        xs = jnp.moveaxis(x.reshape(rows, k // c, c), 1, 0)  # [K/c, R, c]
        grouped = bk < k
        scale = expand_blocks(self._scales(self.scale[...]), -(-k // bk), n, 1, bn)  # [G, N]
        zero = None if self.zero is None else expand_blocks(
            self.zero[...].astype(jnp.float32), -(-k // bk), n, 1, bn)

        def body(acc, chunk):
            v, xc, s, z = chunk
            part = jnp.dot(xc, self._decode_values(v))  # [R, N]
            if z is not None:
                part = part - jnp.sum(xc, -1, keepdims=True) * z
            return acc + (part * s if grouped else part), None

        per_chunk = (scale, zero) if grouped else (jnp.zeros((k // c, 1)), None)
        acc, _ = jax.lax.scan(body, jnp.zeros((rows, n), jnp.float32), (vals, xs, *per_chunk))
        if grouped:
            return acc
        if zero is not None:
            acc = acc - jnp.sum(x, -1, keepdims=True) * zero
        return acc * scale

    def _decode_values(self, v: Array) -> Array:
        """Stored values (all, a chunk of rows, gathered columns) -> f32 quantized values."""
        return self.spec.decode(v)

    def leaves(self) -> dict[str, Array]:
        out = {"values": self.values[...], "scale": self.scale[...]}
        if self.zero is not None:
            out["zero"] = self.zero[...]
        if self.scale2 is not None:
            out["scale2"] = self.scale2[...]
        return out


def _storage_axes(axes, transposed: bool):
    if axes is None:
        return None
    axes = tuple(axes)
    return axes[:-2] + (axes[-1], axes[-2]) if transposed else axes


def quantize_array(w: Array, fmt: str, *, group_size: int = 64, symmetric: bool = True,
                   fp8_granularity: str = "channel", scale_dtype: str = "float32",
                   axes=None, transposed: bool = False) -> QTensor:
    """Quantize a float matrix (logical layout; ``transposed`` for ``[vocab, d]`` embeddings).

    A concrete stack of matrices (``[E, K, N]`` experts) is quantized one matrix at a time: the
    values of each matrix then do not depend on how many others are quantized with it (XLA may
    round a scale differently in a batched program), so a loader quantizing each expert as it
    reads it (``rlx.quant.loading.quantize_streamed``) gives the very same base."""
    shape = tuple(w.shape)
    if len(shape) == 3 and not isinstance(w, jax.core.Tracer):
        kw = dict(group_size=group_size, symmetric=symmetric, fp8_granularity=fp8_granularity,
                  scale_dtype=scale_dtype, transposed=transposed)
        parts = [quantize_array(w[e], fmt, **kw) for e in range(shape[0])]
        leaves = {k: jnp.stack([p.leaves()[k] for p in parts]) for k in parts[0].leaves()}
        return QTensor(fmt, shape, leaves["values"], leaves["scale"], leaves.get("zero"),
                       parts[0].block, _storage_axes(axes, transposed), transposed,
                       leaves.get("scale2"))
    k, n = (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])
    spec, params = _quantizable(fmt), Params(group_size, symmetric, fp8_granularity, scale_dtype)
    block = spec.block(shape, k, n, params)
    if spec.quantize is not None:  # the format's own two-level quantizer (NVFP4)
        leaves = spec.quantize(_matrix(w, (None, (), ()), transposed))
        return QTensor(fmt, shape, leaves["values"], leaves["scale"], None, block,
                       _storage_axes(axes, transposed), transposed, leaves.get("scale2"))
    values, scale, zero = _quantized_leaves(w, spec, params, transposed)
    return QTensor(fmt, shape, values, scale, zero, block, _storage_axes(axes, transposed),
                   transposed)


def _quantizable(fmt: str) -> formats.Format:
    """The record of a format rlx quantizes float weights into; refuses the others."""
    spec = formats.get(fmt)
    if not spec.quantizes:
        raise QuantConfigError(f"cannot quantize to format {fmt!r}")
    return spec


def _quantized_leaves(w: Array, spec: formats.Format, params: Params,
                      transposed: bool) -> tuple[Array, Array, Array | None]:
    """(values, scale, zero point) of ``quantize_array`` by qwix's three stages: the calibration
    (ranges) and the values each one compiled program per shape and format (qwix run op by op
    compiles every one of its operations for each new shape); the scales between them op by op,
    as qwix computes them: a compiled program would multiply by the reciprocal of the constant
    bound instead of dividing by it and round some scales, then values, differently. The
    format's ``how`` says what qwix computes, its ``encode`` how the values are stored."""
    how = spec.how(w.ndim, params)
    calibration = _calibrate(w, how, transposed)
    scale, zero = qarray.compute_scale_zero_point(calibration, how[0])
    if spec.scale_encode is not None:  # scales stored in the format's own encoding (E8M0)
        values, zero = _values(w, scale, zero, how, spec.encode, transposed)
        return values, spec.scale_encode(scale), zero
    scale_dtype = params.scale_dtype
    if scale_dtype != "float32":  # the values are computed with the scale as it is stored
        scale = scale.astype(_SCALE_DTYPES[scale_dtype]).astype(jnp.float32)
    values, zero = _values(w, scale, zero, how, spec.encode, transposed)
    return values, scale.astype(_SCALE_DTYPES[scale_dtype]), zero


def _matrix(w: Array, how: tuple, transposed: bool) -> Array:
    """``w`` as f32 ``[..., K, N]``, zero-padded to whole 128 x 128 tiles for fp8 blocks
    (padding never sets a maximum)."""
    x = jnp.asarray(w, jnp.float32)
    x = jnp.swapaxes(x, -1, -2) if transposed else x
    if len(how[2]) == 2:
        k, n = x.shape[-2:]
        pad = [(0, 0)] * (x.ndim - 2) + [(0, -k % 128), (0, -n % 128)]
        x = jnp.pad(x, pad)
    return x


@functools.partial(jax.jit, static_argnums=(1, 2))
def _calibrate(w: Array, how: tuple, transposed: bool) -> dict:
    qtype, channelwise, tiled, method = how
    return qarray.calibrate(_matrix(w, how, transposed), qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=channelwise, tiled_axes=dict(tiled),
        calibration_method=method))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _values(w: Array, scale: Array, zero: Array | None, how: tuple, encode,
            transposed: bool) -> tuple[Array, Array | None]:
    """The stored values (the format's ``encode``: int4 and nf4 packed two per byte) and int8
    zero points."""
    x = _matrix(w, how, transposed)
    qa = qarray.quantize_with_scale_zero_point(x, how[0], scale, zero)
    values = encode(qa.qvalue)
    if len(how[2]) == 2:  # 2-D tiles (fp8 blocks): the padding dropped
        k, n = w.shape[-1:-3:-1] if transposed else w.shape[-2:]
        values = values[..., :k, :n]
    return values, None if qa.zero_point is None else qa.zero_point.astype(jnp.int8)
