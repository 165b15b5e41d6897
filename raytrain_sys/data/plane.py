"""The data plane: Ray Data reads and permutes windows; the driver deals global batches.

Ray Data runs the reading (and preprocessing) as tasks that may land on CPU-only nodes. The order
never comes from Ray Data's scheduling: each task computes a whole window of the plan in
``raytrain_sys.data.order``, and the stream is consumed with ``preserve_order``. The driver keeps a
small cache of windows keyed by their global index ``g = epoch * windows_per_epoch + window`` and
slices a step's global batch out of it by cursor. Prefetched windows are never "consumed": only
the Supervisor's committed cursor moves, so a failed step re-reads the same rows and a resume
seeks straight to the cursor's window (shard + row group / byte offset, never read-and-drop).

Both formats (Parquet token rows, WebDataset tar samples) go through the same
``map_batches(read_windows)`` over window descriptors; ``shards.read_columns`` reads a segment of
either by seeking.

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
from typing import Callable, Iterator

import numpy as np

from raytrain_sys.data import order
from raytrain_sys.data.manifest import DatasetManifest
from raytrain_sys.data.shards import BadShardError, read_columns
from raytrain_sys.errors import DataError, find_user_error

log = logging.getLogger(__name__)

SKIP_LOG_FILE = "skipped_samples.jsonl"
BAD_SHARD_POLICIES = ("fail", "skip")


def window_layout(plan: order.EpochPlan, w: int) -> tuple[list[order.Segment], np.ndarray, np.ndarray]:
    """(segments, sample ids, shard of each row) of window ``w``, the arrays in training order."""
    segs = plan.window_segments(w)
    seg_ids = np.concatenate([np.arange(s.first_id, s.first_id + s.row_end - s.row_start) for s in segs])
    seg_shard = np.concatenate([np.full(s.row_end - s.row_start, s.shard) for s in segs])
    perm = plan.window_permutation(w)
    return segs, seg_ids[perm], seg_shard[perm]


def kept_rows(shard_of_row: np.ndarray, raw_start: int, skips: dict[int, int]) -> np.ndarray:
    """Mask of a window's rows (training order) that stay in the stream: a row of a skipped shard
    leaves it when its raw stream position is at or after the shard's ``from_position``."""
    keep = np.ones(len(shard_of_row), dtype=bool)
    for shard, frm in skips.items():
        keep &= ~((shard_of_row == shard) & (raw_start + np.arange(len(keep)) >= frm))
    return keep


def read_window(dataset_uri: str, manifest: DatasetManifest, plan: order.EpochPlan, w: int,
                raw_start: int, skips: dict[int, int], start: int = 0,
                s3_endpoint_url: str = "") -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The kept rows of window ``w`` from training-order index ``start`` on: (columns, sample ids).

    Only segments holding such rows are read, so a shard whose rows here are all skipped (or all
    before ``start``: consumed before a restart) is not touched. With no skips and start 0 the ids
    are exactly ``plan.window_sample_ids(w)``.
    """
    segs, ids, shard_of_row = window_layout(plan, w)
    keep = kept_rows(shard_of_row, raw_start, skips)
    keep[:start] = False
    perm = plan.window_permutation(w)
    keep_seg = np.zeros(len(keep), dtype=bool)
    keep_seg[perm] = keep  # training position i holds segment-order row perm[i]
    bounds = np.cumsum([0] + [s.row_end - s.row_start for s in segs])
    read = np.zeros(len(keep), dtype=bool)
    parts = []
    for k, seg in enumerate(segs):
        if keep_seg[bounds[k]:bounds[k + 1]].any():
            parts.append(read_columns(dataset_uri, manifest, seg, s3_endpoint_url))
            read[bounds[k]:bounds[k + 1]] = True
    if not parts:
        return {}, ids[keep]
    columns = {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
    take = (np.cumsum(read) - 1)[perm[keep]]  # segment-order row -> its place among the read rows
    return {c: v[take] for c, v in columns.items()}, ids[keep]


def read_windows(batch: dict[str, np.ndarray], dataset_uri: str, manifest: DatasetManifest,
                 seed: int, window: int, block_rows: int, s3_endpoint_url: str,
                 skips: tuple[tuple[int, int], ...] = ()) -> dict[str, np.ndarray]:
    """Ray Data map_batches function: (window g, start index) -> permuted rows + sample ids."""
    shard_rows = tuple(s.num_rows for s in manifest.shards)
    num_rows = sum(shard_rows)
    per_epoch = -(-num_rows // window)
    parts, ids, gs = [], [], []
    for g, start in zip(batch["g"], batch["start"]):
        epoch, w = divmod(int(g), per_epoch)
        plan = order.epoch_plan(shard_rows, int(seed), epoch, int(window), int(block_rows))
        try:
            columns, wids = read_window(dataset_uri, manifest, plan, w, epoch * num_rows + w * window,
                                        dict(skips), int(start), s3_endpoint_url)
        except BadShardError as exc:
            # A marker in place of the window, not an exception: it reaches the driver in stream
            # order, exactly when the consumer needs this window (prefetch cannot make it surface
            # early), with the shard index intact (Ray Data would wrap an exception into text).
            return {"g": np.asarray([g], dtype=np.int64), "bad_shard": np.asarray([exc.shard]),
                    "error": np.asarray([str(exc)])}
        parts.append(columns)
        ids.append(wids)
        gs.append(np.full(len(wids), g, dtype=np.int64))
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out.update(sample_id=np.concatenate(ids), g=np.concatenate(gs))
    return out


class DataPlane:
    """Serves ``global_batch(data_cursor)`` from a Ray Data stream of plan windows."""

    def __init__(self, dataset_uri: str, manifest: DatasetManifest, seed: int, window: int,
                 block_rows: int, global_batch_size: int, end_position: int, prefetch_steps: int = 4,
                 s3_endpoint_url: str = "", on_bad_shard: str = "fail", run_dir: str = "",
                 on_skip: Callable[[str], None] | None = None):
        if on_bad_shard not in BAD_SHARD_POLICIES:
            raise ValueError(f"on_bad_shard must be one of {BAD_SHARD_POLICIES}")
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
        self.windows_per_epoch = -(-self.num_rows // self.window)
        self.prefetch_windows = max(1, math.ceil(prefetch_steps * global_batch_size / self.window))
        # window g -> (columns, sample ids, delivered offset of the first cached row)
        self._cache: dict[int, tuple[dict[str, np.ndarray], np.ndarray, int]] = {}
        self._stream: Iterator | None = None
        self._stream_next: int | None = None  # the window the stream yields next
        self._stream_first: tuple[int, int] = (-1, 0)  # (window, delivered offset) it opened at
        self.wait_s = 0.0  # time the trainers waited on data (driver-side), for metrics
        self.skips: dict[int, int] = {}  # shard -> raw stream position its rows leave the stream
        self._fstarts: list[int] = []  # delivered-stream start of windows g0, g0+1, ...
        self._keep: dict[int, np.ndarray] = {}  # window -> kept-row mask, while skips exist
        self._load_skips()

    @classmethod
    def for_job(cls, spec, manifest: DatasetManifest, end_position: int, run_dir: str = "",
                on_skip: Callable[[str], None] | None = None) -> "DataPlane":
        """The plane a job spec asks for: the one place that maps ``spec.data`` to the plane."""
        d = spec.data
        return cls(d.path, manifest, d.seed, d.shuffle_window, d.shuffle_block_rows,
                   spec.train.global_batch_size, end_position, prefetch_steps=d.prefetch_steps,
                   s3_endpoint_url=d.s3_endpoint_url, on_bad_shard=d.on_bad_shard, run_dir=run_dir,
                   on_skip=on_skip)

    # ----- window geometry: raw (the plan's) and delivered (after skipped shards) positions
    def _raw_start(self, g: int) -> int:
        epoch, w = divmod(g, self.windows_per_epoch)
        return epoch * self.num_rows + w * self.window

    def _raw_len(self, g: int) -> int:
        w = g % self.windows_per_epoch
        return min(self.window, self.num_rows - w * self.window)

    def _kept(self, g: int) -> np.ndarray | None:
        """Mask of window g's kept rows, or None when no skip reaches into it (all kept)."""
        start = self._raw_start(g)
        if not any(frm < start + self._raw_len(g) for frm in self.skips.values()):
            return None
        if g not in self._keep:
            epoch, w = divmod(g, self.windows_per_epoch)
            plan = order.epoch_plan(self.shard_rows, self.seed, epoch, self.window, self.block_rows)
            self._keep[g] = kept_rows(window_layout(plan, w)[2], start, self.skips)
        return self._keep[g]

    def _delivered_len(self, g: int) -> int:
        keep = self._kept(g)
        return self._raw_len(g) if keep is None else int(keep.sum())

    def _raw_index(self, g: int, offset: int) -> int:
        """Delivered offset in window g -> its row's index in the window's training order."""
        keep = self._kept(g)
        return offset if keep is None else int(np.flatnonzero(keep)[offset])

    def _first_skip_window(self) -> int:
        epoch, p = divmod(min(self.skips.values()), self.num_rows)
        return epoch * self.windows_per_epoch + p // self.window

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
        epoch, w, offset = order.locate(position, self.num_rows, self.window)
        return epoch * self.windows_per_epoch + w, offset

    def _next_window(self, g: int) -> int:
        g += 1
        while self.skips and self._delivered_len(g) == 0:
            g += 1
        return g

    # ----- the stream
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
        last, _ = self._locate(max(self.end_position - 1, 0))
        items, k = [{"g": g, "start": self._raw_index(g, offset)}], g
        while k < last:
            k = self._next_window(k)
            items.append({"g": k, "start": 0})
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            read_windows, batch_size=1, batch_format="numpy",
            # Zero CPUs: readers must not wait behind trainers that hold every CPU of the
            # placement group; reading a window is short and mostly I/O.
            num_cpus=0,
            # ...but bounded: zero-CPU tasks are otherwise launched for every window at once,
            # each in a new worker process. A few in flight keep the prefetch depth filled.
            compute=ray.data.TaskPoolStrategy(size=min(len(items), max(2, min(self.prefetch_windows, 4)))),
            fn_kwargs=dict(dataset_uri=self.dataset_uri, manifest=self.manifest, seed=self.seed,
                           window=self.window, block_rows=self.block_rows,
                           s3_endpoint_url=self.s3_endpoint_url,
                           skips=tuple(sorted(self.skips.items()))),
        )
        self._stream = iter(ds.iter_batches(batch_size=None, batch_format="numpy",
                                            prefetch_batches=self.prefetch_windows))
        self._stream_next, self._stream_first = g, (g, offset)
        log.info("data plane: stream opened at window %d offset %d (epoch %d)", g, offset,
                 g // self.windows_per_epoch)

    def _pull(self, want: tuple[int, int], data_cursor: int) -> None:
        """Take the stream's next window into the cache; ``want`` is the (window, offset) waited for."""
        try:
            batch = next(self._stream)
        except StopIteration:
            raise DataError("data stream ended before the requested cursor") from None
        except Exception as exc:  # Ray Data wraps task errors; surface ours as one line
            self._stream = None
            found = find_user_error(exc)
            if found is not None:
                raise found from None
            raise
        g = int(batch.pop("g")[0])
        assert g == self._stream_next == want[0], f"stream out of order: {g}, {self._stream_next}, {want}"
        if "bad_shard" in batch:
            # Windows after this one were read without knowing: a new stream either way.
            self._drop_stream()
            shard, error = int(batch["bad_shard"][0]), str(batch["error"][0])
            if self.on_bad_shard != "skip":
                raise DataError(error)
            # From the row waited for: rows before it were consumed and keep their positions.
            self._skip(shard, error, self._raw_start(g) + self._raw_index(*want), data_cursor)
            return
        ids = batch.pop("sample_id")
        base = self._stream_first[1] if g == self._stream_first[0] else 0
        self._cache[g] = (batch, ids, base)
        self._stream_next = self._next_window(g)

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
        """The columns and sample ids of delivered-stream positions ``[start, stop)``."""
        t0 = time.perf_counter()
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
        for g in [k for k in self._cache if k < first]:
            del self._cache[g]
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return batch, np.concatenate(ids)

    def global_batch(self, data_cursor: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return self.rows(data_cursor, data_cursor + self.global_batch_size)

    def _drop_stream(self) -> None:
        # Closing the generator now shuts its Ray Data execution down while Ray is still up.
        stream, self._stream = self._stream, None
        if stream is not None and hasattr(stream, "close"):
            try:
                stream.close()
            except Exception as exc:  # a failed stream may not close cleanly; it is gone anyway
                log.debug("closing a data stream: %s", exc)

    def close(self) -> None:
        self._drop_stream()
        self._cache.clear()

    # ----- bad shards
    def _skip(self, bad: int, error: str, frm: int, data_cursor: int) -> None:
        if bad in self.skips and self.skips[bad] <= frm:
            raise DataError(f"{error} (already skipped from stream position {self.skips[bad]}, "
                            f"yet read again: a bug in the data plane)")
        self.skips[bad] = frm
        self._fstarts, self._keep = [], {}
        shard = self.manifest.shards[bad]
        lo = self.manifest.row_offsets[bad]
        epoch, p = divmod(frm, self.num_rows)
        plan = order.epoch_plan(self.shard_rows, self.seed, epoch, self.window, self.block_rows)
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
