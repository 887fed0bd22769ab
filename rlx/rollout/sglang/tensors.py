"""Full weights to SGLang servers in memory (``rollout.sglang.weight_sync = "memory"``).

SGLang (0.5.23) takes new weights inside a session, ``/begin_weight_update`` ... one or more
``/update_weights_from_tensor`` ... ``/end_weight_update``; each call carries named torch tensors
pickled as ``torch.multiprocessing`` passes them between processes (a CPU tensor travels as the
name of the shared-memory file that holds it: the ``file_system`` sharing strategy, which rlx sets
when it first stages weights). rlx cuts the HF-named tensors into buckets of at most
``sync_bucket_mb`` (a tensor larger than that is a bucket of its own), copies each bucket into one
shared-memory staging buffer and posts the bucket's tensors as views of it. A server copies every
tensor into its parameters before it answers, so the next bucket reuses the buffer: the host
holds one bucket of the model at a time plus the buffer (the size of the largest bucket, kept
for the policy's life so that its pages are not faulted in again at every update), and nothing
is written to disk.

The servers must share the learner process's host (they map its shared memory): those rlx
launches do; an attached server elsewhere needs ``weight_sync="disk"``. The pickles need
``torch`` in the learner's environment (the ``[sglang]`` extra; any build: only its CPU tensors
and pickler are used).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Iterator

import numpy as np

from rlx.errors import ConfigError

ALIGN = 64  # bytes: every tensor's view starts at a multiple of this in the staging buffer


def require_torch():
    """The ``torch`` module, or a ``ConfigError`` naming the two ways out."""
    try:
        import torch
    except ImportError:
        raise ConfigError("config.rollout.sglang.weight_sync='memory' pickles the weights as torch "
                          "tensors for SGLang: install torch in this environment (pip install "
                          "-e '.[sglang]'; a CPU build is enough) or set "
                          "config.rollout.sglang.weight_sync='disk'") from None
    return torch


def buckets(named: Iterable[tuple[str, np.ndarray]], limit_bytes: int
            ) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Consecutive groups of ``named`` of at most ``limit_bytes`` (one tensor at least)."""
    group: list[tuple[str, np.ndarray]] = []
    size = 0
    for name, value in named:
        if group and size + value.nbytes > limit_bytes:
            yield group
            group, size = [], 0
        group.append((name, value))
        size += value.nbytes
    if group:
        yield group


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SharedStaging:
    """One shared-memory buffer that each bucket is copied into (grown to the largest bucket)."""

    def __init__(self):
        self.torch = require_torch()
        self.torch.multiprocessing.set_sharing_strategy("file_system")
        self._buffer = None  # uint8 torch tensor in shared memory

    def _reserve(self, nbytes: int):
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # the old buffer's file goes before the new one is made
            self._buffer = self.torch.empty(nbytes, dtype=self.torch.uint8).share_memory_()
        return self._buffer

    def stage(self, bucket: list[tuple[str, np.ndarray]]) -> list[tuple[str, object]]:
        """The bucket copied into the buffer, as (name, torch view) pairs in its dtype and shape."""
        buffer = self._reserve(sum(_aligned(v.nbytes) for _, v in bucket))
        raw, out, offset = buffer.numpy(), [], 0
        for name, value in bucket:
            value = np.ascontiguousarray(value)
            raw[offset:offset + value.nbytes] = value.reshape(-1).view(np.uint8)
            view = buffer[offset:offset + value.nbytes].view(self._dtype(value.dtype))
            out.append((name, view.view(value.shape)))
            offset += _aligned(value.nbytes)
        return out

    def _dtype(self, dtype: np.dtype):
        name = np.dtype(dtype).name
        found = getattr(self.torch, name, None)
        if not isinstance(found, self.torch.dtype):
            raise ValueError(f"no torch dtype for weights of dtype {name}")
        return found

    def payload(self, bucket: list[tuple[str, np.ndarray]]) -> str:
        """The bucket staged and pickled (base64) as ``/update_weights_from_tensor`` reads it."""
        from multiprocessing.reduction import ForkingPickler

        out = io.BytesIO()
        ForkingPickler(out).dump(self.stage(bucket))
        return base64.b64encode(out.getvalue()).decode("ascii")


def payloads(staging: SharedStaging, named: Iterable[tuple[str, np.ndarray]], limit_bytes: int
             ) -> Iterator[str]:
    """One payload per bucket, each staged when the previous one has been sent (lazily)."""
    for bucket in buckets(named, limit_bytes):
        yield staging.payload(bucket)
