"""Checkpoint tensors laid out on the host for CPU devices, without a compile or a second copy.

rlx stores a linear as ``[in, out]`` (experts ``[E, in, out]``) while HF files store ``[out, in]``.
On an accelerator the loader copies each device's slice as stored and transposes it on the device
(``rlx.models.hf.to_layout``, one compiled program per shape). On XLA:CPU the device is the host:
its transposes of one- and two-byte arrays run far below memory speed, and each shape costs a
compile. So where every device of a sharding is a CPU device, each device's slice is written
straight into rlx's layout here: the HF rows it needs are read a chunk at a time
(``CHUNK_BYTES``, a buffer that stays in cache) and transposed into a 64-byte aligned array,
which XLA:CPU then takes as its buffer without copying it (``jax.device_put`` aliases aligned host
memory). The file's bytes are read once, in order, and copied once. Large arrays are anonymous
mappings of their own (``aligned_empty``), so their pages follow the kernel's huge-page policy
rather than numpy's own advice.

``transpose_into`` moves 8-byte words first (a ``[r, k]`` array of 1-, 2- or 4-byte elements
viewed as ``[r, k / m]`` words of ``m`` elements, transposed), then spreads each word's ``m``
elements over ``m`` output rows: word moves and short strided copies, instead of a strided read
per byte.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence

import numpy as np

from rlx.platform.policy import policy_for

ALIGN = 64  # XLA:CPU aliases host buffers aligned to this many bytes instead of copying them
CHUNK_BYTES = 1 << 20  # HF rows read and transposed at a time
MAPPED_BYTES = 1 << 20  # arrays from this size on get an anonymous mapping of their own

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# read(name, index, out) -> out: the ``index`` slice of tensor ``name`` written into ``out``
Reader = Callable[[str, tuple, np.ndarray], np.ndarray]


def on_host(sharding) -> bool:
    """Whether the host lays tensors out for every device of ``sharding``
    (``PlatformPolicy.host_layout``: CPU devices)."""
    return all(policy_for(d.platform).host_layout for d in sharding.device_set)


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``ALIGN``-byte boundary.
    From ``MAPPED_BYTES`` on it is its own anonymous mapping (page-aligned), whose pages follow
    the kernel's transparent-huge-page policy: numpy's allocator advises huge pages for its large
    arrays whatever that policy, and where first-touched huge pages are slower to provide than
    small ones that advice slows a load down."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    if n >= MAPPED_BYTES:
        return np.frombuffer(mmap.mmap(-1, n), np.uint8).view(dtype).reshape(shape)
    raw = np.empty(n + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n].view(dtype).reshape(shape)


def uint_view(a: np.ndarray) -> np.ndarray:
    """``a``'s bits as unsigned integers of its item size (numpy copies ml_dtypes' bf16 / fp8
    element by element, integers as memory); other item sizes: ``a`` itself."""
    size = a.dtype.itemsize
    return a.view(_UINT[size]) if size in _UINT else a


def transpose_into(src: np.ndarray, out: np.ndarray, work: np.ndarray | None = None) -> None:
    """``out[...] = src.T`` for a C-contiguous ``[r, k]`` ``src`` and a ``[k, r]`` ``out`` (a
    view with any strides; another dtype casts as numpy assignment does). ``work``: a scratch
    buffer of at least ``src.nbytes`` bytes, reused across calls (a fresh temporary per chunk
    costs the kernel a page clearing each time)."""
    r, k = src.shape
    size = src.dtype.itemsize
    if work is None or work.nbytes < src.nbytes:
        work = np.empty(src.nbytes, np.uint8)
    if out.dtype != src.dtype:  # transpose the stored bits, then cast
        moved = np.empty((k, r), src.dtype)
        transpose_into(src, moved, work)
        out[...] = moved
        return
    if size in _UINT:  # copy bits: numpy copies ml_dtypes' bf16 / fp8 element by element
        src, out = src.view(_UINT[size]), out.view(_UINT[size])
    m = 8 // size if size in (1, 2, 4) else 1
    if m == 1 or k % m or not src.flags.c_contiguous or r == 0:
        out[...] = src.T
        return
    words = work[:src.nbytes].view(np.uint64).reshape(k // m, r)
    np.copyto(words, src.view(np.uint64).T)  # [k/m, r]: whole words moved
    parts = words.view(src.dtype).reshape(k // m, r, m)  # element j of each word -> row j mod m
    for j in range(m):
        out[j::m] = parts[:, :, j]


def copy_bits(src: np.ndarray) -> np.ndarray:
    """An aligned copy of ``src``, copied as bytes (numpy copies ml_dtypes' bf16 / fp8 element
    by element)."""
    out = aligned_empty(src.shape, src.dtype)
    out.reshape(-1).view(np.uint8)[:] = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    return out


def once_per_index(read: Callable[[tuple], np.ndarray]) -> Callable[[tuple], np.ndarray]:
    """``read`` for one ``jax.make_array_from_callback``, reading each distinct slice once:
    devices of this process that hold the same slice (a replicated axis) get copies of it."""
    done: dict[tuple, np.ndarray] = {}

    def once(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)
        if key in done:
            return copy_bits(done[key])
        done[key] = read(index)
        return done[key]
    return once


def _bounds(s: slice, size: int) -> tuple[int, int]:
    lo, hi, step = s.indices(size)
    if step != 1:
        raise ValueError(f"a device slice with step {step}")
    return lo, max(lo, hi)


def read_transposed(read: Reader, names: Sequence[str], stacked: bool, index: tuple,
                    shape: tuple, dtype, stored, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """The ``index`` slice of an rlx ``[..., k, n]`` array (``shape``; stacked: ``[E, k, n]``,
    expert ``e`` from tensor ``names[e]``, else the one tensor ``names[0]``) whose HF tensors are
    ``[n, k]`` of dtype ``stored``, as an aligned ``dtype`` array in rlx's layout."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if stacked:
        e0, e1 = _bounds(index[0], shape[0])
        chosen = [names[e] for e in range(e0, e1)]
    else:
        chosen = [names[0]]
    k0, k1 = _bounds(index[-2], shape[-2])
    n0, n1 = _bounds(index[-1], shape[-1])
    lead = (len(chosen),) if stacked else ()
    out = aligned_empty(lead + (k1 - k0, n1 - n0), dtype)
    stored = np.dtype(stored)
    rows = max(1, chunk_bytes // max(1, stored.itemsize * (k1 - k0)))
    scratch = np.empty((min(rows, n1 - n0), k1 - k0), stored)
    work = np.empty(scratch.nbytes, np.uint8)
    for i, name in enumerate(chosen):
        target = out[i] if stacked else out
        for a in range(n0, n1, rows):
            b = min(n1, a + rows)
            got = read(name, (slice(a, b), slice(k0, k1)), scratch[:b - a])
            transpose_into(got, target[:, a - n0:b - n0], work)
    return out


def read_direct(read: Reader, name: str, index: tuple, shape: tuple, dtype, stored) -> np.ndarray:
    """The ``index`` slice of tensor ``name`` (stored as ``stored``) as an aligned ``dtype``
    array: read straight into it when the dtypes agree."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    want = tuple(hi - lo for lo, hi in (_bounds(s, d) for s, d in zip(index, shape)))
    out = aligned_empty(want, dtype)
    if np.dtype(stored) == out.dtype:
        return read(name, index, out)
    out[...] = read(name, index, np.empty(want, stored))
    return out


__all__ = ["ALIGN", "CHUNK_BYTES", "aligned_empty", "copy_bits", "on_host", "once_per_index",
           "read_direct", "read_transposed", "transpose_into"]
