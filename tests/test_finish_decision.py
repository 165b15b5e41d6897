"""How a run's end is recorded (``service/finish.py``), as a pure function: a table of named cases,
one a branch. No Ray, no store. The reconciler carrying the cases out on a store is in
tests/test_service_store.py, on a real cluster in tests/test_service_runner.py."""

from __future__ import annotations

import pytest

from raytrain_sys.service.finish import (NO_RESULT, Cancelled, EndedWhileCancelling, Failed, Finished, Paused,
                                         PausedThenCancelled, finish_decision)
from raytrain_sys.service.model import JobState, RunOutcome, RunnerResult, WaitCause
from raytrain_sys.service.starts import GiveUp

STEP, MAX_RETURNS = 12, 2
ASKED = "paused by a: make room"  # the job's stored reason: the request that is on its way
NOT_PLACED = "the cluster could not hold 2 workers within 60 s (resources.start_timeout_s)"


def result(outcome: RunOutcome, reason: str = "why", error_type: str = "") -> RunnerResult:
    return RunnerResult(outcome, reason, error_type)


FINISHED, STOPPED = result(RunOutcome.FINISHED, "reached max_steps"), result(RunOutcome.STOPPED, "pause asked")
CANCELLED, FAILED = result(RunOutcome.CANCELLED, "cancel asked"), result(RunOutcome.FAILED, "RuntimeError: boom")
UNPLACED = result(RunOutcome.FAILED, NOT_PLACED, "ClusterCapacityError")

# (sentence, job state, the run's end, the job's wait cause and starts given up, the decision)
CASES = [
    ("a run that trained to its end while running has finished",
     JobState.RUNNING, FINISHED, None, 0, Finished("finished at step 12: reached max_steps")),
    ("a start whose run ended before any pass saw it train is recorded running, then finished",
     JobState.STARTING, FINISHED, None, 0, Finished("finished at step 12: reached max_steps", run_unseen=True)),
    ("a run that finished while pausing has finished: the end came before the stop",
     JobState.PAUSING, FINISHED, None, 0, Finished("finished at step 12: reached max_steps")),
    ("a run that finished while cancelling has finished: the end came before the stop",
     JobState.CANCELLING, FINISHED, None, 0, Finished("finished at step 12: reached max_steps")),
    ("a pause that landed is paused, with the pause's reason",
     JobState.PAUSING, STOPPED, None, 0, Paused(f"{ASKED}; stopped at step 12 with a checkpoint")),
    ("a run that stopped while running (its own stop_at_step) is recorded a held pause, then paused",
     JobState.RUNNING, STOPPED, None, 0,
     Paused("stopped at step 12: pause asked; stopped at step 12 with a checkpoint",
            pausing_reason="stopped at step 12: pause asked")),
    ("a resume that stopped before any pass saw it train is recorded running, pausing, then paused",
     JobState.RESUMING, STOPPED, None, 0,
     Paused("stopped at step 12: pause asked; stopped at step 12 with a checkpoint",
            pausing_reason="stopped at step 12: pause asked", run_unseen=True)),
    ("a cancel that came after the pause had landed is cancelled, saying it paused first",
     JobState.CANCELLING, STOPPED, None, 0, PausedThenCancelled(f"{ASKED} (paused at step 12 first)")),
    ("a cancel that landed is cancelled, with the cancel's reason",
     JobState.CANCELLING, CANCELLED, None, 0, Cancelled(f"{ASKED}; stopped at step 12")),
    ("a run cancelled with no cancel recorded is recorded cancelling first, saying why",
     JobState.RUNNING, CANCELLED, None, 0,
     Cancelled("the run was cancelled: cancel asked; stopped at step 12",
               cancelling_reason="the run was cancelled: cancel asked")),
    ("a start whose workers could not be placed goes back to the queue, counted",
     JobState.STARTING, UNPLACED, WaitCause.PLACEMENT, 0,
     GiveUp(JobState.QUEUED, WaitCause.PLACEMENT, f"could not be placed: {NOT_PLACED}; back in the queue "
                                                  f"(1 of 2 returns before it fails)", 1)),
    ("a resume whose workers could not be placed goes back to paused",
     JobState.RESUMING, UNPLACED, WaitCause.RESTORE, 1,
     GiveUp(JobState.PAUSED, WaitCause.PLACEMENT, f"could not be placed: {NOT_PLACED}; back in the queue "
                                                  f"(2 of 2 returns before it fails)", 2)),
    ("a start admitted against capacity being provisioned and not placed keeps provisioning as its cause",
     JobState.STARTING, UNPLACED, WaitCause.PROVISIONING, 0,
     GiveUp(JobState.QUEUED, WaitCause.PROVISIONING, f"could not be placed: {NOT_PLACED}; back in the queue "
                                                     f"(1 of 2 returns before it fails)", 1)),
    ("a start not placed after max_start_returns returns in a row fails, saying so",
     JobState.STARTING, UNPLACED, WaitCause.PLACEMENT, MAX_RETURNS,
     GiveUp(JobState.FAILED, WaitCause.PLACEMENT, f"could not start: could not be placed: {NOT_PLACED}; "
                                                  f"3 starts in a row given up (max_start_returns 2)", 3)),
    ("a running job's run not placed (a restart's group) fails: only a start is given up",
     JobState.RUNNING, UNPLACED, None, 0, Failed(f"failed at step 12: {NOT_PLACED}")),
    ("a run that failed while cancelling is cancelled as asked, saying how it ended",
     JobState.CANCELLING, FAILED, None, 0, EndedWhileCancelling(f"{ASKED}; the run ended failed: RuntimeError: boom")),
    ("a start not placed while cancelling is cancelled, not given up",
     JobState.CANCELLING, UNPLACED, None, 0, EndedWhileCancelling(f"{ASKED}; the run ended failed: {NOT_PLACED}")),
    ("a run that failed is failed, with its error",
     JobState.RUNNING, FAILED, None, 0, Failed("failed at step 12: RuntimeError: boom")),
    ("a run that failed while pausing is failed: no checkpoint was promised",
     JobState.PAUSING, FAILED, None, 0, Failed("failed at step 12: RuntimeError: boom")),
    ("a runner that ended without a result is a failed run",
     JobState.RUNNING, None, None, 0, Failed("failed at step 12: the runner ended without a result")),
    ("a runner that ended without a result while cancelling is cancelled",
     JobState.CANCELLING, None, None, 0,
     EndedWhileCancelling(f"{ASKED}; the run ended failed: the runner ended without a result")),
]


def decide(state: JobState, end, wait_cause=None, start_returns: int = 0):
    return finish_decision(state, end, committed_step=STEP, message=ASKED, wait_cause=wait_cause,
                           start_returns=start_returns, max_start_returns=MAX_RETURNS)


@pytest.mark.parametrize("state, end, wait_cause, start_returns, expected", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_runs_end_is_recorded(state, end, wait_cause, start_returns, expected):
    assert decide(state, end, wait_cause, start_returns) == expected


def test_every_outcome_is_decided_from_every_state_with_a_runner():
    """No state with a runner and no outcome (nor none) falls through: each is one of the cases."""
    cases = (Finished, Paused, PausedThenCancelled, Cancelled, GiveUp, EndedWhileCancelling, Failed)
    for state in (s for s in JobState if s.admitted or s.releasing):
        for end in [None, UNPLACED, *(result(o) for o in RunOutcome)]:
            assert isinstance(decide(state, end), cases), (state, end)


@pytest.mark.parametrize("state", [s for s in JobState if not (s.admitted or s.releasing)],
                         ids=lambda s: f"a job {s.value} has no runner whose end to record")
def test_a_job_without_a_runner_raises(state):
    with pytest.raises(ValueError, match=f"a job {state.value} has no runner"):
        decide(state, FINISHED)


def test_no_result_is_a_failed_run():
    assert NO_RESULT == RunnerResult(RunOutcome.FAILED, "the runner ended without a result", "")
