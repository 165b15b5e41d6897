"""The data plane: read tasks put windows of the plan in the object store; the driver deals
references.

Reading (and decoding) runs in plain Ray tasks (``read_chunk``: ``data.num_readers`` at once, with
``data.read_resources``, so they may land on CPU-only nodes). The order never comes from task
timing: each task reads whole windows of the plan in ``raytrain_sys.data.order`` (a chunk of
consecutive windows), chunks are submitted and consumed in stream order, and a task returns its
rows as *pieces* (cut at multiples of a rank's share) plus a small metadata object (sample ids,
each row's loss units, the windows read). The driver keeps the metadata of the chunks around the
cursor and answers ``global_batch_refs(cursor)`` with references and ranges
(``raytrain_sys.data.batches``); ranks fetch their rows where they lie, node to node. Nothing is
ever "consumed": only the Supervisor's committed cursor moves, so a failed step is sent again
with the same references, and a resume seeks straight to the cursor's window (shard + row group /
byte offset, never read-and-drop).

A seek never cancels a read (``_open_stream``): the reads of the stream left behind run to their
end and Ray frees their results, as nothing refers to them; they count against
``data.num_readers`` until then. (Ray Data's streaming executor, which did the reading before,
force-cancels running reads when a stream closes early, and in Ray 2.60 a cancel that meets the
reply in flight aborts the driver.)

Both formats (Parquet token rows, WebDataset tar samples) go through the same ``read_chunk``;
``shards.read_segments`` reads segments of either by seeking (token shards once per shard for a
whole chunk).

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
import contextlib
import json
import logging
import math
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from raytrain_sys.data import order
from raytrain_sys.data.batches import GlobalBatch, Piece
from raytrain_sys.data.manifest import TOKENS_FORMAT, DatasetManifest
from raytrain_sys.data.shards import (BadShardError, clear_caches, gather_rows, read_document_index,
                                      read_documents, read_segments, read_token_pool)
from raytrain_sys.errors import DataError, SpecError, find_user_error

log = logging.getLogger(__name__)

SKIP_LOG_FILE = "skipped_samples.jsonl"
BAD_SHARD_POLICIES = ("fail", "skip")
# rows: the dataset's stored rows. The others make rows of a documents dataset's documents.
SEQUENCES = ("rows", "pack", "pack_masked", "bucket")
# Bytes of rows per read task (a chunk of windows). Measured when Ray Data ran the reads (each of
# its blocks cost up to ~100 ms of latency): 16 MiB stalled the readers, 32 MiB did not, 64 MiB
# gave no more. With plain tasks the per-chunk cost is a task submission, and 32 MiB still keeps
# a few chunks in the object store at most; the first chunk after a seek is one window, then 4x
# each, so the time to the first batch does not grow.
CHUNK_BYTES = 32 * 2**20
# Reading tasks at once, the default of data.num_readers (40 epochs of the stdlib under Ray Data:
# 2 gave 1.1-1.3 M rows/s, 3 gave 1.5-1.6 M, 4 no more than 3 and the start of another process).
READERS = 3
# A piece (what a rank fetches) is at least this big: Ray keeps objects under 100 KiB in the
# owner's memory (the driver's), and every object costs bookkeeping; byte-token rows are ~130 B.
MIN_PIECE_BYTES = 2**20
# Where a piece of MIN_PIECE_BYTES already holds a whole global batch, every rank has rows in
# every piece, so each rank's node pulls every piece whatever its size: a piece is then made to
# hold this many global batches (up to MAX_PIECE_BYTES), which moves no more bytes and passes each
# rank that many times fewer references a lease. Each reference costs the driver's Ray (borrowing,
# pubsub, the call's arguments): 33 a step at 64 ranks with GPT-2's row size and 1 MiB pieces.
PIECE_BATCHES = 16
MAX_PIECE_BYTES = 8 * 2**20


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


@dataclass(frozen=True)
class ReadContext:
    """What every read task of one stream needs, put in the object store once per stream."""

    dataset_uri: str
    manifest: DatasetManifest
    stream: object  # order.RowStream | order.DocumentStream
    s3_endpoint_url: str
    masked: bool
    skips: tuple[tuple[int, int], ...]
    task: object = None  # the job's Task: each row's loss units are counted where it is read
    bucket: bool = False  # keep each row's num_tokens in the metadata (a batch pads to its longest)
    stream_id: str = ""  # new at every seek: a reader process reopens shards for a new stream
    transform: object = None  # data.transform (an import path or a callable), run on every row
    read_timeout_s: float = 0.0  # data.read_timeout_s: a read this slow posts its stack (0: never)


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


def read_chunk_columns(ctx: ReadContext, item: dict[str, int]) -> dict[str, np.ndarray]:
    """A chunk of consecutive windows -> their rows, sample ids (``sample_id``) and windows (``g``).

    A chunk is windows ``g..last`` (those with delivered rows), the first read from training-order
    index ``start``. A bad shard never raises here: an exception would reach the driver at a
    time that depends on prefetch. If the chunk's first window is bad, the result is a marker
    naming the shard (``bad_shard``, ``error``) in place of the window; if a later one is, it
    holds the windows before it and ``bad_window``, and the driver reads on from that window
    with a new stream, whose first chunk is that window alone and so comes back as a marker, in
    stream order, exactly when the consumer needs it.
    """
    manifest, stream, skip_map = ctx.manifest, ctx.stream, dict(ctx.skips)
    first, last, start = int(item["g"]), int(item["last"]), int(item["start"])
    windows = list(range(first, last + 1))
    parts: list[tuple[int, dict[str, np.ndarray], np.ndarray]] = []
    bad_window = -1
    try:
        if isinstance(stream, order.RowStream) and manifest.format == TOKENS_FORMAT:
            parts = _read_row_chunk(ctx.dataset_uri, manifest, stream, windows, start, skip_map,
                                    ctx.s3_endpoint_url)
    except BadShardError:
        parts = []  # window by window below, to find the first bad one
    if not parts:
        for i, g in enumerate(windows):
            try:
                columns, ids = _read_one(ctx.dataset_uri, manifest, stream, g, start if i == 0 else 0,
                                         skip_map, ctx.masked, ctx.s3_endpoint_url)
            except BadShardError as exc:
                if not any(len(ids) for _, _, ids in parts):
                    return {"g": np.asarray([g], dtype=np.int64),
                            "bad_shard": np.asarray([exc.shard], dtype=np.int64),
                            "error": np.asarray([str(exc)])}
                bad_window = g
                break
            parts.append((g, columns, ids))
    parts = [p for p in parts if len(p[2])]  # windows all of whose rows are skipped
    out = {k: np.concatenate([p[1][k] for p in parts]) for k in parts[0][1]}
    out["sample_id"] = np.concatenate([p[2] for p in parts])
    out["g"] = np.concatenate([np.full(len(p[2]), p[0], dtype=np.int64) for p in parts])
    if bad_window >= 0:
        out["bad_window"] = np.asarray([bad_window], dtype=np.int64)
    return out


def row_units(task, columns: dict[str, np.ndarray]) -> np.ndarray:
    """The loss units of each row (their sum over a global batch normalizes its loss). A task
    without ``row_units`` is asked row by row: its ``units`` must be a sum over rows."""
    n = len(next(iter(columns.values()))) if columns else 0
    if task is None:
        return np.ones(n, dtype=np.int64)
    if hasattr(task, "row_units"):
        return np.asarray(task.row_units(columns), dtype=np.int64)
    return np.asarray([task.units({k: v[i:i + 1] for k, v in columns.items()}) for i in range(n)],
                      dtype=np.int64)


def transform_rows(transform, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``data.transform`` on every row (resolved here, in the read task's process)."""
    from raytrain_sys.data.table import apply_transform
    from raytrain_sys.extensions import resolve

    return apply_transform(resolve(transform, "data.transform"), columns)


def sample_rows(spec, manifest: DatasetManifest, n: int) -> dict[str, np.ndarray]:
    """The first ``n`` rows of the dataset's first shard, as a job's reads deliver them (its
    columns, after its transform): what pre-flight runs the task on."""
    from raytrain_sys.data.table import select_columns
    from raytrain_sys.data.shards import read_columns

    manifest = select_columns(manifest, spec.data.columns, spec.data.path)
    seg = order.Segment(0, 0, min(n, manifest.shards[0].num_rows), 0)
    columns = read_columns(spec.data.path, manifest, seg, spec.data.s3_endpoint_url, verify_sha256=False)
    if spec.data.transform:
        columns = transform_rows(spec.data.transform, columns)
    for name, values in columns.items():
        if values.dtype == object or values.dtype.kind in "USV":
            raise SpecError("data.columns", f"column {name!r} of {spec.data.path} holds "
                                            f"{type(values.flat[0]).__name__} values, which cannot become "
                                            f"a tensor: leave it out with data.columns, or turn it "
                                            f"into numbers with data.transform")
    return columns


def bucket_width(num_tokens: np.ndarray) -> int:
    """A bucketed batch is padded to its longest row (2 tokens at least: an input and a target)."""
    return max(2, int(num_tokens.max()))


def rows_per_piece(share_rows: int, row_bytes: int, batch_rows: int) -> int:
    """Rows per piece: a multiple of a rank's share (``share_rows``), at least MIN_PIECE_BYTES
    (Ray inlines objects under 100 KiB into the owner, the driver). Where that already holds a
    global batch (``batch_rows``), PIECE_BATCHES of them up to MAX_PIECE_BYTES: a rank's node
    pulls every piece anyway, and fewer pieces are fewer references a lease. Where a global batch
    is larger, pieces stay small, so a node pulls little more than its ranks' rows."""
    share = max(1, share_rows)
    row_bytes = max(1, row_bytes)
    least = share * math.ceil(max(1, MIN_PIECE_BYTES // row_bytes) / share)
    if least < batch_rows:
        return least
    grown = min(PIECE_BATCHES * batch_rows, MAX_PIECE_BYTES // row_bytes)
    return max(least, share * (grown // share))


def piece_bounds(first: int, stop: int, piece_rows: int) -> list[int]:
    """Where rows ``[first, stop)`` of the stream are cut into pieces: at every multiple of
    ``piece_rows``, so that pieces line up with the ranks' shares whatever chunk they came in."""
    cuts = list(range((first // piece_rows + 1) * piece_rows, stop, piece_rows))
    return [first, *cuts, stop]


def read_chunk(ctx: ReadContext, item: dict[str, int], first: int, piece_rows: int,
               num_pieces: int) -> tuple:
    """Ray task: read a chunk, return ``(meta, piece_0, ..., piece_{num_pieces-1})``.

    Each piece is a dict of columns (numpy, contiguous) for stream positions cut by
    ``piece_bounds``; they stay in the object store of the node this task ran on until a rank
    fetches them. ``meta`` is small and goes to the driver: sample ids, each row's loss units,
    the windows delivered, and a bad shard's marker. A chunk cut short by a bad shard returns
    ``None`` for the pieces it did not fill.
    """
    with _slow_read_watch(ctx, first):
        return _read_chunk(ctx, item, first, piece_rows, num_pieces)


def _read_chunk(ctx: ReadContext, item: dict[str, int], first: int, piece_rows: int, num_pieces: int) -> tuple:
    global _READER_STREAM
    if ctx.stream_id != _READER_STREAM:
        # A seek may follow a repaired or a vanished shard: handles opened for an earlier stream
        # are not trusted (a deleted file stays readable through an open handle).
        clear_caches()
        _READER_STREAM = ctx.stream_id
    out = read_chunk_columns(ctx, item)
    jitter_ms = float(os.environ.get(READ_JITTER_ENV, "0") or 0)
    if jitter_ms:
        time.sleep(np.random.default_rng().random() * jitter_ms / 1000.0)
    if "bad_shard" in out:
        meta = {"g": int(out["g"][0]), "bad_shard": int(out["bad_shard"][0]),
                "error": str(out["error"][0])}
        return (meta, *([None] * num_pieces))
    ids, gs = out.pop("sample_id"), out.pop("g")
    bad_window = out.pop("bad_window", None)
    if ctx.transform is not None:
        out = transform_rows(ctx.transform, out)
    cuts = [0, *(np.flatnonzero(gs[1:] != gs[:-1]) + 1).tolist(), len(gs)]
    meta = {"ids": ids, "units": row_units(ctx.task, out),
            "windows": [(int(gs[lo]), hi - lo) for lo, hi in zip(cuts, cuts[1:])],
            "bad_window": -1 if bad_window is None else int(bad_window[0]),
            "node_id": _node_id()}
    if ctx.bucket:
        meta["num_tokens"] = out["num_tokens"]
    bounds = piece_bounds(first, first + len(ids), piece_rows)
    assert len(bounds) - 1 <= num_pieces, f"{len(bounds) - 1} pieces, {num_pieces} planned"
    pieces = [{k: np.ascontiguousarray(v[lo - first:hi - first]) for k, v in out.items()}
              for lo, hi in zip(bounds, bounds[1:])]
    return (meta, *pieces, *([None] * (num_pieces - len(pieces))))


# Where a read that has run for half of data.read_timeout_s posts its stack, every second until it
# returns (Ray's internal KV, namespace raytrain-sys; the key is the stream's and the read's first
# position): the driver that finds the read hung reads it there, and ends the read's process.
READ_STACK_NAMESPACE = "raytrain-sys"
READ_STACK_EVERY_S = 1.0


def read_stack_key(stream_id: str, first: int) -> str:
    return f"read-stack:{stream_id}:{first}"


@contextlib.contextmanager
def _slow_read_watch(ctx: ReadContext, first: int):
    """Run a read with a watch: past half of ``ctx.read_timeout_s`` its stacks (``stacks``: the
    reading thread's first) are posted for the driver (``read_stack_key``), again every
    READ_STACK_EVERY_S, and taken back when the read returns. Outside Ray, or with no timeout,
    nothing is watched."""
    import threading

    if not ctx.read_timeout_s or not _node_id():  # "": not in Ray
        yield
        return
    from ray.experimental import internal_kv

    from raytrain_sys.stacks import stacks

    done, reader = threading.Event(), threading.get_ident()
    key = read_stack_key(ctx.stream_id, first)

    def watch() -> None:
        if done.wait(ctx.read_timeout_s / 2):
            return
        posted = False
        while not done.is_set():
            found = stacks(reader)
            post = {"pid": os.getpid(), "node_id": _node_id(), "top": found["top"], "stack": found["text"]}
            try:
                internal_kv._internal_kv_put(key, json.dumps(post), namespace=READ_STACK_NAMESPACE)
                posted = True
            except Exception:  # noqa: BLE001: the GCS briefly unreachable: post again
                pass
            done.wait(READ_STACK_EVERY_S)
        if posted:
            with contextlib.suppress(Exception):
                internal_kv._internal_kv_del(key, namespace=READ_STACK_NAMESPACE)

    threading.Thread(target=watch, name="slow-read-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _end_read_process(pid: int, key: str) -> bool:
    """Ray task, on the hung read's node: SIGKILL its process if the read still runs there (its
    stack is still posted); Ray then runs the read again (``_reader``'s retries)."""
    import signal

    from ray.experimental import internal_kv

    if internal_kv._internal_kv_get(key, namespace=READ_STACK_NAMESPACE) is None:
        return False  # it returned meanwhile: the process may be reading something else now
    os.kill(pid, signal.SIGKILL)
    return True


def _posted_stack(key: str) -> dict | None:
    from ray.experimental import internal_kv

    try:
        raw = internal_kv._internal_kv_get(key, namespace=READ_STACK_NAMESPACE)
    except Exception:  # noqa: BLE001: the GCS briefly unreachable: not known yet
        return None
    return json.loads(raw) if raw else None


def _node_id() -> str:
    """The Ray node this read ran on ("" outside Ray): where its pieces lie."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # a read outside a Ray task (tests of the functions)
        return ""


@dataclass
class _Pending:
    """A submitted read: stream positions ``[first, stop)`` planned (fewer if cut short)."""

    item: dict[str, int]
    first: int
    stop: int
    piece_rows: int
    meta_ref: object
    piece_refs: list
    hangs: int = 0  # times it was found hung (its process ended, Ray read it again)


@dataclass
class _Span:
    """A read chunk whose metadata the driver holds: positions ``[first, stop)``."""

    first: int
    stop: int
    ids: np.ndarray
    units: np.ndarray
    num_tokens: np.ndarray | None
    pieces: list[Piece]


_READER = None
_READER_STREAM = ""  # the stream this process last read for (see read_chunk)
# Test hook (tests/seek_stress.py): each read sleeps up to this many ms, so that reads end at
# random moments around the seeks that leave them behind.
READ_JITTER_ENV = "RAYTRAIN_SYS_TEST_READ_JITTER_MS"


def _reader():
    """``read_chunk`` as a Ray task (made once per process, on first use)."""
    global _READER
    if _READER is None:
        import ray

        # Reading is idempotent: a piece lost with its node is read again by Ray (lineage).
        _READER = ray.remote(max_retries=3)(read_chunk)
    return _READER


class DataPlane:
    """Serves ``global_batch_refs(data_cursor)`` (and ``global_batch``, the rows fetched here) from
    read tasks over the plan's windows.

    ``sequences`` and ``row_len`` (model block_size + 1) matter for documents datasets only.
    """

    def __init__(self, dataset_uri: str, manifest: DatasetManifest, seed: int, window: int,
                 block_rows: int, global_batch_size: int, end_position: int, prefetch_steps: int = 4,
                 s3_endpoint_url: str = "", on_bad_shard: str = "fail", run_dir: str = "",
                 on_skip: Callable[[str], None] | None = None, sequences: str = "rows",
                 row_len: int = 0, task=None, num_readers: int = READERS,
                 read_resources: dict | None = None):
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
        self.row_bytes = row_bytes
        self.chunk_rows = max(prefetch_steps * global_batch_size, CHUNK_BYTES // row_bytes)
        self.prefetch_rows = prefetch_steps * global_batch_size
        self.task = task
        self.transform = None  # data.transform, set by for_job
        self.read_timeout_s = 0.0  # data.read_timeout_s, set by for_job (0: a read is waited for as long as it takes)
        self.read_hangs: list[dict] = []  # reads found hung: summary.json's read_hangs
        self._waited_since: dict[int, float] = {}  # a read's first position -> since when it is waited for
        self.on_read_hang: Callable[[dict], None] | None = None  # told of each (the Supervisor's record)
        self.num_readers = max(1, num_readers)
        self.read_resources = dict(read_resources or {})
        # Rows of a rank's share, which pieces line up with (the Supervisor sets it per world).
        self.share_rows = global_batch_size
        self.wait_s = 0.0  # time the driver waited on reads (metadata, or rows it fetched)
        self.rows_read = 0  # rows the read tasks delivered (raytrain_data_rows_read)
        self.read_nodes: dict[str, int] = {}  # Ray node id -> chunks read there
        self.skips: dict[int, int] = {}  # shard -> raw stream position its rows leave the stream
        self._fstarts: list[int] = []  # delivered-stream start of windows g0, g0+1, ...
        self._keep: dict[int, np.ndarray] = {}  # window -> kept-row mask, while skips exist
        # The stream: chunks still to submit, reads submitted, chunks read (positions in order).
        self._items: list[dict[str, int]] = []
        self._next_item = 0
        self._submit_pos = -1  # stream position the next submitted chunk starts at
        self._pending: deque[_Pending] = deque()
        self._abandoned: list = []  # metadata refs of reads a seek left behind, still running
        self._spans: list[_Span] = []
        self._ctx_ref = None
        self._ctx: ReadContext | None = None  # the stream's, for a read in this process (read_first_here)
        # The next read in this process rather than in a read task (set by for_job for a job's
        # first read: its reader processes do not exist yet; see _read_here). Cleared by that read.
        self.read_first_here = False
        self.reads_here = 0  # reads made in this process (read_first_here)
        self._fetched: dict[int, tuple[object, dict]] = {}  # piece first -> (ref, columns), rows()
        # rows()'s fast path: (first, stop, columns, span) of the piece the last batch ended in
        self._hot: tuple | None = None
        self._load_skips()

    @classmethod
    def for_job(cls, spec, manifest: DatasetManifest, end_position: int, run_dir: str = "",
                on_skip: Callable[[str], None] | None = None, task=None) -> "DataPlane":
        """The plane a job spec asks for: the one place that maps ``spec.data`` to the plane."""
        from raytrain_sys.data.table import select_columns

        d = spec.data
        # A relative path is the driver's: read tasks run elsewhere (another working directory).
        path = d.path if d.path.startswith("s3://") else os.path.abspath(d.path)
        plane = cls(path, select_columns(manifest, d.columns, d.path), d.seed, d.shuffle_window,
                    d.shuffle_block_rows, spec.train.global_batch_size, end_position,
                    prefetch_steps=d.prefetch_steps, s3_endpoint_url=d.s3_endpoint_url,
                    on_bad_shard=d.on_bad_shard, run_dir=run_dir, on_skip=on_skip,
                    sequences=d.sequences, row_len=spec.model.block_size + 1, task=task,
                    num_readers=d.num_readers, read_resources=d.read_resources)
        plane.transform = d.transform or None
        plane.read_timeout_s = d.read_timeout_s
        plane.read_next_here()
        return plane

    def read_next_here(self) -> None:
        """The next read runs in this process (``_read_here``), as a stream's first should: a new
        reader process takes seconds to start. Reads asked onto particular nodes
        (data.read_resources) are left there."""
        self.read_first_here = not self.read_resources

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
        ``chunk_rows``, so that the per-task cost is paid rarely.
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

    def _open_stream(self, position: int) -> None:
        """Seek: plan the chunks from delivered position ``position`` to the run's end and start
        reading them. The first window is read from that row on (only the segments holding rows
        from there); nothing before the resume point is read and dropped.

        The reads of the stream left behind are not cancelled: their references are dropped and
        Ray frees what they return when they end. (Cancelling a read whose reply is in flight
        aborts the calling process in Ray 2.60, task_manager.cc "Tried to complete task that was
        not pending"; with no cancel, there is no race to lose.)
        """
        import ray

        self._drop_stream()
        self._hot = None
        self._spans = [s for s in self._spans if s.stop <= position]
        g, offset = self._locate(position)
        self._items = self._chunks(g, self._raw_index(g, offset))
        self._next_item, self._submit_pos = 0, position
        ctx = ReadContext(self.dataset_uri, self.manifest, self.stream, self.s3_endpoint_url,
                          self.sequences == "pack_masked", tuple(sorted(self.skips.items())),
                          self.task, self.sequences == "bucket", uuid.uuid4().hex, self.transform,
                          self.read_timeout_s)
        self._ctx, self._ctx_ref = ctx, ray.put(ctx)
        self._top_up()
        log.info("data plane: stream opened at window %d offset %d (epoch %d)", g, offset,
                 g // self.windows_per_epoch)

    def _piece_rows(self) -> int:
        return rows_per_piece(self.share_rows, self.row_bytes, self.global_batch_size)

    def _submit(self) -> None:
        item = self._items[self._next_item]
        self._next_item += 1
        first = self._submit_pos
        stop = self._fstart(item["last"]) + self._delivered_len(item["last"])
        piece_rows = self._piece_rows()
        bounds = piece_bounds(first, stop, piece_rows)
        options = {"num_returns": len(bounds), "num_cpus": self.read_resources.get("CPU", 0)}
        custom = {k: v for k, v in self.read_resources.items() if k != "CPU"}
        if custom:
            options["resources"] = custom
        refs = self._read_here(item, first, piece_rows, len(bounds) - 1) if self.read_first_here else None
        if refs is None:
            refs = _reader().options(**options).remote(self._ctx_ref, item, first, piece_rows,
                                                       len(bounds) - 1)
        self._pending.append(_Pending(item, first, stop, piece_rows, refs[0], list(refs[1:])))
        self._submit_pos = stop

    def _read_here(self, item: dict[str, int], first: int, piece_rows: int, num_pieces: int) -> list | None:
        """A job's first read, in this process, its results put in the object store as a read
        task's would be: a new job's reader processes take seconds to start (2.4-8.6 s measured
        on a busy node, benchmarks/scheduler.py), and this process is up with its imports done.
        The first chunk of a stream is one window. The reads after it go to read tasks, whose
        processes start meanwhile. None when it failed: the read task reads it again, and its
        error is reported as any read's."""
        import ray

        self.read_first_here = False
        try:
            out = read_chunk(self._ctx, item, first, piece_rows, num_pieces)
        except Exception as exc:  # noqa: BLE001: met again, and reported, by the read task
            log.debug("data plane: the first read here failed (%s); a read task reads it", exc)
            return None
        self.reads_here += 1
        return [ray.put(part) for part in out]

    def _top_up(self) -> None:
        """Keep the readers ahead of the consumer: at most ``num_readers`` reads running (those
        of streams left behind by a seek included), and chunks read or being read covering
        ``prefetch`` rows (``num_readers`` chunks at least). A new stream whose first read finds
        every slot taken waits for one of the old reads to end (a read is short): reads are never
        cancelled, so without this, quick seeks would pile up reads and reader processes."""
        import ray

        depth = max(self.num_readers, math.ceil(self.prefetch_rows / max(1, self.chunk_rows)))
        while self._next_item < len(self._items) and len(self._pending) < depth:
            running = [p.meta_ref for p in self._pending] + self._abandoned
            if len(running) >= self.num_readers:
                _, running = ray.wait(running, num_returns=len(running), timeout=0,
                                      fetch_local=False)
                left = set(running)
                self._abandoned = [r for r in self._abandoned if r in left]
                if len(running) >= self.num_readers:
                    if self._pending or not self._abandoned:
                        return
                    ray.wait(self._abandoned, num_returns=1, fetch_local=False)
                    continue
            self._submit()

    def _pull(self, want: int, data_cursor: int) -> None:
        """Take the next submitted read's metadata (waiting for it); ``want`` is the stream
        position waited for, the first of that read."""
        import ray

        p = self._pending.popleft()
        assert p.first == want, f"stream out of order: read at {p.first}, {want} wanted"
        t0 = time.perf_counter()
        try:
            self._await_read(p)
            meta = ray.get(p.meta_ref)
        except Exception as exc:  # a task's error, wrapped by Ray: surface ours as one line
            self._drop_stream()
            found = find_user_error(exc)
            if found is not None:
                raise found from None
            raise
        finally:
            self.wait_s += time.perf_counter() - t0
        self._top_up()
        if "bad_shard" in meta:
            g = meta["g"]
            assert g == p.item["g"], f"stream out of order: window {g}, {p.item['g']} read"
            # Chunks after this one were read without knowing: a new stream either way.
            self._drop_stream()
            if self.on_bad_shard != "skip":
                raise DataError(meta["error"])
            # From the row waited for: rows before it were consumed and keep their positions.
            g_want, offset = self._locate(want)
            self._skip(meta["bad_shard"], meta["error"], self._raw_start(g_want) + self._raw_index(g_want, offset),
                       data_cursor)
            return
        ids = meta["ids"]
        stop = p.first + len(ids)
        truncated = meta["bad_window"] >= 0
        assert stop == p.stop or (truncated and stop < p.stop), \
            f"chunk at {p.first}: {len(ids)} rows delivered, {p.stop - p.first} planned"
        expect = p.item["g"]
        for g, n in meta["windows"]:
            assert g == expect, f"stream out of order: window {g}, {expect} expected"
            expect = self._next_window(g)
        bounds = piece_bounds(p.first, stop, p.piece_rows)  # as the read cut them
        pieces = [Piece(lo, hi, ref) for lo, hi, ref in zip(bounds, bounds[1:], p.piece_refs)]
        self._spans.append(_Span(p.first, stop, ids, meta["units"], meta.get("num_tokens"), pieces))
        self.rows_read += stop - p.first
        self.read_nodes[meta["node_id"]] = self.read_nodes.get(meta["node_id"], 0) + 1
        if truncated:  # the chunk stopped before a bad shard: read on from there with a new stream
            log.info("data plane: a chunk stopped before a bad shard in window %d; a new stream "
                     "will read on from there", meta["bad_window"])
            self._drop_stream()

    def _await_read(self, p: _Pending) -> None:
        """Wait for read ``p``, finding it hung if it is (``_check_hung``)."""
        import ray

        if not self.read_timeout_s or self._ctx is None:
            return
        while not ray.wait([p.meta_ref], timeout=READ_STACK_EVERY_S, fetch_local=False)[0]:
            self._check_hung(p)
        self._waited_since.pop(p.first, None)

    def _check_hung(self, p: _Pending) -> None:
        """Read ``p`` is waited for and not finished. One the trainers have waited on for
        data.read_timeout_s, and that has run that long (it posted its stack:
        ``_slow_read_watch``), is hung: recorded (its stack's top frame and whole text,
        ``read_hangs``, ``on_read_hang``, the log) and its process ended, and Ray reads it again;
        found hung a second time, the run stops naming where it was stuck. A read that has not
        begun (queued behind others) is waited for."""
        if not self.read_timeout_s or self._ctx is None:
            return
        now = time.monotonic()
        waited = now - self._waited_since.setdefault(p.first, now)
        if waited < self.read_timeout_s:
            return
        key = read_stack_key(self._ctx.stream_id, p.first)
        posted = _posted_stack(key)
        if posted is None:
            return  # not running for long (queued, or read again just now)
        self._read_hung(p, posted, waited, key)
        self._waited_since[p.first] = time.monotonic()

    def _read_hung(self, p: _Pending, posted: dict, waited: float, key: str) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        p.hangs += 1
        top = posted.get("top") or {}
        where = f"{top.get('file', '?')}:{top.get('line', '?')} in {top.get('function', '?')}" if top else "(no stack)"
        record = {"position": p.first, "window": int(p.item["g"]), "waited_s": round(waited, 2),
                  "node_id": posted.get("node_id", ""), "pid": posted.get("pid"), "hang": p.hangs,
                  "top_frame": top, "stack": posted.get("stack", ""),
                  "reason": f"a read of window {int(p.item['g'])} (stream positions {p.first}..{p.stop}) made no "
                            f"progress for {waited:.1f} s (data.read_timeout_s {self.read_timeout_s:g}): "
                            f"stuck in {where}"}
        self.read_hangs.append(record)
        log.warning("data plane: %s; its stack:\n%s", record["reason"], record["stack"])
        if self.on_read_hang is not None:
            self.on_read_hang(record)
        if p.hangs > 1:
            self._drop_stream()
            raise DataError(f"{record['reason']}, the second time this read hung: a data.transform that "
                            f"never returns, or a stuck filesystem? (raise data.read_timeout_s if reads "
                            f"are legitimately this long)")
        where_it_runs = NodeAffinitySchedulingStrategy(posted["node_id"], soft=False) if posted.get("node_id") else None
        end = ray.remote(num_cpus=0, max_retries=0)(_end_read_process)
        try:
            ended = ray.get(end.options(**({"scheduling_strategy": where_it_runs} if where_it_runs else {}))
                            .remote(int(posted["pid"]), key), timeout=30)
        except Exception as exc:  # noqa: BLE001: its node gone: Ray reads it again anyway
            ended = False
            log.warning("data plane: could not end the hung read's process: %s", exc)
        if ended:
            log.warning("data plane: the hung read's process (pid %s) was ended; Ray reads it again", posted["pid"])

    def rows_ahead(self, position: int, finished_reads: bool = False) -> int:
        """Rows read and ready from ``position`` on (the prefetch depth a consumer at it sees):
        the reads taken; with ``finished_reads``, also the submitted reads after them whose tasks
        have finished, in stream order, by their planned rows (taking one is then a lookup). A
        read is taken only when a batch needs it, so without them the depth ends where the
        chunk in use does (a chunk is at most CHUNK_BYTES: about 60 global batches of 512 rows
        of 1,024 tokens), and a lease sized by it would end there too. A finished read cut short
        by a bad shard delivers fewer rows than planned: the batch after them then waits for the
        read after it, as for any read not finished."""
        end = max((s.stop for s in self._spans), default=position)
        if finished_reads and self._pending and self._pending[0].first == end:
            import ray

            refs = [p.meta_ref for p in self._pending]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            done = set(done)
            for p in self._pending:
                if p.meta_ref not in done or p.first != end:
                    break
                end = p.stop
        return max(0, end - position)

    def reads_awaited(self, start: int, stop: int) -> list:
        """The submitted reads, not finished yet, that ``batch_refs(start, stop)`` would wait
        for (their metadata references, for ``ray.wait``): so that a caller can wait for them
        in slices and do other work between (the Supervisor acts on a pause meanwhile). Empty
        when the rows are read, and when reaching them needs a read not submitted yet or a new
        stream (``batch_refs`` submits or opens it, and waits itself)."""
        import ray

        pos = start
        while pos < stop and (i := self._span_index(pos)) >= 0:
            pos = self._spans[i].stop
        awaited = []
        for p in self._pending:
            if pos >= stop or p.first != pos:
                break
            awaited.append(p)
            pos = p.stop
        if not awaited:
            return []
        refs = [p.meta_ref for p in awaited]
        _, running = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        for p in awaited:  # waited for from now on: a read that does not return is found hung
            if p.meta_ref in running:
                self._check_hung(p)
        return [p.meta_ref for p in awaited if p.meta_ref in running]

    def reread_lost(self, position: int, departed_nodes: set[str]) -> int:
        """After members left the group: when a read piece from ``position`` on has a copy on one
        of ``departed_nodes`` (theirs: a piece lives in the object store of the node that read
        it, and of each node that pulled it), or none left anywhere, the stream is read again
        from ``position`` (the driver waits for it, as for any read); returns how many such
        pieces there were. A node that vanished is still listed as alive for seconds after its
        workers' calls fail (Ray's health checks), and a rank that pulls a piece may be sent to
        the copy there, where its pull waits for a timeout: the lease that passes the piece
        waits inside its step deadline and reads as a hang (tests/test_fault_tolerance.py,
        test_node_removed: a newcomer on a warm spare, sent its first lease 0.04 s after the
        rebuild, was killed as hung in 3 runs of 5). The leavers of a shrink or a drain count
        too: a drained node goes, and a shrink pays one read from the cursor."""
        import ray

        refs = [p.ref for s in self._spans if s.stop > position for p in s.pieces]
        if self._pending:  # reads that finished: their pieces exist somewhere, or are lost
            done, _ = ray.wait([p.meta_ref for p in self._pending], num_returns=len(self._pending), timeout=0,
                               fetch_local=False)
            done = set(done)
            refs += [r for p in self._pending if p.meta_ref in done for r in p.piece_refs]
        if not refs:
            return 0
        try:
            where = ray.experimental.get_object_locations(refs)
        except Exception as exc:  # noqa: BLE001: unanswered: the pieces are taken as they are
            log.debug("data plane: could not look up the pieces' locations: %s", exc)
            return 0
        lost = sum(1 for r in refs if not where.get(r, {}).get("did_spill")
                   and (not where.get(r, {}).get("node_ids") or set(where[r]["node_ids"]) & departed_nodes))
        if lost:
            log.warning("data plane: %d read piece(s) from position %d on had a copy on a departed member's "
                        "node: reading again from there", lost, position)
            # As a job's first: a new read task waited 4-5 s for a reader process here
            # (benchmarks/recovery.py worker kill: 4.64 s to the next step, 1.06 s with this, 0.96 without the read).
            self.read_next_here()
            self._open_stream(position)
        return lost

    @property
    def reads_in_flight(self) -> int:
        """Read tasks submitted and not yet taken."""
        return len(self._pending)

    def _span_index(self, position: int) -> int:
        """Index of the span holding ``position``, or -1."""
        i = bisect.bisect_right([s.first for s in self._spans], position) - 1
        return i if i >= 0 and position < self._spans[i].stop else -1

    def _load(self, start: int, stop: int) -> list[_Span]:
        """The spans covering positions ``[start, stop)``, reading (or seeking) as needed."""
        pos = start
        while pos < stop:
            i = self._span_index(pos)
            if i >= 0:
                pos = self._spans[i].stop
                continue
            if not self._pending and self._submit_pos == pos:
                self._top_up()  # the stream is here, its next read not yet submitted
            if not self._pending or self._pending[0].first != pos:
                self._open_stream(pos)
                if not self._pending:
                    raise DataError("data stream ended before the requested cursor")
            self._pull(pos, start)
        self._top_up()
        # Nothing behind the cursor is needed again (a failed step keeps its own references).
        self._spans = [s for s in self._spans if s.stop > start]
        return [s for s in self._spans if s.first < stop and s.stop > start]

    def batch_refs(self, start: int, stop: int) -> GlobalBatch:
        """Delivered positions ``[start, stop)`` as references: pieces, sample ids, loss units."""
        try:
            spans = self._load(start, stop)
        except DataError as exc:
            step = start // self.global_batch_size + 1
            hint = ("; to train on without it set data.on_bad_shard=skip"
                    if self.on_bad_shard == "fail" and "shard" in str(exc) else "")
            raise DataError(f"{exc} [while reading the global batch at data cursor {start}, "
                            f"step {step}{hint}]") from None
        cut = [(max(start, s.first) - s.first, min(stop, s.stop) - s.first) for s in spans]
        ids = np.concatenate([s.ids[lo:hi] for s, (lo, hi) in zip(spans, cut)])
        units = np.concatenate([s.units[lo:hi] for s, (lo, hi) in zip(spans, cut)])
        pieces = [p for s in spans for p in s.pieces if p.first < stop and p.stop > start]
        width = 0
        if self.sequences == "bucket":
            width = bucket_width(np.concatenate([s.num_tokens[lo:hi] for s, (lo, hi) in zip(spans, cut)]))
        return GlobalBatch(start, pieces, ids, units, width)

    def global_batch_refs(self, data_cursor: int) -> GlobalBatch:
        return self.batch_refs(data_cursor, data_cursor + self.global_batch_size)

    def rows(self, start: int, stop: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The columns and sample ids of delivered-stream positions ``[start, stop)``, fetched
        into this process (tests, benchmarks, ``data.delivery=driver``; training ranks fetch
        their own share instead: ``GlobalBatch.share``).

        Read-only arrays, views of the object store's buffers where a batch lies in one piece:
        copy before writing (a Ray task argument or ``torch.tensor`` copies anyway).
        """
        import ray

        hot = self._hot
        if hot is not None and hot[0] <= start and stop <= hot[1]:
            # The common case, a batch inside the piece the last one ended in: views, no lookups.
            first, _, columns, span = hot
            t0 = time.perf_counter()
            out = {k: v[start - first:stop - first] for k, v in columns.items()}
            lo, hi = start - span.first, stop - span.first
            if span.num_tokens is not None:
                out["tokens"] = np.ascontiguousarray(out["tokens"][:, :bucket_width(span.num_tokens[lo:hi])])
            self.wait_s += time.perf_counter() - t0
            return out, span.ids[lo:hi]
        batch = self.batch_refs(start, stop)
        t0 = time.perf_counter()
        missing = [p for p in batch.pieces if self._fetched.get(p.first, (None,))[0] is not p.ref]
        if missing:
            for p, columns in zip(missing, ray.get([p.ref for p in missing])):
                self._fetched[p.first] = (p.ref, columns)
        # The rows as a rank would assemble its share, here the whole batch.
        columns = batch.share(slice(0, stop - start)).assemble(
            [self._fetched[p.first][1] for p in batch.pieces])
        # Keep the piece this batch ended in: the next batches start there.
        last = batch.pieces[-1]
        self._fetched = {k: v for k, v in self._fetched.items() if k >= last.first}
        span = self._spans[self._span_index(last.first)]
        self._hot = (last.first, last.stop, self._fetched[last.first][1], span)
        self.wait_s += time.perf_counter() - t0
        return columns, batch.ids

    def global_batch(self, data_cursor: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return self.rows(data_cursor, data_cursor + self.global_batch_size)

    def _drop_stream(self) -> None:
        """Forget the stream's reads: no cancel (see ``_open_stream``); their results are freed
        by Ray when they end, as nothing refers to them. Their metadata references are kept
        until they end, to count them against ``num_readers``."""
        self._abandoned += [p.meta_ref for p in self._pending]
        self._pending.clear()
        self._waited_since.clear()
        self._items, self._next_item, self._submit_pos = [], 0, -1

    def close(self) -> None:
        self._drop_stream()
        self._hot = None
        self._abandoned = []
        self._spans = []
        self._fetched = {}
        self._ctx_ref = self._ctx = None

    # ----- bad shards
    def _skip(self, bad: int, error: str, frm: int, data_cursor: int) -> None:
        if bad in self.skips and self.skips[bad] <= frm:
            raise DataError(f"{error} (already skipped from stream position {self.skips[bad]}, "
                            f"yet read again: a bug in the data plane)")
        self.skips[bad] = frm
        self._fstarts, self._keep, self._hot = [], {}, None
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
