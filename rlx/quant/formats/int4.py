"""Format "int4": 4-bit integers in groups of ``group_size`` along the input, one scale per
group (symmetric absmax, or min/max with a zero point per group), packed two per byte along K
(row ``2i`` in the low nibble): stored ``u = q + 8``, read back ``q = nibble - 8``.

Served as its dequantized floats (``hf``) or as compressed-tensors ``pack-quantized`` 4-bit groups.
"""

import jax.numpy as jnp
import numpy as np

from rlx.quant.formats import compressed
from rlx.quant.formats.base import (Codec, Format, group_block, group_how, pack_nibbles,
                                    unpack_nibbles)


def _encode(values):
    return pack_nibbles(values.astype(jnp.int8) + 8)


def _decode(v):
    return unpack_nibbles(v).astype(jnp.float32) - 8.0


def _integers(v):
    return unpack_nibbles(v).astype(jnp.int8) - 8


def _bytes(q, k: int, n: int) -> float:
    zero = 0.0 if q.symmetric else 1.0
    return 0.5 + (jnp.dtype(q.scale_dtype).itemsize + zero) / q.group_size


def _config(q) -> dict:
    return compressed.config(q, compressed.int_weights(q, 4, True), None, "pack-quantized")


def _signed(values: np.ndarray) -> np.ndarray:
    """rlx packed nibbles [K/2, N] (u = q + 8) -> q int8 [K, N]."""
    both = np.stack([values & 0x0F, values >> 4], axis=-2)
    return both.reshape(2 * values.shape[0], values.shape[1]).astype(np.int8) - 8


def _to_serving(leaves: dict, name: str, q) -> dict:
    """compressed-tensors 4-bit ``pack-quantized`` groups (zero points when asymmetric)."""
    return compressed.pack_quantized(_signed(leaves["values"]), leaves, name, 4)


INT4 = Format(
    name="int4", summary="int4 in groups along the input, packed two per byte",
    serving=("hf", "compressed-tensors"), quantizes=True, values_per_byte=2, grouped=True,
    asymmetric=True, how=group_how(jnp.int4), block=group_block, encode=_encode, decode=_decode,
    integers=_integers, bytes_per_param=_bytes, codec=Codec(_config, _to_serving))
