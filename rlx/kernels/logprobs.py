"""Per-token log-probabilities (and entropies) without materialising [B, T, V] logits.

The learner needs `log softmax(h_t W)[y_t]` for every generated token. With a 150k vocabulary a
dense [B, T, V] f32 logits tensor (and its cotangent in the backward pass) dominates memory, so
`token_logprobs` flattens the B*T tokens and splits them into chunks of `chunk_size` tokens. The
forward pass keeps only per-token results; the backward pass recomputes logits. This is the
"chunked cross-entropy" idea used by several LLM trainers, done in plain XLA (no fused kernel);
the price is recomputing the projection in the backward pass. How far the vocabulary is split
depends on what `project` is:

* an `LMHead` (a float weight, `[D, V]` kernel or tied `[V, D]` embedding, optional `[V]` bias and
  matmul dtype): the vocabulary is also split into blocks of `vocab_block` columns, so the unit of
  work is a [chunk, vocab_block] tile and no [chunk, V] buffer exists in either pass. The forward
  pass merges per-tile (max, sum of exp, sum of exp * logit) statistics into each token's
  logsumexp and entropy (an online logsumexp); the backward pass, a hand-written VJP of the whole
  computation, keeps only those O(tokens) statistics and, per tile, rebuilds the logits, forms
  their cotangent and accumulates `dh += dz W_blk^T`, `dW_blk += h^T dz` (and the bias). The
  last block of a vocabulary that `vocab_block` does not divide is shifted left to end at V and
  its columns already covered by the previous block are masked, so the weight is never padded.
  dW accumulates over chunks in the weight's dtype (pass an f32 master weight and a bf16 `dtype`
  for a bf16 matmul with f32 gradients). Peak temporary memory is a few [chunk, vocab_block] f32
  tiles. The backward pass sees which inputs and outputs take part in differentiation (the
  custom VJP's symbolic zeros): it skips dW when nothing differentiates the head (a frozen base,
  LoRA mode) and the entropy term when the entropy is only reported. Use this for a plain float
  lm-head (`rlx.learner.step.logprob_head` does). The blocks are dynamic slices along V: under XLA's
  SPMD partitioner a vocabulary-sharded (tensor-parallel) weight is all-gathered to slice it, so
  there the callable form, whose logits stay sharded over V, may use less memory.
* any callable `h -> logits` (a LoRA-adapted, quantized or otherwise opaque lm-head closing over
  params): it can only be applied to whole rows, so a `jax.checkpoint`-ed chunk function is mapped
  over the chunks with `lax.map`, and the backward pass holds one chunk's [chunk, V] logits and
  their cotangent: peak temporary memory is about twice one chunk's `chunk_size * V * 4` bytes.
  Inside a chunk, log-softmax and entropy have a hand-written VJP: the cotangent of the logits is
  one fused elementwise expression, `-p * (g_logp + g_H * (z - E_p[z]))`, plus `g_logp` added in
  place at the target ids (plain autodiff keeps `exp(z - max)`, `p` and `p * z` alive as separate
  [chunk, V] buffers and scatters the gather's cotangent into a fresh zero buffer).

Either way log-softmax is computed in f32, whatever dtype the projection returns, and both paths
give the same values and gradients (to float rounding) as `token_logprobs_dense`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values
from jaxtyping import Array, Float, Int

Projection = Callable[[Float[Array, "... d"]], Float[Array, "... v"]]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["weight", "bias"], meta_fields=["transposed", "dtype", "out_dtype"],
)
@dataclasses.dataclass(frozen=True)
class LMHead:
    """A float lm-head whose vocabulary columns can be sliced: `logits = h @ W (+ bias)`.

    `weight` is a `[D, V]` kernel, or a `[V, D]` (tied input) embedding when `transposed`. The
    matmul multiplies operands in `dtype` (None: the promoted dtype of hidden and weight),
    accumulates in f32 and rounds to `out_dtype` (None: `dtype`), where the bias is added, like a
    `Linear` layer computing in its compute dtype (`out_dtype=float32` keeps the accumulator, as a
    tied head in a low-precision model does). Calling it gives the full logits.
    """

    weight: Float[Array, "d v"] | Float[Array, "v d"]
    bias: Float[Array, " v"] | None = None
    transposed: bool = False
    dtype: Any = None
    out_dtype: Any = None

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0 if self.transposed else 1]

    def compute_dtype(self, hidden_dtype) -> jnp.dtype:
        if self.dtype is not None:
            return jnp.dtype(self.dtype)
        return jnp.result_type(hidden_dtype, self.weight.dtype)

    def block(self, start: Int[Array, ""], size: int) -> LMHead:
        """The head restricted to vocabulary columns [start, start + size)."""
        weight = lax.dynamic_slice_in_dim(self.weight, start, size, 0 if self.transposed else 1)
        bias = None if self.bias is None else lax.dynamic_slice_in_dim(self.bias, start, size)
        return dataclasses.replace(self, weight=weight, bias=bias)

    def __call__(self, h: Float[Array, "... d"]) -> Float[Array, "... v"]:
        cd = self.compute_dtype(h.dtype)
        out = jnp.dtype(self.out_dtype or cd)
        spec = "...d,vd->...v" if self.transposed else "...d,dv->...v"
        z = jnp.einsum(spec, h.astype(cd), self.weight.astype(cd),
                       preferred_element_type=jnp.float32).astype(out)
        return z if self.bias is None else z + self.bias.astype(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logp_entropy_from_logits(
    logits: Float[Array, "n v"], targets: Int[Array, " n"], compute_entropy: bool
) -> tuple[Float[Array, " n"], ...]:
    """f32 (log p(target),) or (log p(target), entropy) of softmax(logits), per row."""
    out, _ = _logp_entropy(logits, targets, compute_entropy)
    return out


def _logp_entropy_fwd(logits, targets, compute_entropy):
    logits, targets = custom_vjp_primal_tree_values((logits, targets))  # symbolic zeros
    return _logp_entropy(logits, targets, compute_entropy)


def _logp_entropy(logits, targets, compute_entropy):
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
    g_logp = _instantiate(cotangents[0], lse)  # [n]
    coef = g_logp[:, None]  # [n, 1]
    if compute_entropy and not isinstance(cotangents[1], SymbolicZero):  # else only reported
        coef = coef + cotangents[1][:, None] * (z - (lse - entropy)[:, None])  # [n, V]
    d_z = -jnp.exp(z - lse[:, None]) * coef  # [n, V]
    rows = jnp.arange(z.shape[0])
    d_z = d_z.at[rows, targets].add(g_logp)  # [n, V]  the one-hot term, in place
    return d_z.astype(logits.dtype), None


_logp_entropy_from_logits.defvjp(_logp_entropy_fwd, _logp_entropy_bwd, symbolic_zeros=True)


def _check_shapes(hidden: Array, targets: Array) -> None:
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, T, D] and targets [B, T]; got hidden {hidden.shape}, "
            f"targets {targets.shape}"
        )


class _Blocking(NamedTuple):
    """Static settings of the blocked path (hashable: a non-differentiable custom_vjp argument)."""

    vocab_block: int
    compute_entropy: bool


def _vocab_blocks(vocab_size: int, vocab_block: int) -> tuple[Int[Array, " k"], Int[Array, " k"]]:
    """Start column of each block, and the first column it owns (earlier ones are masked).

    Block k owns columns [k * vocab_block, ...); the last block starts at V - vocab_block so that
    it stays inside the weight, and overlaps the previous one when vocab_block does not divide V.
    """
    owned = np.arange(0, vocab_size, vocab_block, dtype=np.int32)  # [K]
    return jnp.asarray(np.minimum(owned, vocab_size - vocab_block)), jnp.asarray(owned)


def _tile(
    sub: LMHead, h_c: Float[Array, "c d"], y_c: Int[Array, " c"], start, owned
) -> tuple[Float[Array, "c vb"], Array, Array]:
    """f32 logits of one [chunk, block] tile, its owned-column mask and its target mask."""
    z = sub(h_c).astype(jnp.float32)  # [C, Vb]
    cols = start + jnp.arange(z.shape[1])  # [Vb]
    valid = (cols >= owned)[None, :]  # [1, Vb]
    return z, valid, valid & (cols[None, :] == y_c[:, None])  # ..., [C, Vb]


def _tile_stats(z, valid, is_target) -> tuple[Float[Array, " c"], ...]:
    """Per row over owned columns: max m, sum e, sum e * (z - m) with e = exp(z - m), and z[y]."""
    m = jnp.max(jnp.where(valid, z, -jnp.inf), axis=-1)  # [C]
    shifted = jnp.where(valid, z - m[:, None], 0.0)  # [C, Vb]
    e = jnp.where(valid, jnp.exp(shifted), 0.0)  # [C, Vb]
    z_y = jnp.sum(jnp.where(is_target, z, 0.0), axis=-1)
    return m, jnp.sum(e, axis=-1), jnp.sum(e * shifted, axis=-1), z_y


def _merge_stats(a, b):
    """Combine the statistics of two disjoint column sets (online logsumexp)."""
    m = jnp.maximum(a[0], b[0])
    scale_a, scale_b = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    total = a[1] * scale_a + b[1] * scale_b
    moment = scale_a * (a[2] + a[1] * (a[0] - m)) + scale_b * (b[2] + b[1] * (b[0] - m))
    return m, total, moment, a[3] + b[3]


def _blocked_chunk_forward(head: LMHead, h_c, y_c, blocks, vocab_block: int):
    """(log p(y), entropy, logsumexp) of one chunk, merged over the vocabulary blocks: [C] each."""

    def stats(start, owned):
        return _tile_stats(*_tile(head.block(start, vocab_block), h_c, y_c, start, owned))

    def body(acc, block):
        return _merge_stats(acc, stats(*block)), None

    starts, owned = blocks
    init = stats(starts[0], owned[0])
    (m, total, moment, z_y), _ = lax.scan(body, init, (starts[1:], owned[1:]))
    log_total = jnp.log(total)
    lse = m + log_total
    return z_y - lse, log_total - moment / total, lse  # H = log sum e - E_p[z - m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked_logprobs(
    cfg: _Blocking, head: LMHead, chunks_h: Float[Array, "k c d"], chunks_y: Int[Array, "k c"]
) -> tuple[Float[Array, "k c"], ...]:
    """f32 (log p(y),) or (log p(y), entropy) per token of `head(chunks_h)`, tile by tile."""
    return _blocked_forward(cfg, head, chunks_h, chunks_y)[0]


def _blocked_forward(cfg: _Blocking, head: LMHead, chunks_h, chunks_y):
    """((log p(y),) or (log p(y), entropy), logsumexp), each [K, C]."""
    blocks = _vocab_blocks(head.vocab_size, cfg.vocab_block)
    logp, entropy, lse = lax.map(
        lambda xs: _blocked_chunk_forward(head, *xs, blocks, cfg.vocab_block), (chunks_h, chunks_y)
    )  # [K, C] each
    return ((logp, entropy) if cfg.compute_entropy else (logp,)), lse


def _blocked_fwd(cfg: _Blocking, head, chunks_h, chunks_y):
    # symbolic zeros: each leaf arrives as CustomVJPPrimal(value, perturbed); a head that nothing
    # differentiates (a frozen base) gets no weight gradient in the backward pass
    head_grad = any(leaf.perturbed for leaf in jax.tree.leaves(head))
    head, chunks_h, chunks_y = custom_vjp_primal_tree_values((head, chunks_h, chunks_y))
    outs, lse = _blocked_forward(cfg, head, chunks_h, chunks_y)
    # `()` / `None` tell the backward pass (by pytree structure) whether dW is wanted
    residuals = (head, chunks_h, chunks_y, lse, outs[1] if cfg.compute_entropy else None,
                 () if head_grad else None)
    return outs, residuals


def _tile_cotangent(z, valid, is_target, lse, g_logp, entropy, g_entropy) -> Float[Array, "c vb"]:
    """d/dz of g_logp * log p(y) + g_H * H:  g_logp * (onehot(y) - p) - g_H * p * (z - E_p[z])."""
    coef = g_logp[:, None]  # [C, 1]
    if g_entropy is not None:
        coef = coef + g_entropy[:, None] * (z - (lse - entropy)[:, None])  # [C, Vb]
    d_z = jnp.where(is_target, g_logp[:, None], 0.0) - jnp.exp(z - lse[:, None]) * coef
    return jnp.where(valid, d_z, 0.0)


def _add_block(total: Array, block: Array, start, axis: int) -> Array:
    """total[start : start + size] += block along `axis`, in place, in total's dtype."""
    old = lax.dynamic_slice_in_dim(total, start, block.shape[axis], axis)
    return lax.dynamic_update_slice_in_dim(total, (old + block).astype(total.dtype), start, axis)


def _blocked_chunk_backward(head: LMHead, xs, acc, blocks, vocab_block: int):
    """One chunk's cotangent wrt its hidden states; adds its dW (and d bias) to `acc` unless
    `acc` is None (a frozen head)."""
    h_c, y_c, lse, g_logp, entropy, g_entropy = xs
    cd = head.compute_dtype(h_c.dtype)
    h_cd = h_c.astype(cd)
    axis, spec_h, spec_w = (0, "cv,vd->cd", "cd,cv->vd") if head.transposed else (
        1, "cv,dv->cd", "cd,cv->dv")

    def tile(carry, block):
        d_h, acc = carry
        sub = head.block(block[0], vocab_block)
        z, valid, is_target = _tile(sub, h_c, y_c, *block)
        d_z = _tile_cotangent(z, valid, is_target, lse, g_logp, entropy, g_entropy).astype(cd)
        f32 = jnp.float32
        d_h = d_h + jnp.einsum(spec_h, d_z, sub.weight.astype(cd), preferred_element_type=f32)
        if acc is None:
            return (d_h, acc), None
        d_w, d_b = acc
        d_w_blk = jnp.einsum(spec_w, h_cd, d_z, preferred_element_type=f32)  # [D, Vb] or [Vb, D]
        d_w = _add_block(d_w, d_w_blk, block[0], axis)
        if d_b is not None:
            d_b = _add_block(d_b, jnp.sum(d_z, axis=0, dtype=f32), block[0], 0)
        return (d_h, (d_w, d_b)), None

    (d_h, acc), _ = lax.scan(tile, (jnp.zeros(h_c.shape, jnp.float32), acc), blocks)
    return acc, d_h.astype(h_c.dtype)


def _blocked_bwd(cfg: _Blocking, residuals, cotangents):
    head, chunks_h, chunks_y, lse, entropy, head_grad = residuals
    g_logp = _instantiate(cotangents[0], lse)
    g_entropy = cotangents[1] if cfg.compute_entropy else None
    if isinstance(g_entropy, SymbolicZero):  # entropy only reported: no entropy term at all
        g_entropy = None
    blocks = _vocab_blocks(head.vocab_size, cfg.vocab_block)
    acc = None
    if head_grad is not None:
        acc = (jnp.zeros_like(head.weight), None if head.bias is None else jnp.zeros_like(head.bias))
    xs = (chunks_h, chunks_y, lse, g_logp, entropy, g_entropy)
    acc, d_h = lax.scan(
        lambda acc, x: _blocked_chunk_backward(head, x, acc, blocks, cfg.vocab_block), acc, xs)
    d_head = None if acc is None else dataclasses.replace(head, weight=acc[0], bias=acc[1])
    return d_head, d_h, None


def _instantiate(cotangent, like: Array) -> Array:
    """A cotangent as an array: a symbolic zero becomes zeros shaped like `like`."""
    if isinstance(cotangent, SymbolicZero):
        return jnp.zeros(like.shape, like.dtype)
    return cotangent


_blocked_logprobs.defvjp(_blocked_fwd, _blocked_bwd, symbolic_zeros=True)


def _callable_logprobs(project: Projection, chunks_h, chunks_y, compute_entropy: bool):
    """Whole-row chunks through an opaque projection, rematerialised in the backward pass."""

    @jax.checkpoint
    def one_chunk(xs):
        h_c, y_c = xs  # [C, D], [C]
        return _logp_entropy_from_logits(project(h_c), y_c, compute_entropy)

    return jax.lax.map(one_chunk, (chunks_h, chunks_y))  # each [K, C]


def balanced_chunk(n_tokens: int, chunk_size: int) -> int:
    """The chunk length actually used for `n_tokens` tokens and at most `chunk_size` per chunk:
    as many chunks as `chunk_size` needs, of equal length (1536 tokens at 1024 run as 2 x 768,
    not 2 x 1024 with a third of the lm-head work on padding)."""
    n_tokens = max(n_tokens, 1)
    n_chunks = -(-n_tokens // min(chunk_size, n_tokens))
    return -(-n_tokens // n_chunks)


def token_logprobs(
    hidden: Float[Array, "b t d"],
    project: Projection | LMHead,
    targets: Int[Array, "b t"],
    chunk_size: int,
    compute_entropy: bool = False,
    vocab_block: int = 8192,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"] | None]:
    """Chunked f32 log p(targets | hidden) and entropy, differentiable wrt hidden and `project`.

    Args:
      hidden: final hidden states (after the last norm).
      project: the lm-head: an `LMHead` (blocked over the vocabulary, see the module docstring)
        or any callable, e.g. `lambda h: h @ w`, that may close over (traced) params.
      targets: the token id predicted at each position.
      chunk_size: at most this many tokens per chunk (over the flattened B*T tokens); the tokens
        are split into equal chunks (`balanced_chunk`), so nothing needs to divide anything.
      compute_entropy: also return the per-token entropy of the softmax.
      vocab_block: vocabulary columns per block for an `LMHead` (capped at V; need not divide V).
    Returns:
      (logp [B, T] f32, entropy [B, T] f32 or None).
    """
    _check_shapes(hidden, targets)
    if chunk_size < 1 or vocab_block < 1:
        raise ValueError(
            f"chunk_size and vocab_block must be >= 1, got {chunk_size} and {vocab_block}"
        )
    b, t, d = hidden.shape
    n_tokens = b * t
    chunk_size = balanced_chunk(n_tokens, chunk_size)  # pads < n_chunks tokens, not a whole chunk
    n_chunks = -(-n_tokens // chunk_size)
    pad = n_chunks * chunk_size - n_tokens
    flat_h = hidden.reshape(n_tokens, d)  # [N, D]
    flat_y = targets.reshape(n_tokens)  # [N]
    if pad:
        flat_h = jnp.pad(flat_h, ((0, pad), (0, 0)))  # [N + pad, D]
        flat_y = jnp.pad(flat_y, (0, pad))  # [N + pad]
    chunks_h = flat_h.reshape(n_chunks, chunk_size, d)  # [K, C, D]
    # [K, C] by a gather of constant indices, not a reshape: XLA:TPU (libtpu 0.0.52) fails to
    # compile the reshape of a device's 8,192 per-token numbers into [8, 1024] chunks where it
    # places them in alternate memory ("Reshape should have supported layout before reaching the
    # emitter"; the :long recipes' 8,192-token rows split 4 ways)
    chunks_y = flat_y[np.arange(n_chunks * chunk_size).reshape(n_chunks, chunk_size)]
    if isinstance(project, LMHead):
        cfg = _Blocking(min(vocab_block, project.vocab_size), compute_entropy)
        outs = _blocked_logprobs(cfg, project, chunks_h, chunks_y)
    else:
        outs = _callable_logprobs(project, chunks_h, chunks_y, compute_entropy)
    # [K, C] -> [B, T] by a gather of constant indices too (its transpose, in the backward
    # pass, the same reshape of f32 cotangents otherwise)
    flat = np.arange(n_tokens).reshape(b, t)
    unchunk = lambda x: x[flat // chunk_size, flat % chunk_size]  # noqa: E731
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
