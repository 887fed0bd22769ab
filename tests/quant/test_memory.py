"""The int4 base occupies <= 0.3x the bytes of the same base in bf16 (a model with >= 10M params)."""

import jax.numpy as jnp
from flax import nnx

from rlx.models import ModelConfig, Precision, Transformer
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model, state_bytes

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                  num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)


def test_int4_base_bytes_at_most_0_3x_bf16():
    assert CFG.num_params() >= 10_000_000
    bf16 = state_bytes(Transformer(CFG, Precision(jnp.bfloat16, jnp.bfloat16), nnx.Rngs(0)))["base"]
    model = Transformer(CFG, Precision(), nnx.Rngs(0))
    quantize_model(model, QuantConfig(format="int4", group_size=128, quantize_embed=True, quantize_lm_head=True))
    apply_lora(model, LoraConfig(rank=16), nnx.Rngs(1))
    sizes = state_bytes(model)
    ratio = sizes["base"] / bf16
    print(f"\nparams {CFG.num_params():,}: bf16 base {bf16:,} B, int4 base {sizes['base']:,} B "
          f"(packed {sizes['quantized']:,} + float {sizes['float_frozen']:,}) = {ratio:.3f}x; "
          f"LoRA r16 trainable {sizes['lora']:,} B")
    assert bf16 == 2 * CFG.num_params()
    assert ratio <= 0.3
