"""GGUF K-quant and 5-bit files kept block for block: logits equal transformers' dequantized model.

Oracles: transformers' GGUF loader (which dequantizes with the ``gguf`` package) for the logits of
a whole file, and the file's own bytes for what rlx keeps. A tiny llama file stores each linear in
another block type (Q2_K .. Q6_K, Q5_0, Q5_1); its blocks are random bytes below 0x24, so every f16
field is finite and small (the ``gguf`` package cannot make K-quants). With llama.cpp's environment
present, SmolLM2-135M-Instruct is requantized to Q4_K_M by llama.cpp's own quantizer (a mix of
Q4_K, Q6_K, Q5_0 and Q8_0) and checked the same way.
"""

from __future__ import annotations

import collections
import os
import subprocess

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.bench.peer_envs import LLAMA_CPP
from rlx.models.gguf import read_gguf
from rlx.models.hf import param_map
from rlx.quant import GGUFTensor, load_gguf_quantized
from rlx.quant.formats.gguf.blocks import KEPT
from rlx.quant.loading import node_at
from tests.helpers import SMOLLM2_FILE, smollm2_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN, INTER, HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 64, 128
TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q3_K",
         "ffn_gate": "Q2_K", "ffn_up": "Q5_0", "ffn_down": "Q5_1", "token_embd": "Q6_K"}


def _blocks(rng, rows: int, cols: int, qtype: str) -> np.ndarray:
    elements, nbytes, _ = KEPT[qtype]
    return rng.integers(0, 0x24, size=(rows, cols // elements * nbytes), dtype=np.uint8)


def _write(path: str) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {"block_count": 2, "context_length": 64, "embedding_length": HIDDEN,
                       "feed_forward_length": INTER, "attention.head_count": HEADS,
                       "attention.head_count_kv": HEADS // 2, "rope.dimension_count": HEAD_DIM,
                       "vocab_size": VOCAB}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    kv = HEADS // 2 * HEAD_DIM
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN),
              "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    tensors = {"token_embd.weight": (VOCAB, HIDDEN, "Q6_K"), "output_norm.weight": (HIDDEN,)}
    for layer in range(2):
        tensors |= {f"blk.{layer}.{n}.weight": (*s, TYPES[n]) for n, s in shapes.items()}
        tensors |= {f"blk.{layer}.{n}.weight": (HIDDEN,) for n in ("attn_norm", "ffn_norm")}
    for name, spec in tensors.items():
        if len(spec) == 1:
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(spec)).astype(np.float32))
        else:
            qt = gguf.GGMLQuantizationType[spec[2]]
            writer.add_tensor(name, _blocks(rng, *spec), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _check_against_transformers(path: str, ids: np.ndarray, rel: float) -> collections.Counter:
    """Every linear (and the embedding) is a GGUFTensor holding the file's bytes; logits equal
    transformers' within ``rel`` of their largest magnitude. Returns the kept types' counts."""
    loaded = load_gguf_quantized(path)
    ckpt = read_gguf(path)
    kept = collections.Counter()
    for p, src in param_map(loaded.model.config).items():
        node = node_at(loaded.model, p)
        if isinstance(node, GGUFTensor):
            assert np.array_equal(np.asarray(node.file_blocks()), ckpt.raw(src.hf_names[0]).blocks)
            kept[node.qtype] += 1
    assert not any(isinstance(v, nnx.Param) and v.ndim == 2
                   for _, v in nnx.to_flat_state(nnx.state(loaded.model)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = np.asarray(loaded.model(jnp.asarray(ids)))
    assert np.isfinite(ref).all() and np.abs(out - ref).max() <= rel * np.abs(ref).max()
    return kept


def test_every_k_quant_and_5_bit_type_runs_as_blocks_like_transformers(tmp_path):
    path = os.fspath(tmp_path / "kquants.gguf")
    _write(path)
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 12))
    kept = _check_against_transformers(path, ids, rel=1e-5)
    assert kept == collections.Counter({t: 2 for t in TYPES.values() if t != "Q6_K"}) + \
        collections.Counter({"Q6_K": 3})  # two layers' v_proj and the embedding


@pytest.mark.slow  # kept out of CI's 30 minutes; `python -m pytest -m slow` runs it
def test_llama_cpp_q4_k_m_smollm2_runs_as_blocks_like_transformers(tmp_path):
    missing = LLAMA_CPP.unavailable()
    if missing:
        pytest.skip(missing)
    source = os.path.join(smollm2_dir(), SMOLLM2_FILE)
    target = os.fspath(tmp_path / "smollm2-q4_k_m.gguf")
    script = ("import ctypes, sys, llama_cpp as l\n"
              "p = l.llama_model_quantize_default_params()\n"
              "p.ftype, p.allow_requantize = l.LLAMA_FTYPE_MOSTLY_Q4_K_M, True\n"
              "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
              "ctypes.byref(p)))\n")
    subprocess.run([LLAMA_CPP.interpreter(), "-c", script, source, target], check=True,
                   capture_output=True, timeout=600)
    tokenizer = read_gguf(target).tokenizer
    ids = np.array([tokenizer.encode_chat([{"role": "user", "content": "What is 12 + 7?"}],
                                          add_generation_prompt=True)])
    kept = _check_against_transformers(target, ids, rel=1e-5)
    assert {"Q4_K", "Q6_K", "Q5_0"} <= set(kept)
