"""Chunked token log-probs: equal to the dense reference in value and gradient; bounded memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.learner.logprobs import token_logprobs, token_logprobs_dense

B, T, D, V = 2, 7, 8, 13  # T * B = 14 tokens, not a multiple of the chunk sizes below


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(k[0], (B, T, D))
    w = jax.random.normal(k[1], (D, V)) / np.sqrt(D) * 3.0
    bias = jax.random.normal(k[2], (V,))
    targets = jax.random.randint(k[3], (B, T), 0, V)
    cot = jax.random.normal(k[4], (2, B, T))  # random cotangents for logp and entropy
    return hidden, w, bias, targets, cot


def _gather_reference(hidden, w, bias, targets):
    """Plain jax.nn.log_softmax + gather, and entropy from jax.nn.softmax."""
    logits = jnp.tanh(hidden) @ w + bias  # [B, T, V]
    logp_all = jax.nn.log_softmax(logits, -1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    entropy = -jnp.sum(jax.nn.softmax(logits, -1) * logp_all, -1)
    return logp, entropy


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 14, 64])
@pytest.mark.parametrize("compute_entropy", [False, True])
def test_matches_dense_and_gather_in_value_and_gradient(chunk_size, compute_entropy):
    hidden, w, bias, targets, cot = _inputs()

    def objective(fn, h, w, bias):
        # project is a closure over (traced) params: the gradient must reach w and bias
        logp, ent = fn(h, lambda x: jnp.tanh(x) @ w + bias, targets)
        total = jnp.sum(cot[0] * logp)
        if compute_entropy:
            total = total + jnp.sum(cot[1] * ent)
        return total, (logp, ent)

    chunked_fn = lambda *a: token_logprobs(*a, chunk_size, compute_entropy)  # noqa: E731
    chunked = lambda h, w, b: objective(chunked_fn, h, w, b)  # noqa: E731
    dense = lambda h, w, b: objective(  # noqa: E731
        lambda *a: token_logprobs_dense(*a, compute_entropy=compute_entropy), h, w, b
    )
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(hidden, w, bias)
    (val_c, (lp_c, ent_c)), g_c = grad(chunked)
    (val_d, (lp_d, ent_d)), g_d = grad(dense)
    lp_ref, ent_ref = _gather_reference(hidden, w, bias, targets)

    assert lp_c.shape == (B, T) and lp_c.dtype == jnp.float32
    np.testing.assert_allclose(lp_c, lp_d, atol=1e-5)
    np.testing.assert_allclose(lp_c, lp_ref, atol=1e-5)
    if compute_entropy:
        np.testing.assert_allclose(ent_c, ent_d, atol=1e-5)
        np.testing.assert_allclose(ent_c, ent_ref, atol=1e-5)
    else:
        assert ent_c is None and ent_d is None
    np.testing.assert_allclose(val_c, val_d, atol=1e-5)
    for gc, gd in zip(g_c, g_d):  # d/d hidden, d/d w, d/d bias
        np.testing.assert_allclose(gc, gd, atol=1e-5)


def test_gradient_matches_gather_reference_autodiff():
    """The hand-written VJP against autodiff of log_softmax + gather (not via the dense helper)."""
    hidden, w, bias, targets, cot = _inputs(1)

    def chunked(h, w):
        logp, ent = token_logprobs(h, lambda x: jnp.tanh(x) @ w + bias, targets, 5, True)
        return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)

    def reference(h, w):
        logp, ent = _gather_reference(h, w, bias, targets)
        return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)

    for gc, gr in zip(jax.grad(chunked, (0, 1))(hidden, w), jax.grad(reference, (0, 1))(hidden, w)):
        np.testing.assert_allclose(gc, gr, atol=1e-5)


def test_jit_and_bf16_projection_give_f32():
    hidden, w, _, targets, _ = _inputs(2)
    proj = lambda x: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)  # noqa: E731
    fn = jax.jit(lambda h: token_logprobs(h, proj, targets, 4, True))
    logp, ent = fn(hidden)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    ref, ref_ent = token_logprobs_dense(hidden, proj, targets, True)
    # bf16 logits carry a relative error of 2**-8; with |logit| <= ~10 the chunked and the dense
    # matmuls may round differently by up to ~0.04, so only a loose check here (f32 is tested above)
    np.testing.assert_allclose(logp, ref, atol=0.1)
    np.testing.assert_allclose(ent, ref_ent, atol=0.1)
    g = jax.grad(lambda h: fn(h)[0].sum())(hidden)
    assert g.dtype == hidden.dtype and np.all(np.isfinite(g))


def test_shape_errors():
    hidden, w, _, targets, _ = _inputs()
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, lambda x: x @ w, targets[:, :-1], 4)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, lambda x: x @ w, targets, 0)


# ------------------------------------------------------------------------ memory

MEM_V, MEM_T, MEM_B, MEM_D, MEM_CHUNK = 151936, 1024, 1, 64, 128


def _compiled_memory(fn):
    """Compile value_and_grad (wrt hidden and W) of sum(logp) at the memory shapes; never run."""
    h = jax.ShapeDtypeStruct((MEM_B, MEM_T, MEM_D), jnp.float32)
    w = jax.ShapeDtypeStruct((MEM_D, MEM_V), jnp.float32)
    y = jax.ShapeDtypeStruct((MEM_B, MEM_T), jnp.int32)

    def loss(h, w, y):
        logp, ent = fn(h, lambda x: x @ w, y)
        return jnp.sum(logp) + (0.0 if ent is None else jnp.sum(ent))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.lower(h, w, y).compile().memory_analysis()


@pytest.mark.parametrize("compute_entropy", [False, True])
def test_chunked_backward_memory_is_bounded_by_a_chunk(compute_entropy):
    chunk_logits = MEM_CHUNK * MEM_V * 4  # one chunk's f32 logits: 77.8 MB
    chunked = _compiled_memory(
        lambda h, p, y: token_logprobs(h, p, y, MEM_CHUNK, compute_entropy)
    )
    dense = _compiled_memory(lambda h, p, y: token_logprobs_dense(h, p, y, compute_entropy))
    if chunked is None or dense is None:
        pytest.skip("this backend reports no compiled memory statistics")
    io = chunked.argument_size_in_bytes + chunked.output_size_in_bytes
    print(
        f"\nentropy={compute_entropy}: chunk logits {chunk_logits / 2**20:.1f} MiB, "
        f"args+outputs {io / 2**20:.1f} MiB, "
        f"temp chunked {chunked.temp_size_in_bytes / 2**20:.1f} MiB, "
        f"temp dense {dense.temp_size_in_bytes / 2**20:.1f} MiB"
    )
    assert chunked.temp_size_in_bytes < 2 * chunk_logits + io
    # the dense version holds [T, V] f32 logits (594 MiB) and more; chunking must be far below it
    full_logits = MEM_B * MEM_T * MEM_V * 4
    assert dense.temp_size_in_bytes > full_logits
    assert chunked.temp_size_in_bytes * 4 < dense.temp_size_in_bytes
