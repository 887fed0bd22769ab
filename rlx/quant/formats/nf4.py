"""Format "nf4": 4-bit NormalFloat (QLoRA's table of 16 quantiles of a normal distribution) in
groups of ``group_size`` along the input, one absmax scale per group, packed two per byte along K.

Its values are table entries, not integers: no bf16 shortcut and no product on the stored values
(``QTensor`` dequantizes it). Served as its dequantized floats (``hf``) only.
"""

import jax.numpy as jnp
import numpy as np

from rlx.quant.formats.base import Format, group_block, group_how, pack_nibbles, unpack_nibbles

TABLE = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                  -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                  0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                  0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


def _encode(values):
    return pack_nibbles(values.astype(jnp.uint8))


def _decode(v):
    return jnp.asarray(TABLE)[unpack_nibbles(v).astype(jnp.int32)]


def _bytes(q, k: int, n: int) -> float:
    return 0.5 + jnp.dtype(q.scale_dtype).itemsize / q.group_size


NF4 = Format(
    name="nf4", summary="4-bit NormalFloat in groups along the input, packed two per byte",
    serving=("hf",), quantizes=True, values_per_byte=2, grouped=True, how=group_how("nf4"),
    block=group_block, encode=_encode, decode=_decode, integers=None, bytes_per_param=_bytes)
