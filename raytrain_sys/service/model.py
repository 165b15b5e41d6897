"""The service's vocabulary: job states and their edges, teams, the scheduler's input and output.

Owns: ``JobState`` (with ``terminal`` and ``allowed``: a move the table does not list raises
``TransitionNotAllowed``), ``Team`` (a Kueue-style quota), the stored job as the service sees it
(``JobRecord``, ``TransitionRecord``, ``AuditRecord``), the scheduler's input (``Snapshot`` of
``Team`` and ``JobView``) and its output (``Admit``, ``Grow``, ``Shrink``, ``Pause``, ``Wait``),
and ``WaitCause``: why a job that is not running yet waits (the scheduler's causes for a queued
or paused job, the start's steps for a starting or resuming one).
Also the rules every door holds a request to (the API's schema, the client and CLI before
sending, the store before writing): what a team's name is (``team_name_problem``) and the bounds
of every number a request can store (``MAX_WORKERS``, ``PRIORITY_LIMIT``, ...).
Pure: no Ray, no SQL, no clock. Every time here is unix seconds (``_s``), every size a count of
workers (``_workers``); one priority direction everywhere: a higher number is more important.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union

from raytrain_sys.errors import ServiceInputError, quote


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


# ----------------------------------------------------------------------------- names and bounds

# A team's (or a cohort's) name is a DNS label (RFC 1123): so it is, unchanged, a URL path
# segment, a Prometheus and a Kubernetes label value, a file name, and one line of a log.
NAME_MAX_CHARS = 63  # a DNS label's and a Kubernetes label value's limit
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
NAME_RULE = ("1-63 lowercase letters (a-z), digits and '-', starting and ending with a letter or digit, "
             "e.g. 'ml-research'")
# The audit's principals besides teams (store.Principal's "admin", auth.ANONYMOUS, auth.BOOTSTRAP).
RESERVED_TEAM_NAMES = frozenset({"admin", "unauthenticated", "bootstrap"})
# A team made before the rule keeps its name and is named by it in requests (its quota, tokens,
# jobs), unless the name holds what a URL path segment or a log line cannot carry: '/' or a
# control character. So a request that names an existing team is held to this looser form.
TEAM_REF_MAX_CHARS = 64  # the teams.name column
TEAM_REF_PATTERN = r"^[^/\x00-\x1f\x7f-\x9f]{1,64}$"
_NAME_RE = re.compile(NAME_PATTERN)
_TEAM_REF_RE = re.compile(TEAM_REF_PATTERN)

# A job's name (the jobs.name column): one line, not blank.
JOB_NAME_MAX_CHARS = 200
JOB_NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*[^\x00-\x20\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
_JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)

# Bounds of the numbers a request stores, each well inside its column (32-bit INTEGER on PostgreSQL).
MAX_WORKERS = 100_000  # a quota or a job's size: beyond any Ray cluster (Ray is tested to a few thousand nodes)
PRIORITY_LIMIT = 1_000_000  # |priority|: aging adds a point per 10 min waited, so this is 19 years of waiting
MAX_WEIGHT = 1_000_000.0  # a fair-share weight: shares a million to one apart are no longer shares
MAX_JOB_ID = 2 ** 31 - 1  # jobs.id (INTEGER): a larger id cannot exist


def name_problem(name: object, what: str = "team name") -> Optional[str]:
    """Why ``name`` is not a valid new team (or cohort) name, or None: the one rule (``NAME_RULE``)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        return f"got {quote(name)}; a {what} is {NAME_RULE}"
    if what == "team name" and name in RESERVED_TEAM_NAMES:
        reserved = ", ".join(sorted(RESERVED_TEAM_NAMES))
        return f"got {quote(name)}; reserved: it names a principal in the audit ({reserved})"
    return None


def team_ref_problem(name: object) -> Optional[str]:
    """Why ``name`` cannot name an existing team in a request (``TEAM_REF_PATTERN``), or None."""
    if not isinstance(name, str) or not _TEAM_REF_RE.fullmatch(name):
        return (f"got {quote(name)}; a team's name has 1-{TEAM_REF_MAX_CHARS} characters, no '/' and no "
                f"control characters (a new team's: {NAME_RULE})")
    return None


def check_team_name(name: object, field: str = "team.name") -> str:
    """``name`` if it is a valid new team name, else ``ServiceInputError`` on ``field``."""
    problem = name_problem(name)
    if problem:
        raise ServiceInputError(field, problem)
    return name  # type: ignore[return-value]


def job_name_problem(name: object) -> Optional[str]:
    """Why ``name`` cannot be a job's name (``JOB_NAME_PATTERN``, at most ``JOB_NAME_MAX_CHARS``), or None."""
    if not isinstance(name, str) or len(name) > JOB_NAME_MAX_CHARS or not _JOB_NAME_RE.fullmatch(name):
        return f"got {quote(name)}; a job's name is one line of 1-{JOB_NAME_MAX_CHARS} characters, not all spaces"
    return None


def check_count(field: str, value: object, low: int = 0, high: int = MAX_WORKERS, low_name: str = "") -> int:
    """An integer in ``low..high`` (not a bool), else ``ServiceInputError`` on ``field``;
    ``low_name`` names where the lower bound comes from (another field)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ServiceInputError(field, f"got {quote(value)}; must be an integer")
    if value < low:
        raise ServiceInputError(field, f"got {quote(value)}; must be at least {low_name or low}")
    if value > high:
        raise ServiceInputError(field, f"got {quote(value)}; must be at most {high}")
    return value


# ----------------------------------------------------------------------------- teams


@dataclass(frozen=True)
class Team:
    """A team's queue and quota, in Kueue's words (one resource: workers).

    ``nominal_workers`` is what the team is guaranteed. Teams in the same ``cohort`` lend each
    other the part of their nominal quota they do not use: at most ``lending_limit_workers`` of
    it (None: all of it), and a team borrows at most ``borrowing_limit_workers`` beyond its
    nominal (None: as much as the cohort lends). A team without a cohort is a cohort of one.
    ``weight`` scales its fair share: a team of weight 2 may borrow twice as much before it
    counts as having had its turn.
    """

    name: str
    nominal_workers: int
    cohort: Optional[str] = None
    borrowing_limit_workers: Optional[int] = None
    lending_limit_workers: Optional[int] = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ServiceInputError("team.name", f"got {quote(self.name)}; must be a non-empty string")
        for name in ("nominal_workers", "borrowing_limit_workers", "lending_limit_workers"):
            value = getattr(self, name)
            if value is None and name != "nominal_workers":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ServiceInputError(f"team.{name}", f"got {quote(value)}; must be an integer >= 0")
        if self.lending_limit_workers is not None and self.lending_limit_workers > self.nominal_workers:
            raise ServiceInputError("team.lending_limit_workers",
                                    f"got {self.lending_limit_workers}; must not exceed "
                                    f"nominal_workers {self.nominal_workers}")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            raise ServiceInputError("team.weight", f"got {quote(self.weight)}; must be a number > 0")

    @property
    def cohort_key(self) -> str:
        """The cohort this team shares with; its own name when it has none (a cohort of one)."""
        return self.cohort if self.cohort else f"team:{self.name}"

    @property
    def lendable_workers(self) -> int:
        """The part of the nominal quota the cohort may borrow when this team does not use it."""
        if self.lending_limit_workers is None:
            return self.nominal_workers
        return self.lending_limit_workers

    @property
    def guaranteed_workers(self) -> int:
        """The part of the nominal quota never lent: always this team's."""
        return self.nominal_workers - self.lendable_workers


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

    def view(self) -> "JobView":
        """What the scheduler sees of this job."""
        return JobView(id=self.id, team=self.team, priority=self.priority, state=self.state,
                       min_workers=self.min_workers, max_workers=self.max_workers,
                       elastic=self.elastic, workers=self.workers,
                       target_workers=self.target_workers, submitted_at_s=self.submitted_at_s,
                       waiting_since_s=self.waiting_since_s, started_at_s=self.started_at_s,
                       last_checkpoint_at_s=self.last_checkpoint_at_s, held=self.held)


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


# ----------------------------------------------------------------------------- scheduler input


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


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's whole input, besides the time: the teams, every live job, and how many
    worker slots the cluster has for the service's jobs."""

    teams: tuple[Team, ...]
    jobs: tuple[JobView, ...]
    cluster_workers: int

    def __post_init__(self) -> None:
        # Tuples, so that a caller's list cannot change under a decision (and the snapshot hashes).
        object.__setattr__(self, "teams", tuple(self.teams))
        object.__setattr__(self, "jobs", tuple(self.jobs))


# ----------------------------------------------------------------------------- scheduler output


@dataclass(frozen=True)
class Admit:
    """Start a queued job (or resume a paused one from its checkpoint) on ``workers``."""

    job_id: int
    workers: int
    reason: str

    def __str__(self) -> str:
        return f"admit job {self.job_id} on {self.workers} workers: {self.reason}"


@dataclass(frozen=True)
class Grow:
    """Add workers to a running elastic job, up to ``to_workers`` in all."""

    job_id: int
    to_workers: int
    reason: str

    def __str__(self) -> str:
        return f"grow job {self.job_id} to {self.to_workers} workers: {self.reason}"


@dataclass(frozen=True)
class Shrink:
    """Drain a running elastic job down to ``to_workers`` at a step boundary (no work lost)."""

    job_id: int
    to_workers: int
    reason: str

    def __str__(self) -> str:
        return f"shrink job {self.job_id} to {self.to_workers} workers: {self.reason}"


@dataclass(frozen=True)
class Pause:
    """Checkpoint a running job, release its workers, queue it to resume later."""

    job_id: int
    reason: str
    work_at_risk_worker_s: float = 0.0  # workers x seconds since its last durable checkpoint

    def __str__(self) -> str:
        return f"pause job {self.job_id}: {self.reason}"


@dataclass(frozen=True)
class Wait:
    """Leave a waiting job waiting, and say why: ``cause`` for machines (a metric label, a
    filter), ``reason`` the sentence for people."""

    job_id: int
    cause: WaitCause
    reason: str

    def __str__(self) -> str:
        return f"job {self.job_id} waits ({self.cause.value}): {self.reason}"


Action = Union[Admit, Grow, Shrink, Pause, Wait]


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

__all__ = ["NAME_PATTERN", "NAME_RULE", "RESERVED_TEAM_NAMES", "TEAM_REF_PATTERN", "MAX_WORKERS", "PRIORITY_LIMIT",
           "MAX_WEIGHT", "MAX_JOB_ID", "JOB_NAME_MAX_CHARS", "JOB_NAME_PATTERN", "job_name_problem", "name_problem",
           "team_ref_problem", "check_team_name",
           "check_count", "JobState", "TransitionNotAllowed", "LIVE_STATES", "WaitCause", "Team", "JobRecord", "TransitionRecord",
           "AuditRecord", "JobView", "Snapshot", "Admit", "Grow", "Shrink", "Pause", "Wait", "Action",
           "Policy", "DEFAULT_POLICY"]
