"""Quantization error of every base format on tiny random models, as a markdown table.

Metric: for each decoder block, the block is fed the f32 model's own input to that block (teacher
forcing, so errors do not compound) and its output compared with the f32 block's:
``||y_q - y_f32|| / ||y_f32||`` over all tokens, then averaged over blocks. Two models: a dense
Llama-style one and a Qwen3-MoE-style one (experts quantized too). GGUF rows quantize with the
``gguf`` package's llama.cpp quantizer (measurement only; rlx itself never requantizes into GGUF),
then run rlx's in-graph block dequantization. W8A8 rows also fake-quantize activations per token as
the named server does.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx.bench.formats import ROWS, gguf_model
from rlx.bench.harness import write_json
from rlx.models.config import ModelConfig, MoEConfig
from rlx.models.decoder import Precision, Transformer, resolve_positions
from rlx.quant.quantize import quantize_model

_BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=64)
MODELS = {
    "dense": ModelConfig(architecture="LlamaForCausalLM", **_BASE),
    "moe": ModelConfig(architecture="Qwen3MoeForCausalLM", qk_norm=True, **_BASE, moe=MoEConfig(
        num_experts=8, top_k=2, intermediate_size=128, norm_topk_prob=True, sparse_layers=(0, 1))),
}
def block_errors(ref: Transformer, quant: Transformer, ids) -> list[float]:
    """Relative output error of each block, fed the f32 model's block inputs."""
    pos, seg = resolve_positions(ids, None, None, None)
    x, angles = ref.embed_tokens(ids), ref.rope_angles(pos)
    errs = []
    for a, b in zip(ref.layers, quant.layers):
        ya, yb = a(x, pos, seg, angles), b(x, pos, seg, angles)
        errs.append(float(jnp.linalg.norm(yb - ya) / jnp.linalg.norm(ya)))
        x = ya
    return errs


def run(seed: int = 0, tokens: int = 64, models=tuple(MODELS)) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for name in models:
        cfg = MODELS[name]
        ids = jax.random.randint(jax.random.key(seed + 1), (2, tokens // 2), 0, cfg.vocab_size)
        ref = Transformer(cfg, Precision(), nnx.Rngs(seed))
        for label, spec in ROWS:
            model = Transformer(cfg, Precision(), nnx.Rngs(seed))
            model = gguf_model(model, spec) if isinstance(spec, str) else quantize_model(model, spec)
            table.setdefault(label, {})[name] = float(np.mean(block_errors(ref, model, ids)))
    return table


def markdown(table: dict[str, dict[str, float]]) -> str:
    cols = list(next(iter(table.values())))
    lines = ["| format | " + " | ".join(f"{c} rel. error" for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for label, row in table.items():
        lines.append(f"| {label} | " + " | ".join(f"{row[c]:.2e}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from rlx.bench.quant_decode import DECODE_ROWS
    from rlx.bench.quant_decode import MODELS as DECODE_MODELS

    parser = argparse.ArgumentParser(prog="python -m rlx.bench quant", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of dense,moe")
    parser.add_argument("--decode", action="store_true",
                        help="also measure decode tokens/s per format (rlx.bench.quant_decode)")
    parser.add_argument("--decode-model", default="smollm2", choices=DECODE_MODELS)
    parser.add_argument("--decode-formats", default=",".join(DECODE_ROWS),
                        help=f"comma-separated subset of {','.join(DECODE_ROWS)}")
    parser.add_argument("--decode-shape", default="8,32,32", help="batch,prompt,new tokens")
    parser.add_argument("--decode-rounds", default="3,1", help="measured rounds,warm-up rounds")
    parser.add_argument("--json", default="", help="write the figures to this file")
    args = parser.parse_args(argv)
    table = run(args.seed, args.tokens, tuple(args.models.split(",")))
    print(markdown(table))
    payload: dict = {"benchmark": "quant", "error": table}
    if args.decode:
        payload["decode"] = _decode(args, DECODE_ROWS)
    write_json(args.json or None, payload)
    return 0


def _decode(args, known: tuple[str, ...]) -> dict:
    from rlx.bench.quant_decode import decode_table

    formats = tuple(f.strip() for f in args.decode_formats.split(",") if f.strip())
    bad = [f for f in formats if f not in known]
    if bad or not formats:
        raise SystemExit(f"--decode-formats: {bad or formats} not in {known}")
    batch, prompt, new = (int(x) for x in args.decode_shape.split(","))
    repeats, warmup = (int(x) for x in args.decode_rounds.split(","))
    text, figures = decode_table(args.decode_model, batch, prompt, new, repeats, warmup, formats)
    print(f"\n### decode tokens/s per base format: {args.decode_model}, batch {batch}, prompt "
          f"{prompt}, {new} new tokens (greedy)\n")
    print(text)
    return figures
