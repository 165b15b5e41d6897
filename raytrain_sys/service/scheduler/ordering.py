"""The orderings the scheduler uses, each a named sort key whose docstring lists its criteria.

Owns: which waiting job is considered first (``admission_order``), which running job gives
workers back first (``shrink_order``, ``pause_order``), which elastic job grows first
(``growth_order``), and a waiting job's aged priority (``effective_priority``). Each ends in
the job id, so every ordering is total and a pass is deterministic. Pure: no Ray, no I/O.
"""

from __future__ import annotations

from raytrain_sys.service.scheduler.snapshot import JobView, Policy


def effective_priority(job: JobView, now_s: float, policy: Policy) -> int:
    """The job's priority plus one point per whole ``policy.aging_s_per_point`` seconds it has
    waited (since submit, or since its last pause), so no waiting job starves behind later
    arrivals. Whole points, so that jobs of one priority that waited about as long tie and the
    next criteria (fair share, FIFO) decide between them."""
    waited_s = max(0.0, now_s - job.waited_since_s)
    return job.priority + int(waited_s // policy.aging_s_per_point)


def admission_order(job: JobView, team_share: float, now_s: float, policy: Policy) -> tuple:
    """Which waiting job is considered for admission first (smaller key first):

    1. higher effective priority (priority + aging by time waited);
    2. lower weighted fair share of its team (workers borrowed beyond nominal / weight);
    3. earlier submit time (FIFO);
    4. lower job id (deterministic tie-break).
    """
    return (-effective_priority(job, now_s, policy), team_share, job.submitted_at_s, job.id)


def shrink_order(job: JobView, team_share: float) -> tuple:
    """Which running elastic job gives up workers first when a waiting job needs them (a shrink
    drains at a step boundary and loses no work, so it always comes before any pause):

    1. lower priority;
    2. higher weighted fair share of its team (the team borrowing most gives back first);
    3. more workers above its min_workers;
    4. later submit time (the newest job gives back first);
    5. higher job id (deterministic tie-break).
    """
    return (job.priority, -team_share, -(job.target_workers - job.min_workers), -job.submitted_at_s, -job.id)


def pause_order(job: JobView, now_s: float) -> tuple:
    """Which running job is paused first when shrinking is not enough:

    1. less work at risk (workers x seconds since its last durable checkpoint);
    2. lower priority;
    3. later submit time;
    4. higher job id (deterministic tie-break).
    """
    return (job.work_at_risk(now_s), job.priority, -job.submitted_at_s, -job.id)


def growth_order(job: JobView, workers: int, team_share: float) -> tuple:
    """Which elastic job takes the next idle worker (one worker at a time):

    1. higher priority, plus a point per rung a sweep's trial passed (its scheduler's promotions:
       the best trials grow first; growth only, so a rung never pauses or shrinks a sibling);
    2. lower weighted fair share of its team;
    3. fewer workers above its min_workers so far (round robin among equals);
    4. earlier submit time;
    5. lower job id (deterministic tie-break).
    """
    return (-(job.priority + job.rung), team_share, workers - job.min_workers, job.submitted_at_s, job.id)
