"""Per-token log-probabilities (and entropies) without materialising [B, T, V] logits.

The learner needs `log softmax(h_t W)[y_t]` for every generated token. With a 150k vocabulary a
dense [B, T, V] f32 logits tensor (and its cotangent in the backward pass) dominates memory, so
`token_logprobs` flattens the B*T tokens, splits them into chunks of `chunk_size` tokens and maps a
`jax.checkpoint`-ed chunk function over them with `lax.map` (a scan). The forward pass keeps only
the per-token results; the backward pass recomputes one chunk's logits at a time, so peak
temporary memory is a small multiple of one chunk's `chunk_size * V * 4` bytes.

This is the "chunked cross-entropy" idea used by several LLM trainers. It departs from a fused
kernel (e.g. a Pallas/Triton linear-cross-entropy) in that the lm-head is an opaque `project`
callable and XLA decides the fusion; the price is recomputing the projection in the backward pass.

Inside a chunk, log-softmax and entropy have a hand-written VJP: the cotangent of the logits is
one fused elementwise expression, `-p * (g_logp + g_H * (z - E_p[z]))`, plus `g_logp` added in place
at the target ids. Plain autodiff of the same code keeps `exp(z - max)`, `p` and `p * z` alive as
separate [chunk, V] buffers (and a gather's cotangent is a scatter into a fresh zero buffer), which
doubles the peak. Log-softmax is always computed in f32, whatever dtype `project` returns.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

Projection = Callable[[Float[Array, "... d"]], Float[Array, "... v"]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logp_entropy_from_logits(
    logits: Float[Array, "n v"], targets: Int[Array, " n"], compute_entropy: bool
) -> tuple[Float[Array, " n"], ...]:
    """f32 (log p(target),) or (log p(target), entropy) of softmax(logits), per row."""
    out, _ = _logp_entropy_fwd(logits, targets, compute_entropy)
    return out


def _logp_entropy_fwd(logits, targets, compute_entropy):
    z = logits.astype(jnp.float32)  # [n, V]
    z_max = jnp.max(z, axis=-1, keepdims=True)  # [n, 1]
    shifted = jnp.exp(z - z_max)  # [n, V]
    total = jnp.sum(shifted, axis=-1)  # [n]
    lse = z_max[:, 0] + jnp.log(total)  # [n]
    logp = jnp.take_along_axis(z, targets[:, None], axis=-1)[:, 0] - lse  # [n]
    if not compute_entropy:
        return (logp,), (logits, targets, lse, None)
    mean_logit = jnp.sum(shifted * z, axis=-1) / total  # [n]  E_p[z]
    entropy = lse - mean_logit  # [n]
    return (logp, entropy), (logits, targets, lse, entropy)


def _logp_entropy_bwd(compute_entropy, residuals, cotangents):
    """d logp / dz = onehot(y) - p;  d H / dz = -p * (z - E_p[z]),  E_p[z] = lse - H."""
    logits, targets, lse, entropy = residuals
    z = logits.astype(jnp.float32)  # [n, V]
    g_logp = cotangents[0]  # [n]
    coef = g_logp[:, None]  # [n, 1]
    if compute_entropy:
        coef = coef + cotangents[1][:, None] * (z - (lse - entropy)[:, None])  # [n, V]
    d_z = -jnp.exp(z - lse[:, None]) * coef  # [n, V]
    rows = jnp.arange(z.shape[0])
    d_z = d_z.at[rows, targets].add(g_logp)  # [n, V]  the one-hot term, in place
    return d_z.astype(logits.dtype), None


_logp_entropy_from_logits.defvjp(_logp_entropy_fwd, _logp_entropy_bwd)


def _check_shapes(hidden: Array, targets: Array) -> None:
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, T, D] and targets [B, T]; got hidden {hidden.shape}, "
            f"targets {targets.shape}"
        )


def token_logprobs(
    hidden: Float[Array, "b t d"],
    project: Projection,
    targets: Int[Array, "b t"],
    chunk_size: int,
    compute_entropy: bool = False,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"] | None]:
    """Chunked f32 log p(targets | hidden) and entropy, differentiable wrt hidden and `project`.

    Args:
      hidden: final hidden states (after the last norm).
      project: the lm-head, e.g. `lambda h: h @ w`; it may close over (traced) params.
      targets: the token id predicted at each position.
      chunk_size: tokens per chunk (over the flattened B*T tokens); T need not divide it.
      compute_entropy: also return the per-token entropy of the softmax.
    Returns:
      (logp [B, T] f32, entropy [B, T] f32 or None).
    """
    _check_shapes(hidden, targets)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, d = hidden.shape
    n_tokens = b * t
    chunk_size = min(chunk_size, max(n_tokens, 1))
    n_chunks = -(-n_tokens // chunk_size)
    pad = n_chunks * chunk_size - n_tokens
    flat_h = hidden.reshape(n_tokens, d)  # [N, D]
    flat_y = targets.reshape(n_tokens)  # [N]
    if pad:
        flat_h = jnp.pad(flat_h, ((0, pad), (0, 0)))  # [N + pad, D]
        flat_y = jnp.pad(flat_y, (0, pad))  # [N + pad]
    chunks_h = flat_h.reshape(n_chunks, chunk_size, d)  # [K, C, D]
    chunks_y = flat_y.reshape(n_chunks, chunk_size)  # [K, C]

    @jax.checkpoint
    def one_chunk(xs):
        h_c, y_c = xs  # [C, D], [C]
        return _logp_entropy_from_logits(project(h_c), y_c, compute_entropy)

    outs = jax.lax.map(one_chunk, (chunks_h, chunks_y))  # each [K, C]
    unchunk = lambda x: x.reshape(n_chunks * chunk_size)[:n_tokens].reshape(b, t)  # noqa: E731
    logp = unchunk(outs[0])
    entropy = unchunk(outs[1]) if compute_entropy else None
    return logp, entropy


def token_logprobs_dense(
    hidden: Float[Array, "b t d"],
    project: Projection,
    targets: Int[Array, "b t"],
    compute_entropy: bool = False,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"] | None]:
    """Reference: the same quantities from the full [B, T, V] logits (tests and small models)."""
    _check_shapes(hidden, targets)
    logits = project(hidden).astype(jnp.float32)  # [B, T, V]
    log_probs = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V]
    logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, T]
    if not compute_entropy:
        return logp, None
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)  # [B, T]
    return logp, entropy
