"""The service scheduler as a pure function: a table of named cases, multi-pass scenarios that
feed each pass's actions back as the runner would, and properties over random snapshots.

No Ray, no database: ``decide(snapshot, now_s)`` only.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raytrain_sys.errors import ServiceInputError
from raytrain_sys.service.flavors import FlavorState, ResourceFlavor, WorkerShape
from raytrain_sys.service.model import JobState, TransitionNotAllowed, WaitCause
from raytrain_sys.service.scheduler.actions import Admit, Grow, Pause, Shrink, Wait
from raytrain_sys.service.scheduler.snapshot import JobView, Policy, Snapshot
from raytrain_sys.service.teams import FlavorQuota, Team
from raytrain_sys.service.scheduler import (FlavorQuotas, Quotas, admission_order, decide, never_fits_reason,
                                            team_ceiling_workers)

NOW = 10_000.0


def team(name, nominal, cohort="c", borrow=None, lend=None, weight=1.0) -> Team:
    return Team(name, nominal, cohort=cohort, borrowing_limit_workers=borrow, lending_limit_workers=lend,
                weight=weight)


def running(id, team, workers, min=None, max=None, priority=0, checkpoint_age_s=60.0, submitted=0.0,
            target=None) -> JobView:
    lo = workers if min is None else min
    hi = workers if max is None else max
    return JobView(id=id, team=team, priority=priority, state=JobState.RUNNING, min_workers=lo, max_workers=hi,
                   elastic=hi > lo, workers=workers, target_workers=workers if target is None else target,
                   submitted_at_s=submitted, started_at_s=0.0, last_checkpoint_at_s=NOW - checkpoint_age_s)


def queued(id, team, min, max=None, priority=0, submitted=NOW - 1, state=JobState.QUEUED, held=False) -> JobView:
    hi = min if max is None else max
    return JobView(id=id, team=team, priority=priority, state=state, min_workers=min, max_workers=hi,
                   elastic=hi > min, submitted_at_s=submitted, held=held)


def summary(actions) -> list[tuple]:
    """What a case compares: kind, job and size of each action, and a wait's cause (reasons are
    checked apart)."""
    out = []
    for a in actions:
        size = {Admit: "workers", Grow: "to_workers", Shrink: "to_workers"}.get(type(a))
        detail = (getattr(a, size),) if size else (a.cause.value,) if isinstance(a, Wait) else ()
        out.append((type(a).__name__, a.job_id) + detail)
    return out


AB = [team("a", 2), team("b", 2)]

CASES = [
    ("an elastic job grows into its cohort's idle quota, borrowing beyond its nominal",
     Snapshot(AB, [running(1, "a", 2, min=1, max=4)], cluster_workers=4),
     [("Grow", 1, 4)]),
    ("a queued elastic job is admitted at its min and grown into idle workers in the same pass",
     Snapshot(AB, [queued(1, "a", 2, max=3)], cluster_workers=4),
     [("Admit", 1, 3)]),
    ("gang admission: a job waits when its min_workers do not fit, and nothing smaller starts in its place",
     Snapshot([team("a", 4)], [running(1, "a", 3, priority=5), queued(2, "a", 2)], cluster_workers=4),
     [("Wait", 2, "team_quota")]),
    ("best-effort FIFO: a smaller job behind a blocked one starts",
     Snapshot([team("a", 4)], [running(1, "a", 3, priority=5), queued(2, "a", 2, submitted=1.0),
                               queued(3, "a", 1, submitted=2.0)], cluster_workers=4),
     [("Admit", 3, 1), ("Wait", 2, "team_quota")]),
    ("a higher-priority job pauses the lower-priority job with the least work at risk",
     Snapshot([team("a", 4)], [running(1, "a", 2, checkpoint_age_s=100.0), running(2, "a", 2, checkpoint_age_s=10.0),
                               queued(3, "a", 2, priority=10)], cluster_workers=4),
     [("Pause", 2), ("Wait", 3, "releasing")]),
    ("work at risk counts workers too: one worker 100 s behind loses less than four workers 30 s behind",
     Snapshot([team("a", 5)], [running(1, "a", 4, checkpoint_age_s=30.0), running(2, "a", 1, checkpoint_age_s=100.0),
                               queued(3, "a", 1, priority=10)], cluster_workers=5),
     [("Pause", 2), ("Wait", 3, "releasing")]),
    ("shrinking an elastic job is preferred over pausing, even a job with less work at risk",
     Snapshot([team("a", 4)], [running(1, "a", 3, min=1, max=4), running(2, "a", 1, checkpoint_age_s=1.0),
                               queued(3, "a", 2, priority=10)], cluster_workers=4),
     [("Shrink", 1, 1), ("Wait", 3, "releasing")]),
    ("a shrink never goes below the job's min_workers: the rest comes from a pause",
     Snapshot([team("a", 4)], [running(1, "a", 3, min=2, max=4), running(2, "a", 1),
                               queued(3, "a", 2, priority=10)], cluster_workers=4),
     [("Shrink", 1, 2), ("Pause", 2), ("Wait", 3, "releasing")]),
    ("an equal-priority running job is never paused for a waiting one",
     Snapshot([team("a", 4)], [running(1, "a", 2, priority=5), running(2, "a", 2, priority=5),
                               queued(3, "a", 2, priority=5)], cluster_workers=4),
     [("Wait", 3, "team_quota")]),
    ("a higher-priority running job is never paused or shrunk for a lower-priority one",
     Snapshot([team("a", 4)], [running(1, "a", 4, min=2, max=4, priority=9), queued(2, "a", 2, priority=1)],
              cluster_workers=4),
     [("Wait", 2, "team_quota")]),
    ("a team within its nominal quota takes its quota back: the borrower is paused whatever its priority",
     Snapshot(AB, [running(1, "a", 4, priority=10), queued(2, "b", 2)], cluster_workers=4),
     [("Pause", 1), ("Wait", 2, "releasing")]),
    ("a high-priority job preempts within its own team, never another team's job within its nominal quota",
     Snapshot(AB, [running(1, "a", 2), running(2, "b", 2), queued(3, "b", 2, priority=9)], cluster_workers=4),
     [("Pause", 2), ("Wait", 3, "releasing")]),
    ("a team over its nominal quota cannot preempt another team's equal-priority borrowed job",
     Snapshot([team("a", 2), team("b", 2), team("c", 2)],
              [running(1, "a", 4), running(2, "b", 2), queued(3, "b", 2)], cluster_workers=6),
     [("Wait", 3, "cohort")]),
    ("the lending limit is respected: a team lends only that much of its unused quota",
     Snapshot([team("a", 2), team("b", 2, lend=1)], [running(1, "a", 2, min=1, max=4)], cluster_workers=4),
     [("Grow", 1, 3)]),
    ("the borrowing limit is respected: a team borrows no more than its limit",
     Snapshot([team("a", 2, borrow=1), team("b", 2)], [running(1, "a", 2, min=1, max=4)], cluster_workers=4),
     [("Grow", 1, 3)]),
    ("a team without a cohort neither borrows nor lends",
     Snapshot([team("a", 2, cohort=None), team("b", 2, cohort=None)], [running(1, "a", 2, min=1, max=4)],
              cluster_workers=4),
     []),
    ("the cluster's size bounds growth even when quotas would allow more",
     Snapshot(AB, [running(1, "a", 2, min=1, max=4)], cluster_workers=3),
     [("Grow", 1, 3)]),
    ("fair share: of two equal jobs, the team borrowing less is admitted first",
     Snapshot([team("a", 1), team("b", 1), team("lender", 4)],
              [running(1, "a", 3), queued(2, "a", 1, submitted=NOW - 2), queued(3, "b", 1, submitted=NOW - 1)],
              cluster_workers=4),
     [("Admit", 3, 1), ("Wait", 2, "cluster_capacity")]),
    ("weighted fair share: a team of weight 3 borrowing 2 goes before a team of weight 1 borrowing 1",
     Snapshot([team("a", 1, weight=3.0), team("b", 1), team("lender", 6)],
              [running(1, "a", 3), running(2, "b", 2), queued(3, "b", 1, submitted=NOW - 2),
               queued(4, "a", 1, submitted=NOW - 1)], cluster_workers=6),
     [("Admit", 4, 1), ("Wait", 3, "cluster_capacity")]),
    ("a shrink in flight is waited for, not repeated",
     Snapshot(AB, [running(1, "a", 4, min=1, max=4, target=2), queued(2, "b", 2)], cluster_workers=4),
     [("Wait", 2, "releasing")]),
    ("a pause in flight is waited for: its workers are claimed, nothing else is preempted",
     Snapshot([team("a", 4)], [dataclasses.replace(running(1, "a", 2), state=JobState.PAUSING),
                               running(2, "a", 2), queued(3, "a", 2, priority=9)], cluster_workers=4),
     [("Wait", 3, "releasing")]),
    ("a paused job is admitted again (resumes from its checkpoint) when workers are free",
     Snapshot([team("a", 4)], [queued(1, "a", 2, state=JobState.PAUSED)], cluster_workers=4),
     [("Admit", 1, 2)]),
    ("a job its team holds waits, whatever is free",
     Snapshot([team("a", 4)], [queued(1, "a", 2, held=True)], cluster_workers=4),
     [("Wait", 1, "held")]),
    ("a job larger than its team could ever get waits and says so",
     Snapshot(AB, [queued(1, "a", 5)], cluster_workers=8),
     [("Wait", 1, "never_fits")]),
    ("a job of an unknown team waits and says so",
     Snapshot(AB, [queued(1, "z", 1)], cluster_workers=4),
     [("Wait", 1, "unknown_team")]),
    ("a job that waited past reserve_after_s keeps the free workers: nothing behind it starts or grows",
     Snapshot([team("a", 8)], [running(1, "a", 2, min=1, max=3, priority=5), queued(2, "a", 3, submitted=0.0),
                               queued(3, "a", 1, submitted=NOW - 1)], cluster_workers=4),
     [("Wait", 2, "cluster_capacity"), ("Wait", 3, "reserved")]),
    # Why a job waits, one cause a case (the scheduler's WaitCause; the cases above assert theirs too).
    ("team quota: a job past its team's borrowing limit waits on the team's quota, though the cohort has room",
     Snapshot([team("a", 2, borrow=1), team("b", 4)], [running(1, "a", 3), queued(2, "a", 1)], cluster_workers=8),
     [("Wait", 2, "team_quota")]),
    ("team quota: a team alone in its cohort has nobody to borrow from",
     Snapshot([team("a", 2, cohort=None)], [running(1, "a", 2), queued(2, "a", 1)], cluster_workers=8),
     [("Wait", 2, "team_quota")]),
    ("cohort: a job within its nominal quota waits while another team's growing job borrows it",
     Snapshot(AB, [running(1, "b", 3, min=1, max=4, target=4), queued(2, "a", 2)], cluster_workers=8),
     [("Wait", 2, "cohort")]),
    ("cluster capacity: the quota allows it, the cluster has no free worker, the running job outranks it",
     Snapshot([team("a", 4)], [running(1, "a", 2, priority=9), queued(2, "a", 2)], cluster_workers=2),
     [("Wait", 2, "cluster_capacity")]),
]


@pytest.mark.parametrize("snapshot, expected", [(s, e) for _, s, e in CASES], ids=[name for name, _, _ in CASES])
def test_decide(snapshot, expected):
    actions = decide(snapshot, NOW)
    assert summary(actions) == expected, "\n".join(str(a) for a in actions)
    assert all(a.reason.strip() for a in actions)


def trial(job: JobView, sweep: int, rung: int = 0) -> JobView:
    """``job`` as a trial of sweep ``sweep`` that passed ``rung`` rungs."""
    return dataclasses.replace(job, group=sweep, rung=rung)


GROUP_CASES = [
    ("a sweep's cap holds its trials: the next trial waits though the cluster is free, a job of its own starts",
     Snapshot([team("a", 8)], [trial(running(1, "a", 2), 7), trial(running(2, "a", 2), 7),
                               trial(queued(3, "a", 1), 7), queued(4, "a", 1)], cluster_workers=8,
              group_limits=((7, 4),)),
     [("Admit", 4, 1), ("Wait", 3, "sweep_cap")]),
    ("growth stops at the sweep's cap",
     Snapshot([team("a", 8)], [trial(running(1, "a", 1, min=1, max=4), 7)], cluster_workers=8,
              group_limits=((7, 2),)),
     [("Grow", 1, 2)]),
    ("a stopped trial's workers go to the next trial under the cap",
     Snapshot([team("a", 8)], [trial(running(1, "a", 2), 7), trial(queued(2, "a", 2), 7)], cluster_workers=8,
              group_limits=((7, 4),)),
     [("Admit", 2, 2)]),
    ("the trial that passed more rungs takes the idle worker first",
     Snapshot([team("a", 8)], [trial(running(1, "a", 1, min=1, max=3), 7), trial(running(2, "a", 1, min=1, max=3), 7, rung=1)],
              cluster_workers=3),
     [("Grow", 2, 2)]),
    ("a trial blocked by its sweep's cap reclaims nothing, whatever its priority",
     Snapshot([team("a", 8)], [trial(running(1, "a", 2), 7), trial(queued(2, "a", 1, priority=10), 7)],
              cluster_workers=2, group_limits=((7, 2),)),
     [("Wait", 2, "sweep_cap")]),
    ("a sweep without a cap is scheduled as any jobs are",
     Snapshot([team("a", 8)], [trial(running(1, "a", 2), 7), trial(queued(2, "a", 2, max=6), 7)], cluster_workers=8,
              group_limits=((9, 1),)),
     [("Admit", 2, 6)]),
]


@pytest.mark.parametrize("snapshot, expected", [(s, e) for _, s, e in GROUP_CASES],
                         ids=[name for name, _, _ in GROUP_CASES])
def test_decide_with_a_sweeps_cap(snapshot, expected):
    actions = decide(snapshot, NOW)
    assert summary(actions) == expected, "\n".join(str(a) for a in actions)
    assert all(a.reason.strip() for a in actions)


def test_a_waits_sentence_opens_with_its_cause():
    by_case = {name: decide(snapshot, NOW) for name, snapshot, _ in CASES}
    openings = {"team_quota": "over its team's quota: ", "cohort": "its cohort has no quota to lend it now: ",
                "cluster_capacity": "the cluster is full: ", "held": "held by its team", "never_fits": "can never start",
                "unknown_team": "unknown team", "reserved": "the free workers are kept for job",
                "releasing": ""}  # "2 workers are being released/reclaimed for it"
    seen = set()
    for name, actions in by_case.items():
        for wait in (a for a in actions if isinstance(a, Wait)):
            seen.add(wait.cause)
            assert wait.reason.startswith(openings[wait.cause.value]), (name, wait)
            assert str(wait).startswith(f"job {wait.job_id} waits ({wait.cause.value}): ")
    assert seen == {c for c in WaitCause if c.value in openings}, "a scheduler cause no named case shows"


def test_the_reasons_say_why():
    actions = decide(CASES[6][1], NOW)  # shrink preferred over pause
    shrink, wait = actions
    assert "loses no work" in shrink.reason and "outranks" in shrink.reason
    assert "shrink of job 1" in wait.reason
    [wait] = decide(Snapshot(AB, [queued(1, "a", 5)], cluster_workers=8), NOW)
    assert "can never start" in wait.reason and "could ever get: 4" in wait.reason
    [pause, _] = decide(CASES[4][1], NOW)
    assert pause.work_at_risk_worker_s == pytest.approx(20.0) and "least work at risk" in pause.reason


def apply(snapshot: Snapshot, actions, *, drained: bool) -> Snapshot:
    """What the runner does with a pass's actions: admitted jobs run; grows land at once; shrinks
    and pauses land only once ``drained`` (the next step boundary)."""
    by_id = {j.id: j for j in snapshot.jobs}
    for a in actions:
        job = by_id[a.job_id]
        if isinstance(a, Admit):
            by_id[a.job_id] = dataclasses.replace(job, state=JobState.RUNNING, workers=a.workers,
                                                  target_workers=a.workers, started_at_s=NOW)
        elif isinstance(a, Grow):
            by_id[a.job_id] = dataclasses.replace(job, workers=a.to_workers, target_workers=a.to_workers)
        elif isinstance(a, Shrink):
            by_id[a.job_id] = dataclasses.replace(job, target_workers=a.to_workers)
        elif isinstance(a, Pause):
            by_id[a.job_id] = dataclasses.replace(job, state=JobState.PAUSING, target_workers=0)
    if drained:
        for id, job in list(by_id.items()):
            if job.state is JobState.PAUSING:
                by_id[id] = dataclasses.replace(job, state=JobState.PAUSED, workers=0, target_workers=0,
                                                waiting_since_s=NOW)
            elif job.workers > job.target_workers:
                by_id[id] = dataclasses.replace(job, workers=job.target_workers)
    return dataclasses.replace(snapshot, jobs=tuple(by_id.values()))


def stopping(id, team, workers, state=JobState.CANCELLING, priority=0) -> JobView:
    """A job whose pause or cancel was asked: still holding ``workers`` until its run lets them go."""
    return dataclasses.replace(running(id, team, workers, priority=priority), state=state)


RELEASED_CASES = [
    ("a cancelled job whose run let its workers go: the queued job starts in this pass, not after the run's end",
     Snapshot([team("a", 2)], [stopping(1, "a", 2), queued(2, "a", 2)], cluster_workers=2), {1},
     [("Admit", 2, 2)]),
    ("a paused job whose run let its workers go: the same",
     Snapshot([team("a", 2)], [stopping(1, "a", 2, state=JobState.PAUSING), queued(2, "a", 2)], cluster_workers=2),
     {1}, [("Admit", 2, 2)]),
    ("a job that finished and let its workers go (its run still closing): the next job starts on them and "
     "its team's quota",
     Snapshot([team("a", 2)], [running(1, "a", 2, priority=9), queued(2, "a", 2)], cluster_workers=2), {1},
     [("Admit", 2, 2)]),
    ("a finished elastic job whose run let its workers go is not grown into what it freed",
     Snapshot([team("a", 4)], [running(1, "a", 2, min=1, max=4)], cluster_workers=4), {1}, []),
    ("a stopping job whose run still holds its workers: the queued job waits for them",
     Snapshot([team("a", 2)], [stopping(1, "a", 2), queued(2, "a", 2)], cluster_workers=2), set(),
     [("Wait", 2, "releasing")]),
    ("only what the released job held is handed on: a second stopping job still holds its own",
     Snapshot([team("a", 4)], [stopping(1, "a", 2), stopping(3, "a", 2), queued(2, "a", 3)], cluster_workers=4),
     {1}, [("Wait", 2, "releasing")]),
    ("a sweep's finished trial no longer counts against the sweep's cap",
     Snapshot([team("a", 8)], [trial(running(1, "a", 2), 7), trial(queued(2, "a", 2), 7)], cluster_workers=8,
              group_limits=((7, 2),)), {1}, [("Admit", 2, 2)]),
]


@pytest.mark.parametrize("snapshot, released, expected", [(s, r, e) for _, s, r, e in RELEASED_CASES],
                         ids=[name for name, *_ in RELEASED_CASES])
def test_decide_on_workers_released_by_stopping_runs(snapshot, released, expected):
    assert summary(decide(snapshot.released(released), NOW)) == expected
    assert snapshot.released(set()) is snapshot


def test_issue_scenario_shrink_then_admit_then_grow_back():
    """Teams A and B, quota 2 each, cohort capacity 4. A's elastic 1..4 job runs on 4; B submits
    a 2-worker job: A shrinks to 2 (no work lost), B starts once the drain freed the workers, and
    when B finishes A grows back to 4."""
    s = Snapshot(AB, [running(1, "a", 4, min=1, max=4), queued(2, "b", 2)], cluster_workers=4)
    first = decide(s, NOW)
    assert summary(first) == [("Shrink", 1, 2), ("Wait", 2, "releasing")]
    s = apply(s, first, drained=False)
    assert summary(decide(s, NOW)) == [("Wait", 2, "releasing")], "the drain has not landed: wait, ask nothing new"
    s = apply(s, [], drained=True)
    second = decide(s, NOW)
    assert summary(second) == [("Admit", 2, 2)]
    s = apply(s, second, drained=True)
    assert summary(decide(s, NOW)) == [], "the cluster is full and fair: nothing to do"
    s = dataclasses.replace(s, jobs=tuple(j for j in s.jobs if j.id != 2))  # B finished
    assert summary(decide(s, NOW)) == [("Grow", 1, 4)]


def test_aging_eventually_admits_a_starved_low_priority_job():
    """One worker; a priority-5 job arrives every 100 s and runs 100 s. A priority-0 job queued at
    t=0 would wait forever without aging; with one point per 600 s it starts after at most about
    5 x 600 s plus one run."""
    policy = Policy(aging_s_per_point=600.0, reserve_after_s=1e9)
    low = JobView(id=1, team="a", priority=0, state=JobState.QUEUED, min_workers=1, max_workers=1,
                  submitted_at_s=0.0)
    jobs = [low]
    started_at = None
    for tick in range(1, 100):
        now = tick * 100.0
        jobs = [j for j in jobs if j.state is not JobState.RUNNING]  # each run lasts one tick
        jobs.append(JobView(id=tick + 1, team="a", priority=5, state=JobState.QUEUED, min_workers=1,
                            max_workers=1, submitted_at_s=now))
        actions = decide(Snapshot([team("a", 1)], jobs, cluster_workers=1), now, policy)
        [admit] = [a for a in actions if isinstance(a, Admit)]
        jobs = [dataclasses.replace(j, state=JobState.RUNNING, workers=1, target_workers=1)
                if j.id == admit.job_id else j for j in jobs]
        if admit.job_id == low.id:
            started_at = now
            break
    assert started_at is not None and started_at <= 5 * 600.0 + 200.0, started_at


def test_decide_leaves_the_snapshot_unchanged():
    for _, snapshot, _ in CASES:
        before = copy.deepcopy(snapshot)
        decide(snapshot, NOW)
        assert snapshot == before


def test_decide_is_deterministic_whatever_the_input_order():
    snapshot = Snapshot([team("a", 2), team("b", 2), team("c", 0)],
                        [running(1, "a", 4, min=1, max=4), running(2, "b", 1, priority=2),
                         queued(3, "b", 2, priority=1), queued(4, "c", 1), queued(5, "a", 1, submitted=1.0),
                         queued(6, "c", 2, submitted=1.0)], cluster_workers=5)
    first = decide(snapshot, NOW)
    reversed_input = dataclasses.replace(snapshot, jobs=tuple(reversed(snapshot.jobs)),
                                         teams=tuple(reversed(snapshot.teams)))
    assert decide(snapshot, NOW) == first
    assert decide(reversed_input, NOW) == first


def test_job_state_edges():
    assert JobState.QUEUED.allowed >= {JobState.STARTING, JobState.CANCELLED, JobState.FAILED}
    JobState.RUNNING.check_move(JobState.PAUSING)
    JobState.RUNNING.check_move(JobState.RUNNING)  # a note in the same state (a resize)
    with pytest.raises(TransitionNotAllowed, match="queued cannot move to running"):
        JobState.QUEUED.check_move(JobState.RUNNING)
    with pytest.raises(TransitionNotAllowed, match="it has ended"):
        JobState.FINISHED.check_move(JobState.QUEUED)
    assert {s for s in JobState if s.terminal} == {JobState.FINISHED, JobState.FAILED, JobState.CANCELLED}
    # Nothing is killed without a checkpoint: a running job reaches paused only through pausing.
    assert JobState.PAUSED not in JobState.RUNNING.allowed


@pytest.mark.parametrize("kwargs, field", [
    ({"nominal_workers": -1}, "team.nominal_workers"),
    ({"nominal_workers": 2, "lending_limit_workers": 3}, "team.lending_limit_workers"),
    ({"nominal_workers": 2, "borrowing_limit_workers": 1.5}, "team.borrowing_limit_workers"),
    ({"nominal_workers": 2, "weight": 0}, "team.weight"),
], ids=["a negative quota names nominal_workers", "lending more than the quota names lending_limit_workers",
        "a fractional limit names borrowing_limit_workers", "a zero weight names weight"])
def test_team_validation_names_the_field(kwargs, field):
    with pytest.raises(ServiceInputError) as err:
        Team("a", **kwargs)
    assert err.value.field == field


def test_team_ceiling_and_never_fits():
    teams = [team("a", 2, borrow=1), team("b", 2, lend=1), team("solo", 3, cohort=None)]
    assert team_ceiling_workers("a", teams) == 3  # nominal 2 + borrowing limit 1
    assert team_ceiling_workers("b", teams) == 4  # b borrows a's whole quota
    assert team_ceiling_workers("solo", teams) == 3
    assert team_ceiling_workers("b", teams, cluster_workers=2) == 2
    assert never_fits_reason("a", 3, teams) is None
    assert "could ever get: 3" in never_fits_reason("a", 4, teams)
    assert "unknown team 'z'" in never_fits_reason("z", 1, teams)
    assert "cluster's 2 workers" in never_fits_reason("b", 3, teams, cluster_workers=2)


def test_admission_order_criteria():
    policy = Policy(aging_s_per_point=600.0)
    old_low = queued(1, "a", 1, priority=0, submitted=NOW - 3000)  # aged 5 points
    new_high = queued(2, "a", 1, priority=4, submitted=NOW)
    assert admission_order(old_low, 0.0, NOW, policy) < admission_order(new_high, 0.0, NOW, policy)
    first, second = queued(3, "a", 1, submitted=NOW - 10), queued(4, "b", 1, submitted=NOW - 5)
    assert admission_order(second, 0.0, NOW, policy) < admission_order(first, 1.0, NOW, policy)  # share
    assert admission_order(first, 0.0, NOW, policy) < admission_order(second, 0.0, NOW, policy)  # FIFO
    twin = dataclasses.replace(first, id=5)
    assert admission_order(first, 0.0, NOW, policy) < admission_order(twin, 0.0, NOW, policy)  # id


# ----------------------------------------------------------------------------- properties

@st.composite
def snapshots(draw):
    n_teams = draw(st.integers(1, 4))
    teams = []
    for i in range(n_teams):
        nominal = draw(st.integers(0, 4))
        teams.append(Team(f"t{i}", nominal, cohort=draw(st.sampled_from(["x", "y", None])),
                          borrowing_limit_workers=draw(st.one_of(st.none(), st.integers(0, 3))),
                          lending_limit_workers=draw(st.one_of(st.none(), st.integers(0, nominal))),
                          weight=draw(st.sampled_from([0.5, 1.0, 2.0]))))
    jobs = []
    for job_id in range(draw(st.integers(0, 10))):
        lo = draw(st.integers(1, 4))
        hi = draw(st.integers(lo, 6))
        state = draw(st.sampled_from([JobState.QUEUED, JobState.PAUSED, JobState.RUNNING, JobState.RUNNING,
                                      JobState.STARTING, JobState.PAUSING]))
        workers = target = 0
        if state in (JobState.RUNNING, JobState.STARTING):
            target = draw(st.integers(lo, hi))
            workers = draw(st.sampled_from([target, target, lo]))
        elif state is JobState.PAUSING:
            workers = draw(st.integers(lo, hi))
        jobs.append(JobView(id=job_id, team=f"t{draw(st.integers(0, n_teams - 1))}",
                            priority=draw(st.integers(0, 3)), state=state, min_workers=lo, max_workers=hi,
                            elastic=hi > lo, workers=workers, target_workers=target,
                            submitted_at_s=draw(st.floats(0, NOW)), started_at_s=0.0,
                            last_checkpoint_at_s=draw(st.one_of(st.none(), st.floats(0, NOW))),
                            held=draw(st.booleans()) and state.waiting))
    return Snapshot(teams, jobs, cluster_workers=draw(st.integers(0, 16)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_no_decision_exceeds_the_cluster_or_admits_below_min(snapshot):
    before = copy.deepcopy(snapshot)
    actions = decide(snapshot, NOW)
    assert snapshot == before
    jobs = {j.id: j for j in snapshot.jobs}
    assert len({a.job_id for a in actions}) == len(actions), "one action per job"
    held = sum(max(j.workers, j.target_workers) if j.state.admitted else j.workers for j in snapshot.jobs)
    added = 0
    usage = {t.name: 0 for t in snapshot.teams}
    for j in snapshot.jobs:
        if j.state.admitted and j.team in usage:
            usage[j.team] += j.target_workers
    usage_before = dict(usage)
    for a in actions:
        job = jobs[a.job_id]
        assert a.reason
        if isinstance(a, Admit):
            assert job.state.waiting and not job.held
            assert job.min_workers <= a.workers <= job.max_workers
            added += a.workers
            usage[job.team] += a.workers
        elif isinstance(a, Grow):
            assert job.state is JobState.RUNNING and job.elastic
            assert job.target_workers < a.to_workers <= job.max_workers
            added += a.to_workers - job.target_workers
            usage[job.team] += a.to_workers - job.target_workers
        elif isinstance(a, Shrink):
            assert job.state is JobState.RUNNING and job.elastic
            assert job.min_workers <= a.to_workers < job.target_workers
            usage[job.team] -= job.target_workers - a.to_workers
        elif isinstance(a, Pause):
            assert job.state is JobState.RUNNING
            usage[job.team] -= job.target_workers
    assert added <= max(0, snapshot.cluster_workers - held), "workers given that the cluster does not have"
    quotas_after = Quotas(snapshot.teams, usage)
    quotas_before = Quotas(snapshot.teams, usage_before)
    for t in snapshot.teams:
        if usage[t.name] > usage_before[t.name] and t.borrowing_limit_workers is not None:
            assert usage[t.name] <= t.nominal_workers + t.borrowing_limit_workers, f"team {t.name} over its limit"
    for cohort, used in quotas_after.pool_used.items():
        if quotas_before.pool_used[cohort] <= quotas_before.pool_capacity[cohort]:
            assert used <= quotas_after.pool_capacity[cohort], f"cohort {cohort} lent more than it has"


# ----------------------------------------------------------------------------- flavors

SPOT = ResourceFlavor("spot-cpu", "spot", resources=("cpu",))
ON_DEMAND = ResourceFlavor("on-demand-cpu", "on-demand", resources=("cpu",))
A10G = ResourceFlavor("spot-a10g", "spot", "A10G", resources=("gpu",))
H100 = ResourceFlavor("on-demand-h100", "on-demand", "H100", resources=("gpu",))
CPU4 = WorkerShape(cpu=4.0)


def state(flavor, present=None, **ceiling) -> FlavorState:
    return FlavorState(flavor, ceiling, present)


def fteam(name, cohort="c", **quotas) -> Team:
    """A team with per-flavor quotas: ``spot_cpu_cpu=(nominal, borrowing limit, lending limit)``."""
    made = []
    for key, value in quotas.items():
        flavor, resource = key.rsplit("_", 1)
        nominal, borrow, lend = (tuple(value) + (None, None))[:3] if isinstance(value, tuple) else (value, None, None)
        made.append(FlavorQuota(flavor.replace("_", "-"), resource, nominal, borrow, lend))
    return Team(name, 0, cohort=cohort, quotas=tuple(made))


def frun(id, team, workers, flavor, shape=WorkerShape(), min=None, max=None, priority=0) -> JobView:
    return dataclasses.replace(running(id, team, workers, min=min, max=max, priority=priority), flavor=flavor.name,
                               shape=shape)


def fqueued(id, team, min, shape=WorkerShape(), max=None, priority=0) -> JobView:
    return dataclasses.replace(queued(id, team, min, max=max, priority=priority), shape=shape)


def fsummary(actions) -> list[tuple]:
    """``summary`` with the flavor (and provisioning) of each admission."""
    out = []
    for a, row in zip(actions, summary(actions)):
        out.append(row + ((a.flavor,) + (("provisioning",) if a.provisioning else ()) if isinstance(a, Admit) else ()))
    return out


TWO = [state(SPOT, cpu=4), state(ON_DEMAND, cpu=4)]
AB_CPU = [fteam("a", spot_cpu_cpu=4, on_demand_cpu_cpu=4), fteam("b", spot_cpu_cpu=4, on_demand_cpu_cpu=4)]

FLAVOR_CASES = [
    ("a flavor that is full while another is free: a job that may use either is admitted on the free one",
     Snapshot(AB_CPU, [frun(1, "a", 4, SPOT), fqueued(2, "b", 2)], flavors=TWO),
     [("Admit", 2, 2, "on-demand-cpu")]),
    ("a flavor that is full while another is free: a job that asks for the full one's market waits on it",
     Snapshot(AB_CPU, [frun(1, "a", 4, SPOT, priority=9), fqueued(2, "a", 2, WorkerShape(market="spot"))],
              flavors=TWO),
     [("Wait", 2, "cluster_capacity")]),
    ("the table's order is the preference: both free, the first flavor is taken",
     Snapshot(AB_CPU, [fqueued(1, "a", 2)], flavors=TWO),
     [("Admit", 1, 2, "spot-cpu")]),
    ("quotas count CPUs: a gang of two 4-CPU workers needs 8 of the team's cpu quota, it has 4 left",
     Snapshot([fteam("a", cohort=None, spot_cpu_cpu=8)], [frun(1, "a", 1, SPOT, CPU4, priority=9),
                                                      fqueued(2, "a", 2, CPU4)], flavors=[state(SPOT, cpu=32)]),
     [("Wait", 2, "team_quota")]),
    ("capacity counts CPUs: two 4-CPU workers do not fit in 6 free CPUs, one 2-CPU job behind does",
     Snapshot([fteam("a", cohort=None, spot_cpu_cpu=32)], [frun(1, "a", 2, SPOT, priority=9),
                                                       fqueued(2, "a", 2, CPU4, priority=1),
                                                       fqueued(3, "a", 1, WorkerShape(cpu=2.0))],
              flavors=[state(SPOT, cpu=8)]),
     [("Admit", 3, 1, "spot-cpu"), ("Wait", 2, "cluster_capacity")]),
    ("a GPU job draws from the flavor of its accelerator type, a CPU job from no GPU flavor",
     Snapshot([fteam("a", spot_a10g_gpu=4, on_demand_h100_gpu=4, on_demand_cpu_cpu=4)],
              [fqueued(1, "a", 2, WorkerShape(gpu=1.0, accelerator="H100")), fqueued(2, "a", 1)],
              flavors=[state(A10G, gpu=4, cpu=16), state(H100, gpu=4, cpu=16), state(ON_DEMAND, cpu=4)]),
     [("Admit", 1, 2, "on-demand-h100"), ("Admit", 2, 1, "on-demand-cpu")]),
    ("reclaim shrinks the borrower on the flavor that is short, not its job on the other flavor",
     Snapshot([fteam("a", spot_cpu_cpu=2, on_demand_cpu_cpu=2), fteam("b", spot_cpu_cpu=2, on_demand_cpu_cpu=2)],
              [frun(1, "a", 4, ON_DEMAND, min=1, max=4), frun(2, "a", 4, SPOT, min=1, max=4),
               fqueued(3, "b", 2, WorkerShape(market="spot"))], flavors=TWO),
     [("Shrink", 2, 2), ("Wait", 3, "releasing")]),
    ("a job whose shape fits no flavor waits and says so",
     Snapshot(AB_CPU, [fqueued(1, "a", 1, WorkerShape(gpu=1.0))], flavors=TWO),
     [("Wait", 1, "never_fits")]),
    ("borrowing is per flavor: a team may borrow the cohort's spot quota, not on-demand it was given none of",
     Snapshot([fteam("a", spot_cpu_cpu=2), fteam("b", spot_cpu_cpu=2, on_demand_cpu_cpu=(2, None, 0))],
              [fqueued(1, "a", 2, WorkerShape(market="on-demand")), fqueued(2, "a", 4, WorkerShape(market="spot"))],
              flavors=TWO),
     [("Admit", 2, 4, "spot-cpu"), ("Wait", 1, "never_fits")]),
    ("autoscaling: a job beyond what is up but within the ceiling is admitted, its workers being provisioned",
     Snapshot(AB_CPU, [frun(1, "a", 2, SPOT), fqueued(2, "b", 2, WorkerShape(market="spot"))],
              flavors=[state(SPOT, present={"cpu": 2}, cpu=8), state(ON_DEMAND, cpu=4)]),
     [("Admit", 2, 2, "spot-cpu", "provisioning")]),
    ("growth stays on the job's flavor: a full flavor gives nothing, though another is idle",
     Snapshot(AB_CPU, [frun(1, "a", 4, SPOT, min=1, max=6)], flavors=TWO),
     []),
]


@pytest.mark.parametrize("snapshot, expected", [(s, e) for _, s, e in FLAVOR_CASES],
                         ids=[name for name, _, _ in FLAVOR_CASES])
def test_decide_with_flavors(snapshot, expected):
    actions = decide(snapshot, NOW)
    assert fsummary(actions) == expected, "\n".join(str(a) for a in actions)
    assert all(a.reason.strip() for a in actions)
    before = copy.deepcopy(snapshot)
    decide(snapshot, NOW)
    assert snapshot == before


def test_flavor_reasons_name_the_flavor_and_the_shape():
    [wait] = decide(FLAVOR_CASES[1][1], NOW)
    assert wait.reason.startswith("the cluster is full: needs 2 workers of 1 CPU, spot on spot-cpu (min_workers)")
    [wait] = decide(FLAVOR_CASES[3][1], NOW)
    assert "needs 2 workers of 4 CPU on spot-cpu" in wait.reason and "uses 4 CPU of nominal 8 CPU" in wait.reason
    [wait] = decide(FLAVOR_CASES[7][1], NOW)
    assert "spot-cpu has no GPUs, the job asks resources.gpus_per_worker=1" in wait.reason
    shrink, _ = decide(FLAVOR_CASES[6][1], NOW)
    assert "within its team's nominal quota on spot-cpu, which team a borrows" in shrink.reason
    [admit] = decide(FLAVOR_CASES[9][1], NOW)
    assert "the autoscaler adds the nodes" in admit.reason


def test_one_ledger_keeps_the_figures_in_workers():
    quotas = FlavorQuotas([team("a", 2), team("b", 2)], [ResourceFlavor.implicit()])
    quotas.add("a", "default", 3)
    assert quotas.share("a") == 1.0 and quotas.headroom("a", "default") == 1
    assert quotas.explain("a", "default") == "team a uses 3 of nominal 2 (no borrowing limit; cohort pool 1 free)"


@st.composite
def flavored_snapshots(draw):
    flavors = [SPOT, ON_DEMAND, A10G]
    shapes = [WorkerShape(), CPU4, WorkerShape(market="spot"), WorkerShape(cpu=2.0, market="on-demand"),
              WorkerShape(gpu=1.0)]
    teams = [fteam(f"t{i}", cohort=draw(st.sampled_from(["x", None])),
                   spot_cpu_cpu=(draw(st.integers(0, 8)), draw(st.one_of(st.none(), st.integers(0, 4)))),
                   on_demand_cpu_cpu=draw(st.integers(0, 8)), spot_a10g_gpu=draw(st.integers(0, 2)))
             for i in range(draw(st.integers(1, 3)))]
    jobs = []
    for job_id in range(draw(st.integers(0, 8))):
        shape = draw(st.sampled_from(shapes))
        lo = draw(st.integers(1, 3))
        hi = draw(st.integers(lo, 4))
        state_ = draw(st.sampled_from([JobState.QUEUED, JobState.RUNNING, JobState.RUNNING, JobState.PAUSING]))
        fits = [f for f in flavors if f.refuses(shape) is None]
        flavor = draw(st.sampled_from(fits)).name
        workers = target = 0
        if state_ is JobState.RUNNING:
            target = workers = draw(st.integers(lo, hi))
        elif state_ is JobState.PAUSING:
            workers = lo
        jobs.append(JobView(id=job_id, team=f"t{draw(st.integers(0, len(teams) - 1))}", priority=draw(st.integers(0, 2)),
                            state=state_, min_workers=lo, max_workers=hi, elastic=hi > lo, workers=workers,
                            target_workers=target, submitted_at_s=draw(st.floats(0, NOW)), started_at_s=0.0,
                            last_checkpoint_at_s=NOW - 10, shape=shape,
                            flavor=flavor if state_ is not JobState.QUEUED else ""))
    states = [FlavorState(f, {"cpu": float(draw(st.integers(0, 16))), "gpu": float(draw(st.integers(0, 4)))})
              for f in flavors]
    return Snapshot(teams, jobs, flavors=states)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flavored_snapshots())
def test_no_decision_gives_a_flavor_more_than_it_has(snapshot):
    """Per flavor and resource: what admissions and growth add never exceeds what was free, and
    every admission is on a flavor the job's shape fits."""
    actions = decide(snapshot, NOW)
    jobs = {j.id: j for j in snapshot.jobs}
    free = {s.name: s.capacity() for s in snapshot.flavors}
    flavor_of = {}
    for j in snapshot.jobs:
        if j.state.admitted or j.state.releasing:
            held = max(j.workers, j.target_workers) if j.state.admitted else j.workers
            for r in free[j.flavor]:
                free[j.flavor][r] -= held * j.shape.amount(r)
            flavor_of[j.id] = j.flavor
    by_name = {s.name: s.flavor for s in snapshot.flavors}
    for a in actions:
        job = jobs[a.job_id]
        if isinstance(a, Admit):
            assert by_name[a.flavor].refuses(job.shape) is None, (a, job.shape)
            added, flavor = a.workers, a.flavor
        elif isinstance(a, Grow):
            added, flavor = a.to_workers - job.target_workers, flavor_of[a.job_id]
        else:
            continue
        for r in free[flavor]:
            if job.shape.amount(r) > 0:
                assert added * job.shape.amount(r) <= max(0.0, free[flavor][r]) + 1e-9, (a, free)
                free[flavor][r] -= added * job.shape.amount(r)
