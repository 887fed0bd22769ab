"""Rollouts as JSON, exactly: what a checkpoint records of the batches in flight.

A one-step-off (or deeper) run has batches generated ahead of the learner; a checkpoint records
their progress (``RolloutQueue.snapshot``): a finished batch's rollouts, or each completion's
tokens so far (``rollout.partial``), so that a resumed run trains on the very rollouts the
uninterrupted run trains on. Arrays travel as dtype, shape and base64 of their bytes (bit-exact,
float32 log-probs included); every other field of ``Rollout`` as its JSON value.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np

from rlx.types import Rollout


def encode_array(x: np.ndarray) -> dict[str, Any]:
    x = np.ascontiguousarray(x)
    return {"dtype": x.dtype.str, "shape": list(x.shape),
            "bytes": base64.b64encode(x.tobytes()).decode("ascii")}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    data = base64.b64decode(d["bytes"])
    return np.frombuffer(data, np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def encode_rollout(r: Rollout) -> dict[str, Any]:
    """Every field of ``r``: arrays encoded (``encode_array``), the rest as they are."""
    out = {}
    for field in dataclasses.fields(r):
        value = getattr(r, field.name)
        out[field.name] = {"array": encode_array(value)} if isinstance(value, np.ndarray) else value
    return out


def decode_rollout(d: dict[str, Any]) -> Rollout:
    return Rollout(**{k: decode_array(v["array"]) if isinstance(v, dict) and "array" in v else v
                      for k, v in d.items()})


__all__ = ["decode_array", "decode_rollout", "encode_array", "encode_rollout"]
