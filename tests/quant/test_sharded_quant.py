"""A quantized base + LoRA on a mesh of 8 fake CPU devices gives the single-device logits (<= 1e-5),
with the packed base leaves actually sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.mesh import TRAIN_RULES, MeshShape, batch_sharding, make_mesh, shard_variables
from rlx.models import from_hf
from rlx.quant import LoraConfig, apply_lora, quantize_model
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import INT4, ids, randomize_lora_b


@pytest.mark.parametrize("family,shape", [("llama", MeshShape(data=2, fsdp=2, tensor=2)),
                                          ("qwen3_moe", MeshShape(data=2, tensor=2, expert=2))])
def test_sharded_quantized_lora_logits(tmp_path, family, shape):
    path = make_hf_model(family, str(tmp_path))
    forward = jax.jit(lambda m, x: m(x))
    x = ids(8, 6)

    def build(mesh):
        model = quantize_model(from_hf(path, mesh=mesh), INT4, mesh=mesh)
        apply_lora(model, LoraConfig(rank=4), nnx.Rngs(0))
        randomize_lora_b(model)
        if mesh is not None:
            shard_variables(model, nnx.LoRAParam, mesh, TRAIN_RULES)
        return model

    single = np.asarray(forward(build(None), jnp.asarray(x)))
    mesh = make_mesh(shape)
    model = build(mesh)
    out = forward(model, jax.device_put(jnp.asarray(x), batch_sharding(mesh, 2)))
    assert np.abs(np.asarray(out) - single).max() <= 1e-5
    packed = model.layers[0].self_attn.q_proj.kernel.values[...]
    assert packed.addressable_shards[0].data.shape[1] == packed.shape[1] // 2  # out dim over tensor
    lora_a = model.layers[0].self_attn.q_proj.lora.lora_a[...]
    assert lora_a.sharding.mesh.shape == mesh.shape
