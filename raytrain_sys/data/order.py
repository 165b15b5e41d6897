"""Where a sample's order is decided: pure functions of (manifest row counts, seed, epoch).

No Ray, no I/O. The global sample stream is the concatenation of epochs; each epoch is the
manifest's shards cut into blocks, the blocks in a seeded order, cut into windows of ``window``
rows, each window permuted by its own seeded permutation. The data cursor is one integer: the number of samples
consumed by committed steps. Step ``k`` of a job with constant global batch ``B`` reads positions
``[cursor, cursor + B)``; the world size only decides how those rows are dealt to ranks
(``deal``), so the global batches are the same at any world size and across resizes.

Sample ids are positions in the manifest's (unpermuted) concatenation of shards.

A documents dataset (variable-length token documents plus a length index) orders its documents
the same way and turns each window of documents into rows by packing or length bucketing
(``DocumentEpoch``); the stream, the cursor and ``deal`` then work on those rows exactly as on
stored rows. A row's sample id is the corpus index of its first token.
"""

from __future__ import annotations

import bisect
import hashlib
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

    def block_order_ids(self) -> np.ndarray:
        """Sample ids of the whole epoch in permuted-block order (before the window shuffles)."""
        rows_of_block = np.diff(self._starts)
        return (np.repeat(self._first_id - self._starts[:-1], rows_of_block)
                + np.arange(self.num_rows, dtype=np.int64))

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


def deal(global_batch_size: int, dp_world_size: int, rows: list[int] | None = None) -> list[slice]:
    """The one place that turns a world size into rank slices of a global batch.

    Contiguous slices whose sizes differ by at most one (the first ``B % W`` ranks get one more
    row); the loss is weighted by row count so uneven shares give the single-process gradient.
    ``rows``: the sizes asked for instead (``weighted_rows``, a straggler's smaller share), in
    data-index order; they must sum to the global batch.
    """
    if dp_world_size <= 0:
        raise ValueError("dp_world_size must be positive")
    if rows is None:
        base, extra = divmod(global_batch_size, dp_world_size)
        rows = [base + (1 if r < extra else 0) for r in range(dp_world_size)]
    elif len(rows) != dp_world_size or sum(rows) != global_batch_size or min(rows) < 1:
        raise ValueError(f"rows {rows} do not split {global_batch_size} rows over {dp_world_size} ranks")
    slices, start = [], 0
    for size in rows:
        slices.append(slice(start, start + size))
        start += size
    return slices


def weighted_rows(global_batch_size: int, weights: list[float]) -> list[int]:
    """Row counts in proportion to ``weights``: largest remainders (ties to the lower index),
    then at least one each, taken from the largest (a rank with no rows would have nothing to
    run its collectives on)."""
    n = len(weights)
    if n == 0 or global_batch_size < n or min(weights) <= 0:
        raise ValueError(f"cannot split {global_batch_size} rows by weights {weights}")
    total = float(sum(weights))
    exact = [global_batch_size * w / total for w in weights]
    rows = [int(x) for x in exact]
    by_remainder = sorted(range(n), key=lambda i: (-(exact[i] - rows[i]), i))
    for i in by_remainder[:global_batch_size - sum(rows)]:
        rows[i] += 1
    for i in range(n):
        if rows[i] == 0:
            rows[max(range(n), key=lambda j: (rows[j], -j))] -= 1
            rows[i] = 1
    return rows


# ----------------------------------------------------------------------------- streams
# The plane asks one of two geometries where a window of the global stream begins, how many rows it
# holds and which window a stream position falls in. Stored rows are the samples of a row dataset;
# a documents dataset's rows are made from its documents (packing or length bucketing), a pure
# function of the document lengths, so neither needs to read a byte to plan or to seek.


@dataclass(frozen=True)
class RowStream:
    """Stored rows are the samples: windows of ``window`` rows; every epoch has the same length."""

    shard_rows: tuple[int, ...]
    seed: int
    window: int
    block_rows: int

    @property
    def rows_per_epoch(self) -> int:
        return sum(self.shard_rows)

    @property
    def windows_per_epoch(self) -> int:
        return -(-self.rows_per_epoch // self.window)

    def plan(self, epoch: int) -> EpochPlan:
        return epoch_plan(self.shard_rows, self.seed, epoch, self.window, self.block_rows)

    def window_start(self, g: int) -> int:
        """Stream position of window ``g``'s first row (g = epoch * windows_per_epoch + w)."""
        epoch, w = divmod(g, self.windows_per_epoch)
        return epoch * self.rows_per_epoch + w * self.window

    def window_rows(self, g: int) -> int:
        w = g % self.windows_per_epoch
        return min(self.window, self.rows_per_epoch - w * self.window)

    def locate(self, position: int) -> tuple[int, int]:
        """Stream position -> (window g, offset within it)."""
        epoch, w, offset = locate(position, self.rows_per_epoch, self.window)
        return epoch * self.windows_per_epoch + w, offset

    def ids(self, start: int, stop: int) -> np.ndarray:
        return sample_ids(self.shard_rows, self.seed, self.window, self.block_rows, start, stop)


PACK = "pack"  # a window's documents concatenated in training order, cut every row_len tokens
BUCKET = "bucket"  # every document cut every row_len tokens, one row per piece, batched by length
LAYOUTS = (PACK, BUCKET)


class DocumentIndex:
    """Token count of every document (in sample id order) and documents per shard.

    All a documents plan needs: read once from the dataset's length index, never from the shards.
    Hashable by content, so plans built from it can be cached.
    """

    def __init__(self, lengths, shard_docs: tuple[int, ...]):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.lengths.setflags(write=False)
        self.shard_docs = tuple(int(n) for n in shard_docs)
        if len(self.lengths) != sum(self.shard_docs):
            raise ValueError(f"{len(self.lengths)} document lengths for {sum(self.shard_docs)} documents")
        if (self.lengths < 0).any() or not self.lengths.sum():
            raise ValueError("document lengths must be non-negative and not all zero")
        # Corpus token index of each document's first token: a row's sample id is the corpus index
        # of its first token, unique within an epoch because each token is in one row per epoch.
        self.token_offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self._key = hashlib.sha256(self.lengths.tobytes() + repr(self.shard_docs).encode()).hexdigest()

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, DocumentIndex) and other._key == self._key

    def __reduce__(self):
        return (DocumentIndex, (self.lengths, self.shard_docs))


@dataclass(frozen=True)
class WindowRows:
    """How one window's documents become rows. Arrays are in training order.

    The window's documents, in training order, are laid end to end (the *concatenation*); every
    row is a slice of it of ``row_tokens`` tokens starting at ``row_starts``, padded to row_len.
    """

    doc_ids: np.ndarray  # the window's documents in training order
    doc_lengths: np.ndarray
    doc_starts: np.ndarray  # each document's first token in the concatenation; [-1] = its length
    row_starts: np.ndarray
    row_tokens: np.ndarray  # real tokens of each row; the rest of the row is padding
    row_ids: np.ndarray  # sample ids: corpus token index of each row's first token

    @property
    def num_tokens(self) -> int:
        return int(self.doc_starts[-1])

    def docs_of_rows(self, first_row: int) -> np.ndarray:
        """Mask over the documents (training order) that rows ``first_row..`` take tokens from."""
        needed = np.zeros(len(self.doc_ids) + 1, dtype=np.int64)
        starts = self.row_starts[first_row:]
        tokens = self.row_tokens[first_row:]
        starts, tokens = starts[tokens > 0], tokens[tokens > 0]
        firsts = np.searchsorted(self.doc_starts[:-1], starts, side="right") - 1
        lasts = np.searchsorted(self.doc_starts[:-1], starts + tokens - 1, side="right") - 1
        np.add.at(needed, firsts, 1)  # a difference array: +1 at a row's first document...
        np.add.at(needed, lasts + 1, -1)  # ...-1 after its last
        return np.cumsum(needed[:-1]) > 0


def bucket_order(row_tokens: np.ndarray, first_position: int, batch_rows: int,
                 rng: np.random.Generator) -> np.ndarray:
    """Length bucketing of one window: the order of its rows, rows of similar length together.

    Rows sorted by length (longest first, ties in training order) are cut into groups of
    ``batch_rows`` aligned with the global stream, so that each global batch is one group and
    pads little. The window's first rows complete the batch the previous window began, and its
    last rows begin the next one: both take the longest rows, as the previous window's last
    rows did, so the batch that spans two windows pads little too. The full groups come in a
    seeded random order, so lengths do not rise or fall through an epoch.
    """
    num_rows = len(row_tokens)
    by_len = np.argsort(-np.asarray(row_tokens), kind="stable")
    head = min(num_rows, (-first_position) % batch_rows)
    full = (num_rows - head) // batch_rows
    tail = num_rows - head - full * batch_rows
    groups = by_len[head + tail:].reshape(full, batch_rows)
    return np.concatenate([by_len[:head], groups[rng.permutation(full)].ravel(),
                           by_len[head:head + tail]])


class DocumentEpoch:
    """The rows of one epoch of a documents dataset. Cheap: O(documents), no I/O.

    Documents are ordered as rows are in ``EpochPlan`` (blocks of documents permuted, windows of
    ``window`` documents shuffled), then each window becomes rows of at most ``row_len`` tokens:

    - ``pack``: the window's documents are concatenated in training order and cut every row_len
      tokens; only the window's last row can be short (it is padded, its padding loss-masked).
      Windows stay independent: a window is read, packed and sought into on its own.
    - ``bucket``: every document is cut every row_len tokens and each piece is a row, ordered by
      ``bucket_order``; each global batch is padded to its longest row.

    A window's row count follows from the lengths of its documents alone, so the plan and the
    resume seek never read data. Every token of every document is in exactly one row per epoch.
    """

    def __init__(self, index: DocumentIndex, seed: int, epoch: int, window: int, block_docs: int,
                 row_len: int, layout: str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if row_len < 2:
            raise ValueError("row_len must be at least 2 (an input and a target)")
        self.index, self.seed, self.epoch = index, seed, epoch
        self.row_len, self.layout = row_len, layout
        self.docs = epoch_plan(index.shard_docs, seed, epoch, window, block_docs)
        lengths = index.lengths[self.docs.block_order_ids()]
        edges = np.minimum(np.arange(self.docs.num_windows + 1) * window, index.num_docs)
        if layout == PACK:
            window_tokens = np.diff(np.concatenate([[0], np.cumsum(lengths)])[edges])
            window_rows = -(-window_tokens // row_len)
        else:
            pieces = -(-lengths // row_len)
            window_rows = np.diff(np.concatenate([[0], np.cumsum(pieces)])[edges])
        self.row_starts = np.concatenate([[0], np.cumsum(window_rows)])  # epoch-relative
        self.num_rows = int(self.row_starts[-1])

    def window(self, w: int, first_position: int = 0, batch_rows: int = 1) -> WindowRows:
        """Window ``w``'s rows; ``first_position`` (its stream position) aligns bucket groups."""
        doc_ids = self.docs.window_sample_ids(w)
        doc_lengths = self.index.lengths[doc_ids]
        doc_starts = np.concatenate([[0], np.cumsum(doc_lengths)])
        total, L = int(doc_starts[-1]), self.row_len
        if self.layout == PACK:
            row_starts = np.arange(0, total, L, dtype=np.int64)
            row_tokens = np.minimum(L, total - row_starts)
        else:
            pieces = -(-doc_lengths // L)
            piece_doc = np.repeat(np.arange(len(doc_ids)), pieces)
            piece_k = np.arange(len(piece_doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            row_starts = doc_starts[piece_doc] + piece_k * L
            row_tokens = np.minimum(L, doc_lengths[piece_doc] - piece_k * L)
            rng = _rng(self.seed, self.epoch, 1 + w, 1)  # 4 keys: apart from the window's stream
            keep = bucket_order(row_tokens, first_position, batch_rows, rng)
            row_starts, row_tokens = row_starts[keep], row_tokens[keep]
        first_doc = np.searchsorted(doc_starts[:-1], row_starts, side="right") - 1
        row_ids = self.index.token_offsets[doc_ids[first_doc]] + row_starts - doc_starts[first_doc]
        assert len(row_starts) == self.row_starts[w + 1] - self.row_starts[w]
        return WindowRows(doc_ids, doc_lengths, doc_starts, row_starts, row_tokens.astype(np.int64),
                          row_ids.astype(np.int64))


@lru_cache(maxsize=8)
def document_epoch(index: DocumentIndex, seed: int, epoch: int, window: int, block_docs: int,
                   row_len: int, layout: str) -> DocumentEpoch:
    return DocumentEpoch(index, seed, epoch, window, block_docs, row_len, layout)


class DocumentStream:
    """The global stream of rows made from documents: epochs of ``DocumentEpoch`` end to end.

    A packed epoch's row count depends on how its windows fall (each pads its last row), so epoch
    starts are summed as far as a position needs; bucketed epochs all have the same count.
    ``batch_rows`` (the job's global batch size) aligns length buckets with global batches.
    """

    def __init__(self, index: DocumentIndex, seed: int, window: int, block_docs: int, row_len: int,
                 layout: str, batch_rows: int = 1):
        if window <= 0 or block_docs <= 0 or batch_rows <= 0:
            raise ValueError("window, block_docs and batch_rows must be positive")
        self.index, self.seed, self.window, self.block_docs = index, seed, window, block_docs
        self.row_len, self.layout, self.batch_rows = row_len, layout, batch_rows
        self.windows_per_epoch = -(-index.num_docs // window)
        self._epoch_starts = [0]  # stream position of epoch e's first row, filled on demand

    def __reduce__(self):  # ship the constants, not the caches
        return (DocumentStream, (self.index, self.seed, self.window, self.block_docs, self.row_len,
                                 self.layout, self.batch_rows))

    def epoch(self, e: int) -> DocumentEpoch:
        return document_epoch(self.index, self.seed, e, self.window, self.block_docs, self.row_len,
                              self.layout)

    def epoch_start(self, e: int) -> int:
        while len(self._epoch_starts) <= e:
            last = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + self.epoch(last).num_rows)
        return self._epoch_starts[e]

    def window_start(self, g: int) -> int:
        e, w = divmod(g, self.windows_per_epoch)
        return self.epoch_start(e) + int(self.epoch(e).row_starts[w])

    def window_rows(self, g: int) -> int:
        e, w = divmod(g, self.windows_per_epoch)
        starts = self.epoch(e).row_starts
        return int(starts[w + 1] - starts[w])

    def locate(self, position: int) -> tuple[int, int]:
        """Stream position -> (window g, offset within it)."""
        while self._epoch_starts[-1] <= position:  # every epoch has a row: this ends
            self.epoch_start(len(self._epoch_starts))
        e = bisect.bisect_right(self._epoch_starts, position) - 1
        p = position - self._epoch_starts[e]
        starts = self.epoch(e).row_starts
        # 'right': a window without rows starts where the next one does; this finds the one with rows.
        w = int(np.searchsorted(starts[:-1], p, side="right")) - 1
        return e * self.windows_per_epoch + w, p - int(starts[w])

    def window_layout(self, g: int) -> WindowRows:
        e, w = divmod(g, self.windows_per_epoch)
        return self.epoch(e).window(w, self.window_start(g), self.batch_rows)

    def ids(self, start: int, stop: int) -> np.ndarray:
        """Sample ids (first-token corpus indices) of stream positions ``[start, stop)``."""
        out, pos = [], start
        while pos < stop:
            g, offset = self.locate(pos)
            take = self.window_layout(g).row_ids[offset: offset + (stop - pos)]
            out.append(take)
            pos += len(take)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
