"""The GGUF container, opened safely: rlx's bounds checks before the ``gguf`` package parses a file.

The ``gguf`` package trusts every length a file declares (an array length past the end of the file
makes it loop without end). ``open_gguf`` first walks the header itself and checks every declared
length and count against the bytes that are left, the value and tensor type ids, the dimension
counts and that each tensor's data lies inside the file; only then does the package parse it.
Every problem raises ``GGUFError`` with the path first. What the file means (architecture,
tensors, tokenizer) is read by ``rlx.models.gguf`` and ``rlx.models.tokenizer``, which both open
files through here.

A file is parsed once per process while it is unchanged: ``open_gguf`` keeps the last few readers
(the package's parse of a real vocabulary, tens of thousands of strings, costs seconds, and a run
reads the same file for its architecture, weights and tokenizer). A kept reader is used again only
if the file's size and modification time are the same and its header bytes (everything before the
tensor data) hash the same, so a file rewritten in place is parsed again; tensor data is a
read-only map of the file either way.
"""

from __future__ import annotations

import collections
import hashlib
import math
import mmap
import os
import struct
import threading
from typing import Any

import gguf

__all__ = ["GGUFError", "open_gguf"]


class GGUFError(ValueError):
    """A GGUF file uses something this reader does not support, or lacks something it needs."""


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """The `gguf` package's reader over `path`, after rlx's bounds checks; errors name the path."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    try:
        key = os.path.abspath(path)
        return _READERS.get(key) or _READERS.put(key, _open(path))
    except GGUFError as err:
        raise GGUFError(f"{path}: {err}") from err.__cause__


class _Readers:
    """The last ``size`` readers opened, by path, each with what identifies its file's header."""

    def __init__(self, size: int) -> None:
        self.size, self.lock = size, threading.Lock()
        self.kept: collections.OrderedDict[str, tuple[tuple, gguf.GGUFReader]] = (
            collections.OrderedDict())

    def get(self, path: str) -> gguf.GGUFReader | None:
        with self.lock:
            kept = self.kept.get(path)
        if kept is None or _identity(path, kept[1].data_offset) != kept[0]:
            return None
        with self.lock:
            self.kept.move_to_end(path)
        return kept[1]

    def put(self, path: str, reader: gguf.GGUFReader) -> gguf.GGUFReader:
        identity = _identity(path, reader.data_offset)
        with self.lock:
            self.kept[path] = (identity, reader)
            self.kept.move_to_end(path)
            while len(self.kept) > self.size:
                self.kept.popitem(last=False)
        return reader


def _identity(path: str, header_bytes: int) -> tuple:
    """Size, modification time and a hash of the first ``header_bytes`` bytes of ``path``."""
    stat = os.stat(path)
    with open(path, "rb") as f:
        digest = hashlib.blake2b(f.read(header_bytes), digest_size=16).digest()
    return stat.st_size, stat.st_mtime_ns, digest


_READERS = _Readers(4)


def _open(path: str) -> gguf.GGUFReader:
    _check_layout(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OverflowError) as err:  # what the package raises
        raise GGUFError(f"not a readable GGUF file: {type(err).__name__}: {err}") from err
    if reader.byte_order != "I":
        raise GGUFError("big-endian GGUF files are not supported")
    return reader


# ------------------------------------------------------------------------------ layout checks
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by value type
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Cursor:
    """Bounds-checked little-endian reads from the start of a buffer."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int, what: str) -> int:
        left = len(self.buf) - self.at
        if n > left:
            raise GGUFError(f"file truncated or corrupt: {what} at byte {self.at} needs {n} bytes, {left} left")
        start, self.at = self.at, self.at + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at byte {start} is not valid UTF-8") from None


def _check_layout(path: str) -> None:
    """Walks the header and tensor table, checking each declared size against the file."""
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"not a GGUF file: {size} bytes is shorter than a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if cur.u32("magic") != gguf.GGUF_MAGIC:
            raise GGUFError("not a GGUF file (bad magic)")
        version = cur.u32("version")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (2, 3):
                raise GGUFError("big-endian GGUF files are not supported")
            raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_keys = cur.u64("tensor count"), cur.u64("metadata count")
        alignment, keys = gguf.GGUF_DEFAULT_ALIGNMENT, set()
        for i in range(n_keys):
            key = cur.string(f"metadata key {i} of {n_keys}")
            if key in keys:
                raise GGUFError(f"metadata key {key!r} appears twice")
            keys.add(key)
            kind = cur.u32(f"type of {key!r}")
            if key == "general.alignment":
                alignment = cur.u32(f"value of {key!r}") if kind == _UINT32 else 0
                if alignment == 0 or alignment & (alignment - 1):
                    raise GGUFError("general.alignment must be a uint32 power of two")
            else:
                _skip_value(cur, kind, key)
        tensors = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor {i} of {n_tensors}")
            n_dims = cur.u32(f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GGUFError(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
            dims = [cur.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
            qtype = cur.u32(f"type of tensor {name!r}")
            offset = cur.u64(f"data offset of tensor {name!r}")
            tensors.append((name, dims, qtype, offset))
        data_start = -(-cur.at // alignment) * alignment
        _check_tensor_extents(tensors, size - data_start)


def _skip_value(cur: _Cursor, kind: int, key: str) -> None:
    if kind in _SCALAR_SIZES:
        cur.take(_SCALAR_SIZES[kind], f"value of {key!r}")
    elif kind == _STRING:
        cur.string(f"value of {key!r}")
    elif kind == _ARRAY:
        element = cur.u32(f"element type of {key!r}")
        count = cur.u64(f"length of {key!r}")
        if element in _SCALAR_SIZES:
            cur.take(count * _SCALAR_SIZES[element], f"{count} elements of {key!r}")
        elif element == _STRING:
            if count * 8 > len(cur.buf) - cur.at:
                raise GGUFError(f"array {key!r} declares {count} strings, more than the file can hold")
            for i in range(count):
                cur.string(f"{key}[{i}]")
        else:
            raise GGUFError(f"array {key!r} has element type {element}, which is not supported")
    else:
        raise GGUFError(f"metadata {key!r} has unknown value type {kind}")


def _check_tensor_extents(tensors: list[tuple[str, list[int], int, int]], data_size: int) -> None:
    """Each tensor has a known type, whole blocks per row and data inside the file."""
    names = set()
    for name, dims, qtype, offset in tensors:
        if name in names:
            raise GGUFError(f"tensor {name!r} appears twice")
        names.add(name)
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name!r} has unknown type id {qtype}") from None
        if dims[0] % block:
            raise GGUFError(f"tensor {name!r}: row length {dims[0]} is not a multiple of the block size {block}")
        n_bytes = math.prod(dims) // block * block_bytes
        if offset + n_bytes > data_size:
            raise GGUFError(
                f"tensor {name!r} (shape {list(reversed(dims))}, {n_bytes} bytes at data offset {offset}) "
                f"extends past the end of the file (file truncated or corrupt?)"
            )
