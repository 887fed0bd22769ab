"""The native FP4 kernel of ``rlx.platform.cpu.kernels`` (MXFP4, NVFP4 and compressed-tensors'
NVFP4 ``QTensor`` kernels) equals ``x @ W`` within f32 summation rounding, ``W`` decoded from the
stored bytes by ml_dtypes (``float4_e2m1fn`` codes, ``float8_e4m3fn`` scales) and numpy's
``ldexp`` (E8M0 scales), not by rlx; decode products of these formats call it on XLA:CPU, and an
engine decoding an NVFP4 base keeps the learner's log-probs within 1e-5.

Bound (as ``test_cpu_kernels``): a dot product of length K summed in f32 in any order is within
``K * 2**-24 * sum_k |x_k w_k|`` of the exact sum; the kernel decodes every weight to the
dequantized f32 value (the same one rounded product ``e2m1 * scale``), so only the order of the
sums differs. Random bytes hold all 16 codes in both nibbles; a swapped nibble or a misread scale
misses the bound by orders of magnitude (and fails the golden test below). Shapes: several
blocks, K not a multiple of the 128 input rows decoded at once, N not a multiple of the 32
columns of a panel, and one matrix split over threads (``K * N >= 2**16``); rows 1 to 16.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from rlx.models import from_hf
from rlx.models.mixed import FEW_ROWS
from rlx.platform.cpu import kernels as cpu_kernels
from rlx.quant import QuantConfig, quantize_model
from rlx.quant.tensors import QTensor
from rlx.rollout.jax.engine import JaxEngine
from rlx.types import SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.parity import TOL, parity, sample_prompts
from tests.helpers.quant import check_f32_sum_bound, jitted_product

BLOCK = {"mxfp4": 32, "nvfp4": 16, "nvfp4-ct": 16}
SHAPES = {"mxfp4": [(64, 77), (608, 45), (1024, 517)], "nvfp4": [(80, 77), (1024, 517)],
          "nvfp4-ct": [(80, 77)]}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    reason = cpu_kernels.unavailable_reason()
    if reason:
        pytest.skip(f"rlx CPU kernels unavailable: {reason}")


def _scales(fmt: str, s: np.ndarray, scale2: float) -> np.ndarray:
    """Stored scale bytes -> f32 scales, by ml_dtypes / numpy: E8M0 ``2^(e - 127)``; e4m3 times
    ModelOpt's ``scale2`` or divided by compressed-tensors' global scale."""
    if fmt == "mxfp4":
        return np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32)
    e4m3 = s.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if fmt == "nvfp4":
        return e4m3 * np.float32(scale2)
    # XLA:CPU computes the dequantization's ``scale / global`` as ``scale * (1 / global)`` (a
    # correctly rounded quotient differs in the last bit for about half of these scales)
    return e4m3 * (np.float32(1) / np.float32(scale2))


def _fp4_tensor(fmt: str, k: int, n: int, seed: int = 0) -> tuple[QTensor, np.ndarray]:
    """A QTensor of random stored bytes and its ``[K, N]`` matrix decoded by ml_dtypes."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
    if fmt == "mxfp4":
        scale = rng.integers(120, 135, (k // BLOCK[fmt], n), dtype=np.uint8)
    else:
        scale = rng.uniform(0.01, 400, (k // BLOCK[fmt], n)).astype(ml_dtypes.float8_e4m3fn)
    scale2 = np.float32(0.37)
    codes = np.stack([values & 15, values >> 4], axis=1).reshape(k, n)  # row 2i: the low nibble
    e2m1 = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = _scales(fmt, scale.view(np.uint8), scale2)
    w = (e2m1 * np.repeat(s, BLOCK[fmt], axis=0)).astype(np.float32)
    t = QTensor(fmt, (k, n), jnp.asarray(values), jnp.asarray(scale), None, (BLOCK[fmt], 1), None,
                scale2=None if fmt == "mxfp4" else jnp.full((1, 1), scale2, jnp.float32))
    return t, w


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_fp4_kernel_equals_the_dequantized_product(fmt):
    for i, (k, n) in enumerate(SHAPES[fmt]):
        t, w = _fp4_tensor(fmt, k, n, seed=i)
        np.testing.assert_array_equal(np.asarray(t.dequantize()), w)  # the XLA path's values
        run, hlo = jitted_product(t)
        assert cpu_kernels.FP4 in hlo(jnp.ones((2, k), jnp.float32))
        for rows in range(1, 17) if i == 0 else (1, 3, 16):
            x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)), jnp.float32)
            check_f32_sum_bound(run(x), x, w)
            check_f32_sum_bound(jax.jit(lambda x: x @ t.dequantize())(x), x, w)


def test_fp4_kernel_golden_nibbles_and_scales():
    """One packed byte 0xB1 holds input row 0's code 0x1 (+0.5) and row 1's 0xB (-1.5). MXFP4
    with E8M0 byte 129 (2^2 = 4): x = (1, 10) gives 0.5 * 4 + 10 * (-1.5 * 4) = 2 - 60 = -58.
    NVFP4 with e4m3 byte 0x3C (1.5) and scale2 0.5: 0.5 * 0.75 + 10 * (-1.5 * 0.75) = -10.875."""
    x = jnp.zeros((1, 32), jnp.float32).at[0, :2].set(jnp.asarray([1.0, 10.0]))
    values = jnp.zeros((16, 32), jnp.uint8).at[0].set(0xB1)
    mx = QTensor("mxfp4", (32, 32), values, jnp.full((1, 32), 129, jnp.uint8), None, (32, 1), None)
    e4m3 = jax.lax.bitcast_convert_type(jnp.full((2, 32), 0x3C, jnp.uint8), jnp.float8_e4m3fn)
    nv = QTensor("nvfp4", (32, 32), values, e4m3, None, (16, 1), None,
                 scale2=jnp.full((1, 1), 0.5, jnp.float32))
    for t, want in ((mx, -58.0), (nv, -10.875)):
        run, hlo = jitted_product(t)
        assert cpu_kernels.FP4 in hlo(x)
        np.testing.assert_array_equal(np.asarray(run(x)), np.full((1, 32), want, np.float32))


def test_fp4_gradients_through_the_kernel_are_xlas():
    t, w = _fp4_tensor("nvfp4", 64, 77)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 64)), jnp.float32)
    loss = lambda x: jnp.sum(jnp.sin(t.product(x, jnp.float32, jnp.float32)))  # noqa: E731
    ref = lambda x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    assert cpu_kernels.FP4 in jax.jit(loss).lower(x).as_text()  # the kernel runs forward
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(ref)(x), atol=1e-5, rtol=0)


def _nvfp4_llama(root: str):
    """A tiny llama whose linears are NVFP4 (ModelOpt's two-level scales)."""
    model = from_hf(make_hf_model("llama", root))
    quantize_model(model, QuantConfig(format="nvfp4"))
    return model


def test_nvfp4_decode_step_calls_the_kernel(tmp_path):
    model = _nvfp4_llama(str(tmp_path))
    graph, state = nnx.split(model)
    one_token = jnp.ones((1, 1), jnp.int32)  # a decode step's one row per sequence
    run = jax.jit(lambda s, ids: nnx.merge(graph, s)(ids))
    assert cpu_kernels.FP4 in run.lower(state, one_token).compile().as_text()


@pytest.mark.slow  # 45 s on 2 cores (the engine's programs compile)
def test_nvfp4_engine_logprobs_equal_the_learners(tmp_path, monkeypatch):
    """The engine's decode traces the FP4 kernel (the real one, its calls counted), the
    learner's step dequantizes inside its matmuls; log-probs within 1e-5."""
    model = _nvfp4_llama(str(tmp_path))
    traced, kernel = [], cpu_kernels.fp4_product
    monkeypatch.setattr(cpu_kernels, "fp4_product",
                        lambda *a: traced.append(a[-1].shape) or kernel(*a))
    JaxEngine(model).generate(sample_prompts(), SamplingParams(max_new_tokens=2, seed=1))
    assert traced and all(rows <= FEW_ROWS for rows, _ in traced), traced
    monkeypatch.undo()
    sampled, scored, _ = parity(model)
    print(f"nvfp4 llama f32 engine vs learner: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL
