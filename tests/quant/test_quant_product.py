"""A quantized kernel's product reads its stored values: equal to the dequantized product, and the
matrix of scaled values is never formed."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from rlx.models.layers import Linear
from rlx.platform import active, current
from rlx.quant import tensors
from rlx.quant.tensors import quantize_array

K, N = 256, 384
FORMATS = [("int8", {}), ("int8", {"symmetric": False}), ("fp8", {}),
           ("fp8", {"fp8_granularity": "block128"}), ("int4", {"group_size": 64}),
           ("int4", {"group_size": 64, "symmetric": False})]
NARROW = (32, 96)  # K below one 128x128 tile: fp8 block128 has one K-group wider than K


@pytest.fixture
def grouped_here():
    """Grouped scales run inside the product on accelerators only; in f32 the CPU runs that path
    too, under its policy with ``grouped_products`` on."""
    with active(dataclasses.replace(current(), grouped_products=True)):
        yield


def _qtensor(fmt, kw):
    w = jax.random.normal(jax.random.key(0), (K, N)) * 0.05
    return quantize_array(w, fmt, **kw)


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=[f"{f}-{sorted(k.values())}" for f, k in FORMATS])
@pytest.mark.parametrize("rows", [(1,), (3, 5)])
def test_product_equals_dequantized_product(grouped_here, fmt, kw, rows):
    q = _qtensor(fmt, kw)
    x = jax.random.normal(jax.random.key(1), (*rows, K))
    y = q.product(x, jnp.float32, jnp.float32)
    ref = x @ q.dequantize(jnp.float32)
    assert y is not None and y.shape == ref.shape
    assert float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))) <= 1e-5


@pytest.mark.parametrize("fmt,kw", [("int8", {}), ("fp8", {})])
def test_channel_product_never_forms_the_scaled_matrix(fmt, kw):
    q = _qtensor(fmt, kw)
    graphdef, state = nnx.split(q)
    fn = jax.jit(lambda x, st: nnx.merge(graphdef, st).product(x, jnp.bfloat16, jnp.float32))
    text = fn.lower(jnp.ones((4, K), jnp.bfloat16), state).as_text()
    products = [ln for ln in text.splitlines() if "multiply" in ln]
    assert products and not [ln for ln in products if f"{K}x{N}" in ln], products
    assert any(f"tensor<4x{N}xf32>" in ln for ln in products)  # the scale meets the accumulator


def test_one_tile_wider_than_the_matrix():
    w = jax.random.normal(jax.random.key(3), NARROW) * 0.05
    q = quantize_array(w, "fp8", fp8_granularity="block128")
    x = jax.random.normal(jax.random.key(4), (2, 9, NARROW[0]))
    y, ref = q.product(x, jnp.float32, jnp.float32), x @ q.dequantize(jnp.float32)
    assert float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))) <= 1e-5


def test_grouped_product_keeps_the_dequantized_path_for_many_rows(grouped_here):
    q = _qtensor("int4", {"group_size": 64})
    assert q.product(jnp.ones((tensors.GROUPED_ROWS, K)), jnp.float32, jnp.float32) is not None
    assert q.product(jnp.ones((tensors.GROUPED_ROWS + 1, K)), jnp.float32, jnp.float32) is None


def test_linear_with_a_quantized_kernel_uses_it():
    lin = Linear(K, N, ("embed", "mlp"), bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs=nnx.Rngs(0))
    lin.kernel = _qtensor("int8", {})
    x = jax.random.normal(jax.random.key(2), (2, 3, K))
    ref = x @ lin.kernel.dequantize(jnp.float32)
    assert float(jnp.max(jnp.abs(lin(x) - ref)) / jnp.max(jnp.abs(ref))) <= 1e-5
