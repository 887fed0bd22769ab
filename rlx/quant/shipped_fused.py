"""Checking, reading and writing back fused expert stacks a shipped layout stores quantized
(``Layout.fused``: gpt-oss's MXFP4 experts, ``rlx.quant.formats.layouts.mxfp4``).

A fused stack ``X`` (``...mlp.experts.gate_up_proj`` / ``down_proj``) is stored as ``X_blocks``
uint8 ``[E, N', K/B, B/2]`` (``B`` values per scale, two codes a byte, the even input in the low
nibble) and ``X_scales`` ``[E, N', K/B]``, ``N'`` the stack's outputs (gate_up: the gate and up
outputs interleaved, ``2N``). rlx's ``[E, K, N]`` parameter (the gate or the up half, or down)
becomes a ``QTensor`` whose leaves are those bytes rearranged, never changed: values
``[E, K/2, N]`` (row ``j`` of a column = byte ``j`` of its flattened blocks) and scales
``[E, K/B, N]``. Each device reads its slice of the file's tensors (the rows of its half and
outputs), so the host holds one slice at a time; ``write_back`` reassembles the file's tensors.
"""

from __future__ import annotations

import jax
import numpy as np

from rlx.mesh import named_sharding
from rlx.models.hf import INTERLEAVED, ParamSource, read_stored
from rlx.models.safetensors_io import CheckpointError
from rlx.platform.cpu.host_layout import once_per_index
from rlx.quant.formats.layouts import Layout
from rlx.quant.tensors import QTensor


def names(src: ParamSource, lay: Layout) -> dict[str, str]:
    """The file's tensors of a fused stack: {"values": X_blocks, "scale": X_scales}."""
    x = src.hf_names[0]
    return {"values": f"{x}_{lay.tensors.values}", "scale": f"{x}_{lay.tensors.scale}"}


def _rows(src: ParamSource, n: int) -> int:
    """The stored stack's outputs of an rlx parameter with ``n`` (a half: interleaved, twice)."""
    return 2 * n if src.layout in INTERLEAVED else n


def check_fused(tensors, src: ParamSource, shape: tuple, lay: Layout) -> None:
    """``X_blocks`` and ``X_scales`` exist with the dtypes and shapes ``lay`` and config.json
    imply for rlx parameter ``shape`` ``[E, K, N]``; errors name the file and the tensor."""
    e, k, n = shape
    b = lay.group
    t = names(src, lay)
    if k % b:
        raise CheckpointError(f"{src.hf_names[0]}: input width {k} is not a multiple of the "
                              f"{lay.method} block of {b} values")
    want = {"values": (e, _rows(src, n), k // b, b // 2), "scale": (e, _rows(src, n), k // b)}
    for leaf, name in t.items():
        if name not in tensors:
            other = next((v for v in t.values() if v in tensors), None)
            where = f"{tensors.file_of(other)}: " if other and hasattr(tensors, "file_of") else ""
            raise CheckpointError(
                f"{where}tensor {name!r} is missing: quantization_config ({lay.method}) stores "
                f"{src.hf_names[0]} quantized, and its {'scales' if leaf == 'scale' else 'blocks'} "
                "are needed")
        got, kind = tuple(tensors.shape(name)), tensors.dtype_name(name)
        if kind not in lay.tensors.values_dtypes or got != want[leaf]:
            per = f" ({2 * got[-1]} values a block; {lay.method} has {b})" if (
                leaf == "values" and len(got) == 4 and got[-1] != b // 2) else ""
            raise CheckpointError(
                f"{tensors.file_of(name)}: tensor {name!r} is {kind} {list(got)}, but "
                f"quantization_config ({lay.method}) and config.json imply "
                f"{'/'.join(lay.tensors.values_dtypes)} {list(want[leaf])}{per}")


def _reader(tensors, name: str, src: ParamSource, leaf: str, k: int, shape: tuple):
    """Callback: a device's ``index`` slice of one leaf (``shape`` ``[E, K', N]``) from the
    file's tensor ``name``: its experts and its half's outputs, as stored, laid out ``[E, K', N]``."""
    parity = INTERLEAVED.get(src.layout)

    def read(index):
        index = tuple(index) + (slice(None),) * (3 - len(index))
        lo, hi, _ = index[2].indices(shape[2])
        rows = slice(lo, hi) if parity is None else slice(2 * lo + parity, 2 * hi, 2)
        raw = read_stored(tensors, name, (index[0], rows))  # [e, n, K/B, B/2] or [e, n, K/B]
        raw = raw.reshape(raw.shape[0], raw.shape[1], -1)[:, :, index[1]]
        return np.ascontiguousarray(np.swapaxes(raw, 1, 2))
    return read


def read_fused(tensors, src: ParamSource, shape: tuple, axes, lay: Layout, mesh, rules) -> QTensor:
    """The ``QTensor`` of one fused expert parameter (rlx ``shape`` ``[E, K, N]``), each distinct
    device slice read once from the file."""
    e, k, n = shape
    leaf_shapes = {"values": (e, k // lay.format.values_per_byte, n), "scale": (e, k // lay.group, n)}
    leaves = {}
    for leaf, name in names(src, lay).items():
        s = leaf_shapes[leaf]
        sharding = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                    else named_sharding(mesh, axes, rules, s))
        read = once_per_index(_reader(tensors, name, src, leaf, k, s))
        leaves[leaf] = jax.make_array_from_callback(s, sharding, read)
    return QTensor(lay.fmt, shape, leaves["values"], leaves["scale"], None, lay.block(k, n), axes)


def write_back(parts: dict[str, QTensor], src: ParamSource, lay: Layout) -> dict[str, np.ndarray]:
    """The file's tensors of one fused stack from its rlx ``QTensor``s (``parts``: layout ->
    QTensor; gate_up: "even" and "odd", down: "copy"), byte for byte as read."""
    out = {}
    for leaf, name in names(src, lay).items():
        halves = {p: np.swapaxes(np.asarray(q.leaves()[leaf]), 1, 2) for p, q in parts.items()}
        first = next(iter(halves.values()))
        e, n, kk = first.shape
        rows = np.empty((e, n * len(halves), kk), first.dtype)
        for p, h in halves.items():
            if p in INTERLEAVED:
                rows[:, INTERLEAVED[p]::2] = h
            else:
                rows[...] = h
        out[name] = rows.reshape(e, rows.shape[1], -1, lay.group // 2) if leaf == "values" else rows
    return out


__all__ = ["check_fused", "names", "read_fused", "write_back"]
