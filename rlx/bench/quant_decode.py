"""Decode tokens/s of rlx's built-in engine per frozen-base format (``python -m rlx.bench quant --decode``).

Every format is one side of the harness (its own worker, interleaved rounds, medians): SmolLM2-135M
(or the tiny model, or ``llama8b-wide`` for accelerators: Llama-3-8B's widths, 8 random layers,
bf16, its "f32" row then bf16) with its decoder-layer linears in that format, generating exactly
``new`` greedy tokens for ``batch`` prompts. Each row is what that ``QuantConfig`` gives a user: the
embedding / tied output projection stays f32 (``quantize_embed=False``, the default) except in the
"+ int8 embedding" row (``quantize_embed=True``: one int8 scale per vocabulary row, for the lookup
and the head product, as llama.cpp and int8 servers quantize the head).
The SmolLM2 "GGUF Q4_1" row uses the file's own blocks; other GGUF rows quantize the f32 weights
with the ``gguf`` package (as the error table does). Quantized bases trade memory for dequantization
work inside the matmul: on a CPU, where decode reads every weight once per token, fewer bytes can
win or lose depending on how cheap the dequantization is. A CPU decode step's quantized products
run ``rlx.platform.cpu.kernels`` where it builds (with ``RLX_CPU_KERNELS=0`` in the environment,
XLA's: the "(XLA)" rows). Columns: tokens/s and tokens per CPU-second of the worker (every thread), medians.
"""

from __future__ import annotations

import tempfile
import time

from rlx.bench.harness import Side, interleave, markdown_table

DECODE_ROWS = ("f32", "int8 channel", "int8 channel + int8 embedding", "int4 g64 sym", "nf4 g64",
               "fp8 channel", "GGUF Q8_0", "GGUF Q4_1", "mxfp4", "mxfp4 (XLA)", "nvfp4")
# decode rows beyond the error table's formats (rlx.bench.formats.ROWS): the QuantConfig fields a
# user sets, here the tied embedding / head quantized too (QuantConfig.quantize_embed), and FP4
DECODE_ONLY = {"int8 channel + int8 embedding": dict(format="int8", quantize_embed=True),
               "mxfp4": dict(format="mxfp4"), "mxfp4 (XLA)": dict(format="mxfp4"),
               "nvfp4": dict(format="nvfp4")}
# a row's worker environment: "(XLA)" rows keep XLA's products (no native CPU kernel)
ROW_ENV = {"mxfp4 (XLA)": {"RLX_CPU_KERNELS": "0"}}

# An accelerator-sized model: Llama-3-8B's widths and vocabulary, random, bf16, few layers (each
# layer reads the same bytes per token, so the per-format ratios do not depend on the depth)
LLAMA8B_WIDE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": False}
MODELS = ("smollm2", "tiny", "llama8b-wide")


def _spec(label: str):
    """A row's QuantConfig or GGUF block type."""
    from rlx.bench.formats import ROWS
    from rlx.quant import QuantConfig

    return QuantConfig(**DECODE_ONLY[label]) if label in DECODE_ONLY else dict(ROWS)[label]


def _llama8b_wide(label: str):
    """``LLAMA8B_WIDE`` in bf16 with its decoder linears in ``label``'s format ("f32": bf16)."""
    import jax.numpy as jnp
    from flax import nnx

    from rlx.models import Precision, Transformer, from_hf_config
    from rlx.quant import quantize_model

    bf16 = Precision(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    m = Transformer(from_hf_config(LLAMA8B_WIDE), bf16, rngs=nnx.Rngs(0))
    spec = None if label == "f32" else _spec(label)
    if isinstance(spec, str):
        raise SystemExit(f"--decode-model llama8b-wide: {label} is a GGUF row; pick rlx's formats")
    return m if spec is None else quantize_model(m, spec)


def _model(model: str, label: str, hf_config: dict | None):
    from rlx.bench.formats import gguf_model
    from rlx.bench.workloads import load_model
    from rlx.quant import quantize_model

    if model == "llama8b-wide":
        return _llama8b_wide(label)
    if model == "smollm2" and label == "GGUF Q4_1":
        return load_model(model, "q4_1")[0]
    m = load_model(model, "f32", hf_config=hf_config)[0]
    if label == "f32":
        return m
    spec = _spec(label)
    return gguf_model(m, spec) if isinstance(spec, str) else quantize_model(m, spec)


def decode_side(model: str, label: str, prompts: list[list[int]], new: int,
                hf_config: dict | None = None):
    """Harness factory: greedy generation of ``new`` tokens per prompt on one base format."""
    from rlx.quant import state_bytes
    from rlx.rollout.jax.engine import JaxEngine
    from rlx.types import Prompt, SamplingParams

    m = _model(model, label, hf_config)
    weights = state_bytes(m)["base"]
    engine = JaxEngine(m)
    requests = [Prompt(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
    greedy = SamplingParams(max_new_tokens=new, temperature=0.0)

    def run() -> dict:
        t = time.perf_counter()
        out = engine.generate(requests, greedy)
        seconds = time.perf_counter() - t
        counts = [len(r.completion_ids) for r in out]
        if set(counts) != {new}:
            raise RuntimeError(f"{label}: rows produced {sorted(set(counts))} tokens, not {new}")
        return {"tokens": sum(counts), "seconds": seconds, "weight_bytes": weights}

    return run


def decode_table(model: str = "smollm2", batch: int = 8, prompt: int = 32, new: int = 32,
                 repeats: int = 3, warmup: int = 1, rows=DECODE_ROWS) -> tuple[str, dict]:
    """(markdown table, figures) of decode tokens/s per format, relative to f32."""
    from rlx.bench.workloads import Workload, prompt_ids, smollm2_config

    # llama8b-wide takes the same prompts: SmolLM2's plain ids are plain ids of Llama-3 too
    w = Workload("smollm2" if model == "llama8b-wide" else model, batch, prompt, new)
    hf_config = smollm2_config() if model == "tiny" else None
    sides = [Side(label, "rlx.bench.quant_decode:decode_side",
                  dict(model=model, label=label, prompts=prompt_ids(w), new=new, hf_config=hf_config),
                  env=ROW_ENV.get(label, {}))
             for label in rows]
    with tempfile.TemporaryDirectory(prefix="rlx-bench-quant-") as logs:
        results = interleave(sides, repeats, warmup, logs)
    rate = {label: results.rate(label, "tokens") for label in rows}
    per_cpu = {label: results.rate(label, "tokens", "cpu_s") for label in rows}

    def vs_f32(r: dict, label: str) -> str:
        return "-" if "f32" not in r else f"{r[label] / r['f32']:.2f}x"

    table_rows = [[label, rate[label], vs_f32(rate, label), per_cpu[label], vs_f32(per_cpu, label),
                   f"{results.median(label, 'weight_bytes') / 1e6:,.1f}",
                   f"{results.median(label, 'peak_rss_mb'):,.0f}"] for label in rows]
    header = ["format", "decode tokens/s", "vs f32", "tokens/CPU-s", "vs f32 (per CPU-s)",
              "base MB (layers + embedding)", "peak RSS MB"]
    return markdown_table(header, table_rows), {"rate": rate, "per_cpu_s": per_cpu,
                                                 "results": results.to_json()}
