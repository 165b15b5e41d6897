"""Where a rank is in its step: the phase marker its training thread keeps and its control path
reads (``TrainWorker.phase``), without the training thread.

A rank hung in a step and the ranks waiting on it look alike from outside: every one alive,
answering pings, none progressing. What tells them apart is where each one is: the waiting ones
inside the collective that the hung one never reached (or skipped). So each rank keeps, cheaply,
the phase of the step it is in and since when, and the Supervisor reads it at the step's
deadline (``liveness.find_hung``).

A marker is one tuple replaced whole (one attribute store, atomic under the GIL: no lock), so
a reader on another thread sees the phase before or the phase after, never half of one; a
write costs 0.13-0.18 us (timeit), about eight a step. The training thread writes the phases of
``train_step`` and of ``ParallelModel.forward_backward``; DDP's comm hook (``StepClock.timed``)
writes the all-reduce once the last bucket is handed over (after that the rank only waits). Not
marked: the collectives inside a layout's own forward and backward (FSDP's all-gathers and
reduce-scatters, tensor parallel's), and a pipeline schedule's sends and receives, which run
inside ``forward`` here: a rank blocked there looks like a rank computing.
"""

from __future__ import annotations

import threading
import time

from raytrain_sys.stacks import stacks  # noqa: F401 (its callers read the stacks from here)

IDLE = "idle"  # between leases (waiting for the next call, or its arguments)
DATA = "data"  # its rows assembled from the pieces
FORWARD = "forward"  # task.loss_sum on a micro-batch: the model's forward and the user's loss
BACKWARD = "backward"
ALL_REDUCE = "all-reduce"  # the gradients' all-reduce, once the last bucket is handed over
OPTIMIZER = "optimizer"  # clipping and the optimizer's step
COPY = "copy"  # waiting for the peer copy of the state (checkpoint.peer_copies) to be whole
AGREEMENT = "agreement"  # the step's all-gather over the whole group (TrainWorker._agree)
CONFIRM = "confirm"  # a lease's end: every rank's copy confirmed (one all-reduce)
EVALUATION = "evaluation"

# The order of the phases within a step: of two collectives that ranks wait in, the earlier one
# is the one that must complete first.
ORDER = {IDLE: -1, DATA: 0, FORWARD: 1, BACKWARD: 2, ALL_REDUCE: 3, OPTIMIZER: 4, COPY: 5, AGREEMENT: 6,
         CONFIRM: 7, EVALUATION: 8}
# A rank in one of these waits for its peers.
IN_COLLECTIVE = frozenset({ALL_REDUCE, COPY, AGREEMENT, CONFIRM})

WHAT = {IDLE: "waiting for its next lease", DATA: "assembling its rows", FORWARD: "the forward and loss (task.loss_sum)",
        BACKWARD: "the backward", ALL_REDUCE: "the gradients' all-reduce", OPTIMIZER: "the optimizer step",
        COPY: "the peer copy of its state", AGREEMENT: "the step's agreement (all-gather)",
        CONFIRM: "the lease's copies confirmed (all-reduce)", EVALUATION: "an evaluation"}


class PhaseMarker:
    """One rank's phase: ``now`` is (phase, step, index, since_unix_s, group), ``step`` the step
    run (the committed steps it starts from), ``index`` the micro-batch (forward, backward) or
    the last bucket (all-reduce), ``group`` the global ranks of the collective's process group
    (None: every rank). ``thread``: the training thread's id, whose stack is the one that
    matters (``stacks``)."""

    def __init__(self) -> None:
        self.now: tuple = (IDLE, -1, -1, time.time(), None)
        self.thread = 0

    def enter(self, phase: str, step: int | None = None, index: int = -1, group: tuple | None = None) -> None:
        self.now = (phase, self.now[1] if step is None else step, index, time.time(), group)

    def start_step(self, step: int) -> None:
        """A step begins on the calling thread (the training thread)."""
        self.thread = threading.get_ident()
        self.enter(DATA, step)

    def read(self) -> dict:
        phase, step, index, since, group = self.now
        return {"phase": phase, "step": step, "index": index, "since_unix_s": since,
                "group": list(group) if group is not None else None}


def describe(phase: dict) -> str:
    """``phase`` (``PhaseMarker.read``) in words: "the gradients' all-reduce (bucket 0) of step 20"."""
    name, index = phase["phase"], phase.get("index", -1)
    what = WHAT.get(name, name)
    if name == ALL_REDUCE and index >= 0:
        what += f" (bucket {index})"
    elif name in (FORWARD, BACKWARD) and index > 0:
        what += f" (micro-batch {index + 1})"
    return what if name == IDLE else f"{what} of step {phase['step'] + 1}"
