"""Hand-written backward passes of the decoder's layers, and the engine's KV-cache element type.

The rotary embedding's VJP (the inverse rotation) and the causal query blocks' split (cotangents
concatenated) must give autodiff's gradients of the plain formulas; the forward values are checked
against HF by ``test_hf_parity``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.models.config import RopeConfig
from rlx.models.kv_cache import cache_dtype
from rlx.kernels.attention import causal_attention, gqa_attention
from rlx.models.layers import rope_angles, rope_inv_freq, rotate
from rlx.platform import CPU, GPU, TPU


def apply_rope(x, positions, inv_freq):
    """The decoder's rotary embedding at ``positions`` (its angles, then the rotation)."""
    return rotate(x, rope_angles(positions, inv_freq))


def _hf_rope(x, positions, inv_freq):
    """HF's rotate-half formula (``q * cos + rotate_half(q) * sin``), differentiated by autodiff."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(emb) + rotated * jnp.sin(emb)


def _inputs(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("kind", ["default", "llama3"])
def test_rope_values_and_gradient_match_the_plain_formula(kind):
    x, w = _inputs((2, 11, 3, 16)), _inputs((2, 11, 3, 16), 1)
    positions = jnp.asarray(np.random.default_rng(2).integers(0, 500, (2, 11)))
    inv = rope_inv_freq(RopeConfig(theta=10000.0, kind=kind, factor=8.0), 16)
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x, positions, inv)) * w)  # noqa: E731
    np.testing.assert_allclose(apply_rope(x, positions, inv), _hf_rope(x, positions, inv),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.grad(loss(apply_rope))(x), jax.grad(loss(_hf_rope))(x),
                               rtol=1e-5, atol=1e-5)


def test_bf16_rope_is_the_f32_rotation_rounded_once():
    x = _inputs((2, 9, 2, 8)).astype(jnp.bfloat16)
    positions = jnp.tile(jnp.arange(9), (2, 1))
    inv = rope_inv_freq(RopeConfig(), 8)
    got = apply_rope(x, positions, inv)
    assert got.dtype == jnp.bfloat16
    want = _hf_rope(x.astype(jnp.float32), positions, inv).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    g = jax.grad(lambda x: jnp.sum(apply_rope(x, positions, inv).astype(jnp.float32)))(x)
    assert g.dtype == jnp.bfloat16


@pytest.mark.parametrize("t", [40, 100, 176])
def test_causal_blocks_gradients_match_one_masked_attention(t):
    b, h, kv, d = 2, 6, 2, 8
    q, k, v = _inputs((b, t, h, d)), _inputs((b, t, kv, d), 1), _inputs((b, t, kv, d), 2)
    w = _inputs((b, t, h, d), 3)
    lens = jnp.asarray([t, t - 13])
    cols = jnp.arange(t)
    real = cols[None, :] < lens[:, None]  # [b, t]
    mask = real[:, None, :] & real[:, :, None] & (cols[None, :] <= cols[:, None])[None]

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, mask) * w)

    got = jax.grad(loss(causal_attention), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(gqa_attention), (0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_kv_cache_is_f32_for_16_bit_compute_on_cpu_only():
    assert cache_dtype(jnp.bfloat16, CPU) == jnp.float32
    assert cache_dtype(jnp.float16, CPU) == jnp.float32
    assert cache_dtype(jnp.float32, CPU) == jnp.float32
    assert cache_dtype(jnp.bfloat16, GPU) == jnp.bfloat16
    assert cache_dtype(jnp.bfloat16, TPU) == jnp.bfloat16
    from rlx.models.config import ModelConfig
    from rlx.models.kv_cache import KVCache
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    cache = KVCache.zeros(cfg, 2, 5, jnp.bfloat16)  # the tests run on a CPU
    assert cache.keys[0].dtype == cache.values[0].dtype == jnp.float32


@pytest.mark.parametrize("shape,head_dim", [((2, 9), 8), ((3, 7), 6)])
def test_rope_angles_are_cos_and_sin_of_the_positions(shape, head_dim):
    """``rope_angles`` (two-trip loop over halves of the frequencies; 3 frequencies pad to 4)
    gives ``cos`` / ``sin`` exactly."""
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 4000, shape))
    inv = rope_inv_freq(RopeConfig(), head_dim)
    cos, sin = jax.jit(lambda p: rope_angles(p, inv))(positions)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    assert cos.shape == sin.shape == (*shape, 1, head_dim // 2)
    np.testing.assert_array_equal(cos[:, :, 0], jnp.cos(freqs))
    np.testing.assert_array_equal(sin[:, :, 0], jnp.sin(freqs))


def test_rotary_angles_are_evaluated_once_per_forward_pass():
    """The compiled forward and backward pass of a 2-layer model evaluate one cosine and one sine
    (each layer's queries and keys read them; XLA would fuse them into every consumer)."""
    import re

    from flax import nnx

    from rlx.models.config import ModelConfig
    from rlx.models.decoder import Precision, Transformer
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    model = Transformer(cfg, Precision(jnp.bfloat16, jnp.bfloat16), nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    ids = jnp.tile(jnp.arange(24) % 64, (2, 1))

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params).hidden_states(ids).astype(jnp.float32) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    assert len(re.findall(r" cosine\(", hlo)) == 1 and len(re.findall(r" sine\(", hlo)) == 1
