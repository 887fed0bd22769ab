"""Mixed-precision products (``rlx.models.mixed``): f32 is plain einsum, bit for bit; bf16 values
and gradients match an f32 reference to bf16 rounding, and stay bf16 x bf16 in the backward pass."""

import jax
import jax.numpy as jnp
import numpy as np

from rlx.models.mixed import FEW_ROWS, matmul, matmul_out_in, mixed_einsum

KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (2, 3, 16))
W = jax.random.normal(KEYS[1], (16, 8)) / 4


def _loss(fn, dtype):
    return lambda x, w: jnp.sum(jnp.cos(fn(x.astype(dtype), w.astype(dtype)).astype(jnp.float32)))


def test_f32_is_plain_einsum():
    got = jax.grad(_loss(lambda x, w: matmul(x, w, jnp.float32), jnp.float32), (0, 1))(X, W)
    want = jax.grad(_loss(lambda x, w: x @ w, jnp.float32), (0, 1))(X, W)
    for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_bf16_values_and_gradients_near_f32():
    want_y = np.asarray(X @ W)
    want = jax.grad(_loss(lambda x, w: x @ w, jnp.float32), (0, 1))(X, W)
    y = matmul(X, W, jnp.bfloat16)
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 3, 8)
    np.testing.assert_allclose(np.asarray(y, np.float32), want_y, atol=0.05, rtol=0.02)
    got = jax.grad(_loss(lambda x, w: matmul(x, w, jnp.bfloat16), jnp.bfloat16), (0, 1))(X, W)
    for g, r in zip(got, want):
        # bf16 keeps 8 bits of mantissa: 2^-8 relative per rounding, a few roundings deep
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), atol=0.08, rtol=0.05)


def test_backward_products_stay_low_precision():
    f = jax.jit(jax.grad(_loss(lambda x, w: mixed_einsum("nd,df->nf", x, w, jnp.float32),
                               jnp.bfloat16), (0, 1)))
    hlo = f.lower(X.reshape(6, 16), W).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line and "=" in line]
    assert len(dots) == 3, dots  # forward, dx, dw
    assert all("bf16" in line.split("dot_general")[1] for line in dots), dots


def test_out_in_product_equals_x_times_w_transposed_for_few_and_many_rows():
    """``matmul_out_in`` (kernel held ``[out, in]``): the barrier-transposed product up to
    ``FEW_ROWS`` rows and the plain one above give ``x @ w.T`` in f32 and bf16."""
    w = jax.random.normal(KEYS[2], (24, 16)) / 4  # [out, in]
    for rows in (1, FEW_ROWS, FEW_ROWS + 1, 3 * FEW_ROWS):
        x = jax.random.normal(KEYS[3], (rows, 1, 16))
        want = np.asarray(x @ w.T)
        hlo = jax.jit(lambda x: matmul_out_in(x, w, jnp.float32)).lower(x).as_text()
        assert ("opt-barrier" in hlo or "optimization_barrier" in hlo) == (rows <= FEW_ROWS)
        np.testing.assert_allclose(np.asarray(matmul_out_in(x, w, jnp.float32)), want, atol=1e-5)
        got = matmul_out_in(x, w, jnp.bfloat16)
        assert got.dtype == jnp.bfloat16 and got.shape == (rows, 1, 24)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.05, rtol=0.02)


def test_bf16_linear_with_adapter_rounds_its_sum_once():
    """A bf16 ``Linear`` + LoRA keeps both products' f32 accumulators and rounds the sum once: it
    equals the f32 sum of the bf16 operands' products rounded to bf16 (the adapter's rank-r
    intermediate is a product operand, so it is rounded first). Rounding the base and adapter
    products separately, then their sum, differs from that in a large share of the outputs."""
    from flax import nnx

    from rlx.models.layers import Linear
    from rlx.quant.config import LoraConfig
    from rlx.quant.lora import LoRA

    keys = jax.random.split(jax.random.key(1), 4)
    lin = Linear(64, 48, ("embed", "mlp"), bias=False, dtype=jnp.bfloat16,
                 param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    lin.lora = LoRA(64, 48, LoraConfig(rank=8, alpha=16.0, param_dtype="bfloat16"),
                    ("embed", "mlp"), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    lin.kernel[...] = (jax.random.normal(keys[0], (64, 48)) / 8).astype(jnp.bfloat16)
    lin.lora.lora_b[...] = (jax.random.normal(keys[1], (8, 48)) / 4).astype(jnp.bfloat16)
    x = jax.random.normal(keys[2], (4, 32, 64)).astype(jnp.bfloat16)
    f32 = lambda a: np.asarray(a[...], np.float32)  # noqa: E731
    xs, s = f32(x), lin.lora.scaling
    mid = f32(jnp.asarray(xs @ f32(lin.lora.lora_a)).astype(jnp.bfloat16))  # rounded operand
    base, adapter = xs @ f32(lin.kernel), s * (mid @ f32(lin.lora.lora_b))
    once = np.asarray(jnp.asarray(base + adapter).astype(jnp.bfloat16), np.float32)
    bf = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float32)  # noqa: E731
    twice = bf(bf(base) + bf(adapter))
    got = np.asarray(lin(x), np.float32)
    assert lin(x).dtype == jnp.bfloat16
    assert np.mean(got == once) >= 0.99  # f32 summation order may flip a rare rounding
    assert np.mean(twice != once) >= 0.05  # the test tells the two roundings apart
