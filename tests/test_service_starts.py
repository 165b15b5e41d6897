"""A start's wait reason and when it is given up (``service/starts.py``), as a pure function: a
table of named cases. No Ray, no store. The reconciler carrying them out on a real cluster is in
tests/test_service_runner.py."""

from __future__ import annotations

import dataclasses

import pytest

from raytrain_sys.service.model import JobState, WaitCause
from raytrain_sys.service.starts import (BOUNDED, NO_ANSWER, STEP_CAUSES, GiveUp, Starting, StartView,
                                         admitted_reason, give_up, step_reason, watch_start)

STALL_S, MAX_RETURNS, NOW = 60.0, 2, 1000.0


def view(cause=None, since=None, state=JobState.STARTING, returns=0, reason=None) -> StartView:
    return StartView(state=state, workers=2, checkpoint_step=5, cause=cause, reason=reason,
                     since_s=since, start_returns=returns)


CASES = [
    ("a runner that has not answered yet, with nothing stored: its runner is starting",
     view(), None, Starting(WaitCause.RUNNER_START, NO_ANSWER)),
    ("a runner that does not answer this pass: the stored reason stands",
     view(WaitCause.PLACEMENT, NOW - 10, reason="waiting for ..."), None,
     Starting(WaitCause.PLACEMENT, "waiting for ...")),
    ("a start in placement under the bound goes on",
     view(WaitCause.PLACEMENT, NOW - STALL_S + 1), "placement",
     Starting(WaitCause.PLACEMENT, "waiting for the cluster to place its 2 workers: Ray has not found room for "
                                   "them yet")),
    ("a start that moved to another step is not given up, however long the previous one took",
     view(WaitCause.PLACEMENT, NOW - 10 * STALL_S), "workers",
     Starting(WaitCause.WORKER_START, "its 2 workers are placed and starting: worker processes, the MLflow run, "
                                      "the process group, the first batch")),
    ("a restore is never given up here: loading a checkpoint is the run's own work",
     view(WaitCause.RESTORE, NOW - 10 * STALL_S, state=JobState.RESUMING), "restore",
     Starting(WaitCause.RESTORE, "loading its checkpoint at step 5")),
    ("a later start says which of its allowed starts it is",
     view(WaitCause.RUNNER_START, NOW, returns=1), "preparing",
     Starting(WaitCause.RUN_START, "the run is preparing: pre-flight checks, the Ray connection, its first data "
                                   "reads (start 2 of at most 3)")),
]


@pytest.mark.parametrize("start, step, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_start_that_goes_on(start, step, expected):
    assert watch_start(start, step, NOW, STALL_S, MAX_RETURNS) == expected


GIVE_UPS = [
    ("workers not placed for the bound: back to the queue with the placement reason",
     view(WaitCause.PLACEMENT, NOW - STALL_S), "placement", JobState.QUEUED, WaitCause.PLACEMENT, 1),
    ("a resume not placed for the bound goes back to paused (it resumes from its checkpoint later)",
     view(WaitCause.PLACEMENT, NOW - STALL_S, state=JobState.RESUMING), "placement", JobState.PAUSED,
     WaitCause.PLACEMENT, 1),
    ("a runner that never answered for the bound: back to the queue with the runner-start reason",
     view(WaitCause.RUNNER_START, NOW - STALL_S, reason="admitted on 2 workers: its runner is starting"), None,
     JobState.QUEUED, WaitCause.RUNNER_START, 1),
    ("the last allowed start given up fails the job: it never bounces forever",
     view(WaitCause.WORKER_START, NOW - STALL_S, returns=MAX_RETURNS), "workers", JobState.FAILED,
     WaitCause.WORKER_START, MAX_RETURNS + 1),
]


@pytest.mark.parametrize("start, step, to, cause, returns", [c[1:] for c in GIVE_UPS], ids=[c[0] for c in GIVE_UPS])
def test_a_start_given_up(start, step, to, cause, returns):
    outcome = watch_start(start, step, NOW, STALL_S, MAX_RETURNS)
    assert isinstance(outcome, GiveUp) and (outcome.to, outcome.cause, outcome.start_returns) == (to, cause, returns)
    assert f"no progress for {STALL_S:g} s (start_stall_s)" in outcome.reason
    if to is JobState.FAILED:
        assert outcome.reason.startswith("could not start: ")
        assert f"{returns} starts in a row given up (max_start_returns {MAX_RETURNS})" in outcome.reason
    else:
        assert outcome.reason.endswith(f"back in the queue ({returns} of {MAX_RETURNS} returns before it fails)")


def test_a_start_the_run_abandoned_counts_the_same_way():
    """The run's own placement bound (resources.start_timeout_s): finish_decision's give_up."""
    why = "could not be placed: the cluster could not hold 2 workers within 3 s"
    first = give_up(JobState.STARTING, 0, WaitCause.PLACEMENT, why, MAX_RETURNS)
    assert (first.to, first.start_returns) == (JobState.QUEUED, 1) and first.reason.startswith(why)
    last = give_up(JobState.STARTING, MAX_RETURNS, WaitCause.PLACEMENT, why, MAX_RETURNS)
    assert last.to is JobState.FAILED and last.reason.startswith(f"could not start: {why}")


def test_every_step_has_a_cause_and_a_sentence_without_a_clock():
    """A reason is written only when it changes: no step's sentence may change with time alone."""
    assert set(STEP_CAUSES.values()) - {WaitCause.RESTORE} == BOUNDED
    for step in STEP_CAUSES:
        first = step_reason(step, view(), MAX_RETURNS)
        assert first == step_reason(step, dataclasses.replace(view(), since_s=NOW), MAX_RETURNS)
        assert first.cause is STEP_CAUSES[step] and first.reason
    with pytest.raises(ValueError, match="unknown start step 'warming'"):
        step_reason("warming", view(), MAX_RETURNS)


def test_a_start_admitted_against_capacity_being_provisioned_waits_its_own_bound():
    """Autoscaling: from its admission until its workers are placed the start shows
    provisioning, bounded by provisioning_timeout_s (not start_stall_s); once placed, the usual
    steps and bound again."""
    timeout = 900.0
    reason = admitted_reason(2, timeout)
    start = dataclasses.replace(view(), cause=WaitCause.PROVISIONING, reason=reason, since_s=NOW)
    assert reason.startswith("admitted on 2 workers against capacity being provisioned") and "15 min" in reason
    for step in (None, "supervisor", "preparing", "placement"):
        later = watch_start(start, step, NOW + STALL_S * 3, STALL_S, MAX_RETURNS, timeout)
        assert later == Starting(WaitCause.PROVISIONING, reason), step  # past start_stall_s, still waiting
    gone = watch_start(start, "placement", NOW + timeout, STALL_S, MAX_RETURNS, timeout)
    assert isinstance(gone, GiveUp) and gone.to is JobState.QUEUED
    assert gone.reason.startswith(f"{reason}: its nodes did not come for {timeout:g} s (provisioning_timeout_s)")
    placed = watch_start(start, "workers", NOW + 1, STALL_S, MAX_RETURNS, timeout)
    assert placed.cause is WaitCause.WORKER_START
