"""A base format is a plugin: one defined in this file only ("int8_tensor": int8 values with a single
absmax scale for the whole matrix), registered with ``rlx.quant.formats.register``, is accepted by
the config, quantizes and loads a checkpoint, trains one step of a tiny run, exports for serving
("hf": the dequantized floats) and plans, with no edit anywhere else.

Hand-derived golden of the format, for ``w = [[0.5, -1.0], [0.25, 2.0]]``: absmax 2.0, scale
2.0 / 127.5 = 0.0156862... (qwix's int8 bound is 127.5, so that -128 is used); values
round(w / scale) = round([[31.875, -63.75], [15.9375, 127.5]]) = [[32, -64], [16, 128]], clipped
to int8: [[32, -64], [16, 127]]; dequantized: values x scale.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.errors import ConfigError
from rlx.io.export import export_base
from rlx.models import from_hf
from rlx.models.hf import read_hf_config
from rlx.models.loading import ModelSection
from rlx.plan.memory import state_bytes
from rlx.plan.spec import PlanSpec, abstract_model
from rlx.quant import QuantConfig, QTensor, apply_lora, load_base, quantize_array, quantize_model
from rlx.quant import formats
from rlx.quant.config import LoraConfig
from rlx.quant.formats import Format
from rlx.run.build import build
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import ids
from tests.helpers.runs import run_config

NAME = "int8_tensor"


def _how(ndim: int, q) -> tuple:
    """qwix: int8, absmax over the whole matrix (only leading stack axes keep their own scale)."""
    return jnp.int8, tuple(range(ndim - 2)), (), "absmax"


def _block(shape: tuple, k: int, n: int, q) -> tuple[int, int]:
    return (k, n)  # one scale covers the whole [K, N] matrix


def _bytes(q, k: int, n: int) -> float:
    return 1.0 + jnp.dtype(q.scale_dtype).itemsize / (k * n)


INT8_TENSOR = Format(name=NAME, summary="int8, one scale per matrix", serving=("hf",),
                     quantizes=True, how=_how, block=_block, bytes_per_param=_bytes)


@pytest.fixture
def int8_tensor():
    formats.register(INT8_TENSOR)
    try:
        yield INT8_TENSOR
    finally:
        formats.unregister(NAME)
    assert NAME not in formats.names()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _numpy_int8_tensor(w: np.ndarray) -> tuple[np.ndarray, np.float32]:
    scale = np.float32(np.abs(w).max()) / np.float32(127.5)
    return np.clip(np.rint(w / scale), -128, 127).astype(np.int8), scale


def test_the_format_is_a_choice_only_while_registered(int8_tensor):
    assert NAME in formats.names() and QuantConfig(format=NAME).spec is int8_tensor
    with pytest.raises(ConfigError, match=r"serving='w8a8_int8' cannot serve a 'int8_tensor' base"):
        QuantConfig(format=NAME, serving="w8a8_int8")
    with pytest.raises(ValueError, match="already registered"):
        formats.register(INT8_TENSOR)


def test_unregistered_it_is_refused():
    with pytest.raises(ConfigError, match=r"format='int8_tensor' is not one of \['none', 'int8'"):
        QuantConfig(format=NAME)


def test_values_and_dequantized_matrix_equal_numpy(int8_tensor):
    golden = quantize_array(jnp.asarray([[0.5, -1.0], [0.25, 2.0]]), NAME)
    assert np.array_equal(np.asarray(golden.values[...]), [[32, -64], [16, 127]])
    assert np.asarray(golden.scale[...]).item() == np.float32(2.0) / np.float32(127.5)
    w = np.random.RandomState(0).randn(48, 32).astype(np.float32)
    qt = quantize_array(jnp.asarray(w), NAME)
    values, scale = _numpy_int8_tensor(w)
    assert qt.block == (48, 32) and qt.scale[...].shape == (1, 1)
    assert np.array_equal(np.asarray(qt.values[...]), values)
    assert np.array_equal(np.asarray(qt.dequantize()), values.astype(np.float32) * scale)
    x = np.random.RandomState(1).randn(3, 48).astype(np.float32)  # the product on stored values
    y = np.asarray(qt.product(jnp.asarray(x), jnp.float32, jnp.float32))
    np.testing.assert_allclose(y, x @ (values.astype(np.float32) * scale), rtol=1e-5, atol=1e-5)


def test_a_float_checkpoint_loads_quantized_while_read(int8_tensor, zoo):
    folder = make_hf_model("llama", zoo)
    q = QuantConfig(format=NAME)
    loaded, resolved = load_base(ModelSection(path=folder), q)
    whole = quantize_model(from_hf(folder), q)
    assert resolved == q
    kernels = [t for _, t in nnx.iter_graph(loaded.model) if isinstance(t, QTensor)]
    assert kernels and all(k.fmt == NAME for k in kernels)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(loaded.model)),
                                 nnx.to_flat_state(nnx.state(whole))):
        assert np.array_equal(np.asarray(a[...]), np.asarray(b[...])), path
    x = jnp.asarray(ids())
    assert np.array_equal(np.asarray(loaded.model(x)), np.asarray(whole(x)))


def test_a_tiny_lora_run_trains_one_step(int8_tensor, tmp_path):
    run = build(run_config("tiny", tmp_path, **{"quant.format": NAME, "train.steps": 1,
                                                "mesh.data": 8}), progress=False)
    try:
        frozen = nnx.to_flat_state(run.compiled.state.frozen)
        scales = [v[...] for p, v in frozen if p[-1] == "scale"]
        assert scales and all(s.shape[-2:] == (1, 1) for s in scales)  # one scale per matrix
        assert all(v[...].dtype == jnp.int8 for p, v in frozen if p[-1] == "values")
        before = [np.asarray(x) for x in jax.tree.leaves(run.compiled.state.params)]
        record = run.step()
        after = [np.asarray(x) for x in jax.tree.leaves(run.compiled.state.params)]
        assert np.isfinite(record["learner/loss"])
        assert any(not np.array_equal(a, b) for a, b in zip(before, after))  # adapters moved
    finally:
        run.close()


def test_exported_for_serving_as_dequantized_floats(int8_tensor, zoo, tmp_path):
    q = QuantConfig(format=NAME)
    model = quantize_model(from_hf(make_hf_model("llama", zoo)), q)
    apply_lora(model, LoraConfig(rank=2), nnx.Rngs(0))
    out = export_base(model, q, str(tmp_path / "base"), "v1")
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    served = from_hf(out)
    w = model.layers[0].self_attn.q_proj.kernel
    values, scale = np.asarray(w.values[...]), np.asarray(w.scale[...]).item()
    assert np.array_equal(np.asarray(served.layers[0].self_attn.q_proj.kernel[...]),
                          values.astype(np.float32) * np.float32(scale))
    x = jnp.asarray(ids())  # the same weights; the base's product sums in another order
    np.testing.assert_allclose(np.asarray(served(x)), np.asarray(model(x, adapter=False)),
                               rtol=1e-5, atol=1e-5)


def test_the_planner_counts_the_declared_bytes_per_parameter(int8_tensor, zoo):
    arch = read_hf_config(make_hf_model("llama", zoo))
    plain = PlanSpec(model=arch, quant=QuantConfig(), param_dtype="float32", dtype="float32")
    spec = dataclasses.replace(plain, quant=QuantConfig(format=NAME))
    kernels = [t for _, t in nnx.iter_graph(abstract_model(spec)) if isinstance(t, QTensor)]
    assert kernels and all(t.fmt == NAME for t in kernels)
    saved = sum(t.kn[0] * t.kn[1] * (4 - int8_tensor.bytes_per_param(spec.quant, *t.kn))
                for t in kernels)
    assert state_bytes(plain)["frozen"] - state_bytes(spec)["frozen"] == pytest.approx(saved)
