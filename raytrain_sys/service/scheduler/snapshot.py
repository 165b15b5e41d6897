"""The scheduler's input: ``Snapshot`` (the teams, every live job as a ``JobView``, and the
cluster's capacity per flavor) and its knobs (``Policy``).

Owns the scheduler's view of a job (``JobView``, made from a stored one by ``JobView.of``) and of
a pass's whole input. A decision is a pure function of these and the time (``decide.py``); its
output is ``actions.py``. Pure: no Ray, no SQL, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Optional

from raytrain_sys.errors import ServiceInputError
from raytrain_sys.service.flavors import DEFAULT_SHAPE, FlavorState, ResourceFlavor, WorkerShape
from raytrain_sys.service.model import JobRecord, JobState
from raytrain_sys.service.teams import Team


@dataclass(frozen=True)
class JobView:
    """One live job as the scheduler sees it.

    ``workers`` is what the job holds now; ``target_workers`` what the runner was last told
    (they differ while a shrink drains or a grow places actors). A job is elastic when its
    spec lets it run anywhere in ``min_workers..max_workers``.
    """

    id: int
    team: str
    priority: int
    state: JobState
    min_workers: int
    max_workers: int
    submitted_at_s: float
    elastic: bool = False
    workers: int = 0
    target_workers: int = 0
    waiting_since_s: Optional[float] = None  # None: since submitted_at_s
    started_at_s: Optional[float] = None
    last_checkpoint_at_s: Optional[float] = None  # the last durable checkpoint
    held: bool = False
    shape: WorkerShape = DEFAULT_SHAPE  # what one worker asks
    flavor: str = ""  # the flavor its workers run on ("": not admitted yet; or from before the flavor table)
    group: Optional[int] = None  # the sweep it is a trial of: its workers count against the sweep's cap
    rung: int = 0  # the sweep scheduler's rungs it passed: it grows before trials that passed fewer

    @property
    def waited_since_s(self) -> float:
        return self.submitted_at_s if self.waiting_since_s is None else self.waiting_since_s

    @property
    def changing(self) -> bool:
        """A resize is in flight: the runner has not yet reached ``target_workers``."""
        return self.target_workers != self.workers

    def work_at_risk(self, now_s: float) -> float:
        """Worker-seconds lost if the job stopped now: workers x seconds since its last durable
        checkpoint (or its start, if it has none since)."""
        since = self.last_checkpoint_at_s if self.last_checkpoint_at_s is not None else self.started_at_s
        if since is None:
            return 0.0
        return self.workers * max(0.0, now_s - since)

    @classmethod
    def of(cls, record: JobRecord) -> "JobView":
        """What the scheduler sees of a stored job."""
        return cls(id=record.id, team=record.team, priority=record.priority, state=record.state,
                   min_workers=record.min_workers, max_workers=record.max_workers,
                   elastic=record.elastic, workers=record.workers,
                   target_workers=record.target_workers, submitted_at_s=record.submitted_at_s,
                   waiting_since_s=record.waiting_since_s, started_at_s=record.started_at_s,
                   last_checkpoint_at_s=record.last_checkpoint_at_s, held=record.held, shape=record.shape,
                   flavor=record.flavor or "", group=record.sweep_id, rung=record.rung)


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's whole input, besides the time: the teams, every live job, and the
    cluster's capacity: ``flavors`` (the table's, in its order of preference, each with its
    capacity), or, with no table, ``cluster_workers`` worker slots of the implicit flavor."""

    teams: tuple[Team, ...]
    jobs: tuple[JobView, ...]
    cluster_workers: int = 0
    flavors: tuple[FlavorState, ...] = ()
    # A group's (a sweep's) cap on the workers its jobs hold together, as (group, workers) pairs;
    # a group not listed has none.
    group_limits: tuple[tuple[int, int], ...] = ()

    def released(self, job_ids: Collection[int]) -> "Snapshot":
        """This snapshot without the jobs of ``job_ids``: their runs have let their workers go
        (``JobRunner.status().released``: the group shut down, which only a run's end does),
        and what is left of their ends (closing the MLflow run: seconds under load) holds
        nothing that another job needs, nor will they ask for anything again. The scheduler
        then hands their workers and their quota on in the same pass (an ASHA stop's
        successor, the job a pause or a cancel made room for, the next job after one that
        finished) instead of after the runner has returned; the store keeps the job as it is
        until its end is recorded."""
        if not job_ids:
            return self
        return replace(self, jobs=tuple(j for j in self.jobs if j.id not in job_ids))

    def __post_init__(self) -> None:
        # Tuples, so that a caller's list cannot change under a decision (and the snapshot hashes).
        object.__setattr__(self, "teams", tuple(self.teams))
        object.__setattr__(self, "jobs", tuple(self.jobs))
        object.__setattr__(self, "flavors", tuple(self.flavors))
        object.__setattr__(self, "group_limits", tuple(sorted(dict(self.group_limits).items())))

    @property
    def flavor_states(self) -> tuple[FlavorState, ...]:
        """The flavors a pass schedules on: the table's, or the implicit one of ``cluster_workers``."""
        if self.flavors:
            return self.flavors
        return (FlavorState(ResourceFlavor.implicit(), (("workers", float(self.cluster_workers)),)),)


@dataclass(frozen=True)
class Policy:
    """The scheduler's knobs, each with its reason."""

    # Waiting ages a job: one priority point per this many seconds waited (10 min), so a job
    # that waited an hour outranks a fresh one up to 6 points above it.
    aging_s_per_point: float = 600.0
    # A job that waited this long (2 h) and is blocked only by free workers keeps the free
    # workers for itself: jobs behind it in order may not take them, and nothing grows into them.
    reserve_after_s: float = 7200.0

    def __post_init__(self) -> None:
        if not self.aging_s_per_point > 0:
            raise ServiceInputError("policy.aging_s_per_point", f"got {self.aging_s_per_point}; must be > 0")
        if not self.reserve_after_s >= 0:
            raise ServiceInputError("policy.reserve_after_s", f"got {self.reserve_after_s}; must be >= 0")


DEFAULT_POLICY = Policy()

__all__ = ["JobView", "Snapshot", "Policy", "DEFAULT_POLICY"]
