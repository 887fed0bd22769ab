"""The frozen base in the checkpoint layouts SGLang loads, and back, value for value.

One quantized linear ``W`` (HF ``[out, in]``; rlx storage ``[K=in, N=out]``) under HF name ``X``:

============================  =====================================================================
rlx base -> serving           tensors written (``quantization_config`` in ``config.json``)
============================  =====================================================================
int8 -> ``w8a8_int8``         ``X.weight`` int8 [out, in], ``X.weight_scale`` [out, 1]
                              (``quant_method: w8a8_int8``; activations int8 per token, dynamic)
int8 / int4 ->                ``X.weight_packed`` int32 [out, in*bits/32] (8 nibbles or 4 bytes per
``compressed-tensors``        int32 along ``in``, value + 2^(bits-1), lowest bits first),
                              ``X.weight_scale`` [out, in/group] (int8: [out, 1]),
                              ``X.weight_zero_point`` int32 [ceil(out/8), in/group] (asymmetric int4,
                              packed along ``out``), ``X.weight_shape`` [out, in]
                              (``format: pack-quantized``, weight-only WNA16)
fp8 channel -> ``fp8`` or     ``X.weight`` e4m3 [out, in], ``X.weight_scale`` [out, 1]
``compressed-tensors``        (``format: float-quantized``, activations fp8 per token, dynamic)
fp8 block128 -> ``fp8``       ``X.weight`` e4m3 [out, in], ``X.weight_scale_inv`` [ceil(out/128),
                              ceil(in/128)] (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
                              activations fp8 per 1x128 group, dynamic; DeepSeek/Qwen FP8 layout)
gguf -> ``gguf``              the GGUF file itself
any -> ``hf``                 dequantized float weights (``X.weight``), no quantization_config
============================  =====================================================================

Scales are written in the dtype they are stored in (``QuantConfig.scale_dtype``); a server that
casts them to a lower precision model dtype only keeps the values when that dtype holds them, so
serve a bf16 model from ``scale_dtype="bfloat16"``. Routers, norms, embeddings and lm_head are
written as float tensors under their HF names.
"""

from __future__ import annotations

import numpy as np

from rlx.quant.config import QuantConfig, QuantConfigError

_PACK_BITS = {"int4": 4, "int8": 8}
# compressed-tensors modules left float by QuantConfig.modules="experts" (attention, shared experts,
# dense MLPs; the routed experts' names, mlp.experts.{e}.*, match none of them), as
# Kimi-K2-Thinking's int4 release lists them
_FLOAT_BESIDE_EXPERTS = ["re:.*self_attn.*", "re:.*shared_expert.*",
                         r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def quantization_config(q: QuantConfig) -> dict | None:
    """The ``config.json`` ``quantization_config`` for the serving layout of ``q`` (None for "hf")."""
    if q.serving in ("hf", "gguf"):
        return None
    if q.serving == "w8a8_int8":
        return {"quant_method": "w8a8_int8"}
    if q.format == "fp8" and q.fp8_granularity == "block128":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    if q.format == "fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
        fmt = "float-quantized"
    else:
        bits = _PACK_BITS[q.format]
        group = q.format == "int4"
        weights = {"num_bits": bits, "type": "int", "symmetric": q.symmetric, "dynamic": False,
                   "strategy": "group" if group else "channel", "group_size": q.group_size if group else None}
        acts, fmt = None, "pack-quantized"
    ignore = ["lm_head"] + (_FLOAT_BESIDE_EXPERTS if q.modules == "experts" else [])
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ignore, "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def config_from_hf(qc: dict | None) -> QuantConfig:
    """Inverse of ``quantization_config`` (for reloading what rlx exported, or such checkpoints)."""
    if not qc:
        return QuantConfig()
    method = qc.get("quant_method")
    if method == "w8a8_int8":
        return QuantConfig(format="int8", serving="w8a8_int8")
    if method == "fp8":
        if list(qc.get("weight_block_size") or []) != [128, 128]:
            raise QuantConfigError(f"fp8 checkpoint with weight_block_size={qc.get('weight_block_size')}: "
                                   "only 128x128 blocks are supported")
        return QuantConfig(format="fp8", fp8_granularity="block128", serving="fp8")
    if method != "compressed-tensors" or len(qc.get("config_groups", {})) != 1:
        raise QuantConfigError(f"quantization_config {qc} is not a layout rlx reads (see rlx.quant.serving)")
    w = next(iter(qc["config_groups"].values()))["weights"]
    modules = "experts" if "re:.*self_attn.*" in (qc.get("ignore") or []) else "all"
    if w["type"] == "float":
        return QuantConfig(format="fp8", serving="compressed-tensors", modules=modules)
    fmt = {4: "int4", 8: "int8"}[w["num_bits"]]
    return QuantConfig(format=fmt, group_size=w.get("group_size") or 64, symmetric=w["symmetric"],
                       serving="compressed-tensors", modules=modules)


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


def _signed_int4(values: np.ndarray) -> np.ndarray:
    """rlx packed nibbles [K/2, N] (u = q + 8) -> q int8 [K, N]."""
    both = np.stack([values & 0x0F, values >> 4], axis=-2)
    return both.reshape(2 * values.shape[0], values.shape[1]).astype(np.int8) - 8


def to_serving(leaves: dict[str, np.ndarray], name: str, q: QuantConfig) -> dict[str, np.ndarray]:
    """Serving tensors of one 2-D quantized linear (storage ``[K, N]`` leaves) under HF prefix ``name``."""
    scale_t = np.ascontiguousarray(leaves["scale"].T)  # [N, K/bk] = [out, groups]
    if q.format == "fp8":
        out = {f"{name}.weight": np.ascontiguousarray(leaves["values"].T)}
        key = "weight_scale_inv" if q.fp8_granularity == "block128" else "weight_scale"
        return {**out, f"{name}.{key}": scale_t}
    if q.serving == "w8a8_int8":
        return {f"{name}.weight": np.ascontiguousarray(leaves["values"].T), f"{name}.weight_scale": scale_t}
    bits = _PACK_BITS[q.format]
    qv = _signed_int4(leaves["values"]) if q.format == "int4" else leaves["values"]
    u = (qv.astype(np.int32) + (1 << (bits - 1))).T  # [out, in] unsigned
    out = {f"{name}.weight_packed": pack_int32(u, bits), f"{name}.weight_scale": scale_t,
           f"{name}.weight_shape": np.array(u.shape, np.int64)}
    if "zero" in leaves:
        zu = (leaves["zero"].astype(np.int32) + 8).T  # [out, groups]
        out[f"{name}.weight_zero_point"] = np.ascontiguousarray(pack_int32(zu.T, 4).T)
    return out


def from_serving(tensors, name: str, q: QuantConfig) -> dict[str, np.ndarray]:
    """Inverse of ``to_serving``: storage ``[K, N]`` leaves of one linear read from ``tensors``."""
    if q.format == "fp8" or q.serving == "w8a8_int8":
        key = "weight_scale_inv" if q.fp8_granularity == "block128" else "weight_scale"
        return {"values": np.ascontiguousarray(np.asarray(tensors[f"{name}.weight"]).T),
                "scale": np.ascontiguousarray(np.asarray(tensors[f"{name}.{key}"]).T)}
    bits = _PACK_BITS[q.format]
    out_dim, in_dim = (int(d) for d in np.asarray(tensors[f"{name}.weight_shape"]))
    u = unpack_int32(np.asarray(tensors[f"{name}.weight_packed"]), bits, in_dim).T  # [in, out]
    if q.format == "int4":
        values = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    else:
        values = (u.astype(np.int32) - 128).astype(np.int8)
    leaves = {"values": np.ascontiguousarray(values),
              "scale": np.ascontiguousarray(np.asarray(tensors[f"{name}.weight_scale"]).T)}
    zname = f"{name}.weight_zero_point"
    if zname in tensors:
        zp = np.asarray(tensors[zname])  # [ceil(out/8), groups]
        leaves["zero"] = (unpack_int32(np.ascontiguousarray(zp.T), 4, out_dim).astype(np.int8) - 8)
    return leaves


def is_quantized(tensors, name: str) -> bool:
    """Whether linear ``name`` is stored quantized in ``tensors``."""
    return any(f"{name}.{k}" in tensors for k in ("weight_scale", "weight_scale_inv", "weight_packed"))
