"""Token-dispatch expert parallelism (rlx.models.moe_dispatch) equals the one-device ragged path.

One MoE layer, experts split over the ``expert`` axis of the 8-device CPU mesh (expert=8, and
expert=4 x fsdp=2): outputs and gradients (float expert weights and router; or per-expert LoRA on
int8 / int4 experts) within 1e-5 of the unsharded ``Experts.ragged`` layer (f32). Needs
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (tests/conftest.py sets it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.mesh import TRAIN_RULES, MeshShape, batch_sharding, make_mesh
from rlx.models.hparams import MoEConfig
from rlx.models.moe import SparseMoE, expert_parallel
from rlx.models.moe_dispatch import ExpertParallel, dispatch, permute_rows
from tests.helpers.moe import GPT_OSS, SIGMOID, SOFTMAX, D, F, make_layer, on_mesh

MESHES = {"expert8": MeshShape(expert=8), "expert4-fsdp2": MeshShape(fsdp=2, expert=4)}


def value_and_grads(layer: SparseMoE, x, wrt):
    """Output and the gradients of ``mean(out * cos(x))`` (a per-token mean, as a loss is) w.r.t.
    the ``wrt`` variables."""
    graphdef, params, rest = nnx.split(layer, wrt, ...)

    def loss(params, x):
        out = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.sum(out * jnp.cos(x), axis=-1)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)
    return np.asarray(out), {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("routing,fmt", [("softmax", "float"), ("sigmoid", "int8"),
                                         ("softmax", "int4"), ("gpt_oss", "float"),
                                         pytest.param("gpt_oss", "int4", marks=pytest.mark.slow)])
def test_dispatch_equals_ragged(mesh_name, routing, fmt):
    m = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "gpt_oss": GPT_OSS}[routing]
    wrt = nnx.Param if fmt == "float" else nnx.LoRAParam
    x = jax.random.normal(jax.random.key(1), (8, 5, D))  # 40 tokens, 5 per device
    ref_out, ref_grads = value_and_grads(make_layer(m, fmt), x, wrt)
    mesh = make_mesh(MESHES[mesh_name])
    layer = on_mesh(make_layer(m, fmt), mesh)
    assert layer.expert_parallel.experts_split == MESHES[mesh_name].expert
    out, grads = value_and_grads(layer, jax.device_put(x, batch_sharding(mesh, 3)), wrt)
    assert np.abs(out - ref_out).max() <= 1e-5
    assert grads.keys() == ref_grads.keys()
    expert_paths = [p for p in grads if "experts" in p]
    assert expert_paths and any("router" in p for p in grads) == (fmt == "float")
    for path, g in grads.items():
        assert np.abs(g - ref_grads[path]).max() <= 1e-5, path
        assert np.abs(ref_grads[path]).max() > 0, path  # every gradient is exercised


def test_rows_not_a_multiple_of_the_token_shards_are_padded():
    """Decode's few rows: 3 tokens on 8 token shards (5 padding rows never sent)."""
    x = jax.random.normal(jax.random.key(2), (1, 3, D))
    forward = nnx.jit(lambda layer, x: layer(x))
    ref = forward(make_layer(SOFTMAX, "int8"), x)
    out = forward(on_mesh(make_layer(SOFTMAX, "int8"), make_mesh(MESHES["expert8"])), x)
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 1e-5


def test_capacity_factor_drops_and_counts_pairs():
    """With capacity C rows per destination, the pairs past a destination's first C (in token
    order) are dropped: the output is the ragged layer's with their gates zeroed, and the count of
    dropped pairs is the one numpy finds."""
    layer = make_layer(SOFTMAX, "float")
    x = jax.random.normal(jax.random.key(3), (32, D))  # 4 tokens a device, 8 pairs a device
    idx, gates = layer.route(x)
    mesh = make_mesh(MESHES["expert8"])
    ep = ExpertParallel.of(mesh, TRAIN_RULES, capacity_factor=0.5)
    cap = ep.capacity(4, 2, 1)  # ceil(0.5 * 4 * 2 / 8) = 1 row per (source, destination)
    assert cap == 1
    sharded = on_mesh(make_layer(SOFTMAX, "float"), mesh)
    out, dropped = jax.jit(lambda x, i, g: dispatch(sharded.experts, ep, x, i, g))(x, idx, gates)
    kept = np.ones(idx.shape, bool)
    for source in range(8):  # devices hold 4 consecutive tokens; expert e lives on device e
        seen = {}
        for t in range(4 * source, 4 * source + 4):
            for s in range(2):
                e = int(idx[t, s])
                seen[e] = seen.get(e, 0) + 1
                kept[t, s] = seen[e] <= cap
    assert int(dropped) == int((~kept).sum()) > 0
    ref = layer.experts.ragged(x, idx, jnp.where(jnp.asarray(kept), gates, 0))
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 1e-5


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    mesh = make_mesh(MeshShape(expert=8))
    with pytest.raises(ValueError, match="does not divide the layer's 4 experts"):
        expert_parallel(SparseMoE(D, MoEConfig(num_experts=4, top_k=2, intermediate_size=F,
                                               norm_topk_prob=True),
                                  dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)),
                        mesh, TRAIN_RULES)


def test_permute_rows_gradient_is_a_gather():
    """``permute_rows`` (the dispatch buffers' row moves): the value and gradient of the plain
    gather with a zero row for index n, and no float scatter in its gradient's program."""
    x = jax.random.normal(jax.random.key(0), (5, 3))
    take = jnp.array([2, 5, 0, 4, 5, 1])  # 6 rows out; row 3 of x unused; 5: a zero row
    put = jnp.array([2, 5, 0, 6, 3])  # where each row of x went (6: nowhere)
    ct = jax.random.normal(jax.random.key(1), (6, 3))
    plain = lambda x: jnp.concatenate([x, jnp.zeros((1, 3))])[take]  # noqa: E731
    np.testing.assert_array_equal(permute_rows(x, take, put), plain(x))
    grad = jax.grad(lambda x: jnp.sum(permute_rows(x, take, put) * ct))
    np.testing.assert_array_equal(grad(x), jax.grad(lambda x: jnp.sum(plain(x) * ct))(x))
    eqns = jax.make_jaxpr(grad)(x).jaxpr.eqns
    assert not [e for e in eqns if e.primitive.name.startswith("scatter")]
