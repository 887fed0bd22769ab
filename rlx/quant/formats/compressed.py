"""The compressed-tensors layouts the formats write (``pack-quantized`` integers, ``float-quantized``
fp8): the ``quantization_config`` they share and the int32 packing of integer values.

``X.weight_packed`` int32 ``[out, in*bits/32]`` holds ``32/bits`` values per word along ``in``,
each stored as ``value + 2^(bits-1)``, lowest bits first; ``X.weight_zero_point`` (asymmetric int4)
is packed the same way along ``out``.
"""

from __future__ import annotations

import numpy as np

# compressed-tensors modules left float by QuantConfig.modules="experts" (attention, shared experts,
# dense MLPs; the routed experts' names, mlp.experts.{e}.*, match none of them), as
# Kimi-K2-Thinking's int4 release lists them
FLOAT_BESIDE_EXPERTS = ["re:.*self_attn.*", "re:.*shared_expert.*",
                        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def config(q, weights: dict, acts: dict | None, fmt: str) -> dict:
    """The compressed-tensors ``quantization_config`` of one scheme for every Linear."""
    ignore = ["lm_head"] + (FLOAT_BESIDE_EXPERTS if q.modules == "experts" else [])
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ignore, "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def int_weights(q, bits: int, group: bool) -> dict:
    """The ``weights`` scheme of ``bits``-bit integers, per channel or in groups."""
    return {"num_bits": bits, "type": "int", "symmetric": q.symmetric, "dynamic": False,
            "strategy": "group" if group else "channel", "group_size": q.group_size if group else None}


def pack_int32(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``[rows, n]`` values of ``bits`` bits -> int32 ``[rows, n*bits/32]``, low bits first."""
    per = 32 // bits
    rows, n = u.shape
    pad = (-n) % per
    u = np.pad(u.astype(np.uint32), [(0, 0), (0, pad)]).reshape(rows, -1, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(u << shifts, axis=-1).view(np.int32)


def unpack_int32(p: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of ``pack_int32``: int32 ``[rows, m]`` -> uint8 ``[rows, n]``."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    u = (p.view(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return u.reshape(p.shape[0], -1)[:, :n].astype(np.uint8)


def pack_quantized(qv: np.ndarray, leaves: dict[str, np.ndarray], name: str,
                   bits: int) -> dict[str, np.ndarray]:
    """``pack-quantized`` tensors of one linear: signed values ``qv`` ``[K, N]`` and the storage
    leaves' scales (and zero points) under HF prefix ``name``."""
    u = (qv.astype(np.int32) + (1 << (bits - 1))).T  # [out, in] unsigned
    out = {f"{name}.weight_packed": pack_int32(u, bits),
           f"{name}.weight_scale": np.ascontiguousarray(leaves["scale"].T),
           f"{name}.weight_shape": np.array(u.shape, np.int64)}
    if "zero" in leaves:
        zu = (leaves["zero"].astype(np.int32) + 8).T  # [out, groups]
        out[f"{name}.weight_zero_point"] = np.ascontiguousarray(pack_int32(zu.T, 4).T)
    return out
