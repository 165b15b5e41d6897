"""The service's vocabulary: job states and their edges, teams, the scheduler's input and output.

Owns: ``JobState`` (with ``terminal`` and ``allowed``: a move the table does not list raises
``TransitionNotAllowed``), ``Team`` (a Kueue-style quota), the stored job as the service sees it
(``JobRecord``, ``TransitionRecord``, ``AuditRecord``; its live numbers, ``JobProgress``), the
scheduler's input (``Snapshot`` of ``Team`` and ``JobView``) and its output (``Admit``, ``Grow``,
``Shrink``, ``Pause``, ``Wait``), and ``WaitCause``: why a job that is not running yet waits (the
scheduler's causes for a queued or paused job, the start's steps for a starting or resuming one),
and the words of what a job's runner reports (``RunnerState``, ``RunOutcome``, ``RunnerResult``).
Also the rules every door holds a request to (the API's schema, the client and CLI before
sending, the store before writing): what a team's name is (``team_name_problem``) and the bounds
of every number a request can store (``MAX_WORKERS``, ``PRIORITY_LIMIT``, ...).
Pure: no Ray, no SQL, no clock. Every time here is unix seconds (``_s``), every size a count of
workers (``_workers``); one priority direction everywhere: a higher number is more important.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Collection, Optional, Union

from raytrain_sys.control.node_roles import MARKETS  # a flavor's market: Ray's ray.io/market-type values
from raytrain_sys.errors import ServiceInputError, quote
from raytrain_sys.spec import ACCELERATOR_TYPE_PATTERN


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


# ----------------------------------------------------------------------------- flavors

# What a quota may count (Kueue's resources): a job's workers, or what they ask per worker.
RESOURCES = ("workers", "cpu", "gpu", "memory_gb")
# The one flavor of a service with no flavor table: it counts workers of any shape, on any node,
# with the team's nominal_workers (and limits) as its quota: the service as it was before flavors.
DEFAULT_FLAVOR = "default"
ANY_MARKET = "any"  # a job's market when either will do (the flavor table's order decides)
MAX_AMOUNT = 1e9  # a quota or a ceiling in cpu, gpu or GB: beyond any cluster, within a double
ACCELERATOR_PATTERN = f"^{ACCELERATOR_TYPE_PATTERN}$"  # the spec's resources.accelerator_type
_ACCELERATOR_RE = re.compile(ACCELERATOR_PATTERN)


@dataclass(frozen=True)
class WorkerShape:
    """What one worker of a job asks, from its spec's ``resources``: CPUs, GPUs, memory, the
    accelerator type (``""``: any) and the market (spot, on-demand, or ``any``). It decides which
    flavors the job may draw from (``ResourceFlavor.refuses``) and how much of each it counts."""

    cpu: float = 1.0
    gpu: float = 0.0
    memory_gb: float = 0.0
    accelerator: str = ""
    market: str = ANY_MARKET

    def __post_init__(self) -> None:
        # Looked up for every quota and capacity sum of a pass: one dict, made once.
        object.__setattr__(self, "_amounts", {"workers": 1.0, "cpu": self.cpu, "gpu": self.gpu,
                                              "memory_gb": self.memory_gb})

    def amount(self, resource: str) -> float:
        """What one worker counts of ``resource`` (``workers``: one)."""
        return self._amounts[resource]

    def describe(self) -> str:
        parts = [f"{self.cpu:g} CPU"] + ([f"{self.gpu:g} {self.accelerator or 'GPU'}"] if self.gpu else [])
        parts += [f"{self.memory_gb:g} GB"] if self.memory_gb else []
        return " + ".join(parts) + ("" if self.market == ANY_MARKET else f", {self.market}")


DEFAULT_SHAPE = WorkerShape()


def _amount_problem(value: object, what: str) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_AMOUNT:
        return f"got {quote(value)}; {what} is a number in 0..{MAX_AMOUNT:g}"
    return None


@dataclass(frozen=True)
class ResourceFlavor:
    """A kind of node a job's workers run on, in the service's flavor table (Kueue's
    ResourceFlavor): its market and accelerator (``""``: CPU only), written on nodes as Ray's
    labels (``control/node_roles.Flavor``); which ``resources`` quotas count on it; the price of
    each resource an hour (spot and on-demand priced apart, so cost per token follows where a
    job ran); and, for autoscaling, the most of each resource its node groups can reach
    (``max_*``; None: what Ray's cluster config says, else what is up now).

    The implicit flavor (``implicit()``: ``DEFAULT_FLAVOR``, no market) is the service without a
    table: it counts workers, fits every job and selects no node."""

    name: str
    market: str
    accelerator: str = ""
    resources: tuple[str, ...] = ("cpu", "gpu")
    usd_per_cpu_hour: float = 0.0
    usd_per_gpu_hour: float = 0.0
    usd_per_memory_gb_hour: float = 0.0
    max_cpu: Optional[float] = None
    max_gpu: Optional[float] = None
    max_memory_gb: Optional[float] = None

    @classmethod
    def implicit(cls) -> "ResourceFlavor":
        return cls(DEFAULT_FLAVOR, "", resources=("workers",))

    @property
    def is_implicit(self) -> bool:
        return self.market == ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", tuple(self.resources))
        if self.is_implicit:
            return
        problem = name_problem(self.name, "flavor name")
        if problem or self.name == DEFAULT_FLAVOR:
            raise ServiceInputError("flavor.name", problem or f"got {quote(self.name)}; reserved: the service's "
                                                              f"flavor when it has no table")
        if self.market not in MARKETS:
            raise ServiceInputError("flavor.market", f"got {quote(self.market)}; one of {', '.join(MARKETS)}")
        if self.accelerator and (not isinstance(self.accelerator, str) or not _ACCELERATOR_RE.fullmatch(self.accelerator)):
            raise ServiceInputError("flavor.accelerator", f"got {quote(self.accelerator)}; Ray's accelerator type "
                                                          f"(e.g. A10G, H100), or empty for CPU nodes")
        unknown = [r for r in self.resources if r not in RESOURCES]
        if not self.resources or unknown or len(set(self.resources)) != len(self.resources):
            raise ServiceInputError("flavor.resources", f"got {quote(list(self.resources))}; one or more of "
                                                        f"{', '.join(RESOURCES)}, each once")
        for field in ("usd_per_cpu_hour", "usd_per_gpu_hour", "usd_per_memory_gb_hour", "max_cpu", "max_gpu",
                      "max_memory_gb"):
            value = getattr(self, field)
            if value is None and field.startswith("max_"):
                continue
            problem = _amount_problem(value, "it")
            if problem:
                raise ServiceInputError(f"flavor.{field}", problem)

    def refuses(self, shape: WorkerShape) -> Optional[str]:
        """Why a worker of ``shape`` cannot draw from this flavor, or None: the market must match
        (``any`` takes either); a GPU worker needs a GPU flavor of its accelerator type (any, if it
        names none); a CPU worker draws from CPU flavors, so GPU nodes stay for GPU jobs."""
        if self.is_implicit:
            return None
        if shape.market != ANY_MARKET and shape.market != self.market:
            return f"{self.name} is {self.market}, the job asks resources.market={shape.market}"
        if shape.gpu > 0:
            if not self.accelerator:
                return f"{self.name} has no GPUs, the job asks resources.gpus_per_worker={shape.gpu:g}"
            if shape.accelerator and shape.accelerator != self.accelerator:
                return f"{self.name} has {self.accelerator}, the job asks resources.accelerator_type={shape.accelerator}"
        elif self.accelerator:
            return f"{self.name} is a GPU flavor ({self.accelerator}), the job asks no GPU"
        return None

    def node_selector(self) -> dict[str, str]:
        """The job spec's fields that put its workers on this flavor's nodes (the worker group
        turns them into its placement groups' label selector); none for the implicit flavor."""
        if self.is_implicit:
            return {}
        return {"resources.market": self.market, **({"resources.accelerator_type": self.accelerator}
                                                    if self.accelerator else {})}

    def usd_per_worker_hour(self, shape: WorkerShape) -> float:
        """What a worker of ``shape`` costs an hour here (0: the flavor has no price)."""
        return (shape.cpu * self.usd_per_cpu_hour + shape.gpu * self.usd_per_gpu_hour
                + shape.memory_gb * self.usd_per_memory_gb_hour)

    def ceiling(self) -> dict[str, float]:
        """The configured ceiling per resource (only those set)."""
        caps = {"cpu": self.max_cpu, "gpu": self.max_gpu, "memory_gb": self.max_memory_gb}
        return {r: v for r, v in caps.items() if v is not None}


def flavor_from_dict(raw: object, where: str = "flavor") -> ResourceFlavor:
    """A flavor of a table file (``service start --flavors``): its fields, checked, an unknown key
    or a wrong type named (``where``: how the errors name it)."""
    fields = [f for f in ResourceFlavor.__dataclass_fields__]
    if not isinstance(raw, dict):
        raise ServiceInputError(where, f"got {quote(raw)}; a flavor is a mapping of {', '.join(fields)}")
    unknown = sorted(set(map(str, raw)) - set(fields))
    if unknown:
        raise ServiceInputError(f"{where}.{unknown[0]}", f"unknown field; a flavor has {', '.join(fields)}")
    values = dict(raw)
    if isinstance(values.get("resources"), list):
        values["resources"] = tuple(values["resources"])
    for key in ("name", "market", "accelerator"):
        if key in values and not isinstance(values[key], str):
            raise ServiceInputError(f"{where}.{key}", f"got {quote(values[key])}; a string")
    try:
        return ResourceFlavor(**values)
    except TypeError as exc:  # a required field left out
        raise ServiceInputError(where, f"{exc}; a flavor needs at least name and market") from None


def check_flavor_table(flavors: "tuple[ResourceFlavor, ...] | list[ResourceFlavor]") -> tuple[ResourceFlavor, ...]:
    """A flavor table as the service keeps it: names unique, and no two flavors of one market and
    accelerator (they would select the same nodes and count them twice)."""
    names, kinds = set(), {}
    for i, f in enumerate(flavors):
        if f.name in names:
            raise ServiceInputError(f"flavors[{i}].name", f"got {quote(f.name)} twice; each flavor has its own name")
        names.add(f.name)
        kind = (f.market, f.accelerator)
        if kind in kinds:
            raise ServiceInputError(f"flavors[{i}]", f"{f.name} selects the nodes of {kinds[kind]} (market "
                                                     f"{f.market}, accelerator {f.accelerator or 'none'}): one flavor "
                                                     f"per kind of node")
        kinds[kind] = f.name
    return tuple(flavors)


def no_flavor_reason(shape: WorkerShape, flavors: "tuple[ResourceFlavor, ...] | list[ResourceFlavor]") -> str:
    """Why a worker of ``shape`` may draw from none of ``flavors`` (each one's refusal)."""
    if not flavors:
        return "the service has no flavor"
    return "fits no flavor: " + "; ".join(f.refuses(shape) or f.name for f in flavors)


def shape_refusal(shape: WorkerShape, flavors: "tuple[ResourceFlavor, ...] | list[ResourceFlavor]"
                  ) -> Optional[tuple[str, str]]:
    """(the spec field at fault, why) when a worker of ``shape`` may draw from none of ``flavors``;
    None when it may (or the service has no table). The field is the one whose change alone would
    let it: ``resources.market``, else ``resources.accelerator_type``, else
    ``resources.gpus_per_worker``."""
    if not flavors or any(f.refuses(shape) is None for f in flavors):
        return None

    def fits(**change) -> bool:
        return any(f.refuses(replace(shape, **change)) is None for f in flavors)

    if shape.market != ANY_MARKET and fits(market=ANY_MARKET):
        field = "resources.market"
    elif shape.accelerator and fits(accelerator=""):
        field = "resources.accelerator_type"
    else:
        field = "resources.gpus_per_worker"
    return field, f"a worker of {shape.describe()} {no_flavor_reason(shape, flavors)}"


@dataclass(frozen=True)
class FlavorQuota:
    """A team's quota of one resource on one flavor (Kueue's ClusterQueue resourceGroups): its
    nominal amount, the most it borrows beyond it (None: as much as the cohort lends) and the
    most of it it lends (None: all of it). A team with no quota for a flavor's resource has
    nominal 0 there and may borrow from its cohort."""

    flavor: str
    resource: str
    nominal: float
    borrowing_limit: Optional[float] = None
    lending_limit: Optional[float] = None

    def __post_init__(self) -> None:
        if self.flavor == DEFAULT_FLAVOR:
            raise ServiceInputError("quota.flavor", f"got {quote(self.flavor)}; the service without a flavor table "
                                                    f"counts workers with the team's nominal_workers")
        problem = name_problem(self.flavor, "flavor name")
        if problem:
            raise ServiceInputError("quota.flavor", problem)
        if self.resource not in RESOURCES:
            raise ServiceInputError("quota.resource", f"got {quote(self.resource)}; one of {', '.join(RESOURCES)}")
        for field in ("nominal", "borrowing_limit", "lending_limit"):
            value = getattr(self, field)
            if value is None and field != "nominal":
                continue
            problem = _amount_problem(value, f"a quota of {self.resource}")
            if problem:
                raise ServiceInputError(f"quota.{field}", problem)
        if self.lending_limit is not None and self.lending_limit > self.nominal:
            raise ServiceInputError("quota.lending_limit", f"got {self.lending_limit:g}; must not exceed nominal "
                                                           f"{self.nominal:g}")


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

    These worker fields are its quota on the implicit flavor (a service with no flavor table).
    With a table, ``quotas`` holds its quota per flavor and resource (``FlavorQuota``), read
    through ``quota(flavor, resource)``, with the same cohort and weight.
    """

    name: str
    nominal_workers: int
    cohort: Optional[str] = None
    borrowing_limit_workers: Optional[int] = None
    lending_limit_workers: Optional[int] = None
    weight: float = 1.0
    quotas: tuple[FlavorQuota, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "quotas", tuple(self.quotas))
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

    def quota(self, flavor: str, resource: str) -> tuple[float, Optional[float], Optional[float]]:
        """(nominal, borrowing limit, lending limit) of ``resource`` on ``flavor``: the worker
        fields on the implicit flavor, else its ``FlavorQuota`` (none: nominal 0, borrowing from
        the cohort unlimited, nothing to lend)."""
        if flavor == DEFAULT_FLAVOR:
            return self.nominal_workers, self.borrowing_limit_workers, self.lending_limit_workers
        for q in self.quotas:
            if q.flavor == flavor and q.resource == resource:
                return q.nominal, q.borrowing_limit, q.lending_limit
        return 0, None, 0


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

    def view(self) -> "JobView":
        """What the scheduler sees of this job."""
        return JobView(id=self.id, team=self.team, priority=self.priority, state=self.state,
                       min_workers=self.min_workers, max_workers=self.max_workers,
                       elastic=self.elastic, workers=self.workers,
                       target_workers=self.target_workers, submitted_at_s=self.submitted_at_s,
                       waiting_since_s=self.waiting_since_s, started_at_s=self.started_at_s,
                       last_checkpoint_at_s=self.last_checkpoint_at_s, held=self.held, shape=self.shape,
                       flavor=self.flavor or "", group=self.sweep_id, rung=self.rung)


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


@dataclass(frozen=True)
class FlavorState:
    """One flavor as a scheduling pass sees it: its table entry, the capacity the scheduler may
    give out (``ceiling``: what is up now, or with autoscaling what its node groups can reach)
    and what is up now (``present``; None: the ceiling). Capacity is per resource: ``workers``
    for the implicit flavor, else ``cpu``, ``gpu``, ``memory_gb`` (Ray's CPU, GPU, memory)."""

    flavor: ResourceFlavor
    ceiling: tuple[tuple[str, float], ...]
    present: Optional[tuple[tuple[str, float], ...]] = None

    def __post_init__(self) -> None:
        for name in ("ceiling", "present"):  # a mapping given: kept as sorted pairs (the state hashes)
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, tuple(sorted(value.items())))

    @property
    def name(self) -> str:
        return self.flavor.name

    def capacity(self, present: bool = False) -> dict[str, float]:
        return dict(self.ceiling if not present or self.present is None else self.present)


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


# ----------------------------------------------------------------------------- scheduler output


@dataclass(frozen=True)
class Admit:
    """Start a queued job (or resume a paused one from its checkpoint) on ``workers`` of
    ``flavor``; ``provisioning``: admitted against capacity not up yet (autoscaling), so its
    workers wait for nodes."""

    job_id: int
    workers: int
    reason: str
    flavor: str = DEFAULT_FLAVOR
    provisioning: bool = False

    def __str__(self) -> str:
        where = "" if self.flavor == DEFAULT_FLAVOR else f" of {self.flavor}"
        return f"admit job {self.job_id} on {self.workers} workers{where}: {self.reason}"


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
           "MAX_WEIGHT", "MAX_JOB_ID", "JOB_NAME_MAX_CHARS", "JOB_NAME_PATTERN", "job_name_problem",
           "name_problem", "team_ref_problem", "check_team_name", "check_count", "JobState",
           "TransitionNotAllowed", "LIVE_STATES", "SweepState", "SweepRecord", "SweepTransitionRecord", "WaitCause", "RunnerState",
           "RunOutcome", "RunnerResult", "RESOURCES", "DEFAULT_FLAVOR", "ANY_MARKET",
           "MARKETS", "MAX_AMOUNT", "ACCELERATOR_PATTERN", "WorkerShape", "DEFAULT_SHAPE", "ResourceFlavor",
           "check_flavor_table", "flavor_from_dict", "no_flavor_reason", "shape_refusal", "FlavorQuota",
           "FlavorState", "Team", "JobRecord", "TransitionRecord", "AuditRecord", "JobView", "Snapshot", "Admit",
           "Grow", "Shrink", "Pause", "Wait", "Action", "Policy", "DEFAULT_POLICY"]
