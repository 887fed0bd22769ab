"""Tiny FP4 checkpoints written by formulas of this module (not rlx's): a gpt-oss folder with
MXFP4 experts as the released gpt-oss checkpoints store them, and a Llama folder in ModelOpt's
NVFP4 export layout (below: ``nvfp4_quantize``).

The layout: per layer ``mlp.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, D/32, 16]`` and
``..._scales`` uint8 ``[E, 2I, D/32]`` (rows: the fused, interleaved gate/up outputs; inputs in
blocks of 32, two E2M1 codes a byte with the even input in the low nibble, scale ``2^(e - 127)``),
``down_proj_blocks`` ``[E, D, I/32, 16]`` / ``down_proj_scales`` ``[E, D, I/32]``; biases, attention,
router, embeddings and lm_head float; ``quantization_config`` ``{"quant_method": "mxfp4",
"modules_to_not_convert": [...]}`` as gpt-oss-20b's config.json has it. Verified against
transformers itself: ``test_shipped_mxfp4.py`` loads the folder with ``Mxfp4Config(dequantize=True)``
and finds these very dequantized values in its experts.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file

from tests.helpers.hf_zoo import hf_config

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]  # gpt-oss-20b's modules_to_not_convert


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF ``[..., N, K]`` f32 -> (blocks uint8 ``[..., N, K/32, 16]``, E8M0 scales uint8
    ``[..., N, K/32]``): per 32 inputs ``e = ceil(log2(absmax / 6))``, codes = ml_dtypes' E2M1
    rounding of ``w / 2^e``, element ``2j`` in the low nibble of byte ``j``."""
    *lead, n, k = w.shape
    b = w.reshape(*lead, n, k // 32, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    exp = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 6.0)), 0).astype(np.int32)
    codes = (b / np.ldexp(1.0, exp)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp[..., 0] + 127).astype(np.uint8)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of ``mxfp4_quantize``'s storage: HF ``[..., N, K]`` f32."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    w = vals * np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None]
    return w.reshape(*w.shape[:-2], -1)


def gpt_oss_config() -> transformers.PretrainedConfig:
    """The zoo's gpt-oss with an expert width of 32 (MXFP4 blocks need 32 | D and 32 | I)."""
    config = hf_config("gpt_oss")
    config.intermediate_size = 32
    return config


def make_gpt_oss(root: str, float_only: bool = False) -> str:
    """The float folder of a tiny random gpt-oss (``float_only``) or its MXFP4 copy (cached)."""
    src = os.path.join(root, "gpt_oss_f32")
    if not os.path.exists(os.path.join(src, "config.json")):
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(gpt_oss_config())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or name.endswith("sinks") or "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))
        model.save_pretrained(src)
    if float_only:
        return src
    out = os.path.join(root, "gpt_oss_mxfp4")
    if not os.path.exists(os.path.join(out, "config.json")):
        write_mxfp4(src, out)
    return out


def write_mxfp4(src: str, out: str) -> None:
    """Copy float gpt-oss folder ``src`` to ``out`` with MXFP4 experts."""
    os.makedirs(out, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)  # [E, K, N] as transformers keeps it
        blocks, scales = mxfp4_quantize(np.ascontiguousarray(np.swapaxes(w, -1, -2)))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": NOT_CONVERTED}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


# --- NVFP4, ModelOpt's export ---------------------------------------------------------------
def nvfp4_quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    """HF ``[N, K]`` f32 -> ModelOpt's NVFP4 tensors by its formula, in f32 numpy:
    ``weight_scale_2 = amax / (6 * 448)``, per 16 inputs ``weight_scale = e4m3(block_amax /
    (6 * weight_scale_2))`` (0 -> 1), codes = E2M1 of ``w / (weight_scale * weight_scale_2)``
    (ml_dtypes' rounding), even input in the low nibble; ``input_scale`` 1."""
    n, k = w.shape
    s2 = np.float32(np.abs(w).max() / np.float32(6 * 448))
    b = w.reshape(n, k // 16, 16)
    per = np.abs(b).max(axis=-1) / (np.float32(6) * s2)
    scale = np.where(per == 0, np.float32(1), per).astype(ml_dtypes.float8_e4m3fn)
    full = scale.astype(np.float32)[..., None] * s2
    codes = (np.clip(b / full, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F)
    codes = codes.reshape(n, k)
    return {"weight": (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8),
            "weight_scale": scale, "weight_scale_2": np.array(s2, np.float32),
            "input_scale": np.array(1.0, np.float32)}


def nvfp4_dequantize(t: dict[str, np.ndarray]) -> np.ndarray:
    """HF ``[N, K]`` f32 of ``nvfp4_quantize``'s tensors: ``e2m1 * (weight_scale * scale_2)``."""
    p = t["weight"]
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    full = t["weight_scale"].astype(np.float32) * t["weight_scale_2"]
    return vals * np.repeat(full, 16, axis=-1)


NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", "*.mlp.down_proj"]}


def write_nvfp4(src: str, out: str, dequantized: str, hf_quant_config: bool = False) -> None:
    """Copy float folder ``src`` to ``out`` with ModelOpt NVFP4 linears (``NVFP4_CONFIG``: in
    config.json, or in ``hf_quant_config.json`` as older exports keep it) and to ``dequantized``
    with the very values as f32 weights (what transformers, which reads no NVFP4, computes on)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant, floats = {}, dict(tensors)
    for name, w in tensors.items():
        m = name[: -len(".weight")]
        if (name.endswith("_proj.weight") and ".layers." in name
                and not m.endswith("mlp.down_proj")):
            t = nvfp4_quantize(w.astype(np.float32))
            quant.update({f"{m}.{k}": v for k, v in t.items()})
            floats[name] = nvfp4_dequantize(t)
        else:
            quant[name] = w
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for path, tensors_out, qc in ((out, quant, not hf_quant_config), (dequantized, floats, False)):
        os.makedirs(path, exist_ok=True)
        save_file(tensors_out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config, quantization_config=NVFP4_CONFIG) if qc and path == out else config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    if hf_quant_config:
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": {
                k: v for k, v in NVFP4_CONFIG.items() if k != "quant_method"}}, f)


# --- NVFP4, compressed-tensors' nvfp4-pack-quantized (written by compressed-tensors itself) ---
def ct_nvfp4(w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """compressed-tensors 0.20.0's NVFP4 of HF ``[N, K]`` f32: its global scale
    (``generate_gparam``: 448 * 6 / amax), its e4m3 group scales (``calculate_qparams``), its
    packing (``NVFP4PackedCompressor.compress``); returns (tensors, its f32 dequantization)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    x = torch.from_numpy(w)
    amax = x.abs().max().reshape(1)
    gs = generate_gparam(-amax, amax)
    b = x.reshape(x.shape[0], -1, 16)
    scale, _ = calculate_qparams(b.amin(-1), b.amax(-1), scheme.weights, global_scale=gs)
    out = NVFP4PackedCompressor.compress(
        {"weight": x, "weight_scale": scale, "weight_global_scale": gs}, scheme)
    codes = unpack_fp4_from_uint8(out["weight_packed"], *w.shape, torch.float32)
    deq = dequantize(x_q=codes, scale=out["weight_scale"].float(), args=scheme.weights,
                     global_scale=gs, dtype=torch.float32)
    tensors = {k: v.numpy() if v.dtype != torch.float8_e4m3fn
               else v.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
               for k, v in out.items()}
    tensors["input_global_scale"] = np.ones(1, np.float32)
    return tensors, deq.numpy()


def ct_nvfp4_config() -> dict:
    """The ``quantization_config`` of compressed-tensors' NVFP4 preset (lm_head left float)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    dump = lambda a: {k: v for k, v in a.model_dump().items()  # noqa: E731
                      if k in ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic")}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dump(scheme.weights),
                                          "input_activations": dump(scheme.input_activations)}}}


def write_ct_nvfp4(src: str, out: str, dequantized: str) -> None:
    """Copy float folder ``src`` to ``out`` with compressed-tensors NVFP4 decoder linears and to
    ``dequantized`` with compressed-tensors' own f32 dequantization of them."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant, floats = {}, dict(tensors)
    for name, w in tensors.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            t, deq = ct_nvfp4(w.astype(np.float32))
            quant.update({f"{name[: -len('.weight')]}.{k}": v for k, v in t.items()})
            floats[name] = deq
        else:
            quant[name] = w
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for path, data, cfg in ((out, quant, dict(config, quantization_config=ct_nvfp4_config())),
                            (dequantized, floats, config)):
        os.makedirs(path, exist_ok=True)
        save_file(data, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
