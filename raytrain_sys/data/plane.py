"""The data plane: Ray Data reads and permutes windows; the driver deals global batches.

Ray Data runs the reading (and, later, preprocessing) as tasks that may land on CPU-only nodes.
The order never comes from Ray Data's scheduling: each task computes a whole window of the plan
in ``raytrain_sys.data.order``, and the stream is consumed with ``preserve_order``. The driver
keeps a small cache of windows keyed by (epoch, window) and slices a step's global batch out of
it by cursor. Prefetched windows are never "consumed": only the Supervisor's committed cursor
moves, so a failed step re-reads the same rows and a resume seeks straight to the cursor's window.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Iterator

import numpy as np

from raytrain_sys.data import order
from raytrain_sys.data.manifest import DatasetManifest
from raytrain_sys.data.shards import read_segment
from raytrain_sys.errors import DataError, find_user_error

log = logging.getLogger(__name__)


def read_windows(batch: dict[str, np.ndarray], dataset_uri: str, manifest: DatasetManifest,
                 seed: int, window: int, block_rows: int, s3_endpoint_url: str) -> dict[str, np.ndarray]:
    """Ray Data map_batches function: (epoch, window) descriptors -> permuted rows + sample ids."""
    shard_rows = tuple(s.num_rows for s in manifest.shards)
    tokens, ids, epochs, windows = [], [], [], []
    for epoch, w in zip(batch["epoch"], batch["window"]):
        plan = order.epoch_plan(shard_rows, int(seed), int(epoch), int(window), int(block_rows))
        rows = np.concatenate([read_segment(dataset_uri, manifest, seg, s3_endpoint_url)
                               for seg in plan.window_segments(int(w))])
        perm = plan.window_permutation(int(w))
        tokens.append(rows[perm])
        ids.append(plan.window_sample_ids(int(w)))
        epochs.append(np.full(len(perm), epoch, dtype=np.int64))
        windows.append(np.full(len(perm), w, dtype=np.int64))
    return {"tokens": np.concatenate(tokens), "sample_id": np.concatenate(ids),
            "epoch": np.concatenate(epochs), "window": np.concatenate(windows)}


class DataPlane:
    """Serves ``global_batch(cursor)`` from a Ray Data stream of plan windows."""

    def __init__(self, dataset_uri: str, manifest: DatasetManifest, seed: int, window: int,
                 block_rows: int, global_batch_size: int, end_position: int, prefetch_steps: int = 4,
                 s3_endpoint_url: str = ""):
        self.dataset_uri = dataset_uri
        self.manifest = manifest
        self.seed = seed
        self.window = min(window, manifest.num_rows)
        self.block_rows = block_rows
        self.global_batch_size = global_batch_size
        self.end_position = end_position
        self.s3_endpoint_url = s3_endpoint_url
        self.shard_rows = tuple(s.num_rows for s in manifest.shards)
        self.num_rows = manifest.num_rows
        self.prefetch_windows = max(1, math.ceil(prefetch_steps * global_batch_size / self.window))
        self._cache: dict[tuple[int, int], tuple[dict[str, np.ndarray], np.ndarray]] = {}
        self._stream: Iterator | None = None
        self._stream_next: tuple[int, int] | None = None  # the window the stream yields next
        self.wait_s = 0.0  # time the trainers waited on data (driver-side), for metrics

    # ----- window keys in stream order
    def _windows_per_epoch(self) -> int:
        return -(-self.num_rows // self.window)

    def _key(self, position: int) -> tuple[int, int]:
        epoch, w, _ = order.locate(position, self.num_rows, self.window)
        return epoch, w

    def _next_key(self, key: tuple[int, int]) -> tuple[int, int]:
        epoch, w = key
        return (epoch, w + 1) if w + 1 < self._windows_per_epoch() else (epoch + 1, 0)

    def _open_stream(self, start: tuple[int, int]) -> None:
        """Seek: a new Ray Data pipeline that starts at ``start``, not at the epoch's beginning."""
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # our plan is the order, not task timing
        ctx.enable_progress_bars = False
        # Ray Data logs every execution start at INFO; one per (re)seek is noise in a run's log.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        items, key = [], start
        last = self._key(max(self.end_position - 1, 0))
        while True:
            items.append({"epoch": key[0], "window": key[1]})
            if key >= last:
                break
            key = self._next_key(key)
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            read_windows, batch_size=1, batch_format="numpy",
            # Zero CPUs: readers must not wait behind trainers that hold every CPU of the
            # placement group; reading a window is short and mostly I/O.
            num_cpus=0,
            fn_kwargs=dict(dataset_uri=self.dataset_uri, manifest=self.manifest, seed=self.seed,
                           window=self.window, block_rows=self.block_rows, s3_endpoint_url=self.s3_endpoint_url),
        )
        self._stream = iter(ds.iter_batches(batch_size=None, batch_format="numpy",
                                            prefetch_batches=self.prefetch_windows))
        self._stream_next = start
        log.info("data plane: stream opened at epoch %d window %d", *start)

    def _pull(self) -> None:
        try:
            batch = next(self._stream)
        except StopIteration:
            raise DataError("data stream ended before the requested cursor") from None
        except Exception as exc:  # Ray Data wraps task errors; surface ours as one line
            found = find_user_error(exc)
            self._stream = None
            if found is not None:
                raise found from None
            raise
        key = (int(batch.pop("epoch")[0]), int(batch.pop("window")[0]))
        assert key == self._stream_next, f"stream out of order: {key} != {self._stream_next}"
        ids = batch.pop("sample_id")
        self._cache[key] = (batch, ids)
        self._stream_next = self._next_key(key)

    def _window(self, key: tuple[int, int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if key in self._cache:
            return self._cache[key]
        if self._stream is None or self._stream_next is None or key < self._stream_next:
            self._open_stream(key)
        while key not in self._cache:
            if self._stream_next > key:  # skipped past (cannot happen with preserve_order)
                self._open_stream(key)
            self._pull()
        return self._cache[key]

    def rows(self, start: int, stop: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The columns and sample ids of global positions ``[start, stop)``."""
        t0 = time.perf_counter()
        parts: list[dict[str, np.ndarray]] = []
        ids = []
        pos = start
        while pos < stop:
            epoch, w, offset = order.locate(pos, self.num_rows, self.window)
            columns, wi = self._window((epoch, w))
            take = min(stop - pos, len(wi) - offset)
            parts.append({k: v[offset: offset + take] for k, v in columns.items()})
            ids.append(wi[offset: offset + take])
            pos += take
        # Drop windows wholly before this batch: nothing behind the cursor is needed again.
        first = self._key(start)
        for key in [k for k in self._cache if k < first]:
            del self._cache[key]
        self.wait_s += time.perf_counter() - t0
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return batch, np.concatenate(ids)

    def global_batch(self, data_cursor: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return self.rows(data_cursor, data_cursor + self.global_batch_size)

    def close(self) -> None:
        self._stream = None
        self._cache.clear()
