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
from rlx.rollout.jax.sampling import (CDF_BLOCK, SamplerSpec, _next_tokens, _pick, categorical,
                                      first_argmax)
from tests.helpers.hf_zoo import make_hf_model


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
    tok, logp = _pick(jnp.asarray(x), None, 0, 1.0, 1.0, spec)
    tok_t, logp_t = _pick(jnp.asarray(x.T), None, 0, 1.0, 1.0, spec, vocab_axis=0)
    np.testing.assert_array_equal(np.asarray(tok_t), np.asarray(tok))
    want = x[np.arange(len(x)), np.asarray(tok)] - np.log(np.exp(x.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(logp_t), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logp), want, atol=1e-5)
    with pytest.raises(ValueError, match="picked greedily only"):
        _pick(jnp.asarray(x.T), None, 0, 1.0, 1.0, SamplerSpec(), vocab_axis=0)


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
    tok, logp = _next_tokens(engine_model, h, None, 0, 1.0, 1.0, spec, True)
    want_tok, want_logp = _pick(model.logits(h), None, 0, 1.0, 1.0, spec)
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
