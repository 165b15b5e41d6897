"""Ray Data streams that close without cancelling a running task.

The data plane closes a stream early on every seek (a failure, a resize, a skipped bad shard) and
at the end of a run. Ray Data's iterator then shuts its executor down with ``force=True``, which
cancels the map tasks still running. In Ray 2.60 a cancel that meets the task's reply in flight
kills the calling process on a Ray core check ("Tried to complete task that was not pending",
the cancel-vs-reply race of ray-project/ray PRs 54527 and 54798): for us, the training driver.
It struck about once in three runs of our test suite.

So before the executor is shut down, it is quiesced: a back-pressure gate stops it from starting
new tasks, and the tasks already running (a chunk read is a fraction of a second) are waited for.
The shutdown that follows finds nothing to cancel. Should Ray's internals differ from what this
expects (another Ray version), the stock shutdown runs as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

log = logging.getLogger(__name__)

# Longest wait for running reads before the stock shutdown cancels them anyway.
QUIESCE_TIMEOUT_S = 10.0


def iter_blocks_closing_quietly(ds, **iter_batches_kwargs) -> Iterator[Any]:
    """``ds.iter_batches(**kwargs)``, whose close waits for running tasks instead of cancelling them."""
    it = ds.iterator()
    stock_end = it._on_iteration_end

    def on_iteration_end(executor) -> None:
        try:
            if executor is not None:
                quiesce(executor)
        except Exception as exc:  # internals changed: fall back to Ray's own shutdown
            log.debug("could not quiesce a Ray Data executor before shutdown: %s", exc)
        stock_end(executor)

    it._on_iteration_end = on_iteration_end
    return iter(it.iter_batches(**iter_batches_kwargs))


def quiesce(executor, timeout_s: float = QUIESCE_TIMEOUT_S) -> int:
    """Stop ``executor`` from starting tasks and wait for the running ones. Returns how many
    were waited for."""
    import ray
    from ray.data._internal.execution.backpressure_policy.backpressure_policy import BackpressurePolicy

    class _Closed(BackpressurePolicy):
        def __init__(self):  # no state: it refuses every operator
            pass

        def can_add_input(self, op) -> bool:
            return False

    # Appending is safe against the scheduling thread: it iterates the list each step and takes
    # the operator's new input only if every policy agrees. (Ray Data's liveness rule may still
    # start one task while its output queue is empty; the loop below waits for that one too.)
    executor._backpressure_policies.append(_Closed())
    deadline = time.monotonic() + timeout_s
    finished: set = set()
    while time.monotonic() < deadline:
        # A read is a streaming-generator task: its own return ref is ready when the task has
        # ended, whether or not the executor has taken its block yet (it no longer will).
        running = [ref for ref in _running_tasks(executor) if ref not in finished]
        if not running:
            return len(finished)
        ready, _ = ray.wait(running, num_returns=len(running),
                            timeout=max(0.0, deadline - time.monotonic()), fetch_local=False)
        finished.update(ready)
    log.warning("Ray Data reads still running after %.0f s; closing the stream cancels them",
                timeout_s)
    return len(finished)


def _running_tasks(executor) -> list:
    """The return refs of the executor's active tasks (an ObjectRefGenerator's own task ref)."""
    for _ in range(100):
        try:  # the scheduling thread may change an operator's task table while it is listed
            waitables = [t.get_waitable() for op in list(executor._topology)
                         for t in op.get_active_tasks()]
            return [getattr(w, "_generator_ref", w) for w in waitables]
        except RuntimeError:
            time.sleep(0.001)
    raise RuntimeError("the executor's task table kept changing")
