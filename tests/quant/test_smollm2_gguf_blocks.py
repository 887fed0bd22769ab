"""SmolLM2-135M-Instruct Q4_1 kept block-for-block on device; logits match transformers' GGUF
dequantized model within 1e-3 (f32)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.quant import GGUFTensor, load_gguf_quantized, state_bytes
from rlx.quant.loading import node_at
from rlx.models.hf import param_map
from tests.helpers import smollm2_dir

GGUF_DIR = smollm2_dir()
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def hf_model():
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded():
    return load_gguf_quantized(os.path.join(GGUF_DIR, GGUF_NAME))


def test_blocks_intact(loaded):
    from rlx.models.gguf import read_gguf

    ckpt = read_gguf(os.path.join(GGUF_DIR, GGUF_NAME))
    kept = 0
    for path, src in param_map(loaded.model.config).items():
        node = node_at(loaded.model, path)
        if isinstance(node, GGUFTensor):
            raw = ckpt.raw(src.hf_names[0])
            assert node.qtype == raw.qtype and np.array_equal(np.asarray(node.file_blocks()), raw.blocks)
            kept += 1
    assert kept == 211  # 210 Q4_1 linears + the Q8_0 (tied) embedding
    sizes = state_bytes(loaded.model)
    assert sizes["quantized"] < 0.2 * 4 * loaded.model.config.num_params()
    assert not any(isinstance(v, nnx.Param) and v.ndim == 2 for _, v in nnx.to_flat_state(nnx.state(loaded.model)))


def test_logits_match_transformers_gguf(hf_model, loaded):
    import torch

    x = np.array([loaded.tokenizer.encode_chat([{"role": "user", "content": "What is 12 + 7?"}],
                                               add_generation_prompt=True)])
    with torch.no_grad():
        ref = hf_model(torch.tensor(x)).logits.numpy()
    out = np.asarray(loaded.model(jnp.asarray(x)))
    assert np.abs(out - ref).max() <= 1e-3
