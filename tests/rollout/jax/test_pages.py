"""The paged cache's host bookkeeping (``rlx.rollout.jax.pages``): reference counts, copy on
write of a shared prompt's last page, the prefix index and its eviction."""

import pytest

from rlx.rollout.jax.pages import OutOfPages, PagePool, PrefixIndex, SequencePages, page_keys


def test_pages_are_counted_and_a_shortfall_takes_nothing():
    pool = PagePool(6, 4)  # pages 1..5 (0 is the padding sink)
    seq = SequencePages()
    seq.grow(pool, 9)  # 3 pages
    assert len(seq.pages) == 3 and pool.free == 2 and 0 not in seq.pages
    with pytest.raises(OutOfPages):
        SequencePages().grow(pool, 12)
    assert pool.free == 2
    seq.grow(pool, 12)  # still 3 pages
    assert pool.free == 2
    held = list(seq.pages)
    assert sorted(seq.release(pool)) == sorted(held)
    assert pool.free == 5 and all(r == 0 for r in pool.refs)
    with pytest.raises(ValueError, match="more often than held"):
        pool.drop([1])


def test_samples_of_one_prompt_share_full_pages_and_copy_the_last():
    pool = PagePool(10, 4)
    prompt = SequencePages()
    prompt.grow(pool, 10)  # pages a, b full; c holds 2 tokens
    prompt.length = 10
    forks = [prompt.fork(pool) for _ in range(3)]
    for seq, copy in forks:
        assert seq.pages[:2] == prompt.pages[:2] and copy == (prompt.pages[2], seq.pages[2])
    assert len({seq.pages[2] for seq, _ in forks}) == 3
    assert [pool.refs[p] for p in prompt.pages] == [4, 4, 1]
    prompt.release(pool)
    for seq, _ in forks:
        seq.release(pool)
    assert pool.free == 9
    even = SequencePages()
    even.grow(pool, 8)
    even.length = 8
    twin, copy = even.fork(pool)
    assert copy is None and twin.pages == even.pages


def test_the_prefix_index_serves_whole_pages_and_evicts_the_least_recent():
    pool = PagePool(8, 2)
    index = PrefixIndex(pool)
    a, b = [1, 2, 3, 4, 5], [1, 2, 9, 9, 9, 9]
    for tokens in (a, b):
        seq = SequencePages()
        seq.grow(pool, len(tokens))
        seq.length = len(tokens)
        index.put(tokens, seq.pages)
        seq.release(pool)
    assert len(index) == 4  # a: [1,2],[3,4]; b: [9,9],[9,9] after the shared [1,2]
    assert page_keys([1, 2, 3], 2)[0] == page_keys([1, 2, 9], 2)[0]
    got = index.match([1, 2, 3, 4])  # the last token stays out: one page
    assert len(got) == 1
    pool.drop(got)
    got = index.match([1, 2, 3, 4, 7])
    assert len(got) == 2 and index.match([5, 2, 3, 4, 7]) == []
    assert pool.free == 3
    assert index.evict(5) == 2  # b's two pages; a's are held by the caller
    assert pool.free == 5 and len(index) == 2
    pool.drop(got)
    index.clear()
    assert pool.free == 7 and len(index) == 0
