"""The writer thread of one MLflow run: the run's writes, in order, off the training loop.

Owns: the queue of a run's writes (``Write``: the run's opening, metrics and tags, params, an
artifact rewritten whole, plots) and the one daemon thread that applies them (``Writer``), with
retries, a bounded queue, merged batches within MLflow's limits, and a newer snapshot of a file
superseding a pending one. A write that still fails after its retries is dropped with a warning
and counted (``dropped``): a slow or unreachable MLflow never stalls the training loop. What a
run holds, and when it is written, is the tracker's (``mlflow_tracker.Tracker``).
"""

from __future__ import annotations

import collections
import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from raytrain_sys.tracking import mlflow_store as ms

log = logging.getLogger(__name__)


@dataclass
class Write:
    kind: str  # "open" (the run made: Tracker.begin), "batch" (metrics + tags), "params", "text" (an
    # artifact rewritten whole) or "plots"
    metrics: list = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    artifact: str = ""
    text: str = ""
    summary: dict = field(default_factory=dict)  # "plots": the summary they are drawn from
    count: int = 1  # calls merged into this write, for the dropped count
    params: list = field(default_factory=list)  # "params": the run's params, one batch
    opener: Callable[[], tuple] | None = None  # "open": makes the run, returns (client, run_id)


class Writer:
    """One daemon thread applying a run's writes in order, with retries and a bounded queue.
    Made before its run exists (``Tracker.begin``: client None, run id ""), its first write is
    the "open" that makes the run; if that fails, ``open_error`` keeps why and every write
    queued or made after it is dropped (counted, without a warning each: the run failed)."""

    max_pending = 10_000  # writes waiting; beyond this new ones are dropped (MLflow down for long)
    backoff_s = 0.5  # doubled after each failed attempt
    warn_every_s = 30.0  # at most one "dropped" warning per interval

    def __init__(self, client, run_id: str, tracking_uri: str):
        self._client = client
        self._run_id = run_id
        self._tracking_uri = tracking_uri
        # MLflow's HTTP client already retries each request (mlflow_store._HTTP_CLIENT_BOUNDS); a local store
        # does not, and a busy SQLite file ("database is locked") clears within a second or two.
        self.attempts = 2 if ms.is_http(tracking_uri) else 4
        self._pending: collections.deque[Write] = collections.deque()
        self._cond = threading.Condition()
        self._in_flight = False
        self._closing = False
        self.dropped = 0
        self._last_warning = -float("inf")
        self.open_error: BaseException | None = None  # the "open" write's failure (Tracker.begin)
        self.opened = threading.Event()  # set once the run exists or failed to (at once: made open)
        if run_id:
            self.opened.set()
        self._thread = threading.Thread(
            target=self._loop, name=f"mlflow-writer-{run_id[:8] or 'opening'}", daemon=True
        )
        self._thread.start()

    # --- caller side
    def submit(self, write: Write) -> None:
        with self._cond:
            if self.open_error is not None:  # no run to write to; the run was told (check_open)
                self.dropped += write.count
                return
            if self._closing:
                log.warning("MLflow run %s is finished; a late write was ignored", self._run_id)
                return
            if write.kind in ("text", "plots"):
                # A newer snapshot of the same file supersedes a pending one.
                self._pending = collections.deque(
                    w for w in self._pending
                    if not (w.kind == write.kind and w.artifact == write.artifact)
                )
            if len(self._pending) >= self.max_pending:
                self._drop(write, "the write queue is full")
                return
            self._pending.append(write)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending and not self._in_flight, timeout=timeout_s
            )

    def close(self, timeout_s: float) -> bool:
        """Stop taking writes and wait up to ``timeout_s`` for the queue; False if it did not drain."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        drained = self.flush(timeout_s)
        if not drained:
            self.abandon()
        self._thread.join(timeout=0.1 if not drained else 5.0)
        return drained

    def abandon(self) -> None:
        """Drop every queued write (counted); the one in flight, if any, ends on its own."""
        with self._cond:
            self._closing = True
            self.dropped += sum(w.count for w in self._pending)
            self._pending.clear()
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + int(self._in_flight)

    # --- thread side
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return
                write = self._take_locked()
                self._in_flight = True
            try:
                self._apply_with_retries(write)
            finally:
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()

    def _take_locked(self) -> Write:
        """Pop the next write; consecutive batches merge into one log_batch within MLflow's limits."""
        write = self._pending.popleft()
        if write.kind != "batch":
            return write
        merged = Write("batch", list(write.metrics), dict(write.tags), count=write.count)
        while self._pending and self._pending[0].kind == "batch":
            nxt = self._pending[0]
            n_metrics = len(merged.metrics) + len(nxt.metrics)
            n_tags = len(merged.tags.keys() | nxt.tags.keys())
            if (n_metrics > ms.MAX_METRICS_PER_BATCH or n_tags > ms.MAX_PARAMS_TAGS_PER_BATCH
                    or n_metrics + n_tags > ms.MAX_ENTITIES_PER_BATCH):
                break
            self._pending.popleft()
            merged.metrics.extend(nxt.metrics)
            merged.tags.update(nxt.tags)
            merged.count += nxt.count
        return merged

    def _apply(self, write: Write) -> None:
        from mlflow.entities import RunTag

        if write.kind == "open":
            self._client, self._run_id = write.opener()
        elif write.kind == "batch":
            self._client.log_batch(
                self._run_id,
                metrics=write.metrics,
                tags=[RunTag(k, v) for k, v in write.tags.items()],
                synchronous=True,
            )
        elif write.kind == "params":
            self._client.log_batch(self._run_id, params=write.params, synchronous=True)
        elif write.kind == "plots":
            # Drawn in a child process, which this thread waits for: the step loop only handed
            # over a snapshot, and keeps this process's GIL to itself.
            from raytrain_sys.monitor.plots import write_plots_apart

            with tempfile.TemporaryDirectory(prefix="raytrain-plots-") as tmp:
                if write_plots_apart(write.summary, tmp):
                    self._client.log_artifacts(self._run_id, tmp, write.artifact)
        else:
            self._client.log_text(self._run_id, write.text, write.artifact)

    def _apply_with_retries(self, write: Write) -> None:
        if write.kind == "open":  # retried inside (``mlflow_store.call``); what fails is kept, never retried here
            try:
                self._apply(write)
            except BaseException as exc:  # noqa: BLE001: raised in the caller's thread (check_open)
                with self._cond:
                    self.open_error, self._closing = exc, True  # the thread ends: no run to write to
                    self.dropped += sum(w.count for w in self._pending)
                    self._pending.clear()
            finally:
                self.opened.set()
            return
        for attempt in range(self.attempts):
            try:
                self._apply(write)
                return
            except Exception as exc:
                if attempt + 1 == self.attempts or not ms.is_transient(exc):
                    with self._cond:
                        self._drop(write, ms.first_line(exc))
                    return
                time.sleep(self.backoff_s * 2**attempt)

    def _drop(self, write: Write, reason: str) -> None:
        # Called with the lock held.
        self.dropped += write.count
        now = time.monotonic()
        if now - self._last_warning >= self.warn_every_s:
            self._last_warning = now
            what = {"batch": "metrics/tags", "params": "params"}.get(write.kind, f"artifact {write.artifact}")
            log.warning(
                "MLflow write (%s) to run %s at %s dropped: %s (%d dropped so far; training "
                "continues)", what, self._run_id, self._tracking_uri, reason, self.dropped,
            )

