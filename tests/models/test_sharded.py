"""The same logits on a mesh of 8 fake CPU devices as on one device (<= 1e-5), params sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.mesh import MeshShape, batch_sharding, make_mesh
from rlx.models import from_hf, param_bytes_per_device
from tests.helpers.hf_zoo import make_hf_model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


MESHES = {
    "data-fsdp-tensor": MeshShape(data=2, fsdp=2, tensor=2),
    "data-tensor-expert": MeshShape(data=2, tensor=2, expert=2),
    "fsdp-tensor-expert": MeshShape(fsdp=2, tensor=2, expert=2),
}


@pytest.mark.parametrize("family,mesh_name", [
    ("llama", "data-fsdp-tensor"), ("qwen2", "data-fsdp-tensor"), ("qwen3", "data-fsdp-tensor"),
    ("mixtral", "data-fsdp-tensor"), ("qwen3_moe", "data-tensor-expert"),
    ("qwen2_moe", "data-tensor-expert"), ("deepseek_v3", "data-fsdp-tensor"),
    ("kimi_k2", "data-tensor-expert"), ("glm4_moe", "data-tensor-expert"),
    ("gpt_oss", "fsdp-tensor-expert"), ("glm_moe_dsa", "fsdp-tensor-expert"),
    # the same DSAttention as GLM-5's (its indexer's rotary pairs aside): slow
    pytest.param("deepseek_v32", "data-fsdp-tensor", marks=pytest.mark.slow),
])
def test_sharded_logits_equal_unsharded(zoo, family, mesh_name):
    path = make_hf_model(family, zoo)
    ids = np.random.RandomState(0).randint(0, 97, (8, 6))
    forward = jax.jit(lambda m, x: m(x))  # the same compiled program on 1 device and on the mesh
    single = np.asarray(forward(from_hf(path), jnp.asarray(ids)))
    mesh = make_mesh(MESHES[mesh_name])
    model = from_hf(path, mesh=mesh)
    batch = jax.device_put(jnp.asarray(ids), batch_sharding(mesh, 2))
    sharded = forward(model, batch)
    assert np.abs(np.asarray(sharded) - single).max() <= 1e-5

    attn = model.layers[0].self_attn
    kernel = (attn.q_proj or attn.q_b_proj).kernel[...]  # MLA: q_b_proj when q_lora_rank is set
    assert kernel.sharding.mesh.shape == mesh.shape
    spec = kernel.sharding.spec
    assert "tensor" in jax.tree.leaves(tuple(spec)), spec  # heads split over tensor
    shard_shape = kernel.addressable_shards[0].data.shape
    assert shard_shape[1] == kernel.shape[1] // 2
    if MESHES[mesh_name].expert > 1 and model.config.moe is not None:
        sparse = model.config.moe.sparse_layers[0]
        experts = model.layers[sparse].mlp.experts.gate_proj[...]
        assert experts.addressable_shards[0].data.shape[0] == experts.shape[0] // 2
    per_device = param_bytes_per_device(model)
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert len(per_device) == 8 and max(per_device.values()) < total  # no device holds all
