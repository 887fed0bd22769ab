"""Quantized checkpoints written the way their producers write them, by formulas of their own.

``write_shipped(src, dst, scheme)`` reads a float HF folder (the zoo's) and writes ``dst``: the same
config.json with a ``quantization_config``, and every linear the scheme quantizes replaced by its
quantized tensors. Nothing here calls rlx's quantizer or serving code: the values, the packing and
the scales follow the formats' own definitions (DeepSeek-V3's FP8 128x128 blocks, compressed-tensors'
``pack_to_int32``, SGLang's w8a8_int8), so a test can check rlx's loader against them.
``dequantized(dst)`` gives each quantized linear's float weight by the format's formula, and
``write_safetensors`` writes a safetensors file byte by byte (for truncated and corrupt shards).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct

import ml_dtypes
import numpy as np

_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.int8): "I8",
          np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8"}
_DTYPES = {v: k for k, v in _NAMES.items()}
LINEAR = re.compile(r".*\.(self_attn|mlp|shared_experts?|experts\.\d+)\.[a-z_]+_proj(_with_mqa)?$")
ROUTER = re.compile(r".*mlp\.gate$")
# Kimi-K2-Thinking's / K2.5's compressed-tensors ignore list: only the routed experts are int4
KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], _DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One producer's layout: ``kind`` "fp8_block" (DeepSeek), "fp8_channel" (compressed-tensors
    float-quantized), "pack" (compressed-tensors pack-quantized), "w8a8" (SGLang w8a8_int8)."""

    kind: str
    bits: int = 8
    group: int | None = None  # pack: None = channel strategy
    symmetric: bool = True
    ignore: tuple[str, ...] = ("lm_head",)  # module names / "re:" patterns left float
    scale_dtype: str = "F32"

    def quantization_config(self) -> dict:
        if self.kind == "fp8_block":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128], "modules_to_not_convert": list(self.ignore)}
        if self.kind == "w8a8":
            return {"quant_method": "w8a8_int8"}
        if self.kind == "fp8_channel":
            w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
            fmt = "float-quantized"
        else:
            w = {"num_bits": self.bits, "type": "int", "symmetric": self.symmetric, "dynamic": False,
                 "strategy": "group" if self.group else "channel", "group_size": self.group,
                 "actorder": None, "observer": "minmax"}
            fmt = "pack-quantized"
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "ignore": list(self.ignore), "kv_cache_scheme": None, "config_groups": {"group_0": {
                    "targets": ["Linear"], "weights": w, "input_activations": None,
                    "output_activations": None}}}

    def ignored(self, module: str) -> bool:
        for p in self.ignore:
            if p.startswith("re:") and re.match(p[3:], module) or p == module:
                return True
            if self.kind == "fp8_block" and (module.endswith(p) or module.startswith(p + ".")):
                return True
        return False


def _e4m3(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float8_e4m3fn)


def _blocks(w: np.ndarray, bn: int, bk: int):
    """Per-tile absolute maxima of ``w`` [n, k] over (bn, bk) tiles (edges partial)."""
    n, k = w.shape
    out = np.zeros((-(-n // bn), -(-k // bk)), np.float32)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max()
    return out


def _pack(u: np.ndarray, bits: int) -> np.ndarray:
    """compressed-tensors' pack_to_int32 along dim 1 of unsigned values ``u`` [r, c]."""
    per = 32 // bits
    r, c = u.shape
    u = np.pad(u.astype(np.int64), [(0, 0), (0, -c % per)]).reshape(r, -1, per)
    words = np.zeros(u.shape[:2], np.int64)
    for i in range(per):
        words |= u[..., i] << (bits * i)
    return words.astype(np.uint32).view(np.int32)


def _quantize(w: np.ndarray, s: Scheme, scale_dtype) -> dict[str, np.ndarray]:
    """The tensors of one linear ``w`` [out, in] (suffix -> array)."""
    n, k = w.shape
    if s.kind == "fp8_block":
        scale = (_blocks(w, 128, 128) / 448.0).astype(scale_dtype)
        full = np.repeat(np.repeat(scale.astype(np.float32), 128, 0), 128, 1)[:n, :k]
        return {"weight": _e4m3(w / full), "weight_scale_inv": scale}
    if s.kind == "fp8_channel":
        scale = (np.abs(w).max(1, keepdims=True) / 448.0).astype(scale_dtype)
        return {"weight": _e4m3(w / scale.astype(np.float32)), "weight_scale": scale}
    if s.kind == "w8a8":
        scale = (np.abs(w).max(1, keepdims=True) / 127.0).astype(scale_dtype)
        q = np.clip(np.round(w / scale.astype(np.float32)), -128, 127).astype(np.int8)
        return {"weight": q, "weight_scale": scale}
    g = s.group or k
    groups = -(-k // g)
    lo, hi = -(1 << (s.bits - 1)), (1 << (s.bits - 1)) - 1
    wp = np.pad(w, [(0, 0), (0, groups * g - k)]).reshape(n, groups, g)
    if s.symmetric:
        scale = np.abs(wp).max(-1) / hi
        zero = np.zeros_like(scale, np.int64)
    else:
        mn, mx = np.minimum(wp.min(-1), 0), np.maximum(wp.max(-1), 0)
        scale = (mx - mn) / (hi - lo)
        zero = np.clip(np.round(lo - mn / scale), lo, hi).astype(np.int64)
    scale = scale.astype(scale_dtype)
    sf = np.repeat(scale.astype(np.float32), g, 1)[:, :k]
    zf = np.repeat(zero, g, 1)[:, :k]
    q = np.clip(np.round(w / sf) + zf, lo, hi).astype(np.int64)
    out = {"weight_packed": _pack(q - lo, s.bits), "weight_scale": scale,
           "weight_shape": np.array([n, k], np.int64)}
    if not s.symmetric:
        out["weight_zero_point"] = np.ascontiguousarray(_pack((zero - lo).T, s.bits).T)
    return out


def write_shipped(src: str, dst: str, s: Scheme, shards: int = 1) -> str:
    """``src`` (a float zoo folder) quantized by scheme ``s`` into ``dst``."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = s.quantization_config()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    scale_dtype = _DTYPES[s.scale_dtype]
    out = {}
    for name, a in tensors.items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and LINEAR.match(module) and not s.ignored(module):
            out.update({f"{module}.{k}": v for k, v in _quantize(a.astype(np.float32), s, scale_dtype).items()})
        else:
            out[name] = a
    names = list(out)
    per = -(-len(names) // shards)
    files = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {n: out[n] for n in names[i * per:(i + 1) * per]}
        write_safetensors(os.path.join(dst, file), part)
        files.update({n: file for n in part})
    if shards > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": files}, f)
    return dst


def read_folder(path: str) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(read_safetensors(os.path.join(path, f)))
    return out


def _unpack(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    per = 32 // bits
    u = words.view(np.uint32).astype(np.int64)
    cols = [(u >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    return np.stack(cols, -1).reshape(words.shape[0], -1)[:, :count]


def dequantized(path: str, s: Scheme) -> dict[str, np.ndarray]:
    """Module name -> its float weight [out, in] by the format's formula, for every quantized
    linear of the folder ``path``."""
    t = read_folder(path)
    out = {}
    for name in t:
        for key in ("weight_scale_inv", "weight_scale"):
            if name.endswith("." + key):
                m = name[: -len(key) - 1]
                out[m] = _dequantize(t, m, s)
    return out


def _dequantize(t, m: str, s: Scheme) -> np.ndarray:
    if s.kind in ("fp8_block", "fp8_channel", "w8a8"):
        q = t[f"{m}.weight"].astype(np.float32)
        n, k = q.shape
        scale = t[f"{m}.weight_scale_inv" if s.kind == "fp8_block" else f"{m}.weight_scale"].astype(np.float32)
        if s.kind == "fp8_block":
            scale = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]
        return q * scale
    n, k = (int(d) for d in t[f"{m}.weight_shape"])
    lo = -(1 << (s.bits - 1))
    q = _unpack(t[f"{m}.weight_packed"], s.bits, k) + lo
    g = s.group or k
    scale = np.repeat(t[f"{m}.weight_scale"].astype(np.float32), g, 1)[:, :k]
    zero = 0
    if not s.symmetric:
        zp = _unpack(np.ascontiguousarray(t[f"{m}.weight_zero_point"].T), s.bits, n).T + lo
        zero = np.repeat(zp, g, 1)[:, :k]
    return ((q - zero) * scale).astype(np.float32)


def write_dequantized(src_float: str, shipped_dir: str, dst: str, s: Scheme) -> str:
    """A float folder (transformers reads it) whose linears are ``shipped_dir``'s dequantized."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src_float, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = dict(read_safetensors(os.path.join(src_float, "model.safetensors")))
    for m, w in dequantized(shipped_dir, s).items():
        tensors[f"{m}.weight"] = w.astype(tensors[f"{m}.weight"].dtype)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    return dst
