"""The paged KV cache (``rlx.models.paged_kv``) against the dense one (``rlx.models.kv_cache``).

Two sequences whose pages are scattered over the pool, prefilled in chunks of 4 tokens side by
side (the shorter padded), then decoded a token at a time, give the hidden states that each
sequence gives alone through the dense cache (one prefill, then the same tokens), within 1e-5
(f32): GQA and multi-head latent attention, an unrolled and a scanned model; a forked sequence
(shared full pages, its last partial page copied) continues like its source.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.models import from_hf
from rlx.models.kv_cache import KVCache
from rlx.models.paged_kv import PagedKVCache, copy_pages
from rlx.models.stack import layer_counts, stack_layers
from tests.helpers.hf_zoo import make_hf_model

PAGE, CHUNK, STEPS = 4, 4, 5
TOL = 1e-5


class _Jitted:
    """``model.decode`` compiled (per shape)."""

    def __init__(self, model):
        self.config, self.graphdef = model.config, nnx.graphdef(model)
        self.state, self.stacks = nnx.state(model), layer_counts(model)
        self._run = jax.jit(lambda st, *a: nnx.merge(self.graphdef, st).decode(*a))

    def decode(self, ids, positions, segments, cache):
        return self._run(self.state, ids, positions, segments, cache)


def _dense(model, tokens: list[int], prompt: int) -> np.ndarray:
    """Hidden states of ``tokens`` alone: the first ``prompt`` in one prefill, then one at a
    time."""
    cache = KVCache.zeros(model.config, 1, len(tokens), jnp.float32, model.stacks)
    ids = jnp.asarray([tokens[:prompt]])
    pos = jnp.arange(prompt)[None]
    h, cache = model.decode(ids, pos, jnp.ones_like(pos), cache)
    out = [h[0]]
    for j in range(prompt, len(tokens)):
        one = jnp.asarray([[j]])
        h, cache = model.decode(jnp.asarray([[tokens[j]]]), one, jnp.ones_like(one), cache)
        out.append(h[0])
    return np.asarray(jnp.concatenate(out))


def _paged(model, seqs: list[list[int]], prompts: list[int], tables: np.ndarray,
           cache: PagedKVCache):
    """Hidden states of ``seqs`` side by side: prompts in chunks of ``CHUNK``, then a token per
    step; returns them per sequence and the cache."""
    b = len(seqs)
    lengths = np.zeros(b, np.int32)
    out = [[] for _ in range(b)]
    while any(lengths[r] < prompts[r] for r in range(b)):  # chunked prefill
        ids, pos, seg = (np.zeros((b, CHUNK), np.int32) for _ in range(3))
        for r in range(b):
            n = min(CHUNK, prompts[r] - lengths[r])
            ids[r, :n] = seqs[r][lengths[r]:lengths[r] + n]
            pos[r, :n] = np.arange(lengths[r], lengths[r] + n)
            seg[r, :n] = 1
        view = cache.with_rows(jnp.asarray(tables), jnp.asarray(lengths))
        h, cache = model.decode(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), view)
        for r in range(b):
            out[r] += list(np.asarray(h[r])[seg[r] > 0])
        lengths = np.asarray(cache.lengths)
    for _ in range(STEPS):
        ids = np.asarray([[s[lengths[r]]] for r, s in enumerate(seqs)], np.int32)
        view = cache.with_rows(jnp.asarray(tables), jnp.asarray(lengths))
        h, cache = model.decode(jnp.asarray(ids), jnp.asarray(lengths[:, None]),
                                jnp.ones((b, 1), jnp.int32), view)
        for r in range(b):
            out[r].append(np.asarray(h[r, 0]))
        lengths = np.asarray(cache.lengths)
    return [np.stack(o) for o in out], cache


@pytest.mark.parametrize("family,scan", [("llama", "off"), ("deepseek_v3", "off"),
                                         ("qwen3", "on")])
def test_paged_decode_equals_each_sequence_alone(tmp_path, family, scan):
    model = from_hf(make_hf_model(family, str(tmp_path)))
    if scan == "on":  # the layers scanned over stacked pools
        model = stack_layers(model)
        assert layer_counts(model) == (2,)
    rs = np.random.RandomState(0)
    prompts = [5, 11]
    seqs = [list(rs.randint(0, 97, p + STEPS)) for p in prompts]
    tables = np.asarray([[7, 2, 9, 0, 0], [3, 12, 1, 5, 8]], np.int32)  # scattered; 0: unused
    model = _Jitted(model)
    pool = PagedKVCache.zeros(model.config, 16, PAGE, jnp.float32, model.stacks)
    got, cache = _paged(model, seqs, prompts, tables, pool)
    for r, (s, p) in enumerate(zip(seqs, prompts)):
        np.testing.assert_allclose(got[r], _dense(model, s, p), atol=TOL, rtol=0)

    # a fork of sequence 1 after its 16 tokens: pages 3, 12, 1, 5 full... its 16th token ends
    # page 5; continue it from 14 tokens instead: pages 3, 12, 1 shared, page 5 copied to 14
    fork = np.asarray([[3, 12, 1, 14, 0]], np.int32)
    cache = copy_pages(cache, jnp.asarray([5]), jnp.asarray([14]))
    nxt = [seqs[1][14]]
    view = cache.with_rows(jnp.asarray(fork), jnp.asarray([14]))
    h, _ = model.decode(jnp.asarray([nxt]), jnp.asarray([[14]]), jnp.ones((1, 1), jnp.int32),
                        view)
    np.testing.assert_allclose(np.asarray(h[0, 0]), got[1][14], atol=TOL, rtol=0)
