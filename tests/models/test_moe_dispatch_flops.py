"""XLA's compiled FLOPs of one MoE layer's forward + backward: token dispatch against the one-device
ragged path and the dense path (every expert on every token).

The oracle is ``compile().cost_analysis()`` of XLA:TPU, compiled ahead of time for a v5p 2x2x2
topology (8 chips) with libtpu; no TPU is needed. XLA:CPU cannot serve as the oracle: jax lowers
``ragged_dot`` there as a masked product over every group, so the one-device ragged path itself
counts E times its routed FLOPs (so do the tpu7x and v6e compilers; v5p's counts the routed
rows). Skips where libtpu is not installed.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from rlx.mesh import TRAIN_RULES, MeshShape, batch_sharding, make_mesh, named_sharding
from rlx.models.hparams import MoEConfig
from rlx.models.moe import SparseMoE, expert_parallel

D, F, TOKENS = 256, 512, 1024
MOE = MoEConfig(num_experts=16, top_k=2, intermediate_size=F, norm_topk_prob=True)


@pytest.fixture(scope="module")
def tpu_devices():
    pytest.importorskip("libtpu", reason="the libtpu package (XLA:TPU ahead-of-time compiler)")
    import os

    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu
    return list(topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices)


def compiled_flops(devices, shape: MeshShape, impl: str = "ragged",
                   capacity_factor: float | None = None) -> float:
    """FLOPs of fwd + bwd (gradients of every parameter) summed over the mesh's devices."""
    mesh = make_mesh(shape, devices=devices[:shape.num_devices])
    layer = nnx.eval_shape(lambda: SparseMoE(D, MOE, dtype=jnp.float32, param_dtype=jnp.float32,
                                             rngs=nnx.Rngs(0), impl=impl))
    expert_parallel(layer, mesh, TRAIN_RULES, capacity_factor)
    graphdef, params = nnx.split(layer)
    abstract = jax.tree.map(
        lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=named_sharding(
            mesh, v.get_metadata().get("logical_axes"), TRAIN_RULES, v.shape))),
        params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    x = jax.ShapeDtypeStruct((TOKENS // 8, 8, D), jnp.float32, sharding=batch_sharding(mesh, 3))

    def loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params)(x) * x)

    compiled = jax.jit(jax.grad(loss)).lower(abstract, x).compile()
    return compiled.cost_analysis()["flops"] * shape.num_devices


@pytest.mark.parametrize("shape", [MeshShape(expert=8), MeshShape(fsdp=2, expert=4)],
                         ids=["expert8", "expert4-fsdp2"])
def test_dispatch_flops_near_the_ragged_path(tpu_devices, shape):
    ragged = compiled_flops(tpu_devices, MeshShape(data=1))  # one device, all experts
    dense = compiled_flops(tpu_devices, shape, impl="dense")
    capacity = compiled_flops(tpu_devices, shape, capacity_factor=1.25)
    dropless = compiled_flops(tpu_devices, shape)
    e, k, p = MOE.num_experts, MOE.top_k, shape.expert
    assert dense >= ragged * (e / k) / 1.5  # every expert on every token: E/k = 8 times
    assert capacity <= 1.5 * ragged  # 1.25 times the routed rows
    assert dropless <= 1.1 * ragged * p * min(k, e // p) / k  # worst-case rows (moe_dispatch doc)
