"""The data plane: Ray Data reads and permutes windows; the driver deals global batches.

Ray Data runs the reading (and preprocessing) as tasks that may land on CPU-only nodes. The order
never comes from Ray Data's scheduling: each task computes whole windows of the plan in
``raytrain_sys.data.order``, and the stream is consumed with ``preserve_order``. The driver keeps a
small cache of windows keyed by their global index ``g = epoch * windows_per_epoch + window`` and
slices a step's global batch out of it by cursor. Prefetched windows are never "consumed": only
the Supervisor's committed cursor moves, so a failed step re-reads the same rows and a resume
seeks straight to the cursor's window (shard + row group / byte offset, never read-and-drop).

Both formats (Parquet token rows, WebDataset tar samples) go through the same
``map_batches(read_windows)`` over chunks of consecutive windows; ``shards.read_segments`` reads
segments of either by seeking (token shards once per shard for a whole chunk).

Sequences (``data.sequences``): a documents dataset has no rows of its own. Its windows are
windows of documents, and the task that reads one makes its rows (``order.DocumentEpoch``):
``pack`` and ``pack_masked`` concatenate the window's documents and cut rows of ``row_len``
tokens, ``bucket`` cuts each document into rows and groups rows of similar length. The rows of a
window are a pure function of the document lengths, read once from the dataset's length index, so
the stream positions, the cursor and the seek work as for stored rows. Columns delivered beside
``tokens``: ``num_tokens`` (real tokens per row, the rest is padding, loss-masked) and, for
``pack_masked``, ``doc_ids`` (the document of every token, -1 for padding), from which the task
restarts positions and masks attention at document boundaries. A ``bucket`` global batch is
trimmed to its longest row.

Bad shards (``data.on_bad_shard``):
- ``fail``: the first read error stops the run with the shard, the data cursor and the step.
- ``skip``: the shard's rows leave the stream from a stream position on. The skip ledger maps each
  skipped shard to ``from_position``, the raw stream position of the first window whose read
  failed. A window at or after it is read without that shard's rows; the cursor counts delivered
  samples, so the batch is filled from the next rows of the stream and every step keeps the job's
  global batch size. Positions before it keep their meaning, so exactly-once holds for the rest
  of the stream, at any world size (the ledger, not the world, decides the stream). A failed read
  comes back as a marker in place of its window, in stream order, so ``from_position`` does not
  depend on prefetch timing: the same bytes give the same stream. The ledger is appended to
  ``<run_dir>/skipped_samples.jsonl`` with the skipped ids, and a restarted plane reloads it from
  there.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import time
from typing import Callable, Iterator

import numpy as np

from raytrain_sys.data import order
from raytrain_sys.data.manifest import TOKENS_FORMAT, DatasetManifest
from raytrain_sys.data.shards import (BadShardError, gather_rows, read_document_index,
                                      read_documents, read_segments, read_token_pool)
from raytrain_sys.data.stream import iter_blocks_closing_quietly
from raytrain_sys.errors import DataError, find_user_error

log = logging.getLogger(__name__)

SKIP_LOG_FILE = "skipped_samples.jsonl"
BAD_SHARD_POLICIES = ("fail", "skip")
# rows: the dataset's stored rows. The others make rows of a documents dataset's documents.
SEQUENCES = ("rows", "pack", "pack_masked", "bucket")
# Bytes of rows per Ray Data block (a chunk of windows). Ray Data's executor takes a finished
# task's block on a loop that waits up to 100 ms, and frees the task's slot only after a metadata
# fetch on another thread; so each block costs up to ~100 ms of latency and ~17 ms of driver CPU
# (2 cores), whatever its size. Reading 16 MiB takes about as long: readers stalled half the time
# (1.0-1.1 M rows/s over 40 epochs of the stdlib, pyarrow 1.4-1.7 M); 32 MiB gave 1.2-1.3 M,
# 64 MiB no more. The first chunks after a seek are small (a window, then 4x each), so time to
# first batch does not grow; the driver's cache and the object store hold a few blocks at most.
CHUNK_BYTES = 32 * 2**20
# Reading tasks of a stream at most (40 epochs of the stdlib: 2 gave 1.1-1.3 M rows/s, 3 gave
# 1.5-1.6 M, 4 no more than 3 and the start of another worker process).
READERS = 3


def window_layout(plan: order.EpochPlan, w: int, perm: np.ndarray | None = None
                  ) -> tuple[list[order.Segment], np.ndarray, np.ndarray]:
    """(segments, sample ids, shard of each row) of window ``w``, the arrays in training order."""
    segs = plan.window_segments(w)
    seg_ids = np.concatenate([np.arange(s.first_id, s.first_id + s.row_end - s.row_start) for s in segs])
    seg_shard = np.concatenate([np.full(s.row_end - s.row_start, s.shard) for s in segs])
    perm = plan.window_permutation(w) if perm is None else perm
    return segs, seg_ids[perm], seg_shard[perm]


def kept_rows(shard_of_row: np.ndarray, raw_start: int, skips: dict[int, int]) -> np.ndarray:
    """Mask of a window's rows (training order) that stay in the stream: a row of a skipped shard
    leaves it when its raw stream position is at or after the shard's ``from_position``."""
    keep = np.ones(len(shard_of_row), dtype=bool)
    for shard, frm in skips.items():
        keep &= ~((shard_of_row == shard) & (raw_start + np.arange(len(keep)) >= frm))
    return keep


def window_reads(plan: order.EpochPlan, w: int, raw_start: int, skips: dict[int, int],
                 start: int = 0) -> tuple[list[order.Segment], np.ndarray, np.ndarray]:
    """How to read the kept rows of window ``w`` from training-order index ``start`` on.

    Returns (segments to read, ``take``, sample ids): the window's rows are
    ``concatenation of the segments' rows [take]``. Only segments holding such rows are listed,
    so a shard whose rows here are all skipped (or all before ``start``: consumed before a
    restart) is not touched. With no skips and start 0 the ids are ``plan.window_sample_ids(w)``.
    """
    perm = plan.window_permutation(w)
    segs, ids, shard_of_row = window_layout(plan, w, perm)
    keep = kept_rows(shard_of_row, raw_start, skips)
    keep[:start] = False
    keep_seg = np.zeros(len(keep), dtype=bool)
    keep_seg[perm] = keep  # training position i holds segment-order row perm[i]
    bounds = np.cumsum([0] + [s.row_end - s.row_start for s in segs])
    read = np.zeros(len(keep), dtype=bool)
    to_read = []
    for k, seg in enumerate(segs):
        if keep_seg[bounds[k]:bounds[k + 1]].any():
            to_read.append(seg)
            read[bounds[k]:bounds[k + 1]] = True
    take = (np.cumsum(read) - 1)[perm[keep]]  # segment-order row -> its place among the read rows
    return to_read, take, ids[keep]


def read_window(dataset_uri: str, manifest: DatasetManifest, plan: order.EpochPlan, w: int,
                raw_start: int, skips: dict[int, int], start: int = 0,
                s3_endpoint_url: str = "") -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The kept rows of window ``w`` from training-order index ``start`` on: (columns, sample ids)."""
    segs, take, ids = window_reads(plan, w, raw_start, skips, start)
    if not segs:
        return {}, ids
    columns = read_segments(dataset_uri, manifest, segs, s3_endpoint_url)
    return {c: v[take] for c, v in columns.items()}, ids


def read_document_window(dataset_uri: str, manifest: DatasetManifest,
                         stream: order.DocumentStream, g: int, start: int = 0, masked: bool = False,
                         s3_endpoint_url: str = "") -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Rows ``start..`` of document window ``g``: (columns, sample ids).

    Only the segments holding documents those rows take tokens from are read (a resume mid-window
    reads no document that lies wholly before the cursor). Each document is copied once, straight
    to its place in the window's concatenation; packed rows are then a reshape of it (no copy).
    """
    epoch, w = divmod(g, stream.windows_per_epoch)
    rows = stream.window_layout(g)
    docs = stream.epoch(epoch).docs
    segs, perm = docs.window_segments(w), docs.window_permutation(w)
    needed = rows.docs_of_rows(start) if start else rows.doc_lengths > 0
    train_pos = np.empty(len(perm), dtype=np.int64)
    train_pos[perm] = np.arange(len(perm))  # segment-order document -> its training position
    L, num_rows, total = stream.row_len, len(rows.row_starts), rows.num_tokens
    packed = stream.layout == order.PACK
    # Packed rows are the concatenation cut every L tokens; a bucket row may start anywhere in
    # it, so L zeros after it let every row be a full-width slice.
    buf = np.zeros(num_rows * L if packed else total + L, dtype=np.uint8)
    lo = 0
    for seg in segs:
        n = seg.row_end - seg.row_start
        positions = train_pos[lo:lo + n]
        lo += n
        if not needed[positions].any():
            continue
        data, offsets = read_documents(dataset_uri, manifest, seg, s3_endpoint_url,
                                       stream.index.lengths[seg.first_id: seg.first_id + n])
        for j, i in enumerate(positions.tolist()):
            if needed[i]:
                buf[rows.doc_starts[i]: rows.doc_starts[i + 1]] = data[offsets[j]: offsets[j + 1]]
    if packed:
        tokens = buf.reshape(num_rows, L)[start:]
    else:
        tokens = np.lib.stride_tricks.sliding_window_view(buf, L)[rows.row_starts[start:]]
        tokens[np.arange(L) >= rows.row_tokens[start:, None]] = 0  # another document's tokens
    columns = {"tokens": tokens, "num_tokens": rows.row_tokens[start:].astype(np.int32)}
    if masked:
        doc_ids = np.full(num_rows * L, -1, dtype=np.int32)
        doc_ids[:total] = np.repeat(rows.doc_ids.astype(np.int32), rows.doc_lengths)
        columns["doc_ids"] = doc_ids.reshape(num_rows, L)[start:]
    return columns, rows.row_ids[start:]


def to_table(columns: dict[str, np.ndarray]) -> "pa.Table":
    """A block for Ray Data, zero-copy: a column of rows of any shape is a fixed-size binary column
    over the array's own buffer, its dtype and row shape in the field's metadata.

    Returning the numpy dict instead makes Ray Data build its tensor extension arrays, measured at
    ~2 ms per MB (29 ms for a 15 MB block), the largest cost of a block after reading it.
    """
    import pyarrow as pa

    fields, arrays = [], []
    for name, v in columns.items():
        if v.dtype.kind in "OUS":  # text (a bad shard's error)
            array = pa.array([str(x) for x in v])
            meta = None
        else:
            v = np.ascontiguousarray(v)
            width = int(np.prod(v.shape[1:], dtype=np.int64)) * v.itemsize
            array = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(v),
                                                         [None, pa.py_buffer(v)])
            meta = {"dtype": v.dtype.str, "shape": ",".join(str(d) for d in v.shape[1:])}
        arrays.append(array)
        fields.append(pa.field(name, array.type, metadata=meta))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def from_table(table) -> dict[str, np.ndarray]:
    """The columns of a block made by ``to_table``, as numpy views of its buffers (no copy)."""
    out = {}
    for field in table.schema:
        column = table.column(field.name)
        array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        meta = field.metadata or {}
        if b"dtype" not in meta:
            out[field.name] = np.asarray(array.to_pylist())
            continue
        dtype = np.dtype(meta[b"dtype"].decode())
        shape = tuple(int(d) for d in meta[b"shape"].decode().split(",") if d)
        width = array.type.byte_width
        raw = np.frombuffer(array.buffers()[1], dtype=np.uint8)
        raw = raw[array.offset * width:(array.offset + len(array)) * width]
        out[field.name] = raw.view(dtype).reshape((len(array),) + shape)
    return out


def _read_row_chunk(dataset_uri: str, manifest: DatasetManifest, stream: order.RowStream,
                    windows: list[int], start: int, skips: dict[int, int],
                    s3_endpoint_url: str) -> list[tuple[int, dict[str, np.ndarray], np.ndarray]]:
    """Windows of stored rows, all their segments read in one pass (one call per shard)."""
    plans = []
    for i, g in enumerate(windows):
        epoch, w = divmod(g, stream.windows_per_epoch)
        plans.append((g, *window_reads(stream.plan(epoch), w, stream.window_start(g), skips,
                                       start if i == 0 else 0)))
    segs = [seg for _, window_segs, _, _ in plans for seg in window_segs]
    pool, index = (read_token_pool(dataset_uri, manifest, segs, s3_endpoint_url) if segs
                   else (np.zeros((0, manifest.row_len), np.uint8), np.zeros(0, np.int64)))
    out, lo = [], 0
    for g, window_segs, take, ids in plans:
        # One gather per window, straight from the decoded row groups into training order.
        out.append((g, {"tokens": gather_rows(pool, index[lo + take])}, ids))
        lo += sum(seg.row_end - seg.row_start for seg in window_segs)
    return out


def _read_one(dataset_uri: str, manifest: DatasetManifest, stream, g: int, start: int,
              skips: dict[int, int], masked: bool,
              s3_endpoint_url: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    if isinstance(stream, order.DocumentStream):
        return read_document_window(dataset_uri, manifest, stream, g, start, masked, s3_endpoint_url)
    epoch, w = divmod(g, stream.windows_per_epoch)
    return read_window(dataset_uri, manifest, stream.plan(epoch), w, stream.window_start(g), skips,
                       start, s3_endpoint_url)


def read_windows(batch: dict[str, np.ndarray], dataset_uri: str, manifest: DatasetManifest,
                 stream, s3_endpoint_url: str, masked: bool = False,
                 skips: tuple[tuple[int, int], ...] = ()):
    """Ray Data map_batches function: a chunk of consecutive windows -> their rows + sample ids.

    A chunk is windows ``g..last`` (those with delivered rows), the first read from training-order
    index ``start``; the output has a ``g`` column naming each row's window. One block per chunk
    rather than per window: each Ray Data block costs tens of milliseconds of latency and driver
    CPU, more than reading a window of rows.

    A bad shard never raises here: an exception would reach the driver as text, at a time that
    depends on prefetch. If the chunk's first window is bad, the block is a marker naming the
    shard in place of the window; if a later one is, the block holds the windows before it and a
    ``bad_window`` column, and the driver reads on from that window with a new stream, whose first
    chunk is that window alone and so comes back as a marker, in stream order, exactly when the
    consumer needs it.
    """
    skip_map = dict(skips)
    parts: list[tuple[int, dict[str, np.ndarray], np.ndarray]] = []
    bad_window = -1
    for first, last, start in zip(batch["g"], batch["last"], batch["start"]):
        windows = list(range(int(first), int(last) + 1))
        try:
            if isinstance(stream, order.RowStream) and manifest.format == TOKENS_FORMAT:
                parts += _read_row_chunk(dataset_uri, manifest, stream, windows, int(start), skip_map,
                                         s3_endpoint_url)
                continue
        except BadShardError:
            pass  # window by window below, to find the first bad one
        for i, g in enumerate(windows):
            try:
                columns, ids = _read_one(dataset_uri, manifest, stream, g, int(start) if i == 0 else 0,
                                         skip_map, masked, s3_endpoint_url)
            except BadShardError as exc:
                if not any(len(ids) for _, _, ids in parts):
                    return to_table({"g": np.asarray([g], dtype=np.int64),
                                     "bad_shard": np.asarray([exc.shard], dtype=np.int64),
                                     "error": np.asarray([str(exc)])})
                bad_window = g
                break
            parts.append((g, columns, ids))
        if bad_window >= 0:
            break
    parts = [p for p in parts if len(p[2])]  # windows all of whose rows are skipped
    out = {k: np.concatenate([p[1][k] for p in parts]) for k in parts[0][1]}
    out["sample_id"] = np.concatenate([p[2] for p in parts])
    out["g"] = np.concatenate([np.full(len(p[2]), p[0], dtype=np.int64) for p in parts])
    if bad_window >= 0:
        out["bad_window"] = np.full(len(out["g"]), bad_window, dtype=np.int64)
    return to_table(out)


class DataPlane:
    """Serves ``global_batch(data_cursor)`` from a Ray Data stream of plan windows.

    ``sequences`` and ``row_len`` (model block_size + 1) matter for documents datasets only.
    """

    def __init__(self, dataset_uri: str, manifest: DatasetManifest, seed: int, window: int,
                 block_rows: int, global_batch_size: int, end_position: int, prefetch_steps: int = 4,
                 s3_endpoint_url: str = "", on_bad_shard: str = "fail", run_dir: str = "",
                 on_skip: Callable[[str], None] | None = None, sequences: str = "rows",
                 row_len: int = 0):
        if on_bad_shard not in BAD_SHARD_POLICIES:
            raise ValueError(f"on_bad_shard must be one of {BAD_SHARD_POLICIES}")
        if sequences not in SEQUENCES:
            raise ValueError(f"sequences must be one of {SEQUENCES}")
        self.dataset_uri = dataset_uri
        self.manifest = manifest
        self.seed = seed
        self.window = min(window, manifest.num_rows)
        self.block_rows = block_rows
        self.global_batch_size = global_batch_size
        self.end_position = end_position
        self.s3_endpoint_url = s3_endpoint_url
        self.on_bad_shard = on_bad_shard
        self.run_dir = run_dir
        self.on_skip = on_skip
        self.shard_rows = tuple(s.num_rows for s in manifest.shards)
        self.num_rows = manifest.num_rows
        self.sequences = sequences
        if sequences == "rows":
            self.stream = order.RowStream(self.shard_rows, seed, self.window, block_rows)
            # what a row costs in a block: its columns plus sample id and window (8 bytes each)
            row_bytes = (manifest.row_len or sum(sh.num_bytes for sh in manifest.shards) // self.num_rows) + 16
        else:
            if on_bad_shard == "skip":
                # A skipped shard would re-pack the windows it is in, moving rows already consumed.
                raise ValueError("data.on_bad_shard=skip applies to stored rows; with data.sequences="
                                 f"{sequences} a bad shard stops the run (restore it and resume)")
            index = read_document_index(dataset_uri, manifest, s3_endpoint_url)
            self.stream = order.DocumentStream(
                index, seed, self.window, block_rows, row_len,
                order.BUCKET if sequences == "bucket" else order.PACK, global_batch_size)
            row_bytes = row_len * (5 if sequences == "pack_masked" else 1) + 20  # int32 doc ids
        self.windows_per_epoch = self.stream.windows_per_epoch
        self.chunk_rows = max(prefetch_steps * global_batch_size, CHUNK_BYTES // row_bytes)
        # window g -> (columns, sample ids, delivered offset of the first cached row)
        self._cache: dict[int, tuple[dict[str, np.ndarray], np.ndarray, int]] = {}
        self._stream: Iterator | None = None
        self._stream_next: int | None = None  # the window the stream yields next
        self._stream_first: tuple[int, int] = (-1, 0)  # (window, delivered offset) it opened at
        self.wait_s = 0.0  # time the trainers waited on data (driver-side), for metrics
        self.skips: dict[int, int] = {}  # shard -> raw stream position its rows leave the stream
        self._fstarts: list[int] = []  # delivered-stream start of windows g0, g0+1, ...
        self._keep: dict[int, np.ndarray] = {}  # window -> kept-row mask, while skips exist
        self._partial: list = []  # pieces of a window Ray Data delivered split over blocks
        # (first position, end position, columns, ids) of the window the last batch ended in
        self._last: tuple | None = None
        self._load_skips()

    @classmethod
    def for_job(cls, spec, manifest: DatasetManifest, end_position: int, run_dir: str = "",
                on_skip: Callable[[str], None] | None = None) -> "DataPlane":
        """The plane a job spec asks for: the one place that maps ``spec.data`` to the plane."""
        d = spec.data
        return cls(d.path, manifest, d.seed, d.shuffle_window, d.shuffle_block_rows,
                   spec.train.global_batch_size, end_position, prefetch_steps=d.prefetch_steps,
                   s3_endpoint_url=d.s3_endpoint_url, on_bad_shard=d.on_bad_shard, run_dir=run_dir,
                   on_skip=on_skip, sequences=d.sequences, row_len=spec.model.block_size + 1)

    # ----- window geometry: raw (the plan's) and delivered (after skipped shards) positions
    def _raw_start(self, g: int) -> int:
        return self.stream.window_start(g)

    def _raw_len(self, g: int) -> int:
        return self.stream.window_rows(g)

    def _kept(self, g: int) -> np.ndarray | None:
        """Mask of window g's kept rows, or None when no skip reaches into it (all kept)."""
        start = self._raw_start(g)
        if not any(frm < start + self._raw_len(g) for frm in self.skips.values()):
            return None
        if g not in self._keep:
            epoch, w = divmod(g, self.windows_per_epoch)
            self._keep[g] = kept_rows(window_layout(self.stream.plan(epoch), w)[2], start, self.skips)
        return self._keep[g]

    def _delivered_len(self, g: int) -> int:
        keep = self._kept(g)
        return self._raw_len(g) if keep is None else int(keep.sum())

    def _raw_index(self, g: int, offset: int) -> int:
        """Delivered offset in window g -> its row's index in the window's training order."""
        keep = self._kept(g)
        return offset if keep is None else int(np.flatnonzero(keep)[offset])

    def _first_skip_window(self) -> int:
        return self.stream.locate(min(self.skips.values()))[0]

    def _fstart(self, g: int) -> int:
        """Delivered-stream position of window ``g``'s first row."""
        if not self.skips:
            return self._raw_start(g)
        g0 = self._first_skip_window()
        if g <= g0:  # no window before g0 lost a row
            return self._raw_start(g)
        if not self._fstarts:
            self._fstarts = [self._raw_start(g0)]
        while len(self._fstarts) <= g - g0:
            last = g0 + len(self._fstarts) - 1
            self._fstarts.append(self._fstarts[-1] + self._delivered_len(last))
        return self._fstarts[g - g0]

    def _locate(self, position: int) -> tuple[int, int]:
        """Delivered-stream position -> (window g, offset among its delivered rows)."""
        if self.skips:
            g0 = self._first_skip_window()
            if position >= self._raw_start(g0):
                self._fstart(g0 + 1)  # fills _fstarts from g0
                while self._fstarts[-1] <= position:
                    self._fstart(g0 + len(self._fstarts))
                # An empty window starts where the next one does: bisect finds the non-empty one.
                i = bisect.bisect_right(self._fstarts, position) - 1
                return g0 + i, position - self._fstarts[i]
        return self.stream.locate(position)

    def _next_window(self, g: int) -> int:
        g += 1
        while self._delivered_len(g) == 0:  # all skipped, or documents that make no row
            g += 1
        return g

    # ----- the stream
    def _chunks(self, g: int, start: int) -> list[dict[str, int]]:
        """The stream's items from window ``g`` (read from raw index ``start``) to the run's end.

        The first item is that window alone, so the first batch after a seek waits for one
        window; later items group consecutive windows into chunks that grow 4x in rows up to
        ``chunk_rows``, so that Ray Data's per-block cost is paid rarely.
        """
        last, _ = self._locate(max(self.end_position - 1, 0))
        items = [{"g": g, "last": g, "start": start}]
        budget, k = self._delivered_len(g), g  # a whole window, even when read from mid-window
        while k < last:
            budget = min(4 * budget, self.chunk_rows)
            first = k = self._next_window(k)
            rows = self._delivered_len(k)
            while rows < budget and k < last:
                nxt = self._next_window(k)
                if rows + self._delivered_len(nxt) > self.chunk_rows:
                    break
                k = nxt
                rows += self._delivered_len(k)
            items.append({"g": first, "last": k, "start": 0})
        return items

    def _open_stream(self, g: int, offset: int) -> None:
        """Seek: a new Ray Data pipeline from delivered offset ``offset`` of window ``g``.

        The first window is read from that row on (only the segments holding rows from there);
        nothing before the resume point is read and dropped.
        """
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # our plan is the order, not task timing
        ctx.enable_progress_bars = False
        # Ray Data logs every execution start at INFO; one per (re)seek is noise in a run's log.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        self._drop_stream()
        self._cache.pop(g, None)
        self._last = None
        self._partial = []
        items = self._chunks(g, self._raw_index(g, offset))
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            read_windows, batch_size=1, batch_format="numpy",
            # Zero CPUs: readers must not wait behind trainers that hold every CPU of the
            # placement group; reading a window is short and mostly I/O.
            num_cpus=0,
            # ...but bounded: zero-CPU tasks are otherwise launched for every item at once, each
            # in a new worker process. READERS: Ray Data frees a finished task's slot a scheduling
            # round or two (up to 100 ms each) after the task ends, so with two slots the next
            # read waited on the last one's bookkeeping, and reading ran one task at a time.
            compute=ray.data.TaskPoolStrategy(size=min(len(items), READERS)),
            fn_kwargs=dict(dataset_uri=self.dataset_uri, manifest=self.manifest, stream=self.stream,
                           s3_endpoint_url=self.s3_endpoint_url,
                           masked=self.sequences == "pack_masked",
                           skips=tuple(sorted(self.skips.items()))),
        )
        self._stream = iter_blocks_closing_quietly(ds, batch_size=None, batch_format="pyarrow",
                                                   prefetch_batches=1)
        self._stream_next, self._stream_first = g, (g, offset)
        log.info("data plane: stream opened at window %d offset %d (epoch %d)", g, offset,
                 g // self.windows_per_epoch)

    def _pull(self, want: tuple[int, int], data_cursor: int) -> None:
        """Take the stream's next block (a chunk of windows) into the cache; ``want`` is the
        (window, offset) waited for."""
        try:
            batch = from_table(next(self._stream))
        except StopIteration:
            raise DataError("data stream ended before the requested cursor") from None
        except Exception as exc:  # Ray Data wraps task errors; surface ours as one line
            self._stream = None
            found = find_user_error(exc)
            if found is not None:
                raise found from None
            raise
        if "bad_shard" in batch:
            g = int(batch["g"][0])
            assert g == self._stream_next == want[0], f"stream out of order: {g}, {self._stream_next}, {want}"
            # Windows after this one were read without knowing: a new stream either way.
            self._drop_stream()
            shard, error = int(batch["bad_shard"][0]), str(batch["error"][0])
            if self.on_bad_shard != "skip":
                raise DataError(error)
            # From the row waited for: rows before it were consumed and keep their positions.
            self._skip(shard, error, self._raw_start(g) + self._raw_index(*want), data_cursor)
            return
        gs, ids = batch.pop("g"), batch.pop("sample_id")
        truncated = batch.pop("bad_window", None) is not None
        cuts = [0, *(np.flatnonzero(gs[1:] != gs[:-1]) + 1).tolist(), len(gs)]
        for lo, hi in zip(cuts, cuts[1:]):
            g = int(gs[lo])
            assert g == self._stream_next, f"stream out of order: {g}, {self._stream_next}, {want}"
            self._partial.append(({k: v[lo:hi] for k, v in batch.items()}, ids[lo:hi]))
            base = self._stream_first[1] if g == self._stream_first[0] else 0
            have, need = sum(len(p[1]) for p in self._partial), self._delivered_len(g) - base
            assert have <= need, f"window {g}: {have} rows delivered, {need} planned"
            if have == need:  # Ray Data may split a big block: a window can come in pieces
                parts, self._partial = self._partial, []
                if len(parts) == 1:  # views of the block in the object store, read-only, no copy
                    self._cache[g] = (*parts[0], base)
                else:
                    self._cache[g] = ({k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]},
                                      np.concatenate([p[1] for p in parts]), base)
                self._stream_next = self._next_window(g)
        if truncated:  # the chunk stopped before a bad shard: read on from there with a new stream
            log.info("data plane: a chunk stopped before a bad shard in window %d; a new stream "
                     "will read on from there", self._stream_next)
            self._drop_stream()

    def _window(self, g: int, offset: int, data_cursor: int) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
        """Window g cached from ``offset`` or earlier; seeks when the stream is elsewhere."""
        hit = self._cache.get(g)
        if hit is not None and hit[2] <= offset:
            return hit
        while True:
            stale_first = g == self._stream_first[0] and self._stream_first[1] > offset
            if self._stream is None or self._stream_next != g or stale_first or g in self._cache:
                self._open_stream(g, offset)
            self._pull((g, offset), data_cursor)
            if g in self._cache:
                return self._cache[g]

    def rows(self, start: int, stop: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The columns and sample ids of delivered-stream positions ``[start, stop)``.

        Read-only arrays, views of the stream's blocks where a batch lies in one window: copy
        before writing (a Ray task argument or ``torch.tensor`` copies anyway).
        """
        t0 = time.perf_counter()
        last = self._last
        if last is not None and last[0] <= start and stop <= last[1]:
            # The common case, a batch inside the window the last one ended in: views, no lookups.
            i, n = start - last[0], stop - start
            batch, ids = {k: v[i:i + n] for k, v in last[2].items()}, last[3][i:i + n]
            self.wait_s += time.perf_counter() - t0
            return self._finish(batch), ids
        parts: list[dict[str, np.ndarray]] = []
        ids = []
        pos = start
        try:
            while pos < stop:
                g, offset = self._locate(pos)
                columns, wi, base = self._window(g, offset, start)
                i = offset - base
                take = min(stop - pos, len(wi) - i)
                parts.append({k: v[i: i + take] for k, v in columns.items()})
                ids.append(wi[i: i + take])
                pos += take
        except DataError as exc:
            step = start // self.global_batch_size + 1
            hint = ("; to train on without it set data.on_bad_shard=skip"
                    if self.on_bad_shard == "fail" and "shard" in str(exc) else "")
            raise DataError(f"{exc} [while reading the global batch at data cursor {start}, "
                            f"step {step}{hint}]") from None
        finally:
            self.wait_s += time.perf_counter() - t0
        # Drop windows wholly before this batch: nothing behind the cursor is needed again.
        first, _ = self._locate(start)
        for k in [k for k in self._cache if k < first]:
            del self._cache[k]
        # The window the batch ended in serves the next batches by the fast path above.
        first_row = pos - take - i  # the delivered position of the window's first cached row
        self._last = (first_row, first_row + len(wi), columns, wi)
        if len(parts) == 1:
            return self._finish(parts[0]), ids[0]
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return self._finish(batch), np.concatenate(ids)

    def _finish(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.sequences == "bucket":
            # Padding per batch: to its longest row (2 tokens at least: an input and a target).
            width = max(2, int(batch["num_tokens"].max()))
            batch["tokens"] = np.ascontiguousarray(batch["tokens"][:, :width])
        return batch

    def global_batch(self, data_cursor: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return self.rows(data_cursor, data_cursor + self.global_batch_size)

    def _drop_stream(self) -> None:
        # Closing the generator now shuts its Ray Data execution down while Ray is still up,
        # after the reads running in it end (raytrain_sys.data.stream: no cancel).
        stream, self._stream = self._stream, None
        if stream is not None and hasattr(stream, "close"):
            try:
                stream.close()
            except Exception as exc:  # a failed stream may not close cleanly; it is gone anyway
                log.debug("closing a data stream: %s", exc)

    def close(self) -> None:
        self._last = None
        self._drop_stream()
        self._cache.clear()

    # ----- bad shards
    def _skip(self, bad: int, error: str, frm: int, data_cursor: int) -> None:
        if bad in self.skips and self.skips[bad] <= frm:
            raise DataError(f"{error} (already skipped from stream position {self.skips[bad]}, "
                            f"yet read again: a bug in the data plane)")
        self.skips[bad] = frm
        self._fstarts, self._keep, self._last = [], {}, None
        shard = self.manifest.shards[bad]
        lo = self.manifest.row_offsets[bad]
        epoch, p = divmod(frm, self.num_rows)
        plan = self.stream.plan(epoch)
        ids = []
        for w in range(p // self.window, plan.num_windows):
            _, wids, shard_of_row = window_layout(plan, w)
            raw = epoch * self.num_rows + w * self.window + np.arange(len(wids))
            ids += wids[(shard_of_row == bad) & (raw >= frm)].tolist()
        ids.sort()
        reason = (f"data.on_bad_shard=skip: {error.split(': restore')[0]}; its {len(ids)} remaining "
                  f"samples of epoch {epoch} (and all {shard.num_rows} in later epochs) are skipped "
                  f"from stream position {frm} (data cursor {data_cursor}); ids in "
                  f"{SKIP_LOG_FILE}")
        log.warning(reason)
        if self.run_dir:
            record = {"time": time.time(), "shard": bad, "path": shard.path,
                      "from_position": frm, "data_cursor": data_cursor, "epoch": epoch,
                      "error": error, "sample_ids": ids,
                      "sample_id_range": [lo, lo + shard.num_rows]}
            with open(os.path.join(self.run_dir, SKIP_LOG_FILE), "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.on_skip is not None:
            self.on_skip(reason)

    def _load_skips(self) -> None:
        """A restarted plane continues the ledger of the run it resumes (same run dir)."""
        path = os.path.join(self.run_dir, SKIP_LOG_FILE) if self.run_dir else ""
        if not path or not os.path.exists(path):
            return
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    shard, frm = int(rec["shard"]), int(rec["from_position"])
                    self.skips[shard] = min(frm, self.skips.get(shard, frm))
        if self.skips:
            log.warning("data plane: continuing with skipped shards %s from %s",
                        sorted(self.skips), path)
