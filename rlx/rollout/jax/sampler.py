"""Choosing each row's next token from its logits: greedy, or a draw after temperature, top-k,
top-p and min-p, with the raw policy's log-prob of the token taken.

Order and semantics as in Hugging Face ``generate`` and vLLM: the logits are divided by the
temperature; ``top_k`` keeps the k largest; ``top_p`` keeps the nucleus of what is left (the
smallest set, in descending order, whose mass reaches ``top_p``, renormalised over the top-k
where both are set; the token that crosses ``top_p`` is kept); ``min_p`` keeps the tokens whose
probability is at least ``min_p`` times the largest. One token is drawn with ``categorical`` (a
two-level inverse CDF, steady under last-bit changes of the logits).

No step sorts the vocabulary. Top-k is ``lax.top_k``. Top-p alone looks at the
``SamplerSpec.candidates`` largest logits, normalised by the whole vocabulary's log-sum-exp.
The nucleus lies inside them whenever their mass reaches ``top_p``. A row whose candidates do not
reach it takes a full sort, under a ``lax.cond`` that runs only when some row needs it. Every
other row keeps its candidate draw, so no row's token depends on its neighbours. Min-p
alone is a threshold on the logits.

Every row has its own key, ``fold_in(fold_in(key(seed), uid_hash), sample_index)``, folded with
the step number at every step, so a request's samples do not depend on how requests were batched.
The recorded log-prob is that of the *raw policy* (``log_softmax`` of the f32 logits at
temperature 1 over the whole vocabulary, at the sampled token): what the learner's
``token_logprobs`` computes, not the log-prob under the tempered, truncated distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, UInt32

@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """The static part of the sampling settings (their values are ``Knobs``, traced)."""

    greedy: bool = False
    top_k: int | None = None
    top_p: bool = False  # whether a nucleus cut is applied
    min_p: bool = False  # whether a min-p cut is applied
    logprobs: bool = True  # False: no log-sum-exp over the vocabulary; the log-probs are NaN
    candidates: int = 1024  # top-p without top-k: the largest logits the nucleus is sought in

    @classmethod
    def of(cls, sampling) -> "SamplerSpec":
        """The static settings of ``sampling`` (``rlx.types.SamplingParams``)."""
        return cls(greedy=sampling.temperature == 0, top_k=sampling.top_k,
                   top_p=sampling.top_p is not None and sampling.top_p < 1,
                   min_p=bool(sampling.min_p), logprobs=sampling.logprobs)


@struct.dataclass
class Knobs:
    """The traced sampling values (one compiled program serves every value)."""

    temperature: Float[Array, ""]  # > 0 (greedy is SamplerSpec.greedy)
    top_p: Float[Array, ""]  # in (0, 1]
    min_p: Float[Array, ""]  # in [0, 1]

    @classmethod
    def of(cls, temperature: float, top_p: float | None, min_p: float | None) -> "Knobs":
        """Host values: temperature 0 (greedy) stands as 1, top-p None as 1, min-p None as 0."""
        f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        return cls(f32(temperature or 1.0), f32(1.0 if top_p is None else top_p),
                   f32(min_p or 0.0))

    @classmethod
    def of_sampling(cls, sampling) -> "Knobs":
        """The values of ``sampling`` (``rlx.types.SamplingParams``)."""
        return cls.of(sampling.temperature, sampling.top_p, sampling.min_p)


CDF_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _count_le(cdf: Float[Array, " n"], u: Float[Array, ""]) -> Int[Array, ""]:
    """Entries of a non-decreasing ``cdf`` that are <= ``u``: the index of the first one above."""
    return jnp.sum(cdf <= u, dtype=jnp.int32)


def _last_positive(w: Float[Array, " n"]) -> Int[Array, ""]:
    return jnp.max(jnp.where(w > 0, jnp.arange(w.shape[0], dtype=jnp.int32), 0))


def categorical(key, logits: Float[Array, " v"]) -> Int[Array, ""]:
    """One draw from softmax(logits) by inverting its CDF in two levels, a uniform number each.

    Exact in distribution like the Gumbel-max trick of ``jax.random.categorical`` but it needs two
    random numbers per row instead of one per vocabulary entry (the PRNG dominated a decode step on
    a CPU). No pass runs over the whole vocabulary sequentially (a flat ``cumsum`` + binary search
    cost as much as the model's output projection on a CPU): the weights ``exp(logits - max)`` are
    summed per block of ``CDF_BLOCK`` entries; a block is drawn by its share of the total (the
    first whose cumulative mass exceeds ``u0`` x total), then an entry by its share of that block
    (the first whose cumulative weight exceeds ``u1`` x the block's). P(entry) = P(block) x
    P(entry | block) = its softmax probability.

    Drawing the entry with its own number inside its block, rather than locating one number on
    the whole vocabulary's running sum, keeps the draw steady under last-bit changes of the
    logits (the same weights computed on another device count): in f32 a running sum near the
    total mass of a near-uniform vocabulary is rounded to about 1e-3 of one entry's weight, a
    sum inside a block to about 1e-5. Entries at -inf have zero width and are never drawn (a zero
    weight never moves a cumulative sum past ``u``; rounding at the very end falls back to the
    last positive entry).
    """
    v = logits.shape[0]
    nb = -(-v // CDF_BLOCK)
    w = jnp.exp(logits - jnp.max(logits))  # [v] unnormalised probabilities
    blocks = jnp.pad(w, (0, nb * CDF_BLOCK - v)).reshape(nb, CDF_BLOCK)  # [nb, B]
    mass = jnp.sum(blocks, axis=-1)  # [nb]
    upto = jnp.cumsum(mass)  # [nb] inclusive
    u = jax.random.uniform(key, (2,), jnp.float32)  # the block's number, the entry's number
    blk = jnp.minimum(_count_le(upto, u[0] * upto[-1]), _last_positive(mass))
    row = blocks[blk]  # [B]
    within = jnp.cumsum(row)  # [B] inclusive
    j = jnp.minimum(_count_le(within, u[1] * within[-1]), _last_positive(row))
    return (blk * CDF_BLOCK + j).astype(jnp.int32)


def first_argmax(x: Float[Array, "..."], axis: int = -1) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """(``jnp.argmax`` of a 2-d ``x`` over ``axis``, ties to the lowest index; the maxima).

    ``axis=-1`` for rows ``[b, v]``, ``axis=0`` for vocabulary-major ``[v, b]`` (the engine's
    greedy decode of a few rows). Tiled so that only one pass reads the whole vocabulary: the
    maxima of ``CDF_BLOCK``-wide tiles, then the first tile holding the maximum, then the first
    position in that tile. XLA:CPU runs the (value, index) pair reduction of ``argmax`` over a
    whole vocabulary several times slower, and a mask-and-min formulation needs three passes. A
    NaN row gives some index in range.
    """
    ax = axis % 2  # the vocabulary axis of x; tiles are [b, nt, B] (ax 1) or [nt, B, b] (ax 0)
    v, b = x.shape[ax], x.shape[1 - ax]
    nt = -(-v // CDF_BLOCK)
    pad = [(0, 0), (0, 0)]
    pad[ax] = (0, nt * CDF_BLOCK - v)
    tiles = jnp.pad(x, pad, constant_values=-jnp.inf)
    tiles = tiles.reshape((b, nt, CDF_BLOCK) if ax else (nt, CDF_BLOCK, b))
    across, within = (1, 2) if ax else (0, 1)  # axes of the tile index and inside a tile
    # the barrier keeps XLA from folding max(tile maxima) into a second pass over the vocabulary
    tile_max = jax.lax.optimization_barrier(jnp.max(tiles, axis=within))  # [b, nt] or [nt, b]
    top = jnp.max(tile_max, axis=across)  # [b]
    t = jnp.argmax(tile_max == jnp.expand_dims(top, across), axis=across)  # [b] first such tile
    pick = t[:, None, None] if ax else t[None, None, :]
    tile = jnp.squeeze(jnp.take_along_axis(tiles, pick, axis=across), across)  # [b, B] / [B, b]
    j = jnp.argmax(tile == jnp.expand_dims(top, ax), axis=ax)  # [b]
    return jnp.minimum(t * CDF_BLOCK + j, v - 1).astype(jnp.int32), top


def _nucleus(vals: Float[Array, "b c"], lse: Float[Array, "b 1"], top_p) -> Float[Array, "b c"]:
    """``vals`` (descending) cut to the nucleus of mass ``top_p`` of ``exp(vals - lse)``."""
    probs = jnp.exp(vals - lse)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
    return jnp.where(before < top_p, vals, -jnp.inf)  # the first token is always kept


def _min_p(vals: Float[Array, "b c"], top: Float[Array, "b 1"], min_p) -> Float[Array, "b c"]:
    """``vals`` without the tokens less likely than ``min_p`` times the likeliest (``top``)."""
    return jnp.where(vals >= top + jnp.log(min_p), vals, -jnp.inf)


def truncate(z: Float[Array, "b v"], knobs: Knobs, spec: SamplerSpec
             ) -> tuple[Float[Array, "b c"], Int[Array, "b c"] | None, Array | None]:
    """The tempered logits ``z`` cut by ``spec``'s top-k, top-p and min-p: ``(vals, idx,
    covered)``; ``vals[r, j]`` is token ``idx[r, j]``'s logit or -inf where cut (``idx`` None:
    ``vals`` is over the whole vocabulary). With top-p alone, ``vals`` are the
    ``spec.candidates`` largest and ``covered [b]`` tells which rows' nucleus lies inside them
    (``sample_tokens`` sorts the others in full); else ``covered`` is None."""
    v = z.shape[-1]
    if spec.top_k is None and not spec.top_p:
        vals = _min_p(z, jnp.max(z, -1, keepdims=True), knobs.min_p) if spec.min_p else z
        return vals, None, None
    k = spec.top_k if spec.top_k is not None else spec.candidates
    vals, idx = jax.lax.top_k(z, min(k, v))  # [b, c] descending, ties to the lower id
    covered = None
    if spec.top_p:
        if spec.top_k is not None:  # the nucleus of the top-k, renormalised
            lse = jax.nn.logsumexp(vals, axis=-1, keepdims=True)
        else:
            lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
            covered = jnp.sum(jnp.exp(vals - lse), axis=-1) >= knobs.top_p
        vals = _nucleus(vals, lse, knobs.top_p)
    if spec.min_p:
        vals = _min_p(vals, vals[:, :1], knobs.min_p)
    return vals, idx, covered


def _draw(keys, vals: Float[Array, "b c"], idx: Int[Array, "b c"] | None) -> Int[Array, " b"]:
    choice = jax.vmap(categorical)(keys, vals)  # [b]
    if idx is None:
        return choice
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample_tokens(logits: Float[Array, "b v"], keys, knobs: Knobs, spec: SamplerSpec
                  ) -> Int[Array, " b"]:
    """One token per row from f32 ``logits`` under ``spec``; ``keys`` holds one PRNG key per row."""
    if spec.greedy:
        return first_argmax(logits)[0]
    z = logits / knobs.temperature  # [b, v]
    vals, idx, covered = truncate(z, knobs, spec)
    tok = _draw(keys, vals, idx)
    if covered is None:
        return tok

    def sort_all(_):  # the rows whose nucleus reaches past the candidates
        full = dataclasses.replace(spec, candidates=z.shape[-1])
        return jnp.where(covered, tok, _draw(keys, *truncate(z, knobs, full)[:2]))

    return jax.lax.cond(jnp.all(covered), lambda _: tok, sort_all, None)


def pick(logits, keys, step, knobs: Knobs, spec: SamplerSpec, vocab_axis: int = -1):
    """Sampled token and its raw-policy log-prob for every row at ``step`` (one for all rows,
    or each row's own ``[b]``).

    The log-prob is ``log_softmax``'s arithmetic (``x - max - log(sum(exp(x - max)))``) at the
    token only, so the [b, v] log-softmax is never written out; greedy reuses the row maxima.
    ``vocab_axis=0``: greedy only, on vocabulary-major ``[v, b]`` logits. Without
    ``spec.logprobs`` the log-probs are NaN and no pass over the vocabulary computes them.
    """
    logits = logits.astype(jnp.float32)  # [b, v] or [v, b]
    ax = vocab_axis % 2
    if ax == 0 and not spec.greedy:
        raise ValueError("vocabulary-major logits are picked greedily only")
    if spec.greedy:
        tok, top = first_argmax(logits, ax)  # [b] each
    else:
        step_keys = jax.vmap(jax.random.fold_in, (0, 0 if jnp.ndim(step) else None))(keys, step)
        tok = sample_tokens(logits, step_keys, knobs, spec)  # [b]
    if not spec.logprobs:
        return tok, jnp.full(tok.shape, jnp.nan, jnp.float32)
    if not spec.greedy:
        top = jnp.max(logits, axis=-1)  # [b]
    top = jnp.expand_dims(jax.lax.stop_gradient(top), ax)  # [b, 1] or [1, b]
    lse = jnp.log(jnp.sum(jnp.exp(logits - top), axis=ax))  # [b]
    if spec.greedy:  # the picked logit is the maximum itself: no gather over the vocabulary
        return tok, -lse
    picked = jnp.take_along_axis(logits, jnp.expand_dims(tok, ax), axis=ax)  # [b, 1] or [1, b]
    return tok, jnp.squeeze(picked - top, ax) - lse


def next_tokens(model, h, keys, step, knobs: Knobs, spec: SamplerSpec, adapter: bool):
    """``pick`` on the logits of the last hidden states ``h [b, d]``: greedy decoding takes
    them vocabulary-major when the head allows it (``Transformer.vocab_major_logits``)."""
    if spec.greedy:
        logits_t = model.vocab_major_logits(h, adapter)  # [v, b] or None
        if logits_t is not None:
            return pick(logits_t, keys, step, knobs, spec, vocab_axis=0)
    return pick(model.logits(h, adapter), keys, step, knobs, spec)


def row_keys(seed: Int[Array, ""], uid_hash: UInt32[Array, " b"], sample_index: Int[Array, " b"]):
    """One typed PRNG key per row: ``fold_in(fold_in(key(seed), uid_hash), sample_index)``."""
    base = jax.random.key(seed)
    fold = jax.vmap(jax.random.fold_in, (0, 0))
    return fold(jax.vmap(jax.random.fold_in, (None, 0))(base, uid_hash), sample_index)
