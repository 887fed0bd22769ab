"""Routing replay in one MoE layer (``SparseMoE.routed(x, replay=...)``).

Replayed experts are used as given and the gates are the router's own probabilities (softmax) or
uncorrected scores (sigmoid) of those experts, so the router keeps its gradient. Checked against
a NumPy evaluation of the layer written from the routing definitions (f32, 1e-5), for replayed
experts that differ from the router's choice; replaying the router's own choice changes nothing
(bit-equal outputs and gradients); with the experts split over the 8-device mesh the dispatch path
replays the same way (1e-5).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.mesh import MeshShape, make_mesh
from rlx.models.kv_cache import KVCache
from rlx.models.stack import layer_counts, stack_layers
from tests.helpers.moe import GPT_OSS, SIGMOID, SOFTMAX, D, make_layer, on_mesh, tiny_deepseek

ROUTINGS = [SOFTMAX, SIGMOID, GPT_OSS]
NAMES = ["softmax", "sigmoid", "gpt_oss"]


def _tokens(seed=1, b=2, t=5):
    return jax.random.normal(jax.random.key(seed), (b, t, D), jnp.float32)


def _random_experts(m, b=2, t=5, seed=2):
    """Distinct experts per token, drawn independently of the router."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.stack([rng.permutation(m.num_experts)[:m.top_k]
                                 for _ in range(b * t)]).reshape(b, t, m.top_k), jnp.int32)


def _numpy_layer(layer, x, experts):
    """The layer's output for fixed ``experts`` from its float weights, in NumPy (f64)."""
    m, ex = layer.routing, layer.experts
    x = np.asarray(x, np.float64).reshape(-1, D)
    logits = x @ np.asarray(layer.router[...], np.float64)
    if layer.router_bias is not None:
        logits = logits + np.asarray(layer.router_bias[...], np.float64)
    e = np.asarray(experts).reshape(x.shape[0], -1)
    if m.router == "softmax":
        p = np.exp(logits - logits.max(-1, keepdims=True))
        probs = p / p.sum(-1, keepdims=True)
    else:
        probs = 1 / (1 + np.exp(-logits))
    gates = np.take_along_axis(probs, e, 1)
    if m.norm_topk_prob:
        gates = gates / gates.sum(-1, keepdims=True)
    gates = gates * m.routed_scaling_factor
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (ex.gate_proj, ex.up_proj, ex.down_proj))
    bg, bu, bd = (np.zeros(1) if b is None else np.asarray(b[...], np.float64)
                  for b in (ex.gate_bias, ex.up_bias, ex.down_bias))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j, k in enumerate(e[n]):
            g, u = x[n] @ wg[k] + bg[k % len(bg)], x[n] @ wu[k] + bu[k % len(bu)]
            if m.swiglu_limit is None:
                h = silu(g) * u
            else:  # gpt-oss: (clip(u, -l, l) + 1) * g * sigmoid(alpha * g), g = min(g, l)
                lim = m.swiglu_limit
                g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
                h = (u + 1) * g / (1 + np.exp(-m.swiglu_alpha * g))
            out[n] += gates[n, j] * (h @ wd[k] + bd[k % len(bd)])
    sh = layer.shared_expert
    if sh is None:
        return out
    shw = [np.asarray(p.kernel[...], np.float64) for p in (sh.gate_proj, sh.up_proj, sh.down_proj)]
    shared = (silu(x @ shw[0]) * (x @ shw[1])) @ shw[2]
    if layer.shared_gate is not None:
        shared = shared / (1 + np.exp(-(x @ np.asarray(layer.shared_gate[...], np.float64))))
    return out + shared


def _loss_and_grads(layer, x, replay):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def run(p, rest, x, replay):
        def loss(p):
            r = nnx.merge(graphdef, p, rest).routed(x, replay=replay)
            return jnp.sum(r.out ** 2), r
        return jax.value_and_grad(loss, has_aux=True)(p)[0][1], jax.grad(
            lambda p: loss(p)[0])(p)
    return run(params, rest, x, replay)


@nnx.jit
def _routed(layer, x, replay):
    return layer.routed(x, replay=replay)


@pytest.mark.parametrize("m", ROUTINGS, ids=NAMES)
def test_replayed_experts_match_numpy(m):
    layer, x = make_layer(m, "float"), _tokens()
    experts = _random_experts(m)
    assert not np.array_equal(np.sort(experts, -1), np.sort(_routed(layer, x, None).experts, -1))
    routed, grads = _loss_and_grads(layer, x, experts)
    np.testing.assert_array_equal(routed.experts, experts)
    np.testing.assert_allclose(routed.out.reshape(-1, D), _numpy_layer(layer, x, experts),
                               atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(grads["router"][...]).max()) > 0  # gates still train the router


@pytest.mark.parametrize("m,fmt", [(SOFTMAX, "float"), (SIGMOID, "int4")],
                         ids=["softmax-float", "sigmoid-int4"])
def test_replaying_own_choice_changes_nothing(m, fmt):
    layer, x = make_layer(m, fmt), _tokens()
    own, grads = _loss_and_grads(layer, x, None)
    again, grads_again = _loss_and_grads(layer, x, own.experts)
    np.testing.assert_array_equal(again.out, own.out)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_again)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("m", ROUTINGS, ids=NAMES)
def test_dispatch_replays_like_one_device(m):
    layer, x = make_layer(m, "int4"), _tokens(b=8, t=3)
    experts = _random_experts(m, b=8, t=3)
    want = _routed(layer, x, experts).out
    sharded = on_mesh(make_layer(m, "int4"), make_mesh(MeshShape(expert=8)))
    got = _routed(sharded, x, experts)
    np.testing.assert_array_equal(got.experts, experts)
    assert int(got.dropped) == 0
    np.testing.assert_allclose(got.out, want, atol=1e-5, rtol=1e-5)


@nnx.jit
def _model_routes(model, ids, replay):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    segments = jnp.ones_like(ids)
    x, routes = model.routed_layers(model.embed_tokens(ids), positions, segments,
                                    model.rope_angles(positions), replay=replay)
    return model.logits(model.norm(x)), routes


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_model_replays_its_recorded_routes(stacked):
    model = tiny_deepseek()
    model = stack_layers(model) if stacked else model
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 7)))
    logits, routes = _model_routes(model, ids, None)
    k = model.config.moe.top_k
    assert routes.experts.shape == (2, 7, 3, k) and int(routes.dropped) == 0
    again, replayed = _model_routes(model, ids, routes.experts)
    np.testing.assert_array_equal(replayed.experts, routes.experts)
    np.testing.assert_array_equal(again, logits)
    other = jnp.roll(routes.experts, 1, axis=-1) + 1
    other = other % model.config.moe.num_experts
    moved, replayed = _model_routes(model, ids, other)
    np.testing.assert_array_equal(replayed.experts, other)
    assert float(jnp.abs(moved - logits).max()) > 1e-3  # replayed experts are the ones used


def test_decode_records_the_routes_of_the_forward_pass():
    model = stack_layers(tiny_deepseek())
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 97, (2, 6)))
    _, want = _model_routes(model, ids, None)
    positions, segments = jnp.broadcast_to(jnp.arange(6), ids.shape), jnp.ones_like(ids)
    cache = KVCache.zeros(model.config, 2, 8, jnp.float32, layer_counts(model))
    _, cache, first = nnx.jit(lambda m, c: m.decode_routed(ids[:, :5], positions[:, :5],
                                                           segments[:, :5], c))(model, cache)
    _, _, last = nnx.jit(lambda m, c: m.decode_routed(ids[:, 5:], positions[:, 5:],
                                                      segments[:, 5:], c))(model, cache)
    got = jnp.concatenate([first.experts, last.experts], axis=1)
    np.testing.assert_array_equal(jnp.sort(got, -1), jnp.sort(want.experts, -1))


@pytest.mark.parametrize("m", ROUTINGS, ids=NAMES)
def test_unknown_rows_route_freely(m):
    layer, x = make_layer(m, "float"), _tokens()
    own = _routed(layer, x, None)
    experts = _random_experts(m)
    unknown = jnp.zeros((2, 5), bool).at[0, 1].set(True).at[1, 4].set(True)
    replay = jnp.where(unknown[..., None], -1, experts).at[1, 2, 0].set(-1)  # one -1 is enough
    unknown = unknown.at[1, 2].set(True)
    got = _routed(layer, x, replay)
    np.testing.assert_array_equal(got.experts, jnp.where(unknown[..., None], own.experts, experts))
    np.testing.assert_allclose(got.out.reshape(-1, D), _numpy_layer(layer, x, got.experts),
                               atol=1e-5, rtol=1e-5)
