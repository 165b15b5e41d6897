"""The read side of the data plane: what a read task does, and the shape of what it returns.

Owns what runs in a read (``read_chunk``, a plain Ray task sent by ``submit_read``; a job's
first read runs it in the driver, ``read_here``) and what decides a read's shape: the windows of
each read (``chunk_items``, up to CHUNK_BYTES), the segments a window's kept rows are read from
(``window_reads``; ``kept_rows`` under the skip ledger it is handed), how a chunk's rows are cut
into *pieces* (``piece_bounds``, ``rows_per_piece``) and what its small metadata holds (sample
ids, each row's loss units, ``row_units``; the windows read; a bad shard's marker),
``data.transform`` on every row (``transform_rows``), and the watch through which a slow read
posts its stacks (``_slow_read_watch``) and a hung one's process is ended (``end_hung_read``).
It holds no stream: which reads are made, when, and what a marker or a hung read means for the
run is the driver's, ``raytrain_sys.data.plane``, which calls in here; nothing here calls back.
A read is a pure function of its ``ReadContext`` and item: Ray makes it again after a lost node
or an ended process (``_reader``'s retries).

A task reads whole windows of the plan in ``raytrain_sys.data.order`` (a chunk of consecutive
windows) and returns its rows as pieces cut at multiples of a rank's share, which stay in the
object store of the node it ran on until a rank fetches them; only the metadata goes to the
driver. Both formats (Parquet token rows, WebDataset tar samples) go through the same
``read_chunk``; ``shards.read_segments`` reads segments of either by seeking (token shards once
per shard for a whole chunk).

Sequences (``data.sequences``): a documents dataset has no rows of its own. Its windows are
windows of documents, and the task that reads one makes its rows (``order.DocumentEpoch``):
``pack`` and ``pack_masked`` concatenate the window's documents and cut rows of ``row_len``
tokens, ``bucket`` cuts each document into rows and groups rows of similar length. The rows of a
window are a pure function of the document lengths, read once from the dataset's length index, so
the stream positions, the cursor and the seek work as for stored rows. Columns delivered beside
``tokens``: ``num_tokens`` (real tokens per row, the rest is padding, loss-masked) and, for
``pack_masked``, ``doc_ids`` (the document of every token, -1 for padding), from which the task
restarts positions and masks attention at document boundaries. A ``bucket`` global batch is
trimmed to its longest row (``bucket_width``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from raytrain_sys.data import order
from raytrain_sys.data.manifest import TOKENS_FORMAT, DatasetManifest
from raytrain_sys.data.shards import (BadShardError, clear_caches, gather_rows, read_documents,
                                      read_segments, read_token_pool)
from raytrain_sys.errors import SpecError

log = logging.getLogger(__name__)

# Bytes of rows per read task (a chunk of windows). Measured when Ray Data ran the reads (each of
# its blocks cost up to ~100 ms of latency): 16 MiB stalled the readers, 32 MiB did not, 64 MiB
# gave no more. With plain tasks the per-chunk cost is a task submission, and 32 MiB still keeps
# a few chunks in the object store at most; the first chunk after a seek is one window, then 4x
# each, so the time to the first batch does not grow.
CHUNK_BYTES = 32 * 2**20
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


def chunk_items(g: int, start: int, last: int, chunk_rows: int, rows_of: Callable[[int], int],
                next_window: Callable[[int], int]) -> list[dict[str, int]]:
    """The items of ``read_chunk`` from window ``g`` (read from training-order index ``start``)
    to window ``last``: each ``{"g", "last", "start"}``, windows ``g..last`` of the stream, the
    first read from ``start``. ``rows_of(g)``: the rows window ``g`` delivers; ``next_window(g)``:
    the next window after ``g`` that delivers any.

    The first item is that window alone, so the first batch after a seek waits for one
    window; later items group consecutive windows into chunks that grow 4x in rows up to
    ``chunk_rows``, so that the per-task cost is paid rarely.
    """
    items = [{"g": g, "last": g, "start": start}]
    budget, k = rows_of(g), g  # a whole window, even when read from mid-window
    while k < last:
        budget = min(4 * budget, chunk_rows)
        first = k = next_window(k)
        rows = rows_of(k)
        while rows < budget and k < last:
            nxt = next_window(k)
            if rows + rows_of(nxt) > chunk_rows:
                break
            k = nxt
            rows += rows_of(k)
        items.append({"g": first, "last": k, "start": 0})
    return items


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


def end_hung_read(posted: dict, key: str) -> bool:
    """End the process of a read found hung, from its own node (``_end_read_process``: only if
    its stack, ``posted`` under ``key``, is still there); Ray then reads it again. False when it
    was not ended: the read returned meanwhile, or its node is gone (Ray reads it again anyway)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where_it_runs = NodeAffinitySchedulingStrategy(posted["node_id"], soft=False) if posted.get("node_id") else None
    end = ray.remote(num_cpus=0, max_retries=0)(_end_read_process)
    try:
        return ray.get(end.options(**({"scheduling_strategy": where_it_runs} if where_it_runs else {}))
                       .remote(int(posted["pid"]), key), timeout=30)
    except Exception as exc:  # noqa: BLE001: its node gone: Ray reads it again anyway
        log.warning("data plane: could not end the hung read's process: %s", exc)
        return False


def posted_stack(key: str) -> dict | None:
    """What a slow read posted under ``key`` (``_slow_read_watch``), or None."""
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


def submit_read(ctx_ref, item: dict[str, int], first: int, piece_rows: int, num_pieces: int,
                read_resources: dict) -> list:
    """``read_chunk`` as a read task asking ``read_resources`` (data.read_resources; no CPU
    unless asked there): its references, ``meta`` first, then the pieces."""
    options = {"num_returns": num_pieces + 1, "num_cpus": read_resources.get("CPU", 0)}
    custom = {k: v for k, v in read_resources.items() if k != "CPU"}
    if custom:
        options["resources"] = custom
    return _reader().options(**options).remote(ctx_ref, item, first, piece_rows, num_pieces)


def read_here(ctx: ReadContext, item: dict[str, int], first: int, piece_rows: int,
              num_pieces: int) -> list | None:
    """``read_chunk`` in this process, its results put in the object store as a read task's
    would be (references as ``submit_read``'s). None when it failed: the read task reads it
    again, and its error is reported as any read's."""
    import ray

    try:
        out = read_chunk(ctx, item, first, piece_rows, num_pieces)
    except Exception as exc:  # noqa: BLE001: met again, and reported, by the read task
        log.debug("data plane: the first read here failed (%s); a read task reads it", exc)
        return None
    return [ray.put(part) for part in out]
