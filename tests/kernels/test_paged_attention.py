"""Attention over a paged KV cache read in place (``rlx.kernels.attention.paged``).

Oracle: softmax attention in numpy (float64) over each row's slots gathered by hand from its
page table. Batch invariance: a row's output is bit-identical whatever the other rows' lengths
and the table's width.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.kernels.attention.paged import gqa_paged

PAGES, KV, D, PAGE, HEADS = 24, 2, 8, 4, 6


def _pools(rng):
    keys = rng.normal(size=(PAGES, KV, D, PAGE)).astype(np.float32)
    values = rng.normal(size=(PAGES, KV, PAGE, D)).astype(np.float32)
    return keys, values


def _reference(q, keys, values, table, ends, positions, segments, window, sinks=None):
    b, t, h, d = q.shape
    out = np.zeros((b, t, h, D))
    g = h // KV
    for r in range(b):
        slots = np.arange(ends[r])
        pages, offsets = table[r, slots // PAGE], slots % PAGE
        k = keys[pages, :, :, offsets]  # [s, kv, d]
        v = values[pages, :, offsets, :]  # [s, kv, d]
        for i in range(t):
            seen = (slots <= positions[r, i]) & (segments[r, i] != 0)
            if window is not None:
                seen &= positions[r, i] - slots < window
            if not seen.any():
                continue
            for head in range(h):
                s = k[seen, head // g] @ q[r, i, head].astype(np.float64) / np.sqrt(d)
                p = np.exp(s - s.max())
                sink = 0.0 if sinks is None else np.exp(sinks[head] - s.max())  # value-0 key
                out[r, i, head] = (p / (p.sum() + sink)) @ v[seen, head // g]
    return out


@pytest.mark.parametrize("t,window,sinks", [(1, None, False), (5, None, False), (5, 7, False),
                                           (1, 7, True), (5, 7, True)])
def test_paged_attention_matches_numpy(t, window, sinks):
    """Decode steps (one query) and prefill chunks (several, causal by position, one padding
    query), rows of different lengths over pages in any order, sliding windows and attention
    sinks; 1e-5 (f32)."""
    rng = np.random.default_rng(0)
    keys, values = _pools(rng)
    table = np.array([[3, 7, 1, 0, 0, 0], [9, 2, 11, 5, 13, 4], [8, 0, 0, 0, 0, 0]], np.int32)
    ends = np.array([10, 23, 4], np.int32)
    positions = (ends - t)[:, None] + np.arange(t)[None]
    segments = np.ones((3, t), np.int32)
    if t > 1:
        segments[2, 0] = 0  # a padding query sees nothing and returns zeros
    q = rng.normal(size=(3, t, HEADS, D)).astype(np.float32)
    sink = rng.normal(size=(HEADS,)).astype(np.float32) if sinks else None
    got = jax.jit(lambda *a: gqa_paged(*a, block_pages=2, window=window, sinks=sink))(
        q, keys, values, table, ends, positions, segments)
    want = _reference(q, keys, values, table, ends, positions, segments, window, sink)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_a_rows_attention_does_not_depend_on_the_others():
    """The same row beside longer rows, with a wider table and fewer or more rows: the same
    bits (blocks past a row's end are exact no-ops for it)."""
    rng = np.random.default_rng(1)
    keys, values = _pools(rng)
    q = jnp.asarray(rng.normal(size=(3, 1, HEADS, D)), jnp.float32)
    run = jax.jit(lambda *a: gqa_paged(*a, block_pages=2))
    row = np.array([[5, 6, 0]], np.int32), np.array([7], np.int32)
    alone = run(q[:1], keys, values, *row, row[1][:, None] - 1, np.ones((1, 1), np.int32))
    table = np.array([[5, 6, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 7, 8, 9, 10],
                      [11, 12, 13, 14, 15, 16, 0, 0]], np.int32)
    ends = np.array([7, 31, 22], np.int32)
    mixed = run(q, keys, values, table, ends, ends[:, None] - 1, np.ones((3, 1), np.int32))
    assert np.array_equal(np.asarray(alone[0]), np.asarray(mixed[0]))
