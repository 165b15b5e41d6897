"""What someone outside a run asks of it: pause, cancel, resize. The job service's runner (and a
notebook holding a Supervisor) writes them; the Supervisor acts on them at its next step boundary.

Owns: the pending requests of one run. Written from any thread (``pause``, ``cancel``,
``resize``), read by the Supervisor's loop only (``stop``, ``max_workers``); a lock guards
both. Holds no Ray object and calls nothing: the Supervisor carries a request out, in its own
order (a stop ends the step loop at the next boundary, a lower ``max_workers`` makes members
leave there as a drain does, with no step lost; a higher one requests workers up to it).

A running lease is looked at every ``policy.BOUNDARY_POLL_S`` and cut short at the end of the
step in flight when a request waits (and nothing is sent ahead across it), so a request is acted
on within that plus about one step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

PAUSE = "pause"  # stop at the next boundary with a checkpoint: resumable from it
CANCEL = "cancel"  # stop at the next boundary; checkpoints kept, none added


@dataclass(frozen=True)
class StopRequest:
    how: str  # PAUSE or CANCEL
    reason: str
    by: str  # who asked: a team, "admin", "scheduler"

    def describe(self) -> str:
        who = f" by {self.by}" if self.by else ""
        return f"{'paused' if self.how == PAUSE else 'cancelled'}{who}: {self.reason}"


class RunRequests:
    """The pending requests of one run (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop: StopRequest | None = None
        self._max_workers: int | None = None
        self._resize_reason = ""

    def pause(self, reason: str, by: str = "") -> None:
        """Stop at the next step boundary with a checkpoint (a cancel already asked for stands)."""
        with self._lock:
            if self._stop is None:
                self._stop = StopRequest(PAUSE, reason, by)

    def cancel(self, reason: str, by: str = "") -> None:
        """Stop at the next step boundary; no checkpoint is added (a pause asked for becomes this)."""
        with self._lock:
            self._stop = StopRequest(CANCEL, reason, by)

    def resize(self, max_workers: int, reason: str = "", by: str = "") -> None:
        """Train on at most ``max_workers`` from the next boundary (never below the run's own
        minimum world: the Supervisor keeps that many)."""
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        with self._lock:
            self._max_workers = int(max_workers)
            self._resize_reason = f"{reason}{f' (by {by})' if by else ''}" if reason or by else ""

    def stop(self) -> StopRequest | None:
        with self._lock:
            return self._stop

    def max_workers(self) -> tuple[int | None, str]:
        """(the asked-for ceiling on the world, or None; why)."""
        with self._lock:
            return self._max_workers, self._resize_reason
