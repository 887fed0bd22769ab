"""Chunked token log-probs: equal to the dense reference in value and gradient; bounded memory.

Both ways of passing the lm-head are checked: an opaque callable (whole-row chunks) and an `LMHead`
record (chunks split into vocabulary blocks too).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.kernels.logprobs import LMHead, token_logprobs, token_logprobs_dense

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


# the CI runs a [D, V] kernel without a bias and a tied [V, D] embedding with one; the slow marker
# the other two pairs
@pytest.mark.parametrize("transposed,with_bias", [
    pytest.param(False, False, id="nobias-kernel"),
    pytest.param(True, True, id="bias-tied"),
    pytest.param(False, True, id="bias-kernel", marks=pytest.mark.slow),
    pytest.param(True, False, id="nobias-tied", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("chunk_size,vocab_block,compute_entropy", [
    (3, 4, False),  # 13 = 4 + 4 + 4 + 1: the last block is shifted left and overlaps the third
    (3, 4, True),
    (4, 5, True),  # 13 = 5 + 5 + 3
    (14, 13, False),  # one block
    (5, 1, True),  # one column per block
    (64, 100, True),  # block wider than V: capped at V
])
def test_lm_head_blocks_match_dense_and_gather(
    transposed, with_bias, chunk_size, vocab_block, compute_entropy
):
    hidden, w, bias, targets, cot = _inputs(3)
    bias = bias if with_bias else jnp.zeros(V)
    weight = w.T if transposed else w  # a tied embedding is stored [V, D]

    def blocked(h, weight, b):
        head = LMHead(weight, b if with_bias else None, transposed)
        logp, ent = token_logprobs(jnp.tanh(h), head, targets, chunk_size, compute_entropy,
                                   vocab_block=vocab_block)
        total = jnp.sum(cot[0] * logp) + (jnp.sum(cot[1] * ent) if compute_entropy else 0.0)
        return total, (logp, ent)

    def reference(h, weight, b):
        logp, ent = _gather_reference(h, weight.T if transposed else weight, b, targets)
        total = jnp.sum(cot[0] * logp) + (jnp.sum(cot[1] * ent) if compute_entropy else 0.0)
        return total, (logp, ent)

    grad = lambda f: jax.value_and_grad(f, (0, 1, 2), has_aux=True)(hidden, weight, bias)  # noqa
    (val_b, (lp_b, ent_b)), g_b = grad(blocked)
    (val_r, (lp_r, ent_r)), g_r = grad(reference)
    dense_lp, dense_ent = token_logprobs_dense(
        jnp.tanh(hidden), LMHead(weight, bias, transposed), targets, True)

    assert lp_b.shape == (B, T) and lp_b.dtype == jnp.float32
    np.testing.assert_allclose(lp_b, lp_r, atol=1e-5)
    np.testing.assert_allclose(lp_b, dense_lp, atol=1e-5)
    if compute_entropy:
        np.testing.assert_allclose(ent_b, ent_r, atol=1e-5)
        np.testing.assert_allclose(ent_b, dense_ent, atol=1e-5)
    else:
        assert ent_b is None
    np.testing.assert_allclose(val_b, val_r, atol=1e-5)
    assert g_b[1].shape == weight.shape
    for gb, gr in zip(g_b[:2], g_r[:2]):  # d/d hidden, d/d weight
        np.testing.assert_allclose(gb, gr, atol=1e-5)
    if with_bias:
        np.testing.assert_allclose(g_b[2], g_r[2], atol=1e-5)


def test_lm_head_equals_callable_in_bf16_and_under_jit():
    """A bf16 matmul dtype: the blocked path rounds the logits like the same head as a callable."""
    hidden, w, bias, targets, _ = _inputs(4)
    head = LMHead(w, bias, dtype=jnp.bfloat16)
    run = lambda p: jax.jit(lambda h: token_logprobs(h, p, targets, 4, True, vocab_block=5))  # noqa
    (lp_b, ent_b), (lp_c, ent_c) = run(head)(hidden), run(lambda x: head(x))(hidden)
    assert lp_b.dtype == jnp.float32 and ent_b.dtype == jnp.float32
    np.testing.assert_allclose(lp_b, lp_c, atol=1e-5)
    np.testing.assert_allclose(ent_b, ent_c, atol=1e-5)

    def grads(p):
        def f(h, w):
            lp, ent = token_logprobs(h, p(w), targets, 4, True, vocab_block=5)
            return jnp.sum(lp) + jnp.sum(ent)
        return jax.grad(f, (0, 1))(hidden, w)

    g_b = grads(lambda w: LMHead(w, bias, dtype=jnp.bfloat16))
    g_c = grads(lambda w: LMHead(w, bias, dtype=jnp.bfloat16).__call__)
    for gb, gc in zip(g_b, g_c):  # bf16 cotangents: rounding differs with the summation order
        assert gb.dtype == gc.dtype == jnp.float32
        np.testing.assert_allclose(gb, gc, atol=2e-2, rtol=2e-2)


def test_shape_errors():
    hidden, w, _, targets, _ = _inputs()
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, lambda x: x @ w, targets[:, :-1], 4)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, lambda x: x @ w, targets, 0)
    with pytest.raises(ValueError, match="vocab_block"):
        token_logprobs(hidden, LMHead(w), targets, 4, vocab_block=0)


# ------------------------------------------------------------------------ memory

MEM_V, MEM_T, MEM_B, MEM_D, MEM_CHUNK = 151936, 1024, 1, 64, 128
CHUNK_LOGITS = MEM_CHUNK * MEM_V * 4  # one chunk's f32 logits: 74.2 MiB


def _compiled_memory(fn, head: str = "callable"):
    """Compile value_and_grad (wrt hidden and W) of sum(logp) at the memory shapes; never run.

    `head`: "callable" (`lambda x: x @ w`), "kernel" (`LMHead(w)`) or "tied" (a [V, D] `LMHead`).
    """
    h = jax.ShapeDtypeStruct((MEM_B, MEM_T, MEM_D), jnp.float32)
    w_shape = (MEM_V, MEM_D) if head == "tied" else (MEM_D, MEM_V)
    w = jax.ShapeDtypeStruct(w_shape, jnp.float32)
    y = jax.ShapeDtypeStruct((MEM_B, MEM_T), jnp.int32)

    def loss(h, w, y):
        project = (lambda x: x @ w) if head == "callable" else LMHead(w, transposed=head == "tied")
        logp, ent = fn(h, project, y)
        return jnp.sum(logp) + (0.0 if ent is None else jnp.sum(ent))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.lower(h, w, y).compile().memory_analysis()


def _mib(n_bytes) -> str:
    return f"{n_bytes / 2**20:.1f} MiB ({n_bytes / CHUNK_LOGITS:.3f}x chunk logits)"


@pytest.mark.parametrize("head,vocab_block,compute_entropy", [  # the CI runs one case per head
    ("kernel", 8192, True), ("tied", 8192, False),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("kernel", 8192, False), ("tied", 8192, True), ("kernel", 4096, False),
        ("kernel", 4096, True)])])
def test_lm_head_memory_is_far_below_a_chunk_of_logits(head, vocab_block, compute_entropy):
    """The acceptance bound: temporaries of the compiled step < 2x one chunk's logits, io aside."""
    stats = _compiled_memory(
        lambda h, p, y: token_logprobs(h, p, y, MEM_CHUNK, compute_entropy, vocab_block), head
    )
    if stats is None:
        pytest.skip("this backend reports no compiled memory statistics")
    tile = MEM_CHUNK * vocab_block * 4  # one [chunk, vocab_block] f32 tile
    print(
        f"\n{head} vocab_block={vocab_block} entropy={compute_entropy}: "
        f"temp {_mib(stats.temp_size_in_bytes)}, "
        f"args+outputs {_mib(stats.argument_size_in_bytes + stats.output_size_in_bytes)}"
    )
    assert stats.temp_size_in_bytes < 2 * CHUNK_LOGITS
    # a few [chunk, vocab_block] tiles: no [chunk, V] buffer, no copy of the [D, V] weight or grad
    assert stats.temp_size_in_bytes < 5 * tile < CHUNK_LOGITS / 2


@pytest.mark.parametrize("compute_entropy", [False, True])
def test_callable_backward_memory_is_bounded_by_a_chunk(compute_entropy):
    """An opaque projection holds one chunk's logits and their cotangent (2x, plus O(chunk))."""
    chunked = _compiled_memory(
        lambda h, p, y: token_logprobs(h, p, y, MEM_CHUNK, compute_entropy)
    )
    dense = _compiled_memory(lambda h, p, y: token_logprobs_dense(h, p, y, compute_entropy))
    if chunked is None or dense is None:
        pytest.skip("this backend reports no compiled memory statistics")
    print(
        f"\ncallable entropy={compute_entropy}: temp chunked {_mib(chunked.temp_size_in_bytes)}, "
        f"temp dense {_mib(dense.temp_size_in_bytes)}"
    )
    assert chunked.temp_size_in_bytes < 2.01 * CHUNK_LOGITS
    # the dense version holds [T, V] f32 logits (594 MiB) and more; chunking must be far below it
    full_logits = MEM_B * MEM_T * MEM_V * 4
    assert dense.temp_size_in_bytes > full_logits
    assert chunked.temp_size_in_bytes * 4 < dense.temp_size_in_bytes
