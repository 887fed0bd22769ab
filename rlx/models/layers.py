"""Building blocks of the decoder: linear, RMSNorm, rotary embedding, masked GQA attention.

Every parameter is an ``nnx.Param`` carrying ``logical_axes`` metadata (see ``rlx.mesh``); kernels
are stored ``[in, out]``. Attention takes explicit per-token ``positions`` and ``segment_ids`` so that
left/right padded and packed batches are exact: token ``i`` attends to token ``j`` iff ``j <= i``
and both carry the same non-zero segment id (0 marks padding).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rlx.models.config import RopeConfig

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str = "normal", scale: float = 0.02):
    """A parameter with logical axes; ``rngs=None`` builds zeros (weights are loaded afterwards)."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with ``kernel: [in, out]``."""

    def __init__(self, d_in: int, d_out: int, axes, *, bias: bool, dtype, param_dtype, rngs):
        self.kernel = param(rngs, (d_in, d_out), param_dtype, axes)
        self.bias = param(None, (d_out,), param_dtype, axes[1:], "zeros") if bias else None
        self.dtype = dtype

    def __call__(self, x: Float[Array, "... d_in"]) -> Float[Array, "... d_out"]:
        y = jnp.einsum("...d,df->...f", x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm computed in f32, scaled by ``weight`` after casting back (as HF Llama/Qwen)."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.weight = param(None, (dim,), param_dtype, ("norm",), "ones")
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * normed


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` incl. llama3 / linear scaling (f32)."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind != "llama3":
        return inv
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: Float[Array, "b t h d"], positions: Int[Array, "b t"], inv_freq: np.ndarray
) -> Float[Array, "b t h d"]:
    """Rotate-half rotary embedding (HF convention: first/second halves paired)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, t, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [b, t, 1, d]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention_mask(
    q_segments: Int[Array, "b t"], kv_segments: Int[Array, "b s"],
    q_positions: Int[Array, "b t"], kv_positions: Int[Array, "b s"],
) -> Bool[Array, "b t s"]:
    """Causal-by-position, same-segment, non-padding mask."""
    same = q_segments[:, :, None] == kv_segments[:, None, :]
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    real = (q_segments[:, :, None] != 0) & (kv_segments[:, None, :] != 0)
    return same & causal & real


def gqa_attention(
    q: Float[Array, "b t h d"], k: Float[Array, "b s kv d"], v: Float[Array, "b s kv d"],
    mask: Bool[Array, "b t s"],
) -> Float[Array, "b t h d"]:
    """Grouped-query softmax attention; scores and softmax in f32."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)  # [b, t, kv, g, d]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [b, kv, g, t, s]
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)
