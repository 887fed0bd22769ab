"""How a model's layers run on a mesh beyond what XLA's partitioner infers from the shardings:
``parallelize`` sets, in place, every MoE layer's token dispatch (``rlx.models.moe.
expert_parallel``) and every attention layer's ``AttentionSharding`` (the rows and KV heads each
device gives to a kernel XLA cannot partition, ``rlx.kernels.attention``)."""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from rlx.kernels.attention import AttentionSharding
from rlx.mesh import LogicalRules
from rlx.models.decoder import ATTENTION_LAYERS
from rlx.models.moe import expert_parallel


def parallelize(model: nnx.Module, mesh: Mesh | None, rules: LogicalRules,
                capacity_factor: float | None = None) -> nnx.Module:
    """Lay ``model``'s MoE dispatch and attention kernels out on ``mesh`` under ``rules`` (None:
    one device); in place, returns ``model``."""
    expert_parallel(model, mesh, rules, capacity_factor)
    sharding = AttentionSharding.of(mesh, rules)
    kinds = tuple(ATTENTION_LAYERS.values())
    if hasattr(model, "sharding"):
        model.sharding = sharding
    for _, node in nnx.iter_graph(model):
        if isinstance(node, kinds):
            node.sharding = sharding
    return model
