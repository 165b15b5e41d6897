"""Where a sample's order is decided: pure functions of (manifest row counts, seed, epoch).

No Ray, no I/O. The global sample stream is the concatenation of epochs; each epoch is the
manifest's shards cut into blocks, the blocks in a seeded order, cut into windows of ``window``
rows, each window permuted by its own seeded permutation. The data cursor is one integer: the number of samples
consumed by committed steps. Step ``k`` of a job with constant global batch ``B`` reads positions
``[cursor, cursor + B)``; the world size only decides how those rows are dealt to ranks
(``deal``), so the global batches are the same at any world size and across resizes.

Sample ids are positions in the manifest's (unpermuted) concatenation of shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


def _rng(*key: int) -> np.random.Generator:
    # SeedSequence over the full key: independent streams per (seed, epoch[, window]).
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


@dataclass(frozen=True)
class Segment:
    """Rows ``[row_start, row_end)`` of shard ``shard``; sample ids start at ``first_id``."""

    shard: int
    row_start: int
    row_end: int
    first_id: int


class EpochPlan:
    """The order of one epoch. Cheap to build: O(number of blocks); windows computed on demand.

    Every shard is cut into blocks of ``block_rows`` rows (row-group sized, so a block is one
    cheap read); the blocks of all shards are permuted together, new each epoch, and the
    permuted sequence is cut into windows of ``window`` rows, each shuffled on its own. A short
    run thus samples blocks from across the whole corpus, not the first few shards.
    """

    def __init__(self, shard_rows: tuple[int, ...], seed: int, epoch: int, window: int,
                 block_rows: int):
        if window <= 0 or block_rows <= 0:
            raise ValueError("window and block_rows must be positive")
        self.shard_rows = shard_rows
        self.seed, self.epoch, self.window, self.block_rows = seed, epoch, window, block_rows
        self.num_rows = sum(shard_rows)
        shard_of, start_of, rows_of, id_of = [], [], [], []
        first_id = 0
        for shard, n in enumerate(shard_rows):
            for r in range(0, n, block_rows):
                shard_of.append(shard)
                start_of.append(r)
                rows_of.append(min(block_rows, n - r))
                id_of.append(first_id + r)
            first_id += n
        # Block order is new every epoch; tag 0 separates it from the window streams.
        perm = _rng(seed, epoch, 0).permutation(len(shard_of))
        self._shard = np.asarray(shard_of, dtype=np.int64)[perm]
        self._row_start = np.asarray(start_of, dtype=np.int64)[perm]
        self._first_id = np.asarray(id_of, dtype=np.int64)[perm]
        self._starts = np.concatenate([[0], np.cumsum(np.asarray(rows_of, dtype=np.int64)[perm])])

    @property
    def num_windows(self) -> int:
        return -(-self.num_rows // self.window)

    def window_bounds(self, w: int) -> tuple[int, int]:
        start = w * self.window
        return start, min(start + self.window, self.num_rows)

    def window_segments(self, w: int) -> list[Segment]:
        """The shard row ranges a window covers, in permuted-block order."""
        lo, hi = self.window_bounds(w)
        out = []
        k = int(np.searchsorted(self._starts, lo, side="right")) - 1
        pos = lo
        while pos < hi:
            k_start, k_end = int(self._starts[k]), int(self._starts[k + 1])
            take_end = min(hi, k_end)
            skip = pos - k_start
            row_start = int(self._row_start[k]) + skip
            out.append(Segment(int(self._shard[k]), row_start, row_start + (take_end - pos),
                               int(self._first_id[k]) + skip))
            pos = take_end
            k += 1
        return out

    def window_permutation(self, w: int) -> np.ndarray:
        lo, hi = self.window_bounds(w)
        return _rng(self.seed, self.epoch, 1 + w).permutation(hi - lo)

    def window_sample_ids(self, w: int) -> np.ndarray:
        """Sample ids of window ``w`` in training order."""
        ids = np.concatenate([np.arange(s.first_id, s.first_id + s.row_end - s.row_start)
                              for s in self.window_segments(w)])
        return ids[self.window_permutation(w)]


@lru_cache(maxsize=8)
def epoch_plan(shard_rows: tuple[int, ...], seed: int, epoch: int, window: int,
               block_rows: int) -> EpochPlan:
    return EpochPlan(shard_rows, seed, epoch, window, block_rows)


def locate(position: int, num_rows: int, window: int) -> tuple[int, int, int]:
    """Global stream position -> (epoch, window index, offset within the window)."""
    epoch, p = divmod(position, num_rows)
    w, offset = divmod(p, window)
    return epoch, w, offset


def sample_ids(shard_rows: tuple[int, ...], seed: int, window: int, block_rows: int, start: int,
               stop: int) -> np.ndarray:
    """Sample ids at global stream positions ``[start, stop)``: the reference definition."""
    num_rows = sum(shard_rows)
    out = []
    pos = start
    while pos < stop:
        epoch, w, offset = locate(pos, num_rows, window)
        plan = epoch_plan(shard_rows, seed, epoch, window, block_rows)
        ids = plan.window_sample_ids(w)
        take = ids[offset: offset + (stop - pos)]
        out.append(take)
        pos += len(take)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def deal(global_batch_size: int, dp_world_size: int) -> list[slice]:
    """The one place that turns a world size into rank slices of a global batch.

    Contiguous slices whose sizes differ by at most one (the first ``B % W`` ranks get one more
    row); the loss is weighted by row count so uneven shares give the single-process gradient.
    """
    if dp_world_size <= 0:
        raise ValueError("dp_world_size must be positive")
    base, extra = divmod(global_batch_size, dp_world_size)
    slices, start = [], 0
    for r in range(dp_world_size):
        size = base + (1 if r < extra else 0)
        slices.append(slice(start, start + size))
        start += size
    return slices
