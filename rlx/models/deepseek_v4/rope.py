"""DeepSeek-V4's rotary embedding: interleaved pairs ``(x0, x1), (x2, x3), ...`` on the *trailing*
``rope_dim`` channels of a head (the leading ones pass through), with two frequency tables:
``main`` (``rope_theta``, plain) for sliding-window layers and ``compress`` (``compress_rope_theta``,
optionally YaRN with cos/sin unscaled unless ``attention_factor`` is given, as transformers
forces it to 1) for the compressed layers, their compressors and the indexer. The attention
output's rope channels are rotated back (``sin`` negated) at the query's position, since keys
double as values.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rlx.models.hparams import RopeConfig
from rlx.models.layers import rope_inv_freq

Angles = tuple[Array, Array]  # cos, sin [b, t, rope_dim // 2] (f32)


def inv_freq(rope: RopeConfig, rope_dim: int) -> np.ndarray:
    """Frequencies ``[rope_dim // 2]`` of a table (``rlx.models.layers.rope_inv_freq``)."""
    return rope_inv_freq(rope, rope_dim)


def angles(positions: Int[Array, "b t"], freqs: np.ndarray, scale: float) -> Angles:
    """``scale * cos``, ``scale * sin`` of ``positions * freqs``."""
    f = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
    return scale * jnp.cos(f), scale * jnp.sin(f)


def rotate_tail(x: Float[Array, "b t h d"], cos, sin) -> Float[Array, "b t h d"]:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` (pairs interleaved) by the
    angles ``[b, t, r/2]``, in f32, rounded once to ``x``'s dtype."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:].astype(jnp.float32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
