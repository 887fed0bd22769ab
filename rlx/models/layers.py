"""Building blocks of the decoder: linear, RMSNorm, rotary embedding.

Every parameter is an ``nnx.Param`` carrying ``logical_axes`` metadata (see ``rlx.mesh``); kernels
are stored ``[in, out]``. A ``Linear`` kernel may instead be a frozen quantized tensor (``rlx.quant``:
any object with ``dequantize(dtype)`` and ``product(x, dtype, out_dtype)``), whose product reads
the packed values where it can and is dequantized inside the jitted matmul otherwise; a ``Linear`` may carry a
LoRA adapter (``lora``, called on the unquantized input and skipped when ``adapter=False``; an OFT
adapter there rotates the input of the frozen product instead, ``rlx.quant.oft``) and an
activation fake-quantizer (``act_quant``) that reproduces a W8A8 server's per-token dynamic
activation quantization with a straight-through gradient. Attention itself (its masks, the
dense, blockwise and platform kernels) lives in ``rlx.kernels.attention``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from rlx.models.hparams import RopeConfig
from rlx.models.mixed import matmul, matmul_out_in

PROJECTION = "projection"  # checkpoint name of every Linear's output (kept by train.remat='projections')


def param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str = "normal", scale: float = 0.02):
    """A parameter with logical axes; ``rngs=None`` builds zeros (weights are loaded afterwards)."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def weight_value(w, dtype) -> Array:
    """A weight in ``dtype``: a float ``nnx.Variable``, or a frozen quantized tensor dequantized here."""
    if isinstance(w, nnx.Variable):
        return w[...].astype(dtype)
    return w.dequantize(dtype)


def quantize_activations(x: Float[Array, "... d"], mode: str) -> Float[Array, "... d"]:
    """Per-token dynamic activation quantization as a W8A8 server does it, straight-through gradient.

    ``int8_token``: scale = absmax / 127, ``round(x / scale)``; ``fp8_token``: scale = absmax / 448,
    e4m3 cast; ``fp8_group128``: the fp8 rule per 128 inputs of a token (block-fp8 servers). The value
    is the dequantized activation; its gradient is the identity (``x - stop_gradient(x)`` is an exact 0).
    """
    if mode == "none":
        return x
    xf = x.astype(jnp.float32)
    d = xf.shape[-1]
    if mode == "fp8_group128":
        pad = (-d) % 128
        xf = jnp.pad(xf, [(0, 0)] * (xf.ndim - 1) + [(0, pad)]).reshape(*xf.shape[:-1], -1, 128)
    bound = 127.0 if mode == "int8_token" else 448.0
    scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / bound
    scale = jnp.where(scale > 0, scale, 1.0)
    if mode == "int8_token":
        q = jnp.clip(jnp.round(xf / scale), -128, 127) * scale
    else:
        q = jnp.clip(xf / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    q = q.reshape(*q.shape[:-2], -1)[..., :d] if mode == "fp8_group128" else q
    return jax.lax.stop_gradient(q.astype(x.dtype)) + (x - jax.lax.stop_gradient(x))


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias) (+ lora(x))`` with ``kernel: [in, out]``.

    ``kernel_layout="out_in"`` (set only by the built-in rollout engine on its own copy of float
    weights, ``rlx.rollout.jax.decode_layout``) holds the kernel transposed, ``[out, in]``, and
    multiplies it as ``(kernel @ x^T)^T`` (``rlx.models.mixed.matmul_out_in``).
    """

    def __init__(self, d_in: int, d_out: int, axes, *, bias: bool, dtype, param_dtype, rngs):
        self.kernel = param(rngs, (d_in, d_out), param_dtype, axes)
        self.bias = param(None, (d_out,), param_dtype, axes[1:], "zeros") if bias else None
        self.dtype = dtype
        self.axes = tuple(axes)
        self.lora = nnx.data(None)  # set by rlx.quant.apply_lora
        self.act_quant = "none"  # set by rlx.quant.quantize_model for W8A8 serving formats
        self.kernel_layout = "in_out"  # "out_in": kernel stored [out, in] (rollout engine copies)

    def __call__(self, x: Float[Array, "... d_in"], adapter: bool = True) -> Float[Array, "... d_out"]:
        h = x.astype(self.dtype)
        lora = adapter and self.lora is not None
        if lora and self.lora.rotates:  # OFT: the frozen product takes the rotated input
            h, lora = self.lora.rotate(h), False
        xq = quantize_activations(h, self.act_quant)
        product = matmul_out_in if self.kernel_layout == "out_in" else matmul
        # With an adapter, a low-precision base product and the adapter's stay in their f32
        # accumulators and the sum is rounded once (XLA:CPU evaluates a bf16 sum in f32 with a
        # conversion pair around every operation).
        acc = jnp.float32 if lora else self.dtype
        y = None if isinstance(self.kernel, nnx.Variable) else self.kernel.product(xq, self.dtype, acc)
        if y is None:
            y = product(xq, weight_value(self.kernel, self.dtype), self.dtype, acc)
        if self.bias is not None:
            y = y + self.bias[...].astype(acc)
        if lora:
            y = (y + self.lora(h, acc).astype(acc)).astype(self.dtype)
        return checkpoint_name(y, PROJECTION)


class RMSNorm(nnx.Module):
    """RMSNorm computed in f32, scaled by ``weight`` after casting back (as HF Llama/Qwen).

    ``centered`` (Qwen3-Next): the scale is ``1 + weight``, applied in f32 before the cast
    (``weight`` starts at zero), as transformers' ``Qwen3NextRMSNorm``."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype, centered: bool = False):
        self.weight = param(None, (dim,), param_dtype, ("norm",), "zeros" if centered else "ones")
        self.eps = eps
        self.dtype = dtype
        self.centered = centered

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(var + self.eps)
        if self.centered:
            return ((1.0 + self.weight[...].astype(jnp.float32)) * normed).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` incl. linear / llama3 / YaRN scaling (f32).

    ``head_dim`` is the rotary width (``ModelConfig.rotary_dim``: a GLM head's rotating part,
    MLA's ``qk_rope_head_dim``), as transformers computes the frequencies over that width."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim)
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


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN (Peng et al. 2023, "NTK-by-parts"): frequencies that turn fewer than ``beta_slow``
    times over the original context are divided by ``factor`` (interpolated), those turning more
    than ``beta_fast`` times are kept (extrapolated), with a linear ramp between, over the
    dimension range transformers computes (``truncate``: rounded outwards to whole dimensions).
    The temperature on cos/sin is ``RopeConfig.cos_sin_scale``, applied by ``rope_angles``."""
    def correction_dim(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # a one-dimension ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (original frequency), 0: interpolate
    wavelengths = (rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32)
    interpolated, original = 1.0 / (rope.factor * wavelengths), 1.0 / wavelengths
    return (interpolated * (1 - keep) + original * keep).astype(np.float32)


def rope_angles(positions: Int[Array, "b t"], inv_freq: np.ndarray, scale: float = 1.0
                ) -> tuple[Float[Array, "b t 1 d2"], Float[Array, "b t 1 d2"]]:
    """Cosines and sines ``[b, t, 1, rotary_dim // 2]`` (f32) of the rotary angles at
    ``positions``, both times ``scale`` (YaRN's temperature, ``RopeConfig.cos_sin_scale``).

    The decoder computes them once per forward pass and hands them to every layer. XLA counts
    cosine and sine as cheap and fuses them into every consumer, where a fused loop evaluates them
    again for each head, query and key, layer and pass (a sizeable share of a bf16 update's op
    time; an optimisation barrier does not stop it on XLA:CPU, a one-trip loop is inlined). Over
    more than one token they are therefore evaluated in a two-trip ``lax.map`` (half of the
    frequencies per trip), whose results every consumer then reads: the same values, computed once.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, t, d/2]
    if positions.shape[1] == 1:  # a decode step: a few values, nothing worth materialising
        return scale * jnp.cos(freqs)[:, :, None, :], scale * jnp.sin(freqs)[:, :, None, :]
    # split along the frequencies (never sharded), so a batch sharded over devices stays so
    (b, t, d2), half = freqs.shape, -(-freqs.shape[2] // 2)
    padded = jnp.pad(freqs, ((0, 0), (0, 0), (0, 2 * half - d2)))
    halves = jnp.moveaxis(padded.reshape(b, t, 2, half), 2, 0)  # [2, b, t, half]
    cos, sin = jax.lax.map(lambda f: (scale * jnp.cos(f), scale * jnp.sin(f)), halves)
    join = lambda a: jnp.moveaxis(a, 0, 2).reshape(b, t, 1, 2 * half)[..., :d2]  # noqa: E731
    return join(cos), join(sin)


def rotate(x: Float[Array, "b t h d"], angles: tuple[Array, Array]) -> Float[Array, "b t h d"]:
    """Rotate-half rotary embedding (HF convention: first/second halves paired) by ``angles``
    (``rope_angles``), computed in f32 and rounded once to ``x``'s dtype (HF rounds each step of a
    bf16 input; a bf16 result here is within one rounding of HF's). Angles narrower than the head
    (a partial rotary factor, GLM-4.5) rotate its leading ``2 * angles' width`` dimensions and
    pass the rest through, as transformers does.

    The backward pass is the inverse rotation (``_rotate``'s VJP). Under plain autodiff the
    rotation's transpose (slices, pads, negation, sums) ran in bf16, which XLA:CPU evaluates as f32
    with a conversion pair around every operation; the inverse rotation is one f32 pass rounded
    once, like the forward one.
    """
    rot = 2 * angles[0].shape[-1]
    if rot == x.shape[-1]:
        return _rotate(x, *angles)
    return jnp.concatenate([_rotate(x[..., :rot], *angles), x[..., rot:]], axis=-1)


def _rotation(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@jax.custom_vjp
def _rotate(x, cos, sin):
    return _rotation(x, cos, sin)


def _rotate_fwd(x, cos, sin):
    return _rotation(x, cos, sin), (cos, sin)


def _rotate_bwd(res, g):
    cos, sin = res  # the angles come from positions: no cotangent flows back to them
    return _rotation(g, cos, -sin), jnp.zeros_like(cos), jnp.zeros_like(sin)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)
