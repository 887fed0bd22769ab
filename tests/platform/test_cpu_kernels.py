"""The native few-row products of ``rlx.platform.cpu.kernels`` equal ``x @ dequantize(W)`` within
f32 summation rounding, and the decode products of GGUF planar rows and int8 channel tensors
call them on XLA:CPU.

Bound (as ``test_decode_products``): a dot product of length K summed in f32 in any order is
within ``K * 2**-24 * sum_k |x_k w_k|`` of the exact sum; the kernels decode every weight to the
dequantized f32 value, so only the order of the sums differs. A wrong nibble, header, scale or
column misses the bound by orders of magnitude. Shapes cover odd N, one and several row groups
(1, 3, 16 and 32 rows, the kernels handle rows 8 / 4 / 2 / 1 at a time), a row of blocks that
is not a whole number of the 16 blocks whose scales one row of x reads at once (an odd count left
over), and a matrix large enough to be split over threads (``K * N >= 2**16``).
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.platform.cpu import kernels as cpu_kernels
from rlx.quant.formats.gguf.blocks import PLANAR, GGUFTensor, dequantize_blocks, rows_product
from rlx.quant.tensors import quantize_array
from tests.helpers.quant import check_f32_sum_bound, jitted_product

SHAPES = [(64, 77), (608, 45), (1024, 517)]  # (K, N): K multiples of 32; the last split over threads
# int8, one row of x: input rows split into parts (K not a multiple of the 4 rows taken at once)
# and, past 4096 columns, column blocks (N not a multiple of 8)
INT8_SHAPES = SHAPES + [(1030, 517), (130, 4500)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    reason = cpu_kernels.unavailable_reason()
    if reason:
        pytest.skip(f"rlx CPU kernels unavailable: {reason}")


def _gguf_blocks(qtype: str, k: int, n: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


@pytest.mark.parametrize("qtype", sorted(PLANAR))
@pytest.mark.parametrize("k,n", SHAPES)
def test_gguf_kernel_equals_the_dequantized_product(qtype, k, n):
    blocks = _gguf_blocks(qtype, k, n)
    t = GGUFTensor(qtype, (n, k), jnp.asarray(blocks), None, kernel=True)
    w = np.asarray(dequantize_blocks(jnp.asarray(blocks), qtype)).T  # [K, N]
    fn = jax.jit(cpu_kernels.gguf_product, static_argnums=1)
    for rows in (1, 3, 16, 32):
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)), jnp.float32)
        check_f32_sum_bound(fn(t.blocks[...], qtype, x), x, w)


@pytest.mark.parametrize("k,n", INT8_SHAPES)
def test_int8_channel_kernel_equals_the_dequantized_product(k, n):
    rng = np.random.default_rng(3)
    q = quantize_array(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32), "int8")
    w = np.asarray(q.dequantize())
    fn = jax.jit(cpu_kernels.int8_channel_product)
    for rows in (1, 3, 16, 32):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        check_f32_sum_bound(fn(q.values[...], q.scale[...], x), x, w)


@pytest.mark.parametrize("qtype", sorted(PLANAR))
def test_gguf_decode_products_call_the_kernel(qtype):
    t = GGUFTensor(qtype, (96, 64), jnp.asarray(_gguf_blocks(qtype, 64, 96)), None, kernel=True)
    x = jnp.ones((2, 64), jnp.float32)
    assert cpu_kernels.GGUF_TARGETS[qtype] in jitted_product(t)[1](x)
    emb = GGUFTensor(qtype, (96, 64), jnp.asarray(_gguf_blocks(qtype, 64, 96)), None, kernel=False)
    assert cpu_kernels.GGUF_TARGETS[qtype] in jitted_product(emb, head=True)[1](x)  # the tied head


def test_int8_decode_products_call_the_kernel_and_other_formats_do_not():
    w = jnp.asarray(np.random.default_rng(4).standard_normal((64, 96)) * 0.05, jnp.float32)
    x = jnp.ones((2, 64), jnp.float32)
    assert cpu_kernels.INT8_CHANNEL in jitted_product(quantize_array(w, "int8"))[1](x)
    int4 = quantize_array(w, "int4", group_size=32)
    assert cpu_kernels.INT8_CHANNEL not in jitted_product(int4)[1](x)


def test_int8_tied_head_calls_the_kernel_within_the_bound():
    """An int8 ``[vocab, d]`` embedding (``quantize_embed``, one scale per vocabulary row) used
    as the tied head multiplies a decode step's rows by its stored ``[d, vocab]`` values."""
    rng = np.random.default_rng(6)
    emb = quantize_array(jnp.asarray(rng.standard_normal((4500, 64)) * 0.05, jnp.float32), "int8",
                         transposed=True)
    w = np.asarray(emb.dequantize()).T  # [d, vocab]
    for rows in (1, 3):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        run, hlo = jitted_product(emb, head=True)
        assert cpu_kernels.INT8_CHANNEL in hlo(x)
        check_f32_sum_bound(run(x), x, w)
    assert emb.head_product(jnp.ones((33, 64), jnp.float32), jnp.float32) is None  # a prefill


@pytest.mark.parametrize("qtype", sorted(PLANAR))
def test_xla_path_kept_for_machines_without_the_kernel(qtype):
    """``rows_product`` (the path where the kernels cannot run) stays within the bound."""
    k, n = 64, 77
    blocks = _gguf_blocks(qtype, k, n)
    t = GGUFTensor(qtype, (n, k), jnp.asarray(blocks), None, kernel=True)
    w = np.asarray(dequantize_blocks(jnp.asarray(blocks), qtype)).T
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, k)), jnp.float32)
    check_f32_sum_bound(jax.jit(rows_product, static_argnums=1)(t.blocks[...], qtype, x), x, w)


def test_a_failing_compiler_raises_naming_it(tmp_path):
    with pytest.raises(RuntimeError, match="false"):
        cpu_kernels.build("false", tmp_path)


@pytest.mark.parametrize("kind", ["Q4_1", "int8"])
def test_gradients_through_a_kernel_product_are_xlas(kind):
    """A learner's few rows through a kernel product differentiate: the gradient with respect
    to the rows is the one XLA's own product gives (``with_reference_gradient``), within 1e-5."""
    k, n, rng = 64, 77, np.random.default_rng(5)
    if kind == "int8":
        t = quantize_array(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32), "int8")
    else:
        t = GGUFTensor(kind, (n, k), jnp.asarray(_gguf_blocks(kind, k, n)), None, kernel=True)
    w = t.dequantize(jnp.float32)  # [K, N]
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    loss = lambda x: jnp.sum(jnp.sin(t.product(x, jnp.float32, jnp.float32)))  # noqa: E731
    ref = lambda x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    assert "custom_call" in jax.jit(loss).lower(x).as_text()  # the kernel runs forward
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(ref)(x), atol=1e-5, rtol=0)
