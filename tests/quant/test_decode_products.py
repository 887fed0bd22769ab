"""The few-row products of a decode step read the packed weights: they equal today's
dequantize-then-multiply products within f32 rounding, and the compiled program holds no float
copy of the matrix.

Bound: a dot product of length K summed in f32 in any order is within ``K * 2**-24 * sum_k |x_k
w_k|`` of the exact sum (the standard worst-case bound); both the dequantized product and the
packed one must sit within it of the float64 product of the same dequantized weights. A wrong
nibble order, scale or zero point misses it by orders of magnitude.
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.quant.formats.gguf.blocks import PLANAR, TILE_ROWS, GGUFTensor, dequantize_blocks
from rlx.quant.tensors import CHUNK_ROWS, quantize_array
from tests.helpers.quant import check_f32_sum_bound, jitted_product

K, N = 128, 2 * TILE_ROWS  # 4 blocks of 32 per row; two tiles of output rows


def _no_float_copy(hlo: str, k: int, n: int) -> None:
    """No ``f32[k, n]`` / ``f32[n, k]`` buffer in the optimized program."""
    assert f"f32[{k},{n}]" not in hlo and f"f32[{n},{k}]" not in hlo


def _gguf(qtype: str, kernel: bool, seed: int = 0) -> tuple[GGUFTensor, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05  # [out, in]
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return GGUFTensor(qtype, (N, K), jnp.asarray(blocks), None, kernel=kernel), blocks


@pytest.mark.parametrize("qtype", sorted(PLANAR))
def test_planar_blocks_keep_the_files_bytes_and_values(qtype):
    t, blocks = _gguf(qtype, kernel=True)
    assert np.array_equal(np.asarray(t.file_blocks()), blocks)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])  # [N, K]
    assert np.array_equal(np.asarray(jax.jit(t.dequantize)()), ref.T)
    emb, _ = _gguf(qtype, kernel=False)
    ids = jnp.asarray([[3, 0, N - 1]])
    assert np.array_equal(np.asarray(emb.take(ids, jnp.float32))[0], ref[[3, 0, N - 1]])


@pytest.mark.parametrize("qtype", sorted(PLANAR))
@pytest.mark.parametrize("rows", [1, 16])
def test_gguf_few_row_product_reads_the_blocks(qtype, rows):
    t, blocks = _gguf(qtype, kernel=True)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, K)), jnp.float32)
    w = np.asarray(dequantize_blocks(jnp.asarray(blocks), qtype)).T  # [K, N]
    packed, hlo = jitted_product(t)
    check_f32_sum_bound(packed(x), x, w)
    check_f32_sum_bound(x @ jnp.asarray(w), x, w)  # today's product sits within the same bound
    _no_float_copy(hlo(x), K, N)
    emb, _ = _gguf(qtype, kernel=False)  # the same blocks as a tied head: h @ E^T
    check_f32_sum_bound(jitted_product(emb, head=True)[0](x), x, w)


def test_gguf_product_keeps_the_dequantized_path_for_many_rows_and_bf16():
    t, _ = _gguf("Q4_1", kernel=True)
    assert t.product(jnp.zeros((33, K)), jnp.float32, jnp.float32) is None  # a prefill
    assert t.product(jnp.zeros((1, K)), jnp.bfloat16, jnp.bfloat16) is None
    k_quant = GGUFTensor("Q4_K", (N, 256), jnp.zeros((N, 144), jnp.uint8), None, kernel=True)
    assert k_quant.product(jnp.zeros((1, 256)), jnp.float32, jnp.float32) is None


@pytest.mark.parametrize("fmt,kw", [
    ("int8", {}), ("int4", dict(group_size=32)), ("int4", dict(group_size=32, symmetric=False)),
    ("nf4", dict(group_size=32)), ("fp8", {})])
@pytest.mark.parametrize("rows", [1, 16])
def test_qtensor_few_row_product_reads_the_values(fmt, kw, rows):
    rng, k = np.random.default_rng(2), 2 * CHUNK_ROWS  # two chunks
    q = quantize_array(jnp.asarray(rng.standard_normal((k, N)) * 0.05, jnp.float32), fmt, **kw)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w = np.asarray(q.dequantize())
    packed, hlo = jitted_product(q)
    check_f32_sum_bound(packed(x), x, w)
    _no_float_copy(hlo(x), k, N)
