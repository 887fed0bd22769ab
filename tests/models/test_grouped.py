"""``rlx.models.grouped.grouped_matmul`` against ``jax.lax.ragged_dot`` on the dequantized stack
(the oracle: jax's own grouped product): values and the input gradient, for fp8 128x128 blocks
and int4 groups, with empty groups, a group spanning several tiles, single-row groups and rows
past the groups' sum (which ragged_dot leaves zero)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.models.grouped import grouped_matmul, tile_rows
from rlx.quant.tensors import quantize_array

SIZES = [
    [5, 0, 7, 3, 0, 10, 9, 6],  # m = 40, empty groups, 8-row tiles cut groups
    [0, 0, 3, 0, 2, 0, 0, 0],  # few rows, most experts empty (a decode step)
    [0, 1, 1, 0, 30, 0, 0, 1],  # one group over several tiles
]


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_matmul_equals_ragged_dot_on_the_dequantized_stack(fmt, sizes):
    rng = np.random.default_rng(0)
    e, k, n = 8, 256, 136
    w = jnp.asarray(rng.standard_normal((e, k, n)), jnp.float32)
    q = quantize_array(w, fmt, fp8_granularity="block128", group_size=64)
    gs = jnp.asarray(sizes, jnp.int32)
    m = sum(sizes) + 5  # 5 rows past the groups' sum
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    dense = q.dequantize(jnp.float32)
    want = jax.lax.ragged_dot(x, dense, gs)
    got = jax.jit(grouped_matmul)(x, q, gs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max()))
    assert not np.any(np.asarray(got[sum(sizes):]))
    ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    g_want = jax.grad(lambda x: jnp.sum(jax.lax.ragged_dot(x, dense, gs) * ct))(x)
    g_got = jax.jit(jax.grad(lambda x: jnp.sum(grouped_matmul(x, q, gs) * ct)))(x)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-4 * float(jnp.abs(g_want).max()))


def test_tile_rows_follows_the_mean_group_size():
    assert tile_rows(24, 64) == 8  # a decode step: the smallest tile
    assert tile_rows(1536, 64) == 32  # 24 rows per expert on average
    assert tile_rows(10**6, 8) == 128
