"""The job service's HTTP API schema: the pydantic models of every request body and response,
and the annotated types of its path and query parameters. Together they are the published
OpenAPI document (``/openapi.json``): a class's name is a schema's name there, so renaming one
changes the API.

Owns: each body field's, query's and path parameter's type, bounds (``bounds.py``: worker counts,
priorities, weights, job ids), lengths and patterns (a team's name: ``bounds.NAME_RULE``); that a
body has exactly its fields, each of exactly its JSON type (``_Body``), and how the API's errors
name them (``field_prefix``); an integral number taken as its int; the responses' forms of the
store's records (``JobOut.of``, ``TeamOut.of``, ``FlavorOut.of``). A value the schema refuses is
refused in the words the client, the CLI and the store use (``model.name_problem``, ...). A job
spec given as a mapping is described by the spec's own model (``raytrain_sys.spec.json_schema``:
each section and field, its type, default and description) and checked by it behind the API.

Never: a route, who may ask, a status code or a write (``api.py``, ``auth``, ``requests``). What
the schema cannot say (a spec's own rules, a lending limit above the nominal quota, an unknown
team) is checked by the code behind it and refused the same way.
"""

from __future__ import annotations

import dataclasses
import decimal
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Optional

from annotated_types import Interval
from fastapi import Path as PathParam
from fastapi import Query
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from raytrain_sys.errors import quote
from raytrain_sys.service import door
from raytrain_sys.control.node_roles import MARKETS
from raytrain_sys.service.bounds import (JOB_NAME_MAX_CHARS, JOB_NAME_PATTERN, MAX_JOB_ID, MAX_WEIGHT, MAX_WORKERS,
                                         NAME_MAX_CHARS, NAME_PATTERN, NAME_RULE, PRIORITY_LIMIT, RESERVED_TEAM_NAMES,
                                         TEAM_REF_MAX_CHARS, TEAM_REF_PATTERN, name_problem, team_ref_problem)
from raytrain_sys.service.flavors import ACCELERATOR_PATTERN, DEFAULT_FLAVOR, MAX_AMOUNT, RESOURCES, ResourceFlavor
from raytrain_sys.service.model import JobRecord, JobState, SweepState, WaitCause
from raytrain_sys.service.teams import Team
from raytrain_sys.service.sweeps import requests as sweep_requests
from raytrain_sys.spec import json_schema as spec_json_schema

LOG_CHUNK_BYTES = 1 << 20  # one logs answer at most (1 MiB); a follower asks again from next_offset
MAX_LOG_OFFSET = 2 ** 63 - 1  # a file offset is a signed 64-bit number
MAX_REASON_CHARS = 500  # a request's reason: a sentence, recorded with its transition
MAX_OVERRIDES = 200  # a spec has about 150 fields: an override for each, and room
OVERRIDE_MAX_CHARS = 4096  # one "dotted.key=value": a long path or list, not a file's content
ONE_LINE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"  # no control characters: a reason stays one line in every log
OVERRIDE_PATTERN = r"^[^=\x00-\x1f\x7f-\x9f]+=[^\x00-\x1f\x7f-\x9f]*$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
MAX_FLAVORS = 64  # a flavor table: a kind of node each (market x accelerator type); far more than any cluster has


class ErrorOut(BaseModel):
    error: str = Field(description="one line: what was wrong and what to do")
    field: Optional[str] = Field(None, description="the request or spec field at fault (400)")


def _held_to(problem) -> AfterValidator:
    """A pydantic validator refusing what ``problem(value)`` names, in its words (the same
    message as the client, the CLI and the store give)."""
    def check(value):
        why = problem(value)
        if why:
            raise ValueError(why)
        return value
    return AfterValidator(check)


def _sha256_problem(value: str) -> Optional[str]:
    if re.fullmatch(SHA256_PATTERN, value):
        return None
    return f"got {quote(value)}; a package is named by its sha256: 64 lower-case hex digits"


def _override_problem(value: str) -> Optional[str]:
    if len(value) <= OVERRIDE_MAX_CHARS and re.fullmatch(OVERRIDE_PATTERN, value):
        return None
    return f"got {quote(value)}; an override is one line 'dotted.key=value' of at most {OVERRIDE_MAX_CHARS} characters"


def _spec_problem(value: Any) -> Optional[str]:
    if isinstance(value, dict) or (isinstance(value, str) and len(value) <= door.JSON_BODY_MAX_BYTES):
        return None
    return f"got {type(value).__name__} {quote(value)}; the job spec is a mapping of its sections, or its YAML text"


NewTeamName = Annotated[str, _held_to(name_problem), WithJsonSchema({
    "type": "string", "minLength": 1, "maxLength": NAME_MAX_CHARS, "pattern": NAME_PATTERN,
    "not": {"enum": sorted(RESERVED_TEAM_NAMES)},
    "description": f"a new team's name: {NAME_RULE}; not {', '.join(sorted(RESERVED_TEAM_NAMES))}"})]
CohortName = Annotated[str, _held_to(lambda v: name_problem(v, "cohort name")), WithJsonSchema({
    "type": "string", "minLength": 1, "maxLength": NAME_MAX_CHARS, "pattern": NAME_PATTERN,
    "description": f"teams of a cohort lend each other unused quota; a cohort's name: {NAME_RULE}"})]
TeamRef = Annotated[str, _held_to(team_ref_problem), WithJsonSchema({
    "type": "string", "minLength": 1, "maxLength": TEAM_REF_MAX_CHARS, "pattern": TEAM_REF_PATTERN,
    "description": "an existing team's name (a team made before the name rule may have any name without '/' or "
                   "control characters)"})]
Sha256 = Annotated[str, _held_to(_sha256_problem), WithJsonSchema({
    "type": "string", "pattern": SHA256_PATTERN, "minLength": 64, "maxLength": 64,
    "description": "a code package's sha256 (64 lower-case hex digits)"})]
Override = Annotated[str, _held_to(_override_problem), WithJsonSchema({
    "type": "string", "maxLength": OVERRIDE_MAX_CHARS, "pattern": OVERRIDE_PATTERN,
    "description": '"dotted.key=value" applied to the spec'})]
SpecIn = Annotated[Any, _held_to(_spec_problem), WithJsonSchema({
    "anyOf": [{**spec_json_schema(), "description": "the spec's sections (docs/spec_reference.md)"},
              {"type": "string", "maxLength": door.JSON_BODY_MAX_BYTES, "description": "its YAML or JSON text"}],
    "description": "the job spec: a mapping, or its YAML text"})]
FlavorName = Annotated[str, _held_to(lambda v: name_problem(v, "flavor name") or (
    f"got {quote(v)}; reserved: the service's flavor when it has no table" if v == DEFAULT_FLAVOR else None)),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": NAME_MAX_CHARS, "pattern": NAME_PATTERN,
                    "not": {"enum": [DEFAULT_FLAVOR]},
                    "description": f"a flavor of the service's table: {NAME_RULE}; not {DEFAULT_FLAVOR}"})]
Resource = Annotated[str, _held_to(lambda v: None if v in RESOURCES else f"got {quote(v)}; one of {', '.join(RESOURCES)}"),
                     WithJsonSchema({"type": "string", "enum": list(RESOURCES),
                                     "description": "what a quota counts: workers, or per worker cpu, gpu, memory_gb"})]
Amount = Annotated[float, Field(ge=0, le=MAX_AMOUNT, allow_inf_nan=False)]

JSON_NUMBER_PATTERN = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"  # RFC 8259's number


def _integral_number(value: Any) -> Any:
    """A body's integral float (``185.0``) as its int. The schema's ``integer`` is JSON Schema's:
    any number without a fractional part, 185.0 included (and a JSON writer may send 185 so:
    JavaScript's numbers cannot tell them apart). 185.5, "185" and true stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _integral_text(value: Any) -> Any:
    """A query's or path's integer written as an integral JSON number (``185.0``, ``1e+18``: how a
    client writes an integral float) as its int, exactly; other text is left to the int parser
    (a value past 2^64 is out of every bound here: it stays text, and is refused)."""
    if isinstance(value, str) and re.fullmatch(JSON_NUMBER_PATTERN, value) and not value.lstrip("-").isdigit():
        number = decimal.Decimal(value)
        if abs(number) <= 2 ** 64 and number == number.to_integral_value():
            return int(number)
    return value


def integer(low: int, high: int, convert: Callable[[Any], Any] = _integral_number) -> Any:
    """An integer of ``low``..``high`` (the schema's minimum and maximum) that takes an integral
    number as its int (``_integral_number`` for a body, ``_integral_text`` for a query or a
    path). The bounds come before the conversion: so placed, the schema states them."""
    return Annotated[int, Interval(ge=low, le=high), BeforeValidator(convert)]


JobId = Annotated[integer(1, MAX_JOB_ID, _integral_text), PathParam(description="a job's id")]
SweepId = Annotated[integer(1, MAX_JOB_ID, _integral_text), PathParam(description="a sweep's id")]
LogOffset = Annotated[integer(0, MAX_LOG_OFFSET, _integral_text), Query()]  # GET /v1/jobs/{id}/logs: from byte
LogLimit = Annotated[integer(1, LOG_CHUNK_BYTES, _integral_text), Query()]  # and at most this many
Workers = integer(0, MAX_WORKERS)
Priority = integer(-PRIORITY_LIMIT, PRIORITY_LIMIT)
Weight = Annotated[float, Field(gt=0, le=MAX_WEIGHT, allow_inf_nan=False)]


def _no_default(schema: dict) -> None:
    schema.pop("default", None)  # optional, but not nullable: leaving it out keeps the value


class _Body(BaseModel):
    """A request body: exactly its declared fields (an unknown one is refused; the schema says
    ``additionalProperties: false``), each of exactly its JSON type ("1" is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    field_prefix: ClassVar[str] = ""  # how the API's errors name this body's fields


class SubmitIn(_Body):
    spec: SpecIn
    team: Optional[TeamRef] = Field(None, description="default: the token's team (required with an admin token)")
    priority: Priority = Field(0, description="higher is more important")
    name: Optional[str] = Field(None, min_length=1, max_length=JOB_NAME_MAX_CHARS, pattern=JOB_NAME_PATTERN,
                                description="default: the spec's name")
    overrides: list[Override] = Field(default_factory=list, max_length=MAX_OVERRIDES,
                                      description='"dotted.key=value" applied to the spec')
    package: Optional[Sha256] = Field(None, description="the sha256 of a code package the team uploaded "
                                                        "(PUT /v1/teams/{name}/packages/{sha256}): the job's working directory")


class ActionIn(_Body):
    reason: Optional[str] = Field(None, max_length=MAX_REASON_CHARS, pattern=ONE_LINE_PATTERN,
                                  description="recorded with the transition (one line)")


class CancelIn(ActionIn):
    delete_checkpoints: bool = Field(False, description="delete the job's checkpoints once it has ended")


class JobOut(BaseModel):
    id: int
    team: str
    name: str
    priority: int
    state: JobState
    held: bool = Field(description="paused by its team: the scheduler leaves it waiting until resumed")
    min_workers: int
    max_workers: int
    elastic: bool
    workers: int = Field(description="workers it holds now")
    target_workers: int = Field(description="workers the runner was last told to have")
    restarts: int
    steps_redone: int = Field(0, description="steps its runs committed and then trained again (a runner lost and "
                                             "the job restarted from its checkpoint, or a run that restored one)")
    mlflow_run_id: Optional[str]
    last_checkpoint_step: Optional[int]
    last_checkpoint_at_s: Optional[float]
    submitted_at_s: float
    waiting_since_s: float
    started_at_s: Optional[float]
    updated_at_s: float
    message: str = Field(description="the last transition's reason")
    delete_checkpoints: bool
    package: Optional[str] = Field(None, description="the code package it runs with (sha256), if any")
    wait_cause: Optional[WaitCause] = Field(
        description="why it is not running yet (queued, paused, starting or resuming): the scheduler's cause "
                    "(held ... releasing) or its start's step (runner_start ... restore); null once it runs or has "
                    "ended, and before the service's first look at it")
    wait_reason: Optional[str] = Field(description="that reason in a sentence (null with wait_cause)")
    wait_cause_since_s: Optional[float] = Field(description="since when that cause holds (null with wait_cause)")
    start_returns: int = Field(description="starts given up in a row (back to the queue, saying why); it fails "
                                           "past the service's max_start_returns; 0 again once it runs")
    cpus_per_worker: float = Field(description="what one worker asks (its spec's resources): CPUs")
    gpus_per_worker: float
    memory_per_worker_gb: float
    accelerator: str = Field(description="the GPU type its workers need; empty: any")
    market: str = Field(description="spot, on-demand or any")
    flavor: Optional[str] = Field(description="the flavor its workers run on (set when admitted; 'default' for a "
                                              "service with no flavor table); null while it waits")
    sweep_id: Optional[int] = Field(None, description="the sweep it is a trial of (docs/SWEEPS.md); null for a job "
                                                    "submitted on its own")
    trial_id: Optional[str] = Field(None, description="its trial's id within that sweep")
    rung: int = Field(0, description="the sweep scheduler's rungs the trial passed (it grows before trials that "
                                     "passed fewer); 0 for other jobs")
    segment: int = Field(0, description="the trial's PBT segment: 0, one more each time PBT exploited the trial "
                                        "(its job ended, this one started from the donor's checkpoint); 0 for "
                                        "other jobs")
    spec: Optional[str] = Field(None, description="the validated spec as stored: JSON text, local paths absolute (GET /v1/jobs/{id} only)")

    @classmethod
    def of(cls, job: JobRecord, *, with_spec: bool = False) -> "JobOut":
        fields = {name: getattr(job, name) for name in cls.model_fields if name != "spec"}
        return cls(**fields, spec=job.spec if with_spec else None)


SweepIn = Annotated[Any, _held_to(_spec_problem), WithJsonSchema({
    "anyOf": [sweep_requests.sweep_json_schema(),
              {"type": "string", "maxLength": door.JSON_BODY_MAX_BYTES, "description": "its YAML or JSON text"}],
    "description": "the sweep spec (docs/SWEEPS.md): base, space, metric, mode, num_samples, scheduler, "
                   "max_workers, keep_stopped; a mapping, or its YAML text"})]


class SweepSubmitIn(_Body):
    sweep: SweepIn
    team: Optional[TeamRef] = Field(None, description="default: the token's team (required with an admin token)")
    priority: Priority = Field(0, description="every trial's priority")


class TrialOut(BaseModel):
    job_id: int
    trial_id: Optional[str]
    state: JobState
    workers: int
    rung: int = Field(description="the sweep scheduler's rungs it passed (it grows first)")
    segment: int = Field(0, description="its PBT segment: a trial exploited by PBT has one job per segment, "
                                        "the newest live, the earlier ones cancelled")
    last_checkpoint_step: Optional[int]


class SweepOut(BaseModel):
    id: int
    team: str
    name: str
    priority: int
    state: SweepState
    max_workers: Optional[int] = Field(description="the cap on the workers its trials hold together; null: none")
    storage_path: str = Field(description="where Ray Tune keeps its experiment (Tuner.restore reads it)")
    mlflow_parent_run_id: Optional[str]
    runner_restarts: int
    best_trial: Optional[str]
    best_value: Optional[float]
    submitted_at_s: float
    updated_at_s: float
    message: str = Field(description="the last transition's reason")
    spec: dict[str, Any] = Field(description="the validated sweep spec, local paths absolute")
    trials: Optional[list[TrialOut]] = Field(None, description="its trials' jobs (GET /v1/sweeps/{id} only)")


class ProgressOut(BaseModel):
    job: JobOut
    progress: Optional[dict[str, Any]] = Field(
        description="its run's live numbers (monitor.report.progress: status, step, max_steps, world_size, "
                    "losses [[step, loss]], tokens_per_s, step_time_s, rank_times, cost, stragglers, "
                    "failures, stacks: the newest workers found hung, stragglers replaced or reads found hung, "
                    "each with the top frame of its stack); null before its run starts or when the service cannot read them")
    answering: Optional[bool] = Field(
        description="a live job's runner answered this poll (true), or not within the poll's 2 s (false: busy, "
                    "starting or lost; progress is then its last answer, of progress_at_s); null for a job with "
                    "no runner to ask (queued, paused, ended)")
    progress_at_s: Optional[float] = Field(description="when progress was read from its runner (unix s); null "
                                                       "when it comes from the run's summary.json, or is null")


class TransitionOut(BaseModel):
    from_state: Optional[JobState] = Field(description="null: the submit that created the job")
    to_state: JobState
    at_s: float
    actor: str
    reason: str


class TeamAddIn(_Body):
    field_prefix: ClassVar[str] = "team."
    name: NewTeamName
    nominal_workers: Workers = Field(description="guaranteed workers")
    cohort: Optional[CohortName] = None
    borrowing_limit_workers: Optional[Workers] = Field(None, description="null: as much as the cohort lends")
    lending_limit_workers: Optional[Workers] = Field(None, description="null: lends all of its nominal quota; "
                                                                       "at most nominal_workers")
    weight: Weight = Field(1.0, description="fair-share weight")


class TeamUpdateIn(_Body):
    """The fields to change (the name is the path's; a team is not renamed). An explicit null
    clears a limit or the cohort; the nominal quota and the weight cannot be null."""

    field_prefix: ClassVar[str] = "team."
    nominal_workers: Workers = Field(None, json_schema_extra=_no_default)
    cohort: Optional[CohortName] = None
    borrowing_limit_workers: Optional[Workers] = None
    lending_limit_workers: Optional[Workers] = None
    weight: Weight = Field(None, json_schema_extra=_no_default)


class QuotaOut(BaseModel):
    flavor: str
    resource: str
    nominal: float
    borrowing_limit: Optional[float] = Field(description="null: as much as the cohort lends")
    lending_limit: Optional[float] = Field(description="null: lends all of its nominal quota")


class TeamOut(BaseModel):
    name: str
    nominal_workers: int = Field(description="its quota of workers on a service with no flavor table")
    cohort: Optional[str]
    borrowing_limit_workers: Optional[int]
    lending_limit_workers: Optional[int]
    weight: float
    quotas: list[QuotaOut] = Field(description="its quota per flavor and resource (a flavor table's; a resource "
                                               "of a flavor not listed: nominal 0, borrowing from its cohort)")

    @classmethod
    def of(cls, team: Team) -> "TeamOut":
        fields = {name: getattr(team, name) for name in cls.model_fields if name != "quotas"}
        return cls(**fields, quotas=[QuotaOut(**dataclasses.asdict(q)) for q in team.quotas])


class QuotaIn(_Body):
    field_prefix: ClassVar[str] = "quota."
    resource: Resource
    nominal: Amount = Field(description="guaranteed amount: workers, CPUs, GPUs or GB")
    borrowing_limit: Optional[Amount] = Field(None, description="null: as much as the cohort lends")
    lending_limit: Optional[Amount] = Field(None, description="null: lends all of its nominal quota; at most nominal")


class QuotasIn(_Body):
    """A team's quotas on one flavor, each resource once; an empty list clears them."""

    quotas: list[QuotaIn] = Field(max_length=len(RESOURCES), json_schema_extra={"uniqueItems": True})


class FlavorIn(_Body):
    field_prefix: ClassVar[str] = "flavor."
    name: FlavorName
    market: str = Field(pattern=f"^({'|'.join(MARKETS)})$", description="Ray's ray.io/market-type label of its nodes")
    accelerator: str = Field("", max_length=64, pattern=f"^$|{ACCELERATOR_PATTERN}",
                             description="Ray's ray.io/accelerator-type label of its nodes (A10G, H100...); empty: "
                                         "CPU nodes")
    resources: list[Resource] = Field(["cpu", "gpu"], min_length=1, max_length=len(RESOURCES),
                                      json_schema_extra={"uniqueItems": True},
                                      description="what team quotas count on it (each once)")
    usd_per_cpu_hour: Amount = 0.0
    usd_per_gpu_hour: Amount = 0.0
    usd_per_memory_gb_hour: Amount = 0.0
    max_cpu: Optional[Amount] = Field(None, description="autoscaling: the most CPUs its node groups reach; null: "
                                                        "Ray's cluster config, else what is up")
    max_gpu: Optional[Amount] = None
    max_memory_gb: Optional[Amount] = None


class FlavorsIn(_Body):
    """The whole flavor table, in its order of preference (a job of any market tries the first
    first); an empty list: the service's implicit flavor (workers, any node)."""

    flavors: list[FlavorIn] = Field(max_length=MAX_FLAVORS)


class FlavorOut(BaseModel):
    name: str
    market: str
    accelerator: str
    resources: list[str]
    usd_per_cpu_hour: float
    usd_per_gpu_hour: float
    usd_per_memory_gb_hour: float
    max_cpu: Optional[float]
    max_gpu: Optional[float]
    max_memory_gb: Optional[float]
    capacity: Optional[dict[str, float]] = Field(description="what the scheduler may give out now per resource "
                                                             "(with autoscaling: the ceiling); null: not known here")

    @classmethod
    def of(cls, flavor: ResourceFlavor, capacity: Optional[dict[str, float]]) -> "FlavorOut":
        fields = {name: getattr(flavor, name) for name in cls.model_fields if name != "capacity"}
        return cls(**fields | {"resources": list(flavor.resources)}, capacity=capacity)


class TokenOut(BaseModel):
    team: str
    token: str = Field(description="shown once: the service keeps only its hash")


class RevokedOut(BaseModel):
    team: str
    revoked: int


class PackageOut(BaseModel):
    sha256: str
    team: str
    size_bytes: int
    files: int
    created_at_s: float


class HealthOut(BaseModel):
    ok: bool
    jobs: dict[str, int] = Field(description="jobs per state")
