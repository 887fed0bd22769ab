"""A quantized tied embedding (``QuantConfig(quantize_embed=True)``): its lookup gathers the
stored columns of the wanted rows and dequantizes only those, to the very values of the whole
dequantized table; as the tied head of an int8 base the engine's decode steps multiply by its
int8 values (``rlx.platform.cpu.kernels``) and keep the learner's log-probs within 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.models import from_hf
from rlx.platform.cpu import kernels as cpu_kernels
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from rlx.quant.tensors import QTensor, quantize_array
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import randomize_lora_b
from tests.helpers.parity import TOL, parity


@pytest.mark.parametrize("fmt,kw", [("int8", {}), ("int4", dict(group_size=16)),
                                    ("int4", dict(group_size=16, symmetric=False)),
                                    ("nf4", dict(group_size=16)), ("fp8", {})])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lookup_equals_rows_of_the_dequantized_table(fmt, kw, dtype):
    table = jnp.asarray(np.random.default_rng(0).standard_normal((97, 48)) * 0.05, jnp.float32)
    emb = quantize_array(table, fmt, transposed=True, scale_dtype="bfloat16", **kw)
    ids = jnp.asarray([[3, 96, 0], [3, 50, 7]])
    want = jnp.take(emb.dequantize(dtype), ids, axis=0)
    got = jax.jit(lambda i: emb.take(i, dtype))(ids)
    assert got.shape == (2, 3, 48) and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_int8_embedding_head_keeps_learner_parity(tmp_path):
    """Mode B on an int8 base with an int8 tied embedding: the engine's head product runs the
    int8 kernel (where it builds), the learner's dequantizes; log-probs agree within 1e-5."""
    model = from_hf(make_hf_model("llama_tied", str(tmp_path)))
    quantize_model(model, QuantConfig(format="int8", quantize_embed=True))
    assert isinstance(model.embed, QTensor) and model.lm_head is None
    if cpu_kernels.available():
        h = jnp.ones((1, model.config.hidden_size), jnp.float32)
        assert cpu_kernels.INT8_CHANNEL in jax.jit(model.logits).lower(h).as_text()
    apply_lora(model, LoraConfig(rank=3, alpha=5.0), nnx.Rngs(0))
    randomize_lora_b(model)
    sampled, scored, _ = parity(model)
    print(f"LoRA mode int8 + int8 embedding + LoRA f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL
