"""Blockwise and Pallas attention (rlx.kernels.attention) against dense attention.

The oracle of the masks is dense softmax attention over an explicit ``[b, t, s]`` mask (for sinks
written out here as an extra softmax column of zero value); HF transformers is the oracle of the
models' logits (tests/models/test_hf_parity.py runs every family with both). Tolerance: 1e-5
(float32) on outputs and gradients, relative to the largest gradient entry for gradients.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.kernels.attention import attend, attention_mask, blockwise_attention, gqa_attention
from rlx.kernels.attention.splash import splash_attention
from rlx.models import from_hf
from rlx.platform.policy import CPU, active
from tests.helpers.attention import TOL, batch, dense, errors
from tests.helpers.hf_zoo import FAMILIES, make_hf_model

@pytest.mark.parametrize("t, h, kv, d, dv, bq_bk, window, sinks", [
    (37, 4, 2, 8, 8, (16, 8), None, False),     # GQA, t not a multiple of the blocks
    (64, 4, 1, 8, 6, (32, 16), None, False),     # multi-query, narrower values (MLA-like)
    (50, 4, 4, 12, 8, (16, 16), 7, False),       # sliding window
    (50, 4, 2, 8, 8, (16, 16), None, True),      # attention sinks
    (50, 4, 2, 8, 8, (512, 512), 9, True),       # one block
])
def test_blockwise_equalsdense(t, h, kv, d, dv, bq_bk, window, sinks):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (2, t, n, e)) for kk, n, e in
               zip(keys, (h, kv, kv), (d, d, dv)))
    seg, pos = batch(2, t, pad=5, packed=True)
    args = (q, k, v) + ((jax.random.normal(keys[3], (h,)),) if sinks else ())
    fn = lambda q, k, v, s=None: blockwise_attention(  # noqa: E731
        q, k, v, seg, seg, pos, pos, causal_columns=True, window=window, sinks=s,
        block_q=bq_bk[0], block_k=bq_bk[1])
    ref = lambda q, k, v, s=None: dense(q, k, v, seg, pos, window, s)  # noqa: E731
    out_err, grad_err = errors(fn, ref, args, seg)
    assert out_err <= TOL and grad_err <= TOL, (out_err, grad_err)


@pytest.mark.parametrize("window", [None, 7])
def test_dense_attend_with_sinks_equals_oracle(window):
    """``attend``'s dense path (short sequences, ``causal_attention``'s query blocks) with
    attention sinks and a window: outputs and gradients (sinks included) equal the oracle's."""
    t, h, kv, d = 70, 4, 2, 8
    keys = jax.random.split(jax.random.key(4), 4)
    q, k, v = (jax.random.normal(kk, (2, t, n, d)) for kk, n in zip(keys, (h, kv, kv)))
    seg, pos = batch(2, t, pad=5, packed=True)
    sinks = jax.random.normal(keys[3], (h,))
    fn = lambda q, k, v, s: attend(q, k, v, seg, seg, pos, pos, causal_columns=True,  # noqa: E731
                                   window=window, sinks=s, policy=CPU)
    ref = lambda q, k, v, s: dense(q, k, v, seg, pos, window, s)  # noqa: E731
    out_err, grad_err = errors(fn, ref, (q, k, v, sinks), seg)
    assert out_err <= TOL and grad_err <= TOL, (out_err, grad_err)


def test_blockwise_over_a_cache_equalsdense():
    """New tokens over a KV-head-major cache (the engine's prefill and scoring): position-causal
    only, empty slots (segment 0) and the cache's layouts."""
    b, t, s, h, kv, d = 2, 24, 56, 4, 2, 8
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (b, t, h, d))
    cache_k = jax.random.normal(keys[1], (b, kv, d, s))  # [b, kv, d, s]
    cache_v = jax.random.normal(keys[2], (b, kv, s, d))  # [b, kv, s, d]
    kv_seg = jnp.asarray((np.arange(s) < 40).astype(np.int32)[None].repeat(b, 0))
    kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    q_seg, q_pos = jnp.ones((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(16, 16 + t), (b, t))
    out = jax.jit(lambda *a: blockwise_attention(*a, kv_major=True, block_q=8, block_k=16))(
        q, cache_k, cache_v, q_seg, kv_seg, q_pos, kv_pos)
    mask = attention_mask(q_seg, kv_seg, q_pos, kv_pos)
    ref = gqa_attention(q, cache_k, cache_v, mask, kv_major=True)
    assert float(jnp.abs(out - ref).max()) <= TOL


def test_splash_kernel_equals_blockwise():
    """JAX's Pallas TPU splash kernels, run in the interpreter: GQA, padding and packing."""
    b, t, h, kv, d = 2, 200, 4, 2, 16
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(kk, (b, t, n, d)) for kk, n in zip(keys, (h, kv, kv)))
    seg, pos = batch(b, t, pad=10, packed=True)
    fn = lambda q, k, v: splash_attention(q, k, v, seg, block=128, interpret=True)  # noqa: E731
    ref = lambda q, k, v: blockwise_attention(  # noqa: E731
        q, k, v, seg, seg, pos, pos, causal_columns=True, block_q=64, block_k=64)
    out_err, grad_err = errors(fn, ref, (q, k, v), seg)
    assert out_err <= TOL and grad_err <= TOL, (out_err, grad_err)


BLOCKWISE = dataclasses.replace(CPU, dense_attention_slots=0, attention_block=16)


FAST = ("llama", "deepseek_v3")  # GQA and MLA attention: the rest are `slow`


@pytest.mark.parametrize("family", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_model_gradients_blockwise_equaldense(tmp_path, family):
    """Every architecture's full-parameter gradients of a padded, 40-token batch: blockwise
    attention in 16-token blocks equals the dense path."""
    model = from_hf(make_hf_model(family, str(tmp_path)))
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 40)))
    mask = jnp.asarray(np.arange(40)[None] >= np.array([[0], [7]])).astype(jnp.int32)
    graphdef, params = nnx.split(model)
    w = jax.random.normal(jax.random.key(3), (2, 40, 97)) * mask[:, :, None]

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(ids, attention_mask=mask) * w)

    grads = {}
    for name, policy in (("dense", CPU), ("blockwise", BLOCKWISE)):
        with active(policy):
            grads[name] = jax.jit(jax.grad(loss))(params)
    for a, b in zip(jax.tree.leaves(grads["blockwise"]), jax.tree.leaves(grads["dense"])):
        scale = max(float(jnp.abs(b).max()), 1e-6)
        assert float(jnp.abs(a - b).max()) <= TOL * scale


def test_splash_compiles_for_tpu_without_a_quadratic_array():
    """The TPU policy's attention (forward and backward) over 32k tokens, compiled by XLA:TPU
    through libtpu for 4 TensorCores of a tpu7x topology, rows over ``data`` and KV heads over
    ``tensor`` (``AttentionSharding``: a shard_map around the Pallas kernel): the program holds
    the Mosaic kernels, XLA:TPU compiles it, and no array of it has even t^2 / 8 elements (one head's dense scores
    would have t^2; the largest it holds are ``[t, heads, 128]`` activations). XLA:TPU's
    temporary bytes here are a few arrays of that size, how many live at once being its
    scheduler's choice."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs the libtpu package")
    import re

    from jax.sharding import NamedSharding, PartitionSpec

    from rlx.kernels.attention import AttentionSharding, attend
    from rlx.mesh import TRAIN_RULES, MeshShape, make_mesh
    from rlx.plan.aot import topology
    from rlx.platform.policy import compiling_for

    t = 32768
    mesh = make_mesh(MeshShape(data=2, tensor=2), topology("tpu7x:2x2x1").devices[:4])
    sharding = AttentionSharding.of(mesh, TRAIN_RULES)
    rows = NamedSharding(mesh, PartitionSpec("data"))
    shapes = [((2, t, 8, 128), jnp.bfloat16), ((2, t, 2, 128), jnp.bfloat16),
              ((2, t, 2, 128), jnp.bfloat16), ((2, t), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=rows) for s, d in shapes]

    def loss(q, k, v, seg):
        pos = jnp.broadcast_to(jnp.arange(t), seg.shape)
        out = attend(q, k, v, seg, seg, pos, pos, causal_columns=True, sharding=sharding)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with compiling_for("tpu"):
        lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(
            lowering_platforms=("tpu",))
    lowered.compile()  # XLA:TPU accepts the program (within the TensorCore's memory)
    program = lowered.as_text()
    assert "tpu_custom_call" in program
    sizes = [math.prod(int(x) for x in m.group(1).split("x"))
             for m in re.finditer(r"tensor<(\d+(?:x\d+)*)x\w+>", program)]
    assert max(sizes) < t * t // 8, max(sizes)
