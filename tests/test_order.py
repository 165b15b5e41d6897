"""The sample order: a pure function of (manifest row counts, seed, epoch)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raytrain_sys.data import order

shard_rows_st = st.lists(st.integers(1, 40), min_size=1, max_size=8).map(tuple)


@settings(max_examples=200, deadline=None)
@given(shard_rows=shard_rows_st, seed=st.integers(0, 2**32), window=st.integers(1, 64),
       block=st.integers(1, 16), epoch=st.integers(0, 5))
def test_every_sample_exactly_once_per_epoch(shard_rows, seed, window, block, epoch):
    n = sum(shard_rows)
    ids = order.sample_ids(shard_rows, seed, window, block, epoch * n, (epoch + 1) * n)
    assert sorted(ids.tolist()) == list(range(n))


def test_order_is_shuffled_and_changes_with_epoch_and_seed():
    rows = (100, 100, 100, 100)
    e0 = order.sample_ids(rows, 7, 64, 16, 0, 400)
    e1 = order.sample_ids(rows, 7, 64, 16, 400, 800)
    other_seed = order.sample_ids(rows, 8, 64, 16, 0, 400)
    assert not np.array_equal(e0, np.arange(400))
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, other_seed)
    # Pure: the same inputs give the same order, also from a fresh plan.
    order.epoch_plan.cache_clear()
    assert np.array_equal(e0, order.sample_ids(rows, 7, 64, 16, 0, 400))


def test_a_short_run_draws_from_across_the_corpus():
    """Blocks from all shards are permuted together: the first window is not one shard."""
    rows = (1000,) * 20
    first = order.sample_ids(rows, 0, 2048, 100, 0, 2048)
    assert len(set((first // 1000).tolist())) >= 10


@settings(max_examples=100, deadline=None)
@given(shard_rows=shard_rows_st, seed=st.integers(0, 1000), window=st.integers(1, 50),
       block=st.integers(1, 9), start=st.integers(0, 200), length=st.integers(0, 120))
def test_any_slice_equals_the_slice_of_the_stream(shard_rows, seed, window, block, start, length):
    whole = order.sample_ids(shard_rows, seed, window, block, 0, start + length)
    assert np.array_equal(order.sample_ids(shard_rows, seed, window, block, start, start + length),
                          whole[start:])


@given(batch=st.integers(1, 200), world=st.integers(1, 16))
def test_deal_covers_the_batch_with_shares_differing_by_at_most_one(batch, world):
    slices = order.deal(batch, world)
    assert len(slices) == world
    sizes = [s.stop - s.start for s in slices]
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1
    assert slices[0].start == 0 and all(a.stop == b.start for a, b in zip(slices, slices[1:]))


def test_window_segments_cover_the_window_rows():
    plan = order.epoch_plan((5, 7, 3), 3, 0, 4, 2)
    covered = []
    for w in range(plan.num_windows):
        segs = plan.window_segments(w)
        lo, hi = plan.window_bounds(w)
        assert sum(s.row_end - s.row_start for s in segs) == hi - lo
        covered += [s.first_id + i for s in segs for i in range(s.row_end - s.row_start)]
    assert sorted(covered) == list(range(15))
