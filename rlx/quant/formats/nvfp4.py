"""Format "nvfp4": NVIDIA's FP4 as ModelOpt exports it. E2M1 values (``rlx.quant.formats.e2m1``)
in blocks of 16 along the input, each block's scale a float8 e4m3, and one f32 scale per matrix
over them (``weight_scale_2``), packed two codes a byte along K (even element in the low nibble)::

    w[k, n] = e2m1(code[k, n]) * scale[k // 16, n] * scale2

4.5 bits per weight. Quantized from float weights as ModelOpt does: ``scale2 = amax / (6 * 448)``
over the matrix, each block's ``scale = e4m3(block_amax / (6 * scale2))`` (a zero block: 1), the
values ``w / (scale * scale2)`` rounded to the nearest E2M1 (ties to even). compressed-tensors
stores the reciprocal of ``scale2`` as its ``weight_global_scale`` (``2688 / amax``) and divides by
it: its layout's values are format "nvfp4-ct" (the same storage, ``w = e2m1 * (scale / global)``,
read from checkpoints only).
The learner's product is W4A16: values dequantized inside the jitted matmul, activations not
quantized. SGLang serves these checkpoints as ``modelopt_fp4`` on Blackwell GPUs with FP4
activations (W4A4, ``input_scale``); rlx neither quantizes activations nor serves the layout
quantized (``hf`` floats only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlx.quant.formats import e2m1
from rlx.quant.formats.base import Format, QuantConfigError

BLOCK = 16  # values per e4m3 scale
E4M3_MAX = 448.0


def _block(shape: tuple, k: int, n: int, q) -> tuple[int, int]:
    if k % BLOCK:
        raise QuantConfigError(f"nvfp4 scales blocks of {BLOCK} inputs; the input dimension {k} "
                               f"of a {shape} matrix is not a multiple of {BLOCK}")
    return (BLOCK, 1)


@functools.partial(jax.jit)
def quantize(x: jax.Array) -> dict[str, jax.Array]:
    """ModelOpt's NVFP4 of an f32 ``[K, N]`` matrix: {"values": uint8 ``[K/2, N]``, "scale": e4m3
    ``[K/16, N]``, "scale2": f32 ``[1, 1]``}."""
    k, n = x.shape
    amax = jnp.max(jnp.abs(x))
    scale2 = jnp.where(amax > 0, amax / (e2m1.MAX * E4M3_MAX), 1.0).reshape(1, 1)
    blocks = x.reshape(k // BLOCK, BLOCK, n)
    per_block = jnp.max(jnp.abs(blocks), axis=1) / (e2m1.MAX * scale2)  # [K/16, N]
    scale = jnp.where(per_block == 0, 1.0, per_block).astype(jnp.float8_e4m3fn)
    full = scale.astype(jnp.float32)[:, None, :] * scale2  # [K/16, 1, N]
    values = jnp.clip(blocks / full, -e2m1.MAX, e2m1.MAX).reshape(k, n)
    return {"values": e2m1.encode(values), "scale": scale, "scale2": scale2.astype(jnp.float32)}


def _bytes(q, k: int, n: int) -> float:
    return 0.5 + 1.0 / BLOCK + 4.0 / (k * n)


NVFP4 = Format(
    name="nvfp4", summary="E2M1 (FP4) in blocks of 16 along the input, e4m3 block scales, one "
    "f32 scale per matrix", serving=("hf",), quantizes=True, values_per_byte=2, block=_block,
    decode=e2m1.decode, integers=None, quantize=quantize, bytes_per_param=_bytes, e2m1_blocks=True)


def _over(scale: jax.Array, global_scale: jax.Array) -> jax.Array:
    """compressed-tensors' convention: block scales divided by the global scale."""
    return scale / global_scale


NVFP4_CT = Format(
    name="nvfp4-ct", summary="NVFP4 as compressed-tensors stores it (E2M1, e4m3 block scales of "
    "16, divided by a per-matrix f32 weight_global_scale); read from checkpoints only",
    serving=("hf",), values_per_byte=2, block=_block, decode=e2m1.decode, integers=None,
    combine_scale2=_over, bytes_per_param=_bytes, e2m1_blocks=True)
