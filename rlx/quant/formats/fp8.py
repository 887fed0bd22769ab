"""Format "fp8": float8 e4m3 values, one scale per output column (``fp8_granularity="channel"``)
or per 128x128 tile (``"block128"``, ceil-divided edges, as DeepSeek-V3 / Kimi-K2 / Qwen3-FP8
ship; the tiles are calibrated on the matrix zero-padded to whole tiles, the padding dropped).

Served as its dequantized floats (``hf``), as ``fp8`` (channel: ``weight_scale``; blocks: the
DeepSeek/Qwen ``weight_scale_inv`` layout) or as compressed-tensors ``float-quantized``; the two
fp8 layouts quantize activations too (per token, or per 1x128 group for blocks).
"""

import jax.numpy as jnp
import numpy as np

from rlx.quant.formats import compressed
from rlx.quant.formats.base import Codec, Format

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


def _config(q) -> dict:
    if q.fp8_granularity == "block128":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [TILE, TILE]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return compressed.config(q, weights, acts, "float-quantized")


def _to_serving(leaves: dict, name: str, q) -> dict:
    """``X.weight`` e4m3 ``[out, in]`` and its scales: ``X.weight_scale_inv`` per tile
    (block128), ``X.weight_scale`` ``[out, 1]`` per channel."""
    key = "weight_scale_inv" if q.fp8_granularity == "block128" else "weight_scale"
    return {f"{name}.weight": np.ascontiguousarray(leaves["values"].T),
            f"{name}.{key}": np.ascontiguousarray(leaves["scale"].T)}


FP8 = Format(
    name="fp8", summary="float8 e4m3, per output column or per 128x128 tile",
    serving=("hf", "fp8", "compressed-tensors"), quantizes=True, how=_how, block=_block,
    activations="fp8", activation_mode=_mode, bytes_per_param=_bytes,
    codec=Codec(_config, _to_serving))
