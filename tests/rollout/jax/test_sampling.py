"""Device-side sampling helpers of the built-in engine against NumPy and the learner's layout.

``first_argmax`` must equal ``np.argmax`` (ties to the lowest index) in both layouts it serves;
the vocabulary-major greedy pick must give the row-major pick's tokens and log-probs (<= 1e-5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.models import from_hf
from rlx.rollout.jax.sampler import (CDF_BLOCK, Knobs, SamplerSpec, categorical, first_argmax,
                                     next_tokens, pick)
from tests.helpers.hf_zoo import make_hf_model

KNOBS = Knobs.of(1.0, None, None)


def _logits_with_ties(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    rs = np.random.RandomState(seed)
    x = rs.randint(-50, 50, size=(rows, vocab)).astype(np.float32) / 8  # many equal values
    x[0, :] = -np.inf
    x[0, vocab - 1] = 0.0  # the maximum in the last, partial tile
    x[1, [3, CDF_BLOCK + 3, vocab - 2]] = 100.0  # a tie across tiles: the first one wins
    x[2, :] = 7.0  # every entry tied
    return x


@pytest.mark.parametrize("vocab", [CDF_BLOCK * 3 + 17, CDF_BLOCK * 4])
def test_first_argmax_is_numpy_argmax_in_both_layouts(vocab):
    x = _logits_with_ties(9, vocab)
    want = np.argmax(x, axis=-1)
    rows_tok, rows_top = first_argmax(jnp.asarray(x))
    cols_tok, cols_top = first_argmax(jnp.asarray(x.T), axis=0)
    np.testing.assert_array_equal(np.asarray(rows_tok), want)
    np.testing.assert_array_equal(np.asarray(cols_tok), want)
    np.testing.assert_array_equal(np.asarray(rows_top), x.max(axis=-1))
    np.testing.assert_array_equal(np.asarray(cols_top), x.max(axis=-1))


def test_vocabulary_major_greedy_pick_equals_the_row_pick():
    x = _logits_with_ties(5, CDF_BLOCK * 2 + 5, seed=1)[3:]  # finite rows
    spec = SamplerSpec(greedy=True)
    tok, logp = pick(jnp.asarray(x), None, 0, KNOBS, spec)
    tok_t, logp_t = pick(jnp.asarray(x.T), None, 0, KNOBS, spec, vocab_axis=0)
    np.testing.assert_array_equal(np.asarray(tok_t), np.asarray(tok))
    want = x[np.arange(len(x)), np.asarray(tok)] - np.log(np.exp(x.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(logp_t), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logp), want, atol=1e-5)
    with pytest.raises(ValueError, match="picked greedily only"):
        pick(jnp.asarray(x.T), None, 0, KNOBS, SamplerSpec(), vocab_axis=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: the head is tied to the embedding
def test_engine_head_gives_vocabulary_major_logits(tmp_path, family):
    """The engine's ``out_in`` copy multiplies its head vocabulary-major (few rows, no adapter on
    the head); the learner's layout and many rows fall back to rows. Same tokens, log-probs."""
    from rlx.rollout.jax.engine import _eval_split

    model = from_hf(make_hf_model(family, str(tmp_path)))
    graphdef, state, *_ = _eval_split(model, "out_in", nnx.filterlib.Nothing())  # nothing shared
    engine_model = nnx.merge(graphdef, state)
    h = jnp.asarray(np.random.RandomState(2).randn(6, model.config.hidden_size), jnp.float32)
    logits_t = engine_model.vocab_major_logits(h)
    assert logits_t is not None and logits_t.shape == (model.config.vocab_size, 6)
    np.testing.assert_allclose(np.asarray(logits_t).T, np.asarray(model.logits(h)), atol=1e-5)
    assert model.vocab_major_logits(h) is None  # learner layout
    assert engine_model.vocab_major_logits(jnp.zeros((33, h.shape[1]))) is None  # > FEW_ROWS
    spec = SamplerSpec(greedy=True)
    tok, logp = next_tokens(engine_model, h, None, 0, KNOBS, spec, True)
    want_tok, want_logp = pick(model.logits(h), None, 0, KNOBS, spec)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want_logp), atol=1e-5)


def test_categorical_draws_follow_the_softmax():
    """``categorical``'s frequencies over 40000 keys equal softmax(logits) within 5 standard
    errors per entry (sqrt(p (1 - p) / n)); entries at -inf are never drawn. The vocabulary spans
    three blocks and a partial one, so both levels of the draw and the padding are exercised."""
    vocab, n = CDF_BLOCK * 3 + 17, 40000
    x = np.random.RandomState(3).randn(vocab).astype(np.float32)
    x[::7] = -np.inf
    x[[5, CDF_BLOCK + 9, vocab - 1]] += 4.0  # a few likely entries, one in the partial block
    keys = jax.random.split(jax.random.key(0), n)
    drawn = np.asarray(jax.jit(jax.vmap(categorical, in_axes=(0, None)))(keys, jnp.asarray(x)))
    p = np.exp(x.astype(np.float64) - x.max())
    p /= p.sum()
    freq = np.bincount(drawn, minlength=vocab) / n
    assert freq[::7].sum() == 0
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / n) + 1e-12)


@pytest.mark.slow  # 10000 draws over a 49152-entry vocabulary
def test_categorical_is_steady_under_last_bit_changes_of_the_logits():
    """Logits that differ by about 1e-6 (what another device count gives the same weights) draw
    the same tokens: 5 x 2000 rows of a near-uniform 49152-entry vocabulary (a random model's),
    noise N(0, 1e-6). Locating one number on the whole vocabulary's running sum instead changed 9
    of these 10000 draws (its f32 rounding there is about 1e-3 of an entry's weight)."""
    draw = jax.jit(jax.vmap(categorical))
    for seed in range(5):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((2000, 49152), dtype=np.float32) * np.float32(0.1)
        noisy = x + rng.standard_normal(x.shape, dtype=np.float32) * np.float32(1e-6)
        keys = jax.random.split(jax.random.key(seed), len(x))
        np.testing.assert_array_equal(np.asarray(draw(keys, jnp.asarray(noisy))),
                                      np.asarray(draw(keys, jnp.asarray(x))), err_msg=seed)


def _np_kept(z: np.ndarray, top_k, top_p, min_p) -> np.ndarray:
    """NumPy reference of the cut (Hugging Face / vLLM order): top-k, the nucleus of what is
    left (renormalised), min-p relative to the likeliest; ties ranked by lower id."""
    keep = np.zeros(z.shape, bool)
    for r, row in enumerate(z.astype(np.float64)):
        order = np.argsort(-row, kind="stable")[:top_k or len(row)]
        p = np.exp(row[order] - row[order].max())
        p /= p.sum()
        n = len(order)
        if top_p is not None:
            before = np.cumsum(p) - p
            n = int(np.sum(before < top_p))
        kept = order[:n]
        if min_p is not None:
            kept = kept[row[kept] >= row[kept].max() + np.log(min_p)]
        keep[r, kept] = True
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p,candidates", [
    (None, 0.9, None, 16), (None, 0.9, None, 1024), (40, None, None, 1024),
    (40, 0.8, None, 1024), (None, None, 0.05, 1024), (12, 0.95, 0.1, 1024),
    (None, 0.7, 0.02, 8)])
def test_truncation_keeps_what_numpy_keeps(top_k, top_p, min_p, candidates):
    """The kept set of every row equals the NumPy reference; with top-p alone over few
    candidates some rows need the full sort (their nucleus is wider) and some do not."""
    from rlx.rollout.jax.sampler import truncate

    rs = np.random.RandomState(3)
    z = (rs.randn(12, 3 * CDF_BLOCK + 5) * rs.uniform(0.3, 4.0, (12, 1))).astype(np.float32)
    z[0, :20] = 9.0  # ties at the top
    spec = SamplerSpec(top_k=top_k, top_p=top_p is not None, min_p=min_p is not None,
                       candidates=candidates)
    knobs = Knobs.of(1.0, top_p, min_p)
    want = _np_kept(z, top_k, top_p, min_p)
    vals, idx, covered = truncate(jnp.asarray(z), knobs, spec)
    if covered is not None and not bool(jnp.all(covered)):
        assert 0 < int(jnp.sum(covered)) < len(z)
        full = SamplerSpec(top_p=True, min_p=min_p is not None, candidates=z.shape[1])
        fvals, fidx, _ = truncate(jnp.asarray(z), knobs, full)
        vals, idx = (jnp.where(covered[:, None], jnp.pad(a, ((0, 0), (0, z.shape[1] - a.shape[1])),
                                                         constant_values=c), f)
                     for a, f, c in ((vals, fvals, -np.inf), (idx, fidx, 0)))
    got = np.zeros(z.shape, bool)
    if idx is None:
        got = np.isfinite(np.asarray(vals))
    else:
        rows = np.arange(len(z))[:, None].repeat(idx.shape[1], 1)
        got[rows, np.asarray(idx)] = np.isfinite(np.asarray(vals))
    np.testing.assert_array_equal(got, want)


def test_a_rows_draw_does_not_depend_on_a_neighbour_that_needs_the_full_sort():
    from rlx.rollout.jax.sampler import sample_tokens

    rs = np.random.RandomState(4)
    peaked = rs.randn(4, 2 * CDF_BLOCK).astype(np.float32) * 6  # nucleus inside 8 candidates
    flat = rs.randn(1, 2 * CDF_BLOCK).astype(np.float32) * 0.1  # needs more than 8
    spec, knobs = SamplerSpec(top_p=True, candidates=8), Knobs.of(1.0, 0.9, None)
    keys = jax.random.split(jax.random.key(0), 5)
    alone = sample_tokens(jnp.asarray(peaked), keys[:4], knobs, spec)
    mixed = sample_tokens(jnp.asarray(np.concatenate([peaked, flat])), keys, knobs, spec)
    np.testing.assert_array_equal(np.asarray(mixed[:4]), np.asarray(alone))
    nucleus = _np_kept(flat, None, 0.9, None)[0]
    assert nucleus.sum() > 8 and nucleus[int(mixed[4])]
