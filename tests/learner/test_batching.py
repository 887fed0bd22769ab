"""Host batching (pad / pack) and the segment-aware loss reductions that make packing exact."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlx.learner.batching import (Batching, batch_layout, count_bucket, fill, loss_columns,
                                  micro_count, pack_rollouts, pad_rollouts, train_buckets)
from rlx.learner.losses import LossConfig, aggregate, policy_loss, sequence_count
from rlx.types import Rollout
from tests.helpers.steps import random_rollouts


def _rollout(uid, p, c, version=0, mask=None):
    return Rollout(uid, np.arange(100, 100 + p), np.arange(200, 200 + c),
                   -np.arange(1, c + 1, dtype=np.float32), weight_version=version,
                   completion_mask=mask)


def test_pad_layout_buckets_and_padding_rows():
    rollouts = [_rollout(0, 2, 3, 5), _rollout(0, 1, 2, 5, mask=np.array([1, 0]))]
    batch = pad_rollouts(rollouts, np.array([0.5, -1.0]), buckets=(4, 6, 16), rows_multiple=4)
    batch.validate()
    assert batch.shape == (4, 6)  # longest is 5 tokens -> bucket 6; 2 rows -> 4
    np.testing.assert_array_equal(batch.input_ids[0], [100, 101, 200, 201, 202, 0])
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 2, 3, 4, 0])
    np.testing.assert_array_equal(batch.segment_ids[0], [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch.advantages[0], [0, 0, 0.5, 0.5, 0.5, 0])
    np.testing.assert_array_equal(batch.sampler_logp[0], [0, 0, -1, -2, -3, 0])
    np.testing.assert_array_equal(batch.loss_mask[1], [0, 1, 0, 0, 0, 0])  # tool token masked
    np.testing.assert_array_equal(batch.weight_version[0], [5] * 5 + [-1])
    assert (batch.segment_ids[2:] == 0).all() and (batch.uid[2:] == -1).all()
    assert batch.old_logp is None and batch.ref_logp is None
    assert pad_rollouts(rollouts, np.zeros(2), length_multiple=8).shape == (2, 8)  # no bucket fits


@pytest.mark.parametrize("per_octave", [4, 8])
@pytest.mark.parametrize("top", [40, 64, 251, 256, 1152, 4096])
def test_train_buckets_pad_a_batch_by_at_most_one_step_of_an_octave(top, per_octave):
    buckets = train_buckets(top, per_octave=per_octave)
    assert buckets[-1] == top and list(buckets) == sorted(set(buckets))
    assert all(b % 8 == 0 for b in buckets[:-1])
    for longest in range(1, top + 1):
        length = min(b for b in buckets if b >= longest)
        assert length <= max(64, (1 + 1 / per_octave) * longest), (longest, length)
    octaves = [sum(lo <= b < 2 * lo for b in buckets[:-1]) for lo in (64, 128, 256, 512, 1024, 2048)]
    assert max(octaves) <= per_octave  # compilations per doubling of the length, besides the cap
    batch = pad_rollouts([_rollout(0, 40, 128)], np.zeros(1), buckets=train_buckets(256))
    assert batch.shape == (1, 192)  # powers of two alone padded these 168 tokens to 256
    fine = pad_rollouts([_rollout(0, 46, 128)], np.zeros(1), buckets=train_buckets(256, per_octave=8))
    assert fine.shape == (1, 176)  # 174 tokens: 192 with 4 lengths per doubling
    with pytest.raises(ValueError, match="per_octave"):
        train_buckets(256, per_octave=0)


def test_loss_columns_list_each_rows_loss_tokens_in_a_bucketed_width():
    mask = np.zeros((3, 40), np.float32)
    mask[0, 5:22] = 1  # 17 tokens: the fullest row -> K = 24, the first bucket >= 17 (16, 24, 32)
    mask[1, [3, 4, 9]] = 1  # a masked tool token between completion tokens
    cols = loss_columns(mask)
    assert cols.shape == (3, 24) and cols.dtype == np.int32
    np.testing.assert_array_equal(cols[0], list(range(5, 22)) + [0] * 7)
    np.testing.assert_array_equal(cols[1], [3, 4, 9] + [0] * 21)
    assert not cols[2].any()  # a padding row: every slot unused
    mask[0, 5:39] = 1  # 34 tokens: bucket 40 is the whole row, nothing to save
    assert loss_columns(mask) is None
    assert loss_columns(np.ones((2, 16))) is None  # rows this short are scored whole
    batch = pad_rollouts([_rollout(0, 64, 128), _rollout(1, 40, 100)], np.zeros(2),
                         buckets=train_buckets(256))
    batch.validate()
    assert batch.shape == (2, 192) and batch.logp_columns.shape == (2, 128)
    np.testing.assert_array_equal(batch.logp_columns[1, :100], np.arange(40, 140))
    assert pad_rollouts([_rollout(0, 64, 128)], np.zeros(1), columns=False).logp_columns is None
    packed = pack_rollouts([_rollout(0, 10, 12), _rollout(1, 8, 10)], np.zeros(2), row_len=64)
    np.testing.assert_array_equal(packed.logp_columns[0, :22],
                                  list(range(10, 22)) + list(range(30, 40)))
    with pytest.raises(ValueError, match="logp_columns holds a column outside"):
        batch.replace(logp_columns=batch.logp_columns + 100).validate()
    with pytest.raises(ValueError, match="logp_columns has shape"):
        batch.replace(logp_columns=batch.logp_columns[:1]).validate()


def test_duck_typed_rollouts_with_string_uids_and_versions():
    """Any record with the token fields works; string uids / versions become int indices."""
    ns = lambda **kw: type("R", (), kw)()  # noqa: E731
    rollouts = [ns(prompt_uid=u, prompt_ids=np.array([1]), completion_ids=np.array([2, 3]),
                   sampler_logp=np.zeros(2), weight_version=v)
                for u, v in (("q-b", "w7"), ("q-a", "w8"), ("q-b", "w8"))]
    batch = pack_rollouts(rollouts, np.ones(3), row_len=9)
    assert batch.shape == (1, 9)
    np.testing.assert_array_equal(batch.uid[0], [0, 0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.weight_version[0], [0, 0, 0, 1, 1, 1, 1, 1, 1])


def test_pack_places_every_rollout_once_contiguously():
    rollouts = random_rollouts(9, 50, seed=3)
    old = [r.sampler_logp - 1 for r in rollouts]
    batch = pack_rollouts(rollouts, np.arange(1.0, 10.0), row_len=12, rows_multiple=2, old_logp=old)
    batch.validate()
    assert batch.shape[0] % 2 == 0 and batch.shape[1] == 12
    found = []
    for row in range(batch.shape[0]):
        for seg in range(1, batch.segment_ids[row].max() + 1):
            (cols,) = np.nonzero(batch.segment_ids[row] == seg)
            assert (np.diff(cols) == 1).all()  # contiguous
            np.testing.assert_array_equal(batch.positions[row, cols], np.arange(len(cols)))
            found.append((row, cols))
    assert len(found) == 9
    for i, r in enumerate(rollouts):  # advantage i + 1 identifies rollout i
        hits = [(row, cols) for row, cols in found if np.any(batch.advantages[row, cols] == i + 1)]
        assert len(hits) == 1
        row, cols = hits[0]
        ids = np.concatenate([r.prompt_ids, r.completion_ids])
        np.testing.assert_array_equal(batch.input_ids[row, cols], ids)
        done = cols[len(r.prompt_ids):]
        np.testing.assert_allclose(batch.old_logp[row, done], old[i])
    with pytest.raises(ValueError, match="does not fit"):
        pack_rollouts(rollouts, np.zeros(9), row_len=3)


def test_token_budget_layout_rows_micro_batches_and_the_estimators_view():
    """``batch_layout`` with a token budget: rows of the budget (packed) or padded rows as many as
    fit; a rollout longer than the budget makes the rows its bucketed length; micro-batch counts
    from ``count_bucket``; ``Layout.unpack`` gives each rollout its own row from column 0 and
    ``pack`` puts it back."""
    assert [count_bucket(n) for n in (1, 5, 8, 9, 11, 17, 33, 100)] == [1, 5, 8, 10, 12, 20, 40, 112]
    lengths = [30, 20, 12, 10, 8, 6, 5, 3]  # 94 tokens
    packed = batch_layout(lengths, Batching(pack=True, buckets=(32, 64), shards=2, tokens=32))
    # first-fit decreasing into 32-token rows: [30], [20, 12], [10, 8, 6, 5, 3]: 3 rows; one row per
    # shard per micro-batch: 2 micro-batches of 2 rows
    assert packed.shape == (4, 32) and packed.efficiency == pytest.approx(94 / (3 * 32))
    np.testing.assert_array_equal(packed.rows, [0, 1, 1, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(packed.segments, [1, 1, 2, 1, 2, 3, 4, 5])
    assert micro_count(packed.shape, 2, 1, 32) == 2
    longer = batch_layout(lengths + [40], Batching(pack=True, buckets=(32, 64), shards=2,
                                                   minibatches=2, tokens=32))
    # 40 > 32: rows of 64 ([40, 20, 3], [30, 12, 10, 8], [6, 5]), 2 minibatches x 2 shards x 1
    assert longer.shape == (4, 64) and longer.rows[-1] == 0
    padded = batch_layout(lengths, Batching(pack=False, buckets=(32, 64), shards=2, tokens=64))
    assert padded.shape == (8, 32) and micro_count(padded.shape, 2, 1, 64) == 2  # 2 rows each
    fixed = batch_layout(lengths, Batching(pack=True, buckets=(32, 64), shards=2, micro_batches=3))
    assert fixed.shape == (6, 32) and micro_count(fixed.shape, 2, 3) == 3
    rollouts = [_rollout(i, 2, n - 2) for i, n in enumerate(lengths)]
    batch = fill(rollouts, np.arange(8.0), packed)
    view = packed.unpack(batch.input_ids)  # [8, 30]
    for i, r in enumerate(rollouts):
        np.testing.assert_array_equal(view[i, :lengths[i]], np.concatenate([r.prompt_ids,
                                                                           r.completion_ids]))
        assert not view[i, lengths[i]:].any()
    np.testing.assert_array_equal(packed.pack(view), batch.input_ids)
    np.testing.assert_array_equal(packed.spread(np.arange(8.0)) * batch.loss_mask,
                                  batch.advantages)


def test_segment_aggregation_hand_golden():
    # one packed row: segment 1 = tokens x = (1, 3), segment 2 = (5), then a padding slot;
    # the first token of each segment is a prompt token (mask 0, x ignored).
    x = jnp.array([[9.0, 1.0, 3.0, 9.0, 5.0, 9.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    assert float(sequence_count(mask, seg)) == 2
    assert float(aggregate(x, mask, "token-mean", segment_ids=seg)) == pytest.approx(9 / 3)
    assert float(aggregate(x, mask, "seq-mean-token-sum", segment_ids=seg)) == pytest.approx(
        (4 + 5) / 2)
    assert float(aggregate(x, mask, "seq-mean-token-mean", segment_ids=seg)) == pytest.approx(
        (4 / 2 + 5 / 1) / 2)  # 3.5
    assert float(aggregate(x, mask, "seq-mean-token-sum-norm", 4, segment_ids=seg)) == (
        pytest.approx(9 / (2 * 4)))


@pytest.mark.parametrize("cfg", [LossConfig("gspo"), LossConfig("ppo", tis_mode="sequence-mask")])
def test_packed_row_loss_equals_two_rows(cfg):
    """Per-sequence quantities (GSPO ratio, sequence-mask TIS) are per segment, not per row."""
    rs = np.random.RandomState(0)
    logp, old, samp = (jnp.asarray(-rs.uniform(0.5, 2, (1, 6)), jnp.float32) for _ in range(3))
    adv = jnp.array([[0.0, 1.0, 1.0, 0.0, -2.0, -2.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 2]])
    packed, _ = policy_loss(logp, old, adv, mask, cfg, sampler_logp=samp, segment_ids=seg)
    two = lambda a: jnp.concatenate([a[:, :3], a[:, 3:]], axis=0)  # noqa: E731  [2, 3]
    rows, _ = policy_loss(two(logp), two(old), two(adv), two(mask), cfg, sampler_logp=two(samp))
    assert float(packed) == pytest.approx(float(rows), abs=1e-6)
