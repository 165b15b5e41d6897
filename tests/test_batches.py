"""References and row ranges: a rank's share, assembled from the pieces, is exactly its rows of
the global batch, wherever the pieces were cut (no Ray: pieces are plain dicts here)."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_sys.data.batches import GlobalBatch, Piece
from raytrain_sys.data.plane import piece_bounds


def _stream(n: int) -> dict[str, np.ndarray]:
    return {"tokens": np.arange(n * 3, dtype=np.uint8).reshape(n, 3) % 251,
            "num_tokens": (np.arange(n) % 3 + 1).astype(np.int32)}


@pytest.mark.parametrize("first, stop, piece_rows", [(0, 100, 8), (5, 100, 8), (5, 9, 8), (0, 8, 8),
                                                      (7, 8, 8), (13, 200, 1)],
                         ids=["from zero", "mid piece", "inside one piece", "exactly one piece",
                              "one row", "a piece per row"])
def test_piece_bounds_cut_at_multiples_and_cover_the_range(first, stop, piece_rows):
    b = piece_bounds(first, stop, piece_rows)
    assert b[0] == first and b[-1] == stop and b == sorted(set(b))
    assert all(x % piece_rows == 0 for x in b[1:-1])


@pytest.mark.parametrize("piece_rows", [4, 8, 13, 64])
@pytest.mark.parametrize("shares", [[slice(0, 16), slice(16, 32)], [slice(0, 11), slice(11, 22), slice(22, 32)],
                                    [slice(0, 32)]], ids=["2 even", "3 uneven", "1 rank"])
def test_a_share_assembled_from_pieces_is_its_rows_of_the_batch(piece_rows, shares):
    rows = _stream(200)
    start, B = 37, 32  # a batch that starts mid piece
    bounds = piece_bounds(20, 120, piece_rows)
    store = {f"ref{i}": {k: v[lo:hi] for k, v in rows.items()} for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))}
    pieces = [Piece(lo, hi, f"ref{i}") for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    batch = GlobalBatch(start, [p for p in pieces if p.first < start + B and p.stop > start],
                        np.arange(start, start + B), np.ones(B, dtype=np.int64), width=2)
    for sl in shares:
        share = batch.share(sl)
        sent = share.ranges()  # what travels beside the references
        assert all(ref is None for ref, _, _ in sent.parts)
        got = sent.assemble([store[r] for r in share.refs()])
        want = {k: v[start + sl.start:start + sl.stop] for k, v in rows.items()}
        assert share.num_rows == sl.stop - sl.start
        np.testing.assert_array_equal(got["tokens"], want["tokens"][:, :2])  # trimmed to width
        np.testing.assert_array_equal(got["num_tokens"], want["num_tokens"])


@pytest.mark.parametrize("piece_rows", [4, 13, 64, 200])
@pytest.mark.parametrize("shares", [[slice(0, 16), slice(16, 32)], [slice(0, 11), slice(11, 22), slice(22, 32)],
                                    [slice(0, 32)], [slice(0, 0), slice(0, 32)]],
                         ids=["2 even", "3 uneven", "1 rank", "an empty share"])
def test_a_lease_plan_deals_each_rank_what_share_deals_it(piece_rows, shares):
    """``rank_plans`` (one plan for every rank, its rows and its pieces beside it), as the rank
    reads it (``lease_plans``), gives each rank,
    step by step, the ranges, units and pieces ``GlobalBatch.share`` gives it, and passes each
    rank every piece it reads, once, and no other."""
    import msgpack

    from raytrain_sys.data.batches import lease_length, lease_plans, rank_plans

    B = 32
    bounds = piece_bounds(20, 400, piece_rows)
    pieces = [Piece(lo, hi, f"ref{i}") for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    # Consecutive steps, then one kept from before a rebuild (its own pieces, an older start).
    starts = [37, 37 + B, 37 + 2 * B, 21]
    batches = [GlobalBatch(s, [p for p in pieces if p.first < s + B and p.stop > s], np.arange(s, s + B),
                           np.arange(B, dtype=np.int64) % 3 + s, width=s % 5) for s in starts]
    batches[-1].pieces[:] = [Piece(p.first, p.stop, "kept-" + p.ref) for p in batches[-1].pieces]
    for sl, (sent, refs) in zip(shares, rank_plans(batches, shares)):
        msgpack.packb(sent)  # plain values: Ray sends them with no pickling
        plan = lease_plans(sent)
        assert len(plan) == lease_length(sent) == len(batches) and len(set(refs)) == len(refs)
        used = set()
        for batch, (share, units, which) in zip(batches, plan):
            want = batch.share(sl)
            assert share == want.ranges() and units == batch.units
            assert [refs[k] for k in which] == want.refs()
            used.update(which)
        assert used == set(range(len(refs)))
