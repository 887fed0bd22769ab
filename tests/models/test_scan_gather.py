"""FSDP over the expert devices (``rlx.mesh.TRAIN_RULES``, ``rlx.models.stack.LayerGather``).

Training stores every weight's ``embed`` dimension and MLA's latent ranks split over the ``expert``
mesh axis as well as ``fsdp``; a scanned stack gathers one layer's weights inside the loop body.
A tiny DeepSeek-V3 (MLA, a dense first layer and MoE after it: two stacks) in mode B (LoRA on every
projection, the shared expert and every routed expert, B != 0), stacked and placed as a run places
it on the 8-device CPU mesh (expert=8; expert=4 x fsdp=2), gives the one-device logits and LoRA
gradients within 1e-5 (f32), with and without per-layer remat, while each device holds 1/8 of the
attention and shared-expert weights and the scan body places every layer weight (one sharding
constraint each; none without a mesh).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.mesh import TRAIN_RULES, MeshShape, gathered_rules, make_mesh, shard_variables
from rlx.models.moe import expert_parallel
from rlx.models.stack import stack_layers
from rlx.quant import LoraConfig, apply_lora
from tests.helpers.moe import tiny_deepseek
from tests.helpers.steps import layer_logits_and_grads


def _model():
    model = tiny_deepseek(layers=3)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=(
        "q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down"), experts=True), nnx.Rngs(1))
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B != 0: the adapter acts
        v.set_value(0.1 * jax.random.normal(jax.random.key(v.shape[-1]), v.shape, v.dtype))
    return stack_layers(model)


def _logits_and_grads(model, remat: bool):
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, (8, 9)))
    mask = jnp.ones_like(ids).at[1, :3].set(0)
    logits, grads = layer_logits_and_grads(model, nnx.LoRAParam, ids, mask, remat)
    return logits, {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}


def test_gathered_rules_keep_the_expert_axis_for_experts_and_tokens():
    rules = dict(gathered_rules(TRAIN_RULES))
    # the context devices hold FSDP shards as well (rlx.mesh.TRAIN_RULES)
    assert rules["embed"] == rules["q_lora"] == ("fsdp", "context")
    assert rules["expert"] == "expert" and "expert" in rules["batch"]
    assert "expert" in dict(TRAIN_RULES)["embed"]


def _scan_constraints(jaxpr) -> int:
    """Sharding constraints inside the bodies of ``jaxpr``'s scans (nested jaxprs searched)."""
    def walk(j, in_scan):
        n = 0
        for eqn in j.eqns:
            n += in_scan and eqn.primitive.name == "sharding_constraint"
            for sub in eqn.params.values():
                for x in sub if isinstance(sub, (tuple, list)) else (sub,):
                    inner = getattr(x, "jaxpr", x)
                    if hasattr(inner, "eqns"):
                        n += walk(inner, in_scan or eqn.primitive.name == "scan")
        return n

    return walk(jaxpr.jaxpr, False)


def _forward(model):
    ids = jnp.zeros((8, 4), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(4), (8, 4))
    return model.run_layers(model.embed_tokens(ids), pos, jnp.ones_like(ids),
                            model.rope_angles(pos))


@pytest.mark.parametrize("shape,remat", [
    (MeshShape(expert=8), False),
    pytest.param(MeshShape(fsdp=2, expert=4), True, marks=pytest.mark.slow)])
def test_sharded_stacks_give_the_one_device_logits_and_grads(shape, remat):
    ref = _model()
    assert _scan_constraints(jax.make_jaxpr(_forward)(ref)) == 0  # no mesh: nothing to gather
    ref_logits, ref_grads = _logits_and_grads(ref, remat)
    mesh = make_mesh(shape)
    model = _model()
    shard_variables(model, nnx.Variable, mesh, TRAIN_RULES)
    expert_parallel(model, mesh, TRAIN_RULES)
    # every weight of a layer is placed inside the scan body: one constraint per variable with
    # logical axes, in both stacks
    per_layer = sum(v.get_metadata().get("logical_axes") is not None
                    for s in model.stacks for _, v in nnx.to_flat_state(nnx.state(s.block)))
    assert _scan_constraints(jax.make_jaxpr(_forward)(model)) == per_layer > 0
    attn = model.stacks[1].block.self_attn
    for kernel in (attn.o_proj.kernel, attn.q_b_proj.kernel, model.stacks[1].block.mlp
                   .shared_expert.down_proj.kernel):  # [layers, in, out]: 1/8 on each device
        shard = kernel[...].addressable_shards[0].data.shape
        assert np.prod(shard) * 8 == np.prod(kernel.shape), (kernel.shape, shard)
    logits, grads = _logits_and_grads(model, remat)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for p in ref_grads:
        np.testing.assert_allclose(grads[p], ref_grads[p], atol=1e-5, rtol=0, err_msg=str(p))
