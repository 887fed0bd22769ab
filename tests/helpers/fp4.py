"""Tiny FP4 checkpoints written by formulas of this module (not rlx's): a gpt-oss folder with
MXFP4 experts as the released gpt-oss checkpoints store them.

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
