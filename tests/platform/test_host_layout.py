"""Host-side layout of checkpoint tensors for CPU devices (rlx.platform.cpu.host_layout): the word-wise
transpose equals numpy's ``.T`` for every element size, odd widths, strided outputs and casts;
slices of stacked tensors come out in rlx's orientation; and a shipped FP8-block checkpoint loads
to the same bits through the host path as through the device path (a mapping that is not a
``SafetensorsFolder`` takes the device path), on one device and on a 2 x 2 x 2 mesh."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from rlx.mesh import MeshShape, make_mesh
from rlx.platform.cpu.host_layout import (ALIGN, MAPPED_BYTES, aligned_empty, once_per_index,
                                    read_transposed, transpose_into)
from rlx.models.safetensors_io import SafetensorsFolder
from rlx.quant.loading import load_shipped
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.shipped import Scheme, write_shipped


@pytest.mark.parametrize("shape", [(3, 5), (MAPPED_BYTES // 2 + 1, 2)])  # numpy's; a mapping
def test_aligned_empty_is_taken_by_xla_cpu_without_a_copy(shape):
    a = aligned_empty(shape, ml_dtypes.bfloat16)
    assert a.shape == shape and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % ALIGN == 0
    a[...] = 1.5
    x = jax.device_put(a, jax.devices("cpu")[0])
    assert x.unsafe_buffer_pointer() == a.ctypes.data  # aliased, not copied
    assert (np.asarray(x) == np.full(shape, 1.5, ml_dtypes.bfloat16)).all()


@pytest.mark.parametrize("dtype", [np.uint8, ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16,
                                   np.float32, np.float64])
@pytest.mark.parametrize("shape", [(5, 16), (16, 24), (7, 13), (1, 8), (0, 8)])
def test_transpose_into_equals_numpy(dtype, shape):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 100, shape).astype(np.uint8).astype(np.float32).astype(dtype)
    big = np.zeros((shape[1], shape[0] + 5), dtype)
    transpose_into(src, big[:, 2:2 + shape[0]])  # a strided column block
    assert big[:, 2:2 + shape[0]].tobytes() == np.ascontiguousarray(src.T).tobytes()
    assert not big[:, :2].any() and not big[:, 2 + shape[0]:].any()


def test_transpose_into_casts_after_moving_the_bits():
    src = np.arange(32, dtype=np.float32).reshape(4, 8).astype(ml_dtypes.bfloat16)
    out = np.empty((8, 4), np.float32)
    transpose_into(src, out)
    np.testing.assert_array_equal(out, src.T.astype(np.float32))


def test_read_transposed_slices_stacked_matrices():
    """[E, n, k] stored matrices -> the [1:3, 2:7, 4:9] slice of the rlx [E, k, n] array, read
    a few stored rows at a time; the result is aligned for XLA:CPU to take as is."""
    rng = np.random.default_rng(1)
    files = {f"e{e}": rng.standard_normal((11, 9)).astype(ml_dtypes.bfloat16) for e in range(4)}

    def read(name, index, out):
        out[...] = files[name][index]
        return out

    rlx = np.stack([files[f"e{e}"].T for e in range(4)])  # [4, 9, 11]
    index = (slice(1, 3), slice(2, 7), slice(4, 9))
    for chunk in (1, 24, 1 << 20):  # 1 or 2 stored rows at a time, or all at once
        got = read_transposed(read, list(files), True, index, rlx.shape, np.float32,
                              ml_dtypes.bfloat16, chunk_bytes=chunk)
        assert got.ctypes.data % ALIGN == 0 and got.dtype == np.float32
        np.testing.assert_array_equal(got, rlx[index].astype(np.float32))


def test_once_per_index_reads_each_slice_once():
    calls = []

    def read(index):
        calls.append(index)
        return np.full((2, 2), len(calls), ml_dtypes.bfloat16)

    once = once_per_index(read)
    a, b, c = once((slice(0, 2),)), once((slice(0, 2),)), once((slice(2, 4),))
    assert len(calls) == 2 and a.tobytes() == b.tobytes() and a is not b and c[0, 0] == 2


class _Plain(Mapping):
    """A SafetensorsFolder's tensors behind a mapping that is not one (the device path)."""

    def __init__(self, folder: SafetensorsFolder):
        self._f = folder

    def __getitem__(self, name):
        return self._f[name]

    def __iter__(self):
        return iter(self._f)

    def __len__(self):
        return len(self._f)

    def __getattr__(self, attr):  # shape, dtype_name, file_of, position, nbytes
        return getattr(self._f, attr)


def test_host_and_device_paths_load_the_same_bits(tmp_path):
    path = write_shipped(make_hf_model("deepseek_v3", str(tmp_path)), str(tmp_path / "fp8"),
                         Scheme("fp8_block", ignore=("lm_head",)))
    for mesh in (None, make_mesh(MeshShape(fsdp=2, tensor=2, expert=2))):
        host = load_shipped(path, jnp.float32, mesh, param_dtype=jnp.bfloat16)[0].model
        device = load_shipped(path, jnp.float32, mesh, param_dtype=jnp.bfloat16,
                              tensors=_Plain(SafetensorsFolder(path)))[0].model
        a = dict(nnx.to_flat_state(nnx.state(host)))
        b = dict(nnx.to_flat_state(nnx.state(device)))
        assert a.keys() == b.keys() and len(a) > 30
        for k in a:
            x, y = a[k][...], b[k][...]
            assert x.dtype == y.dtype and x.sharding.is_equivalent_to(y.sharding, x.ndim), k
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), k
