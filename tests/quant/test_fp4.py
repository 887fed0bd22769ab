"""E2M1 (FP4) values and the ``mxfp4`` format: codes against ml_dtypes' ``float4_e2m1fn`` and
transformers' table, quantization against the format's definition, storage against transformers'
own MXFP4 dequantizer, bytes per parameter."""

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from rlx.models.hf import read_hf_config
from rlx.plan.memory import state_bytes
from rlx.plan.spec import PlanSpec, abstract_model
from rlx.quant import QuantConfig, QTensor
from rlx.quant.formats import QuantConfigError, e2m1
from rlx.quant.formats.mxfp4 import MXFP4
from rlx.quant.tensors import quantize_array
from tests.helpers.fp4 import make_gpt_oss


def test_e2m1_codes_are_ml_dtypes_and_transformers():
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(e2m1.TABLE, codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.array_equal(e2m1.TABLE, np.array(FP4_VALUES, np.float32))
    assert np.array_equal(np.signbit(e2m1.TABLE), np.signbit(np.array(FP4_VALUES, np.float32)))
    values = jnp.asarray(e2m1.TABLE).astype(jnp.float4_e2m1fn)
    assert np.array_equal(np.asarray(e2m1.codes(values)), codes)


def _oracle(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 of ``[K, N]`` by its definition, in numpy: per 32 inputs of a column the scale
    ``2^ceil(log2(absmax / 6))`` (so nothing clips), values ``w / scale`` rounded to the nearest
    E2M1 (ties to even: ml_dtypes' cast); returns (f32 values, exponents)."""
    k, n = w.shape
    blocks = w.reshape(k // 32, 32, n)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    exp = np.ceil(np.log2(amax / 6.0)).astype(np.int32)
    q = (blocks / np.ldexp(1.0, exp)).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return q.reshape(k, n), exp[:, 0]


def test_mxfp4_quantizes_by_its_definition():
    w = np.random.default_rng(0).normal(size=(96, 8)).astype(np.float32)
    w[:32, 0] *= 1e3  # blocks of very different ranges
    qt = quantize_array(w, "mxfp4")
    values, exp = _oracle(w)
    assert qt.values[...].dtype == jnp.uint8 and qt.values.shape == (48, 8)
    assert qt.scale[...].dtype == jnp.uint8 and qt.scale.shape == (3, 8) and qt.block == (32, 1)
    np.testing.assert_array_equal(np.asarray(qt.scale[...]).astype(np.int32) - 127, exp)
    np.testing.assert_array_equal(np.asarray(qt.decode()), values)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()),
                                  values * np.repeat(np.ldexp(1.0, exp), 32, axis=0))


def test_mxfp4_storage_is_what_transformers_dequantizes():
    # rlx's [E, K/2, N] bytes and [E, K/32, N] exponents in gpt-oss's layout: blocks
    # [E, N, K/32, 16], scales [E, N, K/32]; transformers' convert_moe_packed_tensors returns
    # [E, K, N], which must be rlx's dequantized stack value for value
    w = np.random.default_rng(1).normal(size=(3, 64, 24)).astype(np.float32)
    qt = quantize_array(w, "mxfp4")
    vals, scale = np.asarray(qt.values[...]), np.asarray(qt.scale[...])
    blocks = vals.transpose(0, 2, 1).reshape(3, 24, 2, 16)
    ours = np.asarray(qt.dequantize())
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks.copy()),
                                        torch.from_numpy(scale.transpose(0, 2, 1).copy()),
                                        dtype=torch.float32).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_mxfp4_product_is_the_dequantized_product():
    w = np.random.default_rng(2).normal(size=(64, 16)).astype(np.float32)
    qt = quantize_array(w, "mxfp4")
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 64)).astype(np.float32))
    y = qt.product(x, jnp.float32, jnp.float32)  # a decode step's rows: chunked per block
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ qt.dequantize()), rtol=1e-5, atol=1e-5)


def test_mxfp4_refuses_inputs_not_in_blocks_of_32():
    with pytest.raises(QuantConfigError, match="not a multiple of 32"):
        quantize_array(np.zeros((48, 8), np.float32), "mxfp4")


def test_the_planner_counts_4_25_bits_per_weight(tmp_path):
    assert MXFP4.bytes_per_param(QuantConfig(format="mxfp4"), 64, 64) * 8 == 4.25
    arch = read_hf_config(make_gpt_oss(str(tmp_path), float_only=True))
    plain = PlanSpec(model=arch, quant=QuantConfig(), param_dtype="float32", dtype="float32")
    spec = dataclasses.replace(plain, quant=QuantConfig(format="mxfp4", modules="experts"))
    stacks = [t for _, t in nnx.iter_graph(abstract_model(spec)) if isinstance(t, QTensor)]
    assert stacks and all(t.fmt == "mxfp4" for t in stacks)
    # each [E, K, N] stack: 4 bytes a weight in f32, 0.5 + 1/32 in mxfp4
    saved = sum(t.shape[0] * t.kn[0] * t.kn[1] * (4 - 0.53125) for t in stacks)
    assert state_bytes(plain)["frozen"] - state_bytes(spec)["frozen"] == pytest.approx(saved)
