"""Zero-copy reading of safetensors files and HF sharded folders.

The ``safetensors`` package's numpy backend cannot represent bf16 or fp8 tensors, and its flax
backend materialises whole tensors on the default device. Loading a large model shard by shard
needs neither: we memory-map the file and view each tensor with the ``ml_dtypes`` dtype named in the
(documented, JSON) header, so a loader can read just the slice a device owns.
Writing goes through ``safetensors`` itself, shard by shard as the tensors come (``ShardWriter``:
an export holds one shard, never the model).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint file or folder that cannot be read as asked; the message names the file/tensor."""


_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def read_header(path: str) -> tuple[dict, int]:
    """Parse a safetensors header; returns (header dict, byte offset of the data section).

    Any malformed header raises `CheckpointError` naming the file; nothing is allocated for a
    declared length before it is checked against the file size.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} exceeds the file size {size} "
                                  "(file truncated or not a safetensors file?)")
        if n > _MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {n} is over the {_MAX_HEADER_BYTES}-byte limit")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, 5000-digit numbers, nesting
            raise CheckpointError(f"{path}: header is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    return header, 8 + n


class SafetensorsFolder(Mapping[str, np.ndarray]):
    """All tensors of one file, or of an HF folder (``model.safetensors`` or a sharded index)."""

    def __init__(self, path: str):
        files = _tensor_files(path)
        self._where: dict[str, tuple[str, dict, int]] = {}
        self.bytes_read: Counter[str] = Counter()  # tensor name -> bytes ``read`` returned of it
        for file in files:
            header, start = read_header(file)
            size = os.path.getsize(file)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                _check_entry(file, name, info, size - start)
                self._where[name] = (file, info, start)

    def __getitem__(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` mapped from its file. Each call maps just that
        tensor, and the mapping goes when the view does: a loader that copies the slice it needs
        and drops the view keeps none of the file resident (nothing counts toward its RSS)."""
        if name not in self._where:
            raise KeyError(name)
        file, info, start = self._where[name]
        lo, hi = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        if hi == lo:
            return np.zeros(info["shape"], dtype)
        return np.memmap(file, dtype=dtype, mode="r", offset=start + lo, shape=tuple(info["shape"]))

    def read(self, name: str, index: tuple = (), out: np.ndarray | None = None) -> np.ndarray:
        """A copy of ``self[name][index]`` (into ``out`` when given: an array of that shape and
        dtype, e.g. one expert's slot of a stacked buffer). Rows ``a:b`` of whole trailing
        dimensions (what a device holds when only the leading axis is split) are one contiguous
        byte range, read with one ``pread`` straight into the array (no page-by-page faults of a
        mapping, no second copy); other slices are copied out of the mapped tensor."""
        file, info, start = self._where[name]
        shape = tuple(info["shape"])
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        whole = all(isinstance(s, slice) and s.indices(d) == (0, d, 1)
                    for s, d in zip(index[1:], shape[1:]))
        contiguous = out is None or (out.flags.c_contiguous and out.flags.writeable)
        if (not shape or not whole or not isinstance(index[0], slice)
                or index[0].step not in (None, 1) or not contiguous):
            if out is None:
                out = np.array(self[name][index])
            else:
                out[...] = self[name][index]
            self.bytes_read[name] += out.nbytes
            return out
        lo, hi, _ = index[0].indices(shape[0])
        dtype = np.dtype(DTYPES[info["dtype"]])
        row = dtype.itemsize * math.prod(shape[1:])
        want = (max(hi - lo, 0),) + shape[1:]
        if out is None:
            out = np.empty(want, dtype)
        elif out.shape != want or out.dtype != dtype:
            raise ValueError(f"read({name!r}): out is {out.dtype}{list(out.shape)}, the slice "
                             f"{dtype}{list(want)}")
        if out.nbytes:
            fd = os.open(file, os.O_RDONLY)
            try:
                view, offset = memoryview(out.reshape(-1).view(np.uint8)), start + info["data_offsets"][0] + lo * row
                while len(view):
                    got = os.preadv(fd, [view], offset)
                    if not got:
                        raise CheckpointError(f"{file}: tensor {name!r} ends early (file truncated?)")
                    view, offset = view[got:], offset + got
            finally:
                os.close(fd)
        self.bytes_read[name] += out.nbytes
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def dtype_name(self, name: str) -> str:
        return self._where[name][1]["dtype"]

    def file_of(self, name: str) -> str:
        """The file that holds tensor ``name``."""
        return self._where[name][0]

    def position(self, name: str) -> tuple[str, int]:
        """(file, byte offset) of tensor ``name``: reading in this order reads each file once,
        front to back."""
        file, info, start = self._where[name]
        return file, start + info["data_offsets"][0]

    def nbytes(self, name: str) -> int:
        lo, hi = self._where[name][1]["data_offsets"]
        return hi - lo

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _tensor_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
        except (ValueError, RecursionError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid index file ({type(e).__name__}: {e})") from None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise CheckpointError(f"{index}: 'weight_map' is not a mapping of tensor names to files")
        return sorted({os.path.join(path, v) for v in weight_map.values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(
            f"{path}: no model.safetensors, model.safetensors.index.json or *.safetensors found"
        )
    return found


def _check_entry(file: str, name: str, info: Any, data_size: int) -> None:
    """The header entry of one tensor is well formed and its bytes lie inside the data section."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{file}: header entry {name!r} is not a JSON object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CheckpointError(f"{file}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    lo, hi = offsets
    n = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize  # Python ints: no overflow
    if not (0 <= lo <= hi <= data_size) or hi - lo != n:
        raise CheckpointError(
            f"{file}: tensor {name!r} offsets {lo}..{hi} do not match shape {shape} "
            f"and dtype {dtype} (file truncated or corrupt?)"
        )


class ShardWriter:
    """HF safetensors shards written as the tensors come (``add``, then ``close``): a shard is
    written once the next tensor would take it past ``max_shard_bytes`` (a tensor larger than
    that is a shard of its own), so the writer holds at most one shard's tensors at a time, never
    the model. One shard: ``model.safetensors``; more: ``model-0000i-of-0000n.safetensors`` (each
    written under a temporary name, renamed once their count is known) and
    ``model.safetensors.index.json``. ``held_bytes`` is what it holds now, ``peak_bytes`` the most
    it ever held."""

    def __init__(self, path: str, max_shard_bytes: int = 2 << 30):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.path, self.max_shard_bytes = path, max_shard_bytes
        self.held_bytes = self.peak_bytes = self.total_bytes = 0
        self._shard: dict[str, np.ndarray] = {}
        self._files: list[tuple[str, list[str]]] = []  # (temporary file, its tensor names)
        self._names: set[str] = set()

    def add(self, name: str, array: np.ndarray) -> None:
        """Take tensor ``name`` (written with the shard it falls in; no name twice)."""
        if name in self._names:
            raise ValueError(f"tensor {name!r} was already written to {self.path}")
        if self._shard and self.held_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._names.add(name)
        self._shard[name] = array
        self.held_bytes += array.nbytes
        self.total_bytes += array.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _flush(self) -> None:
        file = os.path.join(self.path, f".shard-{len(self._files) + 1:05d}.safetensors.tmp")
        _save_file(self._shard, file)
        self._files.append((file, list(self._shard)))
        self._shard, self.held_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the files, write the index (several shards); returns the
        file names."""
        if self._shard or not self._files:
            self._flush()
        n = len(self._files)
        names = (["model.safetensors"] if n == 1 else
                 [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)])
        for (tmp, _), name in zip(self._files, names):
            os.rename(tmp, os.path.join(self.path, name))
        if n > 1:
            weight_map = {t: name for (_, tensors), name in zip(self._files, names) for t in tensors}
            with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
                          f, indent=2)
        return names


def save_sharded(tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]], path: str,
                 max_shard_bytes: int = 2 << 30) -> ShardWriter:
    """Write ``tensors`` (a mapping, or ``(name, array)`` pairs streamed one at a time) as HF
    safetensors shards (+ index when more than one) into ``path`` (``ShardWriter``); returns the
    closed writer (its byte accounting)."""
    writer = ShardWriter(path, max_shard_bytes)
    for name, array in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        writer.add(name, array)
    writer.close()
    return writer


def _save_file(shard: dict[str, np.ndarray], file: str) -> None:
    """numpy writer for numpy dtypes; the flax writer for bf16/fp8 (numpy cannot name them)."""
    plain = all(a.dtype.kind in "fiub" and a.dtype.itemsize in (1, 2, 4, 8) and
                a.dtype.name in np.sctypeDict for a in shard.values())
    if plain:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in shard.items()}, file, {"format": "pt"})
    else:
        import jax.numpy as jnp
        from safetensors.flax import save_file as save_jax

        save_jax({k: jnp.asarray(v) for k, v in shard.items()}, file, {"format": "pt"})
