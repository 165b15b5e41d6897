"""One rank's checkpoint writes off the training thread (``checkpoint.async_save``).

Owns: the rank's background write and the snapshot it holds. At a step boundary the worker
copies the blocks it owns to host memory (the only stall: ``reshard.local_pieces`` clones
them); a thread then serializes, hashes and uploads them while training goes on, and the
Supervisor asks for the records (``BackgroundWrite.result``) at later boundaries, writing the
manifest only when every rank's part is durable.

At most one write is in flight per rank: a new one first waits for the previous one to end
(so the snapshot memory is bounded by one copy of the rank's owned state, plus its bytes while
they are serialized), and the Supervisor never asks for a second save before the first is
committed or abandoned. A write that fails keeps its error for ``result``; nothing here
writes a manifest, so a failed or abandoned write leaves an invisible partial directory.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable

WRITER_NICE_INCREMENT = 10  # enough for the scheduler to favour the training thread ~10:1


class BackgroundWrite:
    """The newest background write of this rank: its step, thread, and outcome."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.snapshot_bytes = 0
        self.write_s = 0.0  # seconds from the snapshot to durable, once done
        self._thread: threading.Thread | None = None
        self._records: list[dict[str, Any]] = []
        self._error: BaseException | None = None

    def start(self, step: int, snapshot_bytes: int, write: Callable[[], list[dict[str, Any]]]) -> None:
        """Run ``write`` (which owns the snapshot) in a thread, after the previous write ended."""
        self.wait()
        self.step, self.snapshot_bytes, self.write_s = step, snapshot_bytes, 0.0
        self._records, self._error = [], None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-{step}",
                                        daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], list[dict[str, Any]]]) -> None:
        t0 = time.perf_counter()
        # Training comes first: where the rank's process has no spare core (CPU training) the
        # write takes the CPU the steps leave, and takes longer instead of slowing them.
        # Linux takes a thread id here, so only this thread (and the upload threads it starts,
        # which inherit it) is niced; raising one's nice value is always allowed.
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            nice = os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE_INCREMENT
            os.setpriority(os.PRIO_PROCESS, tid, min(19, nice))
        try:
            self._records = write()
        except BaseException as exc:  # noqa: BLE001: kept for result(), raised in the caller
            self._error = exc
        self.write_s = time.perf_counter() - t0

    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until no write is in flight (the previous one, if any, has ended either way)."""
        if self._thread is not None:
            self._thread.join()

    def result(self, step: int) -> list[dict[str, Any]]:
        """The manifest records of the write of ``step`` once it is durable; raises its error."""
        if self.step != step:
            raise RuntimeError(f"no background checkpoint write of step {step} here "
                               f"(the newest is of step {self.step})")
        self.wait()
        if self._error is not None:
            raise self._error
        return list(self._records)
