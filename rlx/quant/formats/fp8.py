"""Format "fp8": float8 e4m3 values, one scale per output column (``fp8_granularity="channel"``)
or per 128x128 tile (``"block128"``, ceil-divided edges, as DeepSeek-V3 / Kimi-K2 / Qwen3-FP8
ship; the tiles are calibrated on the matrix zero-padded to whole tiles, the padding dropped).

Served as its dequantized floats (``hf``), as ``fp8`` (channel: ``weight_scale``; blocks: the
DeepSeek/Qwen ``weight_scale_inv`` layout) or as compressed-tensors ``float-quantized``; the two
fp8 layouts quantize activations too (per token, or per 1x128 group for blocks).
"""

import jax.numpy as jnp

from rlx.quant.formats.base import Format

TILE = 128


def _how(ndim: int, q) -> tuple:
    lead = tuple(range(ndim - 2))
    if q.fp8_granularity == "block128":
        return jnp.float8_e4m3fn, lead, ((ndim - 2, TILE), (ndim - 1, TILE)), "absmax"
    return jnp.float8_e4m3fn, lead + (ndim - 1,), (), "absmax"


def _block(shape: tuple, k: int, n: int, q) -> tuple[int, int]:
    return (TILE, TILE) if q.fp8_granularity == "block128" else (k, 1)


def _mode(q) -> str:
    return "fp8_group128" if q.fp8_granularity == "block128" else "fp8_token"


def _bytes(q, k: int, n: int) -> float:
    scales = -(-k // TILE) * -(-n // TILE) if q.fp8_granularity == "block128" else n
    return 1.0 + jnp.dtype(q.scale_dtype).itemsize * scales / (k * n)


FP8 = Format(
    name="fp8", summary="float8 e4m3, per output column or per 128x128 tile",
    serving=("hf", "fp8", "compressed-tensors"), quantizes=True, how=_how, block=_block,
    activations="fp8", activation_mode=_mode, bytes_per_param=_bytes)
