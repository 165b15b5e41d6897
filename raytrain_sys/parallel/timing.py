"""Where a rank's forward and backward went: its own compute, and the exposed wait on the
gradient collectives.

Under DDP the gradient all-reduce overlaps backward: a bucket's all-reduce starts as soon as its
gradients are ready, and backward returns once every bucket's is done. A rank that is slow
reaches its last bucket late, while its peers have already launched theirs and wait in the
reducer for its contribution. So the moment the last bucket was handed to the collective (DDP's
comm hook, which every layout's gradient reduction passes through here) ends this rank's own
compute; what follows until backward returns is the exposed collective wait. The slow rank shows
high compute and little wait, its peers the reverse.

Only ``time.perf_counter`` is read: no extra collective, no device sync. On a GPU the kernels run
asynchronously, so the split says where the host waited (the reducer's wait is where the host
blocks); the sum is still the step's time.

The test-only fault switch (``elastic.fault_slow_rank``) sleeps here too, just before the
gradients are handed over: a rank whose compute took ``c`` seconds takes ``slow_factor x c``,
and its peers wait for it in the collective as they would for a slow node.
"""

from __future__ import annotations

import time

from raytrain_sys.parallel.phases import ALL_REDUCE, PhaseMarker


class StepClock:
    """One rank's forward/backward timer: ``start`` before the first micro-batch,
    ``grads_ready`` each time gradients go to a collective, ``split`` at the end. ``marker``:
    the rank's phase (raytrain_sys.parallel.phases), which ``forward_backward`` and the comm hook
    keep up to date through ``mark``."""

    def __init__(self, slow_factor: float = 1.0, marker: PhaseMarker | None = None):
        self.slow_factor = slow_factor  # test only: > 1 makes this rank's compute that much slower
        self.t0 = 0.0
        self.ready_at: float | None = None
        self.slept = 0.0
        self.marker = marker or PhaseMarker()

    def mark(self, phase: str, index: int = -1, group: tuple | None = None) -> None:
        self.marker.enter(phase, index=index, group=group)

    def start(self) -> None:
        self.t0, self.ready_at, self.slept = time.perf_counter(), None, 0.0

    def grads_ready(self) -> None:
        """Gradients (a DDP bucket, or all of them) are handed to a collective now."""
        now = time.perf_counter()
        if self.slow_factor > 1.0:
            owed = (self.slow_factor - 1.0) * (now - self.t0 - self.slept) - self.slept
            if owed > 0:
                time.sleep(owed)
                self.slept += owed
                now = time.perf_counter()
        self.ready_at = now

    def split(self) -> tuple[float, float]:
        """(compute_s, collective_s) of the forward/backward that began at ``start``. With no
        collective seen (one rank, or a layout whose reductions run inside backward: FSDP), all of
        it is compute."""
        if self.ready_at is None:
            self.grads_ready()
        end = time.perf_counter()
        return self.ready_at - self.t0, end - self.ready_at

    def timed(self, hook, group_ranks: tuple | None = None):
        """DDP comm hook ``hook`` that first marks its bucket's gradients ready; at the last
        bucket the rank's phase becomes the all-reduce (of the process group of ``group_ranks``,
        global ranks; None: every rank): from there on it only waits for its peers."""

        def timed_hook(state, bucket):
            self.grads_ready()
            if bucket.is_last():
                self.mark(ALL_REDUCE, bucket.index(), group_ranks)
            return hook(state, bucket)

        return timed_hook


__all__ = ["StepClock"]
