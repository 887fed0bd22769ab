"""Scanned layers leave every file format as it is: a stacked model (``rlx.models.stack``) gives
transformers' logits (the oracle; 1e-4, as tests/models/test_hf_parity.py) and writes exactly
the tensors the unrolled model writes: the HF state dict, the PEFT adapter (dense and per-expert
LoRA), the quantized base in its serving layout and a GGUF LoRA file (SmolLM2 Q4_1 base).
The longer variants are marked ``slow`` (``python -m pytest -m slow``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.io.export import base_state_dict, peft_state
from rlx.models import from_hf, hf_state_dict
from rlx.models.stack import stack_layers
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from tests.helpers.hf_zoo import hf_logits, make_hf_model
from tests.helpers import SMOLLM2_FILE, smollm2_dir


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("family", ["qwen2", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_stacked_matches_transformers_and_writes_the_same_tensors(zoo, family):
    path = make_hf_model(family, zoo)
    ids = np.random.RandomState(0).randint(0, 97, (2, 9))
    model = from_hf(path)
    stacked = stack_layers(from_hf(path))
    out = np.asarray(jax.jit(lambda m, x: m(x))(stacked, jnp.asarray(ids)))
    assert np.abs(out - hf_logits(path, ids)).max() <= 1e-4
    _same(hf_state_dict(stacked), hf_state_dict(model))


@pytest.mark.slow
def test_peft_and_quantized_base_exports_are_the_same(zoo):
    """int8 base, LoRA on attention, dense MLPs and experts (DeepSeek-V3: two stacks)."""
    def build():
        m = quantize_model(from_hf(make_hf_model("deepseek_v3", zoo)), QuantConfig(format="int8"))
        apply_lora(m, LoraConfig(rank=2, alpha=4.0), nnx.Rngs(3))
        for i, (_, v) in enumerate(nnx.to_flat_state(nnx.state(m, nnx.LoRAParam))):
            v.set_value(jax.random.normal(jax.random.key(i), v.shape, v.dtype))
        return m

    model, stacked = build(), stack_layers(build())
    (tensors, facts), (ref, ref_facts) = peft_state(stacked), peft_state(model)
    assert facts == ref_facts and any(".experts." in k for k in ref)
    _same(tensors, ref)
    q = QuantConfig(format="int8")
    _same(base_state_dict(stacked, q), base_state_dict(model, q))


@pytest.mark.slow
def test_smollm2_gguf_base_with_lora_stacked():
    """SmolLM2-135M's Q4_1 GGUF blocks with LoRA (30 layers: what scan_layers='auto' stacks
    off CPU): the same logits as unrolled (the same products, bit for bit here) and the same GGUF
    LoRA file tensors."""
    import os

    from rlx.io.gguf_lora import gguf_lora_tensors
    from rlx.models.gguf import read_gguf
    from rlx.quant import load_gguf_quantized

    path = os.path.join(smollm2_dir(), SMOLLM2_FILE)
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    model = apply_lora(load_gguf_quantized(path).model, lora, nnx.Rngs(0))
    for i, (_, v) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        v.set_value(0.05 * jax.random.normal(jax.random.key(i), v.shape, v.dtype))
    stacked = stack_layers(nnx.merge(*nnx.split(model)))
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 49152, (1, 8)))
    forward = jax.jit(lambda m, x: m(x))
    np.testing.assert_allclose(np.asarray(forward(stacked, ids)), np.asarray(forward(model, ids)),
                               atol=1e-5, rtol=0)
    base = read_gguf(path)
    _same(gguf_lora_tensors(stacked, base)[0], gguf_lora_tensors(model, base)[0])
