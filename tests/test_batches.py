"""References and row ranges: a rank's share, assembled from the pieces, is exactly its rows of
the global batch, wherever the pieces were cut (no Ray: pieces are plain dicts here)."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_sys.data.batches import GlobalBatch, Piece
from raytrain_sys.data.reads import piece_bounds


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


def _pulled(piece_rows: int, batch_rows: int, ranks: int, ranks_per_node: int, steps: int
            ) -> tuple[float, float]:
    """Over ``steps`` consecutive global batches of a DP job: (rows a node pulls a step, the
    node's pieces being fetched whole, the most of any node; piece references a rank is passed
    a step, on average)."""
    share = batch_rows // ranks
    bounds = piece_bounds(0, steps * batch_rows, piece_rows)
    pieces = list(zip(bounds, bounds[1:]))
    node_rows, refs = [], 0
    for node in range(ranks // ranks_per_node):
        lo, hi = node * ranks_per_node * share, (node + 1) * ranks_per_node * share
        wanted = [(s * batch_rows + lo, s * batch_rows + hi) for s in range(steps)]
        node_rows.append(sum(b - a for a, b in pieces if any(a < y and b > x for x, y in wanted)))
        for r in range(node * ranks_per_node, (node + 1) * ranks_per_node):
            mine = [(s * batch_rows + r * share, s * batch_rows + (r + 1) * share) for s in range(steps)]
            refs += sum(1 for a, b in pieces if any(a < y and b > x for x, y in mine))
    return max(node_rows) / steps, refs / ranks / steps


@pytest.mark.parametrize("row_bytes, batch_rows, ranks, fewer_refs", [
    (1_100, 512, 64, 4),     # GPT-2's rows (1,025 byte tokens), 8 a rank: 1 MiB held 2 batches
    (260, 512, 64, 1.8),     # the benchmark's 129-token rows: 1 MiB held 8 batches
    (4_096, 4_096, 64, 0),   # a 16 MiB global batch: pieces stay at 1 MiB, 4 ranks' rows
    (4_096, 2_048, 2, 0),    # a rank's share (4 MiB) is larger than the least piece
    (2_048, 448, 8, 3),      # a batch just under the least piece (56 rows a rank)
], ids=["gpt2 rows", "small rows", "large batch", "large share", "batch under a piece"])
def test_pieces_grow_only_where_every_node_pulls_every_piece_anyway(row_bytes, batch_rows, ranks,
                                                                     fewer_refs):
    """Against pieces of the least size (the rule before PIECE_BATCHES): each rank is passed
    ``fewer_refs`` times fewer references where a piece held a global batch already, and no node
    pulls more rows."""
    from raytrain_sys.data import reads

    share = batch_rows // ranks
    least = share * -(-max(1, reads.MIN_PIECE_BYTES // row_bytes) // share)
    rows = reads.rows_per_piece(share, row_bytes, batch_rows)
    assert rows % share == 0 and rows * row_bytes >= min(reads.MIN_PIECE_BYTES, share * row_bytes)
    assert rows * row_bytes <= max(reads.MAX_PIECE_BYTES, share * row_bytes)
    steps = 4 * reads.PIECE_BATCHES
    node_before, refs_before = _pulled(least, batch_rows, ranks, min(8, ranks), steps)
    node_after, refs_after = _pulled(rows, batch_rows, ranks, min(8, ranks), steps)
    assert node_after <= node_before
    if fewer_refs:
        assert refs_after <= refs_before / fewer_refs
    else:
        assert rows == least and refs_after == refs_before
