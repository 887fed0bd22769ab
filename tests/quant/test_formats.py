"""Base representations: packing, dequantization goldens, GGUF blocks exact, config refusals,
W8A8 activation fake-quantization."""

import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.models.layers import quantize_activations
from rlx.quant import QuantConfig, QuantConfigError, quantize_array
from rlx.quant.formats.gguf.blocks import KEPT, dequantize_blocks
from rlx.quant.tensors import pack_nibbles, unpack_nibbles


def test_nibble_packing_golden_and_round_trip():
    u = jnp.array([[1, 2], [15, 0], [7, 8], [3, 4]], jnp.uint8)  # [K=4, N=2]
    p = pack_nibbles(u)
    assert p.tolist() == [[0xF1, 0x02], [0x37, 0x48]]  # row 2i low nibble, row 2i+1 high nibble
    assert np.array_equal(unpack_nibbles(p), u)


def test_int4_symmetric_golden():
    # one group of 4 inputs, absmax 1.5 -> scale 1.5 / 7.5 = 0.2; 0.3/0.2 = 1.5 rounds to even 2
    w = jnp.array([[1.5], [-1.5], [0.3], [0.0]])
    q = quantize_array(w, "int4", group_size=4)
    assert np.allclose(q.scale[...], 0.2)
    assert np.allclose(q.dequantize(), [[1.4], [-1.6], [0.4], [0.0]])  # q = 7, -8, 2, 0


@pytest.mark.parametrize("fmt,kw,bound", [
    ("int8", {}, 0.01), ("int4", dict(group_size=16), 0.12), ("int4", dict(group_size=16, symmetric=False), 0.1),
    ("nf4", dict(group_size=16), 0.1), ("fp8", {}, 0.03), ("fp8", dict(fp8_granularity="block128"), 0.03),
])
def test_dequantize_error_and_storage(fmt, kw, bound):
    w = jax.random.normal(jax.random.key(0), (3, 160, 48))  # experts; K=160 not a multiple of 128
    q = quantize_array(w, fmt, **kw)
    err = float(jnp.abs(q.dequantize() - w).mean() / jnp.abs(w).mean())
    assert err < bound
    if fmt in ("int4", "nf4"):
        assert q.values[...].dtype == jnp.uint8 and q.values.shape == (3, 80, 48)  # two per byte
    if kw.get("fp8_granularity") == "block128":
        assert q.scale.shape == (3, 2, 1)  # ceil(160/128) x ceil(48/128) tiles


def test_transposed_embedding_rows():
    e = jax.random.normal(jax.random.key(1), (40, 32))
    q = quantize_array(e, "int8", transposed=True)  # one scale per vocab row
    assert q.scale.shape == (1, 40)
    assert np.allclose(q.take(jnp.array([3, 5]), jnp.float32), q.dequantize()[jnp.array([3, 5])])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_exactly_as_llama_cpp(qtype):
    x = np.random.RandomState(0).randn(6, 96).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(x, t)
    ref = gguf.quants.dequantize(blocks, t)
    out = jax.jit(dequantize_blocks, static_argnums=1)(jnp.asarray(blocks), qtype)
    assert np.array_equal(np.asarray(out), ref)


@pytest.mark.parametrize("qtype", sorted(KEPT))
def test_every_kept_gguf_block_type_decodes_bit_for_bit_as_gguf_does(qtype):
    """Random bytes are valid blocks of every type (f16 fields included: the few non-finite ones
    must come out where the reference puts them)."""
    elements, nbytes, _ = KEPT[qtype]
    blocks = np.random.RandomState(1).randint(0, 256, size=(7, 3 * nbytes)).astype(np.uint8)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    out = np.asarray(jax.jit(dequantize_blocks, static_argnums=1)(jnp.asarray(blocks), qtype))
    assert out.shape == ref.shape == (7, 3 * elements)
    assert np.isfinite(ref).mean() > 0.5
    assert np.array_equal(out, ref, equal_nan=True)


def test_mismatched_serving_format_is_refused():
    with pytest.raises(QuantConfigError, match="w8a8_int8"):
        QuantConfig(format="int4", serving="w8a8_int8")
    with pytest.raises(QuantConfigError, match="gguf"):
        QuantConfig(format="fp8", serving="gguf")
    with pytest.raises(QuantConfigError, match="symmetric"):
        QuantConfig(format="int8", symmetric=False)
    with pytest.raises(QuantConfigError, match="lm_head"):
        QuantConfig(format="int4", quantize_lm_head=True, serving="compressed-tensors")
    assert QuantConfig(format="int8", serving="w8a8_int8").activation_mode == "int8_token"
    assert QuantConfig(format="int8", serving="compressed-tensors").activation_mode == "none"
    assert QuantConfig(format="fp8", fp8_granularity="block128", serving="fp8").activation_mode == "fp8_group128"


def test_group_size_must_divide():
    with pytest.raises(QuantConfigError, match="group_size=32"):
        quantize_array(jnp.ones((48, 8)), "int4", group_size=32)


def test_int8_activation_quant_golden_and_straight_through():
    # absmax 2 -> scale 2/127; 0.5 / scale = 31.75 -> 32 -> 32 * 2 / 127
    x = jnp.array([[2.0, -1.0, 0.5]])
    y = quantize_activations(x, "int8_token")
    assert np.allclose(y, [[2.0, -64 * 2 / 127, 32 * 2 / 127]])  # -1/scale = -63.5 -> -64 (to even)
    g = jax.grad(lambda v: jnp.sum(quantize_activations(v, "int8_token") * jnp.array([1.0, 2.0, 3.0])))(x)
    assert np.array_equal(g, [[1.0, 2.0, 3.0]])  # straight-through


def test_fp8_group_activation_quant_per_128():
    x = jnp.concatenate([jnp.full((1, 128), 1000.0), jnp.full((1, 72), 0.001)], axis=-1)
    y = quantize_activations(x, "fp8_group128")
    assert y.shape == x.shape and np.allclose(y, x, rtol=1e-6)  # each group scaled on its own


@pytest.mark.parametrize("fmt,kw", [
    ("int8", {}), ("int4", dict(group_size=16)), ("fp8", {}),
    ("fp8", dict(fp8_granularity="block128")), ("int8", dict(transposed=True)),
    ("int4", dict(group_size=16, symmetric=False)),  # a zero point: the f32 path
])
def test_bf16_dequantize_has_the_f32_paths_bits(fmt, kw):
    """With bf16 scales and no zero point, ``dequantize(bf16)`` runs in bf16: bit for bit the
    f32 product rounded once (a value of <= 8 bits times a bf16 scale is exact in f32), and no
    f32 array of the matrix's size in the program (XLA would write one per expert stack)."""
    w = jax.random.normal(jax.random.key(2), (3, 160, 48)) * 0.02
    w = w[0] if kw.get("transposed") else w
    q = quantize_array(w, fmt, scale_dtype="bfloat16", **kw)
    k, n = q.kn
    ref = q.dequantize(jnp.float32).astype(jnp.bfloat16)  # computed in f32, rounded once
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.bfloat16), np.float32),
                                  np.asarray(ref, np.float32))
    jaxpr = jax.make_jaxpr(lambda: q.dequantize(jnp.bfloat16))()
    f32 = [v.aval.shape for e in jaxpr.jaxpr.eqns for v in e.outvars
           if v.aval.dtype == jnp.float32 and math.prod(v.aval.shape) >= k * n]
    assert bool(f32) == ("symmetric" in kw), f32
