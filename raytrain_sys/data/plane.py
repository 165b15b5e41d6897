"""The data plane's driver side: the stream of reads, and the references the driver deals.

Owns the stream: which chunks of the plan (consecutive windows of ``raytrain_sys.data.order``) are
read, in what order and how many at once (``data.num_readers``); the driver's wait on them (a hung
read found, its process ended and the read made again: ``_check_hung``); the skip ledger of bad
shards; pieces read again after a node left (``reread_lost``); and the answer to
``global_batch_refs(cursor)``, references and ranges (``raytrain_sys.data.batches``) with which
ranks fetch their rows where they lie, node to node. What a read does in its task, and the pieces
and metadata it returns, is ``raytrain_sys.data.reads``'s: this module submits reads and takes
their results.

The order never comes from task timing: chunks are submitted and consumed in stream order.
Nothing is ever "consumed": only the Supervisor's committed cursor moves, so a failed step is sent
again with the same references, and a resume seeks straight to the cursor's window (shard + row
group / byte offset, never read-and-drop). A seek never cancels a read (``_open_stream``): the
reads of the stream left behind run to their end and Ray frees their results, as nothing refers
to them; they count against ``data.num_readers`` until then. (Ray Data's streaming executor, which
did the reading before, force-cancels running reads when a stream closes early, and in Ray 2.60 a
cancel that meets the reply in flight aborts the driver.)

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
import math
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from raytrain_sys.data import order, reads
from raytrain_sys.data.batches import GlobalBatch, Piece
from raytrain_sys.data.manifest import DatasetManifest
from raytrain_sys.data.shards import read_document_index
from raytrain_sys.errors import DataError, find_user_error

log = logging.getLogger(__name__)

SKIP_LOG_FILE = "skipped_samples.jsonl"
BAD_SHARD_POLICIES = ("fail", "skip")
# rows: the dataset's stored rows. The others make rows of a documents dataset's documents.
SEQUENCES = ("rows", "pack", "pack_masked", "bucket")
# Reading tasks at once, the default of data.num_readers (40 epochs of the stdlib under Ray Data:
# 2 gave 1.1-1.3 M rows/s, 3 gave 1.5-1.6 M, 4 no more than 3 and the start of another process).
READERS = 3


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
        self.chunk_rows = max(prefetch_steps * global_batch_size, reads.CHUNK_BYTES // row_bytes)
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
        self._ctx: reads.ReadContext | None = None  # the stream's, for a read in this process (read_first_here)
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
            self._keep[g] = reads.kept_rows(reads.window_layout(self.stream.plan(epoch), w)[2], start, self.skips)
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
        """The stream's items from window ``g`` (read from raw index ``start``) to the run's end
        (``reads.chunk_items``, over the windows' delivered rows)."""
        last, _ = self._locate(max(self.end_position - 1, 0))
        return reads.chunk_items(g, start, last, self.chunk_rows, self._delivered_len, self._next_window)

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
        ctx = reads.ReadContext(self.dataset_uri, self.manifest, self.stream, self.s3_endpoint_url,
                          self.sequences == "pack_masked", tuple(sorted(self.skips.items())),
                          self.task, self.sequences == "bucket", uuid.uuid4().hex, self.transform,
                          self.read_timeout_s)
        self._ctx, self._ctx_ref = ctx, ray.put(ctx)
        self._top_up()
        log.info("data plane: stream opened at window %d offset %d (epoch %d)", g, offset,
                 g // self.windows_per_epoch)

    def _piece_rows(self) -> int:
        return reads.rows_per_piece(self.share_rows, self.row_bytes, self.global_batch_size)

    def _submit(self) -> None:
        item = self._items[self._next_item]
        self._next_item += 1
        first = self._submit_pos
        stop = self._fstart(item["last"]) + self._delivered_len(item["last"])
        piece_rows = self._piece_rows()
        num_pieces = len(reads.piece_bounds(first, stop, piece_rows)) - 1
        refs = self._read_here(item, first, piece_rows, num_pieces) if self.read_first_here else None
        if refs is None:
            refs = reads.submit_read(self._ctx_ref, item, first, piece_rows, num_pieces, self.read_resources)
        self._pending.append(_Pending(item, first, stop, piece_rows, refs[0], list(refs[1:])))
        self._submit_pos = stop

    def _read_here(self, item: dict[str, int], first: int, piece_rows: int, num_pieces: int) -> list | None:
        """A job's first read, in this process, its results put in the object store as a read
        task's would be: a new job's reader processes take seconds to start (2.4-8.6 s measured
        on a busy node, benchmarks/scheduler.py), and this process is up with its imports done.
        The first chunk of a stream is one window. The reads after it go to read tasks, whose
        processes start meanwhile. None when it failed (``reads.read_here``): a read task reads it."""
        self.read_first_here = False
        refs = reads.read_here(self._ctx, item, first, piece_rows, num_pieces)
        if refs is not None:
            self.reads_here += 1
        return refs

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
        bounds = reads.piece_bounds(p.first, stop, p.piece_rows)  # as the read cut them
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
        while not ray.wait([p.meta_ref], timeout=reads.READ_STACK_EVERY_S, fetch_local=False)[0]:
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
        key = reads.read_stack_key(self._ctx.stream_id, p.first)
        posted = reads.posted_stack(key)
        if posted is None:
            return  # not running for long (queued, or read again just now)
        self._read_hung(p, posted, waited, key)
        self._waited_since[p.first] = time.monotonic()

    def _read_hung(self, p: _Pending, posted: dict, waited: float, key: str) -> None:
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
        if reads.end_hung_read(posted, key):
            log.warning("data plane: the hung read's process (pid %s) was ended; Ray reads it again", posted["pid"])

    def rows_ahead(self, position: int, finished_reads: bool = False) -> int:
        """Rows read and ready from ``position`` on (the prefetch depth a consumer at it sees):
        the reads taken; with ``finished_reads``, also the submitted reads after them whose tasks
        have finished, in stream order, by their planned rows (taking one is then a lookup). A
        read is taken only when a batch needs it, so without them the depth ends where the
        chunk in use does (a chunk is at most ``reads.CHUNK_BYTES``: about 60 global batches of
        512 rows of 1,024 tokens), and a lease sized by it would end there too. A finished read
        cut short by a bad shard delivers fewer rows than planned: the batch after them then
        waits for the read after it, as for any read not finished."""
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
            width = reads.bucket_width(np.concatenate([s.num_tokens[lo:hi] for s, (lo, hi) in zip(spans, cut)]))
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
                out["tokens"] = np.ascontiguousarray(out["tokens"][:, :reads.bucket_width(span.num_tokens[lo:hi])])
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
            _, wids, shard_of_row = reads.window_layout(plan, w)
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
