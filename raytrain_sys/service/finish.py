"""How a run's end is recorded: the reconciler's decision once a job's runner says its Supervisor
has returned (``RunnerStatus.done``).

Owns: ``finish_decision``, from the job as stored (its state, its last reason, its wait cause,
its starts given up in a row) and the run's end (``RunnerResult`` at its committed step) to one
named case that carries the reasons the store records:

===============================  ==================  =============================================
the run's end                    the job (stored)    the case: the job's moves
===============================  ==================  =============================================
finished                         any with a runner   ``Finished``: (running,) finished
stopped                          pausing             ``Paused``: paused
stopped                          starting, running,  ``Paused``: (running,) pausing (held), paused
                                 resuming
stopped                          cancelling          ``PausedThenCancelled``: cancelled
cancelled                        any with a runner   ``Cancelled``: (cancelling,) cancelled
failed: not placed               starting, resuming  ``starts.GiveUp``: back to the queue (a resume:
                                                     paused), or failed after ``max_start_returns``
failed, or no result             cancelling          ``EndedWhileCancelling``: cancelled
failed, or no result             else                ``Failed``: failed
===============================  ==================  =============================================

"(running,)": a start whose run ended before any pass saw it train is recorded running first
(it ran). The end comes first whatever stop was on its way: a run that reached its last step
before a pause or a cancel landed has finished. ``Reconciler._finish`` carries the case out (one
guarded transition a move, then the runner ended); an unknown case raises there. Pure: no Ray, no
store, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from raytrain_sys.errors import ClusterCapacityError
from raytrain_sys.service import starts
from raytrain_sys.service.model import JobState, RunOutcome, RunnerResult, WaitCause

# A runner done without a result (its thread ended without setting one) is a failed run.
NO_RESULT = RunnerResult(RunOutcome.FAILED, "the runner ended without a result")
# The note of a start recorded running at its end: no pass saw it train, and it ran.
RAN_UNSEEN = "its run trained to its end before it was seen running"


@dataclass(frozen=True)
class Finished:
    """The run trained to its end (from pausing or cancelling too: the end came before the stop)."""

    reason: str
    run_unseen: bool = False  # a start: recorded running first (RAN_UNSEEN)


@dataclass(frozen=True)
class Paused:
    """The run stopped at a step boundary with a checkpoint: paused, resumable."""

    reason: str  # the move to paused
    # A stop the job was not pausing for (the run's own ``train.stop_at_step``): first recorded as
    # a pause, held until its team resumes it, with this reason; "" when it was pausing.
    pausing_reason: str = ""
    run_unseen: bool = False  # a start: recorded running first (RAN_UNSEEN)


@dataclass(frozen=True)
class PausedThenCancelled:
    """The run stopped with a checkpoint for a pause, and a cancel came after the pause had
    landed: cancelled, saying it paused first."""

    reason: str


@dataclass(frozen=True)
class Cancelled:
    """The run stopped on a cancel, no checkpoint added."""

    reason: str  # the move to cancelled
    # A cancel the store has not recorded (the run cancelled itself): first moved to cancelling
    # with this reason; "" when the job was cancelling.
    cancelling_reason: str = ""


@dataclass(frozen=True)
class EndedWhileCancelling:
    """The run failed on its own while a cancel was on its way: cancelled as asked, saying how
    the run ended."""

    reason: str


@dataclass(frozen=True)
class Failed:
    reason: str


FinishDecision = Union[Finished, Paused, PausedThenCancelled, Cancelled, starts.GiveUp, EndedWhileCancelling, Failed]


def finish_decision(state: JobState, result: Optional[RunnerResult], *, committed_step: int, message: str,
                    wait_cause: Optional[WaitCause], start_returns: int, max_start_returns: int) -> FinishDecision:
    """How to record the end of the run of a job in ``state`` (one with a runner), whose stored
    reason is ``message``: see the module's table. ``result`` None: the runner ended without
    one, a failed run. ``wait_cause`` and ``start_returns`` (the job's) matter to a start not
    placed: ``provisioning`` stays its cause (its nodes did not come), any other is
    ``placement``; the start counts as given up (``starts.give_up``)."""
    if not (state.admitted or state.releasing):
        raise ValueError(f"a job {state.value} has no runner whose end to record")
    result = result or NO_RESULT
    outcome, why, at = result.outcome, result.reason, f"at step {committed_step}"
    starting = state in (JobState.STARTING, JobState.RESUMING)
    if outcome is RunOutcome.FINISHED:
        return Finished(f"finished {at}: {why}", run_unseen=starting)
    if outcome is RunOutcome.STOPPED:
        if state is JobState.CANCELLING:  # a cancel that came after the pause had landed
            return PausedThenCancelled(f"{message} (paused {at} first)")
        if state is JobState.PAUSING:
            return Paused(f"{message}; stopped {at} with a checkpoint")
        pausing = f"stopped {at}: {why}"
        return Paused(f"{pausing}; stopped {at} with a checkpoint", pausing_reason=pausing, run_unseen=starting)
    if outcome is RunOutcome.CANCELLED:
        if state is JobState.CANCELLING:
            return Cancelled(f"{message}; stopped {at}")
        cancelling = f"the run was cancelled: {why}"
        return Cancelled(f"{cancelling}; stopped {at}", cancelling_reason=cancelling)
    if outcome is not RunOutcome.FAILED:
        raise ValueError(f"unknown run outcome {outcome!r}")
    if result.error_type == ClusterCapacityError.__name__ and starting:
        cause = WaitCause.PROVISIONING if wait_cause is WaitCause.PROVISIONING else WaitCause.PLACEMENT
        return starts.give_up(state, start_returns, cause, f"could not be placed: {why}", max_start_returns)
    if state is JobState.CANCELLING:
        return EndedWhileCancelling(f"{message}; the run ended {outcome.value}: {why}")
    return Failed(f"failed {at}: {why}")


__all__ = ["Finished", "Paused", "PausedThenCancelled", "Cancelled", "EndedWhileCancelling", "Failed",
           "FinishDecision", "finish_decision", "NO_RESULT", "RAN_UNSEEN"]
