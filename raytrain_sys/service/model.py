"""A job's life in the service: its states and their edges, its stored records, and the words of
what its runner reports.

Owns: ``JobState`` (with ``terminal`` and ``allowed``: a move the table does not list raises
``TransitionNotAllowed``) and ``SweepState`` alike; ``WaitCause``: why a job that is not running
yet waits (the scheduler's causes for a queued or paused job, the start's steps for a starting or
resuming one); the stored job as the service sees it (``JobRecord``, ``TransitionRecord``,
``AuditRecord``, ``SweepRecord``, ``SweepTransitionRecord``; its live numbers, ``JobProgress``);
and what a job's runner reports (``RunnerState``, ``RunOutcome``, ``RunnerResult``).
Not here: the bounds a request is held to (``service/bounds.py``), flavors and worker shapes
(``service/flavors.py``), teams and quotas (``service/teams.py``), the scheduler's input and
output (``service/scheduler/snapshot.py``, ``service/scheduler/actions.py``).
Pure: no Ray, no SQL, no clock. Every time here is unix seconds (``_s``), every size a count of
workers (``_workers``); one priority direction everywhere: a higher number is more important.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from raytrain_sys.service.flavors import ANY_MARKET, WorkerShape


class TransitionNotAllowed(RuntimeError):
    """A job state change the table below does not list: a bug in whoever asked for it."""


class JobState(str, Enum):
    QUEUED = "queued"  # submitted, waiting for admission (never ran)
    STARTING = "starting"  # admitted: the runner is launching its Supervisor
    RUNNING = "running"
    PAUSING = "pausing"  # checkpointing at a step boundary, then releasing its workers
    PAUSED = "paused"  # holds no workers; resumes from its checkpoint when admitted again
    RESUMING = "resuming"  # admitted again: the runner is restoring it from its checkpoint
    CANCELLING = "cancelling"  # stopping its Supervisor, then releasing its workers
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """The job has ended: no move leaves this state."""
        return self in (JobState.FINISHED, JobState.FAILED, JobState.CANCELLED)

    @property
    def allowed(self) -> frozenset["JobState"]:
        """The states this one may move to. Every live state may also stay (a note in the same
        state, such as a resize of a running job) and may fail."""
        if self.terminal:
            return frozenset()
        return _MOVES[self] | {self, JobState.FAILED}

    @property
    def waiting(self) -> bool:
        """Holds no workers and wants some (unless held by its team)."""
        return self in (JobState.QUEUED, JobState.PAUSED)

    @property
    def pending(self) -> bool:
        """Not running yet: waiting for admission, or admitted and starting. Such a job has a
        wait reason (``WaitCause`` and a sentence) once the reconciler has looked at it."""
        return self in (JobState.QUEUED, JobState.PAUSED, JobState.STARTING, JobState.RESUMING)

    @property
    def releasing(self) -> bool:
        """Still holds workers it is giving back: counted free for quotas, not yet for the
        cluster."""
        return self in (JobState.PAUSING, JobState.CANCELLING)

    @property
    def admitted(self) -> bool:
        """Holds (or is being given) workers and counts against its team's quota."""
        return self in (JobState.STARTING, JobState.RUNNING, JobState.RESUMING)

    def check_move(self, to: "JobState") -> None:
        if to not in self.allowed:
            raise TransitionNotAllowed(
                f"job state {self.value} cannot move to {to.value} "
                f"(allowed: {', '.join(sorted(s.value for s in self.allowed)) or 'none, it has ended'})")


# Where each state leads (besides staying and failing). A queued or paused job holds nothing,
# so cancelling it needs no stop; a starting or resuming job whose start was given up (not
# placed, or no progress: service/starts.py) goes back to where it waited, nothing having run since.
_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.QUEUED, JobState.CANCELLING}),
    JobState.RUNNING: frozenset({JobState.PAUSING, JobState.CANCELLING, JobState.FINISHED}),
    # A run that reached its last step before the stop landed at a boundary has finished.
    JobState.PAUSING: frozenset({JobState.PAUSED, JobState.CANCELLING, JobState.FINISHED}),
    JobState.PAUSED: frozenset({JobState.RESUMING, JobState.CANCELLED}),
    JobState.RESUMING: frozenset({JobState.RUNNING, JobState.PAUSED, JobState.CANCELLING}),
    JobState.CANCELLING: frozenset({JobState.CANCELLED, JobState.FINISHED}),
}

LIVE_STATES = tuple(s for s in JobState if not s.terminal)


class SweepState(str, Enum):
    """A sweep's lifecycle (its trials are jobs with their own). The sweep runner drives a
    running sweep; a paused one has every trial held; an ended one has no live trial left."""

    QUEUED = "queued"  # submitted: the reconciler has not started its sweep runner yet
    RUNNING = "running"  # its sweep runner (Ray Tune) submits and follows trials
    PAUSED = "paused"  # paused by its team: every trial held, the runner waits for resume
    FINISHED = "finished"  # Tune ended: every trial finished or stopped by the scheduler
    FAILED = "failed"  # its runner was lost more often than its budget, or Tune raised
    CANCELLED = "cancelled"  # cancelled by its team: its live trials are cancelled with it

    @property
    def terminal(self) -> bool:
        return self in (SweepState.FINISHED, SweepState.FAILED, SweepState.CANCELLED)

    @property
    def allowed(self) -> frozenset["SweepState"]:
        """The states this one may move to: itself (a note, a runner restart) and failed, as
        for a job, plus ``_SWEEP_MOVES``."""
        if self.terminal:
            return frozenset()
        return _SWEEP_MOVES[self] | {self, SweepState.FAILED}

    def check_move(self, to: "SweepState") -> None:
        if to not in self.allowed:
            raise TransitionNotAllowed(
                f"sweep state {self.value} cannot move to {to.value} "
                f"(allowed: {', '.join(sorted(s.value for s in self.allowed)) or 'none, it has ended'})")


_SWEEP_MOVES: dict[SweepState, frozenset[SweepState]] = {
    SweepState.QUEUED: frozenset({SweepState.RUNNING, SweepState.PAUSED, SweepState.CANCELLED}),
    SweepState.RUNNING: frozenset({SweepState.PAUSED, SweepState.FINISHED, SweepState.CANCELLED}),
    SweepState.PAUSED: frozenset({SweepState.RUNNING, SweepState.CANCELLED}),
}


class WaitCause(str, Enum):
    """Why a job is not running yet: one word a reason, a metric label (bounded: this enum,
    never the sentence). The first group is the scheduler's (``Wait``) for a queued or paused
    job; the second the start's steps for a starting or resuming one (``service/starts.py``)."""

    HELD = "held"  # its team paused it: it waits until resumed
    UNKNOWN_TEAM = "unknown_team"  # its team was deleted
    NEVER_FITS = "never_fits"  # min_workers is more than its team or the cluster could ever give
    TEAM_QUOTA = "team_quota"  # over its team's nominal quota and borrowing limit (or no cohort to borrow from)
    COHORT = "cohort"  # its cohort has no quota to lend now (others use or borrow it)
    CLUSTER = "cluster_capacity"  # the quota allows it, the cluster has no free workers
    RESERVED = "reserved"  # the free workers are kept for a job that has waited longer
    RELEASING = "releasing"  # workers are being released for it (shrinks and pauses in flight)
    RUNNER_START = "runner_start"  # admitted: its runner (a Ray actor) is starting or building the run
    RUN_START = "run_start"  # the run prepares: pre-flight checks, Ray connection, first data reads
    PLACEMENT = "placement"  # the cluster has not placed its workers' slots (placement groups)
    WORKER_START = "worker_start"  # placed: worker processes, MLflow run, process group, first batch
    RESTORE = "restore"  # loading its checkpoint to resume
    # admitted against capacity being provisioned (autoscaling): its workers wait for the nodes the
    # autoscaler was asked for, within the service's provisioning timeout, not start_stall_s
    PROVISIONING = "provisioning"
    SWEEP_CAP = "sweep_cap"  # its sweep's trials hold the sweep's max_workers already


# ----------------------------------------------------------------------------- what a runner reports


class RunnerState(str, Enum):
    """A job's run as its runner reports it (``JobRunner.status``): the Supervisor's state
    (``control/supervisor/journal.py``), or ``launching`` while the Supervisor is being built. A
    ``str`` Enum: it pickles and prints as the Supervisor's word."""

    LAUNCHING = "launching"  # the runner builds the Supervisor (a resume first reads its run's record)
    STARTING = "starting"  # also a new run that trains while its MLflow run opens (runner.reported_state)
    RESTORING = "restoring"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    REBUILDING = "rebuilding"
    RESIZING = "resizing"
    DRAINING = "draining"
    WAITING = "waiting"
    STOPPED = "stopped"
    CANCELLED = "cancelled"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def starting(self) -> bool:
        """Before the run's first step: the job is still starting (or resuming)."""
        return self in (RunnerState.LAUNCHING, RunnerState.STARTING, RunnerState.RESTORING)

    @property
    def ended(self) -> bool:
        """The run has ended: its workers are being released, the runner's ``done`` follows."""
        return self in (RunnerState.STOPPED, RunnerState.CANCELLED, RunnerState.FINISHED, RunnerState.FAILED)

    @property
    def trains(self) -> bool:
        """Past its start and not ended: what the store records as running."""
        return not (self.starting or self.ended)


class RunOutcome(str, Enum):
    """How a runner's Supervisor returned (``RunnerResult.outcome``)."""

    FINISHED = "finished"  # trained to its end
    STOPPED = "stopped"  # paused at a step boundary with a checkpoint: resumable
    CANCELLED = "cancelled"  # stopped at a step boundary on request, no checkpoint added
    FAILED = "failed"  # the Supervisor gave up, or the run raised


@dataclass(frozen=True)
class RunnerResult:
    """A run's end as its runner saw it: the reconciler records it (``service/finish.py``)."""

    outcome: RunOutcome
    reason: str  # the Supervisor's (or its last transition's), or the error a failed run raised
    # The class name of what a failed run raised (the user error found in it, if any), "" otherwise:
    # "ClusterCapacityError" is a start whose workers could not be placed, given up rather than failed.
    error_type: str = ""


# ----------------------------------------------------------------------------- stored records


@dataclass(frozen=True)
class JobRecord:
    """One row of the jobs table, as the store returns it."""

    id: int
    team: str
    name: str
    spec: str  # the job spec as submitted (YAML or JSON text)
    priority: int
    state: JobState
    held: bool  # the team paused it: the scheduler leaves it waiting
    min_workers: int
    max_workers: int
    elastic: bool
    workers: int  # workers it holds now
    target_workers: int  # workers the runner was last told to have
    restarts: int
    mlflow_run_id: Optional[str]
    last_checkpoint_step: Optional[int]
    last_checkpoint_at_s: Optional[float]
    submitted_at_s: float
    waiting_since_s: float  # since when it waits for admission (submit, or its last pause)
    started_at_s: Optional[float]  # its last start or resume
    updated_at_s: float
    message: str  # the last transition's reason
    delete_checkpoints: bool = False  # a cancel asked for its checkpoints to go once it has ended
    package: Optional[str] = None  # the code package it runs with (sha256, service/packages.py)
    # Why it is not running yet (pending states only; the reconciler writes them when they change):
    wait_cause: Optional[WaitCause] = None
    wait_reason: Optional[str] = None  # the sentence
    wait_cause_since_s: Optional[float] = None  # since when this cause holds
    start_returns: int = 0  # starts given up in a row (back to the queue); reset once it runs
    # What one worker asks (from its spec, stored at submit: the scheduler reads no spec) and the
    # flavor its workers run on (set at admission; None while it waits, or from before flavors).
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    memory_per_worker_gb: float = 0.0
    accelerator: str = ""
    market: str = ANY_MARKET
    flavor: Optional[str] = None
    # A sweep's trial (migration 0006): its sweep and Tune's trial id, unique together; None: a job of its own.
    sweep_id: Optional[int] = None
    trial_id: Optional[str] = None
    rung: int = 0  # the sweep scheduler's rungs the trial passed (its sweep runner writes it): growth order
    segment: int = 0  # the trial's PBT segment (migration 0007): 0, and one more each time it was exploited
    steps_redone: int = 0  # steps its runs committed and then trained again (migration 0008)

    @property
    def shape(self) -> WorkerShape:
        return WorkerShape(self.cpus_per_worker, self.gpus_per_worker, self.memory_per_worker_gb,
                           self.accelerator, self.market)



@dataclass(frozen=True)
class JobProgress:
    """A job's live numbers as ``GET /v1/progress`` shows them (``service/progress.py``).

    ``numbers``: ``monitor.report.progress`` of its run (None before it started, or when its
    runner never answered); ``answering``: whether its runner answered this poll within its
    bound (None for a job that has no runner to ask: queued, paused, ended); ``at_s``: when
    ``numbers`` were read (an older answer's time when the runner did not answer)."""

    numbers: Optional[dict] = None
    answering: Optional[bool] = None
    at_s: Optional[float] = None


@dataclass(frozen=True)
class SweepRecord:
    """One row of the sweeps table: a sweep's spec (``raytrain_sys.service.sweeps.spec``, stored as
    JSON), where Tune keeps its experiment, its MLflow parent run, and its lifecycle."""

    id: int
    team: str
    name: str
    spec: str  # the validated sweep spec as JSON (base job spec, space, metric, mode, ...)
    priority: int  # every trial's
    state: SweepState
    max_workers: Optional[int]  # the per-sweep worker cap (a group limit in the scheduler); None: none
    storage_path: str  # Tune's experiment directory (Tuner.restore reads it back)
    mlflow_parent_run_id: Optional[str]
    runner_restarts: int  # sweep runners lost and started again (bounded by the service's budget)
    best_trial: Optional[str]
    best_value: Optional[float]
    submitted_at_s: float
    updated_at_s: float
    message: str  # the last transition's reason


@dataclass(frozen=True)
class SweepTransitionRecord:
    sweep_id: int
    from_state: Optional[SweepState]  # None: the submit
    to_state: SweepState
    at_s: float
    actor: str
    reason: str


@dataclass(frozen=True)
class TransitionRecord:
    job_id: int
    from_state: Optional[JobState]  # None: the submit that created the job
    to_state: JobState
    at_s: float
    actor: str  # a team name, "admin", "scheduler", "reconciler", ...
    reason: str


@dataclass(frozen=True)
class AuditRecord:
    at_s: float
    actor: str  # the team whose token was used, or "admin"
    action: str  # submit, pause, resume, cancel, add_team, issue_token, ...
    target: str  # what it acted on: "job 12", "team a"
    result: str  # "ok", or why it was refused

__all__ = ["JobState", "TransitionNotAllowed", "LIVE_STATES", "SweepState", "WaitCause", "RunnerState", "RunOutcome",
           "RunnerResult", "JobRecord", "JobProgress", "TransitionRecord", "AuditRecord", "SweepRecord",
           "SweepTransitionRecord"]
