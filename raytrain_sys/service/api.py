"""The job service's HTTP API (``/v1``): submit, list, inspect, pause, resume and cancel jobs;
upload the code packages jobs run with (``service/packages.py``); manage teams and their tokens.

Owns: the HTTP form of the service (paths, request and response models, status codes), who may
ask (authentication; a team acts on its own jobs only, the admin on every team's) and the
teams' admin calls. The requests themselves (submit, pause, resume, cancel: what each writes, in
which states, the spec's validation and stored form) are ``service/requests.py``'s, the one
implementation the service actor's methods use too; this module calls it once a request passed
its checks. It never writes a run-time transition (starting, running, paused, finished, ...):
those are the reconciler's, which also finishes every request. Every write and every refusal
leaves an audit row: the refusals only the API sees (401, 403, 404, a wrong body) here
(``auth``), the requests' outcomes (ok, 400 on the spec, 409) in ``requests``.

The jobs page (``GET /``, ``service/page/jobs.html``: static HTML and JavaScript, no build
step and nothing fetched from elsewhere) polls ``GET /v1/progress`` with the token the user
typed in (or gave in the URL fragment, ``/#token=...``, which never reaches a server log), so
it shows exactly what that token may list.

Every request is held to one declared schema (the pydantic models below, which are also the
published OpenAPI document, ``/openapi.json``): each body field, query and path parameter has its
type, bounds (``bounds.py``: worker counts, priorities, weights, job ids), lengths and patterns (a
team's name: ``bounds.NAME_RULE``), and a body has exactly its fields (an unknown one is refused).
What the schema cannot say (a spec's own rules, a lending limit above the nominal quota, an
unknown team) is checked by the code behind it and refused the same way. The front door
(``service/door.py``) bounds every body (413), refuses a body that is not UTF-8 JSON, answers
every refusal of any layer in one shape and audits it.

Errors are JSON ``{"error": "...", "field": ...}``: 400 a field is wrong (named), 401 no valid
token, 403 another team's job or an admin-only call, 404 no such job or team (or path), 405 a
method the path does not have (``Allow`` names those it has), 409 the job's state does not allow
the request (named; nothing changed), 413 a body over its limit (a package 64 MiB, any other
1 MiB), 503 the database is unreachable.

Why FastAPI + uvicorn rather than Ray Serve: the API is one small process that runs beside the
scheduler loop in the service actor (``serve`` starts it on a thread); Serve would add a
controller actor and proxy actors on every cluster for an endpoint that handles a few requests a
minute, and would tie the API's availability to Serve's. FastAPI gives typed request and response
models (pydantic) and the OpenAPI description (``/openapi.json``, ``/docs``) for free; uvicorn is
a plain ASGI server with no cluster dependency, so the API and its tests need no Ray at all.
"""

from __future__ import annotations

import contextlib
import decimal
import errno
import dataclasses
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Optional, Union

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from annotated_types import Interval
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from starlette.concurrency import run_in_threadpool

from raytrain_sys.errors import JobStateConflict, ServiceInputError, ServiceStoreError, UserError, quote
from raytrain_sys.service import auth, door, packages, requests
from raytrain_sys.control.node_roles import MARKETS
from raytrain_sys.service.bounds import (JOB_NAME_MAX_CHARS, JOB_NAME_PATTERN, MAX_JOB_ID, MAX_WEIGHT, MAX_WORKERS,
                                         NAME_MAX_CHARS, NAME_PATTERN, NAME_RULE, PRIORITY_LIMIT, RESERVED_TEAM_NAMES,
                                         TEAM_REF_MAX_CHARS, TEAM_REF_PATTERN, name_problem, team_ref_problem)
from raytrain_sys.service.flavors import ACCELERATOR_PATTERN, DEFAULT_FLAVOR, MAX_AMOUNT, RESOURCES, ResourceFlavor
from raytrain_sys.service.model import JobProgress, JobRecord, JobState, SweepRecord, SweepState, WaitCause
from raytrain_sys.service.teams import FlavorQuota, Team
from raytrain_sys.service.store import Principal, Store
from raytrain_sys.service.sweeps import requests as sweep_requests

log = logging.getLogger(__name__)

API_PREFIX = "/v1"
LOG_CHUNK_BYTES = 1 << 20  # one logs answer at most (1 MiB); a follower asks again from next_offset
SERVE_START_TIMEOUT_S = 10.0  # uvicorn binds no port itself (we pass the socket); startup is ~0.1 s
PAGE_FILE = Path(__file__).with_name("page") / "jobs.html"
MAX_LOG_OFFSET = 2 ** 63 - 1  # a file offset is a signed 64-bit number
MAX_REASON_CHARS = 500  # a request's reason: a sentence, recorded with its transition
MAX_OVERRIDES = 200  # a spec has about 150 fields: an override for each, and room
OVERRIDE_MAX_CHARS = 4096  # one "dotted.key=value": a long path or list, not a file's content
ONE_LINE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"  # no control characters: a reason stays one line in every log
OVERRIDE_PATTERN = r"^[^=\x00-\x1f\x7f-\x9f]+=[^\x00-\x1f\x7f-\x9f]*$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
MAX_FLAVORS = 64  # a flavor table: a kind of node each (market x accelerator type); far more than any cluster has
BEARER = HTTPBearer(auto_error=False, description="a service token: 'Authorization: Bearer rts_...' "
                                                  "(service init-admin; teams token NAME)")


# ----------------------------------------------------------------------------- models


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
    "anyOf": [{"type": "object", "description": "the spec's sections (docs/spec_reference.md)"},
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


# ----------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.status, self.field = status, field


def _status_of(exc: Exception) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, auth.NotAuthenticated):
        return 401
    if isinstance(exc, auth.NotAllowed):
        return 403
    if isinstance(exc, JobStateConflict):
        return 409
    if isinstance(exc, ServiceStoreError):
        return 503
    return 400  # ServiceInputError, SpecError, other UserError


def _error_response(exc: Exception) -> JSONResponse:
    status = _status_of(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return door.refusal(status, str(exc), getattr(exc, "field", None), headers)


REFUSALS = (ApiError, auth.NotAuthenticated, auth.NotAllowed, UserError)


# ----------------------------------------------------------------------------- the app


def create_app(store: Store, *, log_dir: Union[str, os.PathLike, None] = None,
               cluster_workers: Union[int, Callable[[], Optional[int]], None] = None,
               base_dir: Optional[str] = None,
               progress: Optional[Callable[[list[JobRecord]], dict[int, JobProgress]]] = None,
               capacity: Optional[Callable[[], dict[str, dict[str, float]]]] = None) -> FastAPI:
    """The API over ``store``. Job logs are read from ``<log_dir>/job-<id>.log`` (the runner
    writes them; None: the store's log directory, ``Store.log_dir``, which a given one replaces).
    ``cluster_workers`` (a number, or a function returning the current one) also rejects a
    submit whose min_workers the cluster could never hold; None: quotas only.
    ``base_dir``: where a submitted spec's relative paths point (default: this process's working
    directory; the runner runs elsewhere, so they are stored absolute). ``progress``: the live
    numbers of the jobs listed, for the jobs page, in one call (``service/progress.ProgressSource``
    in the service: one bounded wait for all their runners); None:
    the page lists the jobs without them. ``capacity``: each flavor's ceiling per resource (the
    service's), for the submit check and ``GET /v1/flavors``; None: quotas only."""
    log_root = Path(store.log_dir(os.fspath(log_dir) if log_dir is not None else ""))
    auth.install_log_redaction()
    app = FastAPI(title="raytrain-sys job service", version="1",
                  description=__doc__.split("\n\nWhy FastAPI")[0],
                  responses={400: {"model": ErrorOut}, 401: {"model": ErrorOut}, 403: {"model": ErrorOut},
                             404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 413: {"model": ErrorOut},
                             503: {"model": ErrorOut}})

    for exc_type in (ApiError, auth.NotAuthenticated, auth.NotAllowed, UserError):
        app.add_exception_handler(exc_type, lambda _request, exc: _error_response(exc))
    door.install(app, store)

    def principal(request: Request, _bearer: Optional[HTTPAuthorizationCredentials] = Depends(BEARER)) -> Principal:
        try:
            return auth.authenticate(store, request.headers.get("authorization"))
        except auth.NotAuthenticated as e:
            auth.record(store, auth.ANONYMOUS, f"{request.method} {request.url.path}", "-", f"refused (401): {e}")
            raise

    @contextlib.contextmanager
    def audited(who: Principal, action: str, target: str, *, record_ok: bool = True) -> Iterator[dict]:
        """Audit the block: its refusal always, its success when it wrote something. The block
        may name its target better once it knows it (``note["target"]``)."""
        note = {"target": target}
        try:
            yield note
        except REFUSALS as e:
            auth.record(store, who.name, action, note["target"], f"refused ({_status_of(e)}): {e}")
            raise
        if record_ok:
            auth.record(store, who.name, action, note["target"], "ok")

    def owned(who: Principal, kind: str, read: Callable[[int], Any], ident: int) -> Any:
        """The job or sweep ``read(ident)``, if it exists and the principal's team owns it (refusals raise)."""
        try:
            found = read(ident)
        except ServiceInputError:
            raise ApiError(404, f"no {kind} {ident}", f"{kind}_id") from None
        auth.check_team(who, found.team, f"{kind} {ident}")
        return found

    def job_of(who: Principal, job_id: int) -> JobRecord:
        return owned(who, "job", store.job, job_id)

    # ------------------------------------------------------------------ health

    @app.get("/healthz", response_model=HealthOut, tags=["health"])
    def healthz() -> HealthOut:
        """The API is up and its database answers (no token needed)."""
        return HealthOut(ok=True, jobs=store.count_jobs())

    # ------------------------------------------------------------------ jobs

    @app.post(f"{API_PREFIX}/jobs", response_model=JobOut, status_code=201, tags=["jobs"])
    def submit(body: SubmitIn, who: Principal = Depends(principal)) -> JobOut:
        """Queue a job (``requests.submit``). The spec is validated (a wrong field is a 400
        naming it, ``spec.<field>``) and so is its size against the team's quota: a size the team
        could never get is rejected (400, ``spec.elastic.min_workers``, or
        ``spec.resources.num_workers`` for a gang, with the team's ceiling). Nothing is written
        on rejection."""
        team = body.team if body.team is not None else who.team
        with audited(who, "submit", f"team {team}", record_ok=False):  # refusals only the API sees
            if team is None:
                raise ServiceInputError("team", "an admin token must name the team to submit for")
            auth.check_team(who, team, "jobs")
        job = requests.submit(store, team=team, spec=body.spec, overrides=body.overrides, by=who.name,
                              priority=body.priority, name=body.name or "", base_dir=base_dir, package=body.package,
                              cluster_workers=cluster_workers() if callable(cluster_workers) else cluster_workers,
                              capacity=capacity() if capacity is not None else None)
        log.info("job %d submitted by %s for team %s (%d..%d workers)", job.id, who.name, team,
                 job.min_workers, job.max_workers)
        return JobOut.of(job)

    # ------------------------------------------------------------------ code packages
    # Two paths, so that the schema says what each needs: ``/v1/teams/{name}/packages/{sha256}``
    # names the team (the admin's way, and a team's for itself), ``/v1/packages/{sha256}`` is the
    # token's own team's (a team token's; the admin has no team of its own: 403 there).

    def package_team(who: Principal, name: Optional[str]) -> str:
        """The team a package call is for: ``name`` (the path's), else the token's own."""
        if name is None:
            if who.team is None:
                raise auth.NotAllowed("the admin token has no team of its own: name the team, "
                                      "/v1/teams/{name}/packages/{sha256}")
            return who.team
        auth.check_team(who, name, "packages")
        _team_or_404(store, name)
        return name

    async def upload(sha256: str, request: Request, name: Optional[str], who: Principal) -> PackageOut:
        with audited(who, "upload", f"package {sha256[:12]}", record_ok=False):
            team = package_team(who, name)
            data = await request.body()
        info = await run_in_threadpool(requests.upload_package, store, team=team, sha256=sha256, data=data,
                                       by=who.name)
        return PackageOut(**info)

    def held(sha256: str, name: Optional[str], who: Principal) -> PackageOut:
        team = package_team(who, name)
        info = store.package_info(sha256, team)
        if info is None:
            raise ApiError(404, f"no package {sha256} for team {team}: upload it", "sha256")
        return PackageOut(**info)

    package_body = {"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {
        "type": "string", "format": "binary", "maxLength": packages.MAX_BYTES}}}}}

    @app.put(f"{API_PREFIX}/teams/{{name}}/packages/{{sha256}}", response_model=PackageOut, status_code=201,
             tags=["packages"], openapi_extra=package_body)
    async def upload_team_package(name: Annotated[TeamRef, PathParam()], sha256: Sha256, request: Request,
                                  who: Principal = Depends(principal)) -> PackageOut:
        """Keep a code package (a zip, ``service/packages.py``) for the team's submits. The body
        is its bytes (at most 64 MiB: the front door refuses more, 413); ``sha256`` must be
        theirs. Sending one the team has is not an error. A team's token for its own team only."""
        return await upload(sha256, request, name, who)

    @app.get(f"{API_PREFIX}/teams/{{name}}/packages/{{sha256}}", response_model=PackageOut, tags=["packages"])
    def get_team_package(name: Annotated[TeamRef, PathParam()], sha256: Sha256,
                         who: Principal = Depends(principal)) -> PackageOut:
        """Whether the team holds a package (404 when not: upload it)."""
        return held(sha256, name, who)

    @app.put(f"{API_PREFIX}/packages/{{sha256}}", response_model=PackageOut, status_code=201, tags=["packages"],
             openapi_extra=package_body)
    async def upload_package(sha256: Sha256, request: Request, who: Principal = Depends(principal)) -> PackageOut:
        """``PUT /v1/teams/{name}/packages/{sha256}`` for the token's own team (a team token; the
        admin token has none: 403)."""
        return await upload(sha256, request, None, who)

    @app.get(f"{API_PREFIX}/packages/{{sha256}}", response_model=PackageOut, tags=["packages"])
    def get_package(sha256: Sha256, who: Principal = Depends(principal)) -> PackageOut:
        """Whether the token's own team holds a package (404 when not: upload it; the admin
        token has no team: 403)."""
        return held(sha256, None, who)

    @app.get(f"{API_PREFIX}/jobs", response_model=list[JobOut], tags=["jobs"])
    def list_jobs(state: Optional[list[JobState]] = Query(None, max_length=len(JobState), description="repeatable"),
                  team: Optional[TeamRef] = Query(None, description="admin: one team's jobs; a team token: its own"),
                  who: Principal = Depends(principal)) -> list[JobOut]:
        """Jobs in submit order: a team token sees its team's, the admin every team's."""
        return [JobOut.of(j) for j in visible_jobs(who, team, state, "list_jobs")]

    def visible_jobs(who: Principal, team: Optional[str], state: Optional[list[JobState]],
                     action: str) -> list[JobRecord]:
        """The jobs ``who`` may list (its team's; the admin's: every team's or ``team``'s)."""
        if not who.is_admin:
            with audited(who, action, f"team {team}", record_ok=False):
                auth.check_team(who, team or who.team, "the jobs")
            team = who.team
        return store.jobs(states=state, team=team)

    @app.get(f"{API_PREFIX}/progress", response_model=list[ProgressOut], tags=["jobs"])
    def jobs_progress(team: Optional[TeamRef] = Query(None, description="admin: one team's jobs; a team token: "
                                                                        "its own"),
                      who: Principal = Depends(principal)) -> list[ProgressOut]:
        """The jobs the token may list, each with its run's live numbers (the jobs page polls this)."""
        jobs = visible_jobs(who, team, None, "get_progress")
        seen = progress(jobs) if progress is not None else {}
        return [ProgressOut(job=JobOut.of(job), progress=p.numbers, answering=p.answering, progress_at_s=p.at_s)
                for job in jobs for p in [seen.get(job.id) or JobProgress()]]

    @app.get("/", include_in_schema=False)
    def jobs_page() -> FileResponse:
        """The jobs page; it asks for a token itself (no token needed to load it)."""
        return FileResponse(PAGE_FILE, media_type="text/html; charset=utf-8")

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}", response_model=JobOut, tags=["jobs"])
    def get_job(job_id: JobId, who: Principal = Depends(principal)) -> JobOut:
        with audited(who, "get_job", f"job {job_id}", record_ok=False):
            return JobOut.of(job_of(who, job_id), with_spec=True)

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/transitions", response_model=list[TransitionOut], tags=["jobs"])
    def transitions(job_id: JobId, who: Principal = Depends(principal)) -> list[TransitionOut]:
        """Every state change of the job, oldest first, with who made it and why."""
        with audited(who, "get_transitions", f"job {job_id}", record_ok=False):
            job_of(who, job_id)
        return [TransitionOut(from_state=t.from_state, to_state=t.to_state, at_s=t.at_s, actor=t.actor,
                              reason=t.reason) for t in store.history(job_id)]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/logs", tags=["jobs"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "log bytes from offset; header X-Next-Offset is where to ask next",
                              "headers": {"X-Next-Offset": {"required": True,
                                                            "description": "the offset to ask from next",
                                                            "schema": {"type": "integer", "minimum": 0}}}}})
    def logs(job_id: JobId, offset: Annotated[integer(0, MAX_LOG_OFFSET, _integral_text), Query()] = 0,
             limit: Annotated[integer(1, LOG_CHUNK_BYTES, _integral_text), Query()] = LOG_CHUNK_BYTES,
             who: Principal = Depends(principal)) -> Response:
        """The job's log from byte ``offset`` (at most ``limit`` bytes). Empty, with
        X-Next-Offset equal to the offset, when nothing more was written (or the runner has not
        created the log yet); an offset past the end (a log written anew) reads from its end."""
        with audited(who, "get_logs", f"job {job_id}", record_ok=False):
            job_of(who, job_id)
        data, next_offset = _read_log(log_root / f"job-{job_id}.log", offset, limit)
        return Response(content=data, media_type="text/plain; charset=utf-8",
                        headers={"X-Next-Offset": str(next_offset)})

    def request(action: str, job_id: int, body: Optional[ActionIn], who: Principal) -> JobOut:
        """Check what only the API knows (the job's existence and owner: 404, 403, audited here),
        then write the request through ``requests`` (which audits it: ok or 409)."""
        with audited(who, action, f"job {job_id}", record_ok=False):
            job_of(who, job_id)
        reason = (body.reason if body is not None else None) or ""
        if action == "cancel":
            job = requests.cancel(store, job_id, by=who.name, reason=reason,
                                  delete_checkpoints=isinstance(body, CancelIn) and body.delete_checkpoints)
        else:
            job = getattr(requests, action)(store, job_id, by=who.name, reason=reason)
        log.info("job %d: %s by %s -> %s%s", job_id, action, who.name, job.state.value, " (held)" if job.held else "")
        return JobOut.of(job)

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/pause", response_model=JobOut, tags=["jobs"])
    def pause(job_id: JobId, body: Optional[ActionIn] = Body(None), who: Principal = Depends(principal)) -> JobOut:
        """Running: checkpoint and release its workers (-> pausing, held; the reconciler makes
        it paused). Queued, paused, starting, resuming or pausing: held, so the scheduler leaves it
        waiting and the reconciler pauses it once it runs. 409 when it is held already or ended."""
        return request("pause", job_id, body, who)

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/resume", response_model=JobOut, tags=["jobs"])
    def resume(job_id: JobId, body: Optional[ActionIn] = Body(None), who: Principal = Depends(principal)) -> JobOut:
        """Release a job its team paused (held): it waits for admission again (a paused job that
        is admitted resumes from its checkpoint); a hold not carried out yet is dropped."""
        return request("resume", job_id, body, who)

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/cancel", response_model=JobOut, tags=["jobs"])
    def cancel(job_id: JobId, body: Optional[CancelIn] = Body(None), who: Principal = Depends(principal)) -> JobOut:
        """Queued or paused: cancelled now. Starting, running, resuming or pausing: cancelling
        (the reconciler stops it, then cancelled). ``delete_checkpoints`` is recorded with it."""
        return request("cancel", job_id, body, who)

    # ------------------------------------------------------------------ sweeps

    def sweep_of(who: Principal, sweep_id: int) -> SweepRecord:
        return owned(who, "sweep", store.sweep, sweep_id)

    def sweep_out(sweep: SweepRecord, with_trials: bool = False) -> SweepOut:
        return SweepOut(**sweep_requests.sweep_dict(sweep, store.trials(sweep.id) if with_trials else None))

    @app.post(f"{API_PREFIX}/sweeps", response_model=SweepOut, status_code=201, tags=["sweeps"])
    def submit_sweep(body: SweepSubmitIn, who: Principal = Depends(principal)) -> SweepOut:
        """Queue a sweep (``sweeps/requests.submit``): the whole spec is validated and one trial
        must fit the team's quota, before anything is written (400 naming the field:
        ``base.<field>``, ``space.<field>``, ``metric``, ...). The service starts its runner."""
        team = body.team if body.team is not None else who.team
        with audited(who, "submit_sweep", f"team {team}", record_ok=False):
            if team is None:
                raise ServiceInputError("team", "an admin token must name the team to submit for")
            auth.check_team(who, team, "sweeps")
        sweep = sweep_requests.submit(store, team=team, sweep=body.sweep, by=who.name, priority=body.priority,
                                      base_dir=base_dir,
                                      cluster_workers=cluster_workers() if callable(cluster_workers) else cluster_workers,
                                      capacity=capacity() if capacity is not None else None)
        return sweep_out(sweep)

    @app.get(f"{API_PREFIX}/sweeps", response_model=list[SweepOut], tags=["sweeps"])
    def list_sweeps(team: Optional[TeamRef] = Query(None, description="admin: one team's sweeps; a team token: "
                                                                          "its own"),
                    who: Principal = Depends(principal)) -> list[SweepOut]:
        with audited(who, "list_sweeps", "sweeps", record_ok=False):
            if not who.is_admin:
                if team is not None:
                    auth.check_team(who, team, "sweeps")
                team = who.team
        return [sweep_out(s) for s in store.sweeps(team=team)]

    @app.get(f"{API_PREFIX}/sweeps/{{sweep_id}}", response_model=SweepOut, tags=["sweeps"])
    def get_sweep(sweep_id: SweepId, who: Principal = Depends(principal)) -> SweepOut:
        """The sweep with its trials' jobs."""
        with audited(who, "get_sweep", f"sweep {sweep_id}", record_ok=False):
            return sweep_out(sweep_of(who, sweep_id), with_trials=True)

    def sweep_request(action: str, sweep_id: int, body: Optional[ActionIn], who: Principal) -> SweepOut:
        with audited(who, f"{action}_sweep", f"sweep {sweep_id}", record_ok=False):
            sweep_of(who, sweep_id)
        reason = (body.reason if body is not None else None) or ""
        return sweep_out(getattr(sweep_requests, action)(store, sweep_id, by=who.name, reason=reason))

    @app.post(f"{API_PREFIX}/sweeps/{{sweep_id}}/pause", response_model=SweepOut, tags=["sweeps"])
    def pause_sweep(sweep_id: SweepId, body: Optional[ActionIn] = Body(None),
                    who: Principal = Depends(principal)) -> SweepOut:
        """Hold every live trial (each paused as a job is); 409 unless queued or running."""
        return sweep_request("pause", sweep_id, body, who)

    @app.post(f"{API_PREFIX}/sweeps/{{sweep_id}}/resume", response_model=SweepOut, tags=["sweeps"])
    def resume_sweep(sweep_id: SweepId, body: Optional[ActionIn] = Body(None),
                     who: Principal = Depends(principal)) -> SweepOut:
        """Release the trials of a paused sweep; 409 unless paused."""
        return sweep_request("resume", sweep_id, body, who)

    @app.post(f"{API_PREFIX}/sweeps/{{sweep_id}}/cancel", response_model=SweepOut, tags=["sweeps"])
    def cancel_sweep(sweep_id: SweepId, body: Optional[ActionIn] = Body(None),
                     who: Principal = Depends(principal)) -> SweepOut:
        """End the sweep: its runner stops, every live trial is cancelled; 409 once it has ended."""
        return sweep_request("cancel", sweep_id, body, who)

    # ------------------------------------------------------------------ teams (admin)

    @app.get(f"{API_PREFIX}/teams", response_model=list[TeamOut], tags=["teams"])
    def list_teams(who: Principal = Depends(principal)) -> list[TeamOut]:
        with audited(who, "list_teams", "teams", record_ok=False):
            auth.check_admin(who, "listing teams")
        return [TeamOut.of(t) for t in store.teams()]

    @app.post(f"{API_PREFIX}/teams", response_model=TeamOut, status_code=201, tags=["teams"])
    def add_team(body: TeamAddIn, who: Principal = Depends(principal)) -> TeamOut:
        """A new team and its quota (its name: ``bounds.NAME_RULE``; the store checks it again)."""
        with audited(who, "add_team", f"team {body.name}"):
            auth.check_admin(who, "adding a team")
            team = store.add_team(Team(**body.model_dump()))
        return TeamOut.of(team)

    @app.put(f"{API_PREFIX}/teams/{{name}}", response_model=TeamOut, tags=["teams"])
    def update_team(name: Annotated[TeamRef, PathParam()], body: TeamUpdateIn,
                    who: Principal = Depends(principal)) -> TeamOut:
        """Change the fields given (an explicit null clears a limit or the cohort); the others keep
        their values."""
        with audited(who, "update_team", f"team {name}"):
            auth.check_admin(who, "changing a team")
            current = _team_or_404(store, name)
            given = body.model_dump(include=body.model_fields_set)
            merged = {f: getattr(current, f) for f in TeamOut.model_fields} | given | {"name": name}
            team = store.update_team(Team(**merged))
        return TeamOut.of(team)

    @app.put(f"{API_PREFIX}/teams/{{name}}/quotas/{{flavor}}", response_model=TeamOut, tags=["teams"])
    def set_quotas(name: Annotated[TeamRef, PathParam()], flavor: Annotated[FlavorName, PathParam()],
                   body: QuotasIn, who: Principal = Depends(principal)) -> TeamOut:
        """Replace the team's quotas on one flavor of the table (each resource it counts once; an
        empty list clears them: nominal 0 there, borrowing from its cohort)."""
        with audited(who, "set_quotas", f"team {name} on {flavor}"):
            auth.check_admin(who, "setting a team's quotas")
            _team_or_404(store, name)
            team = store.set_quotas(name, flavor, [FlavorQuota(flavor, q.resource, q.nominal, q.borrowing_limit,
                                                               q.lending_limit) for q in body.quotas])
        return TeamOut.of(team)

    # ------------------------------------------------------------------ flavors

    @app.get(f"{API_PREFIX}/flavors", response_model=list[FlavorOut], tags=["flavors"])
    def list_flavors(who: Principal = Depends(principal)) -> list[FlavorOut]:
        """The service's flavor table, in its order, each with its capacity now (any token: a
        team writes its specs' resources.market and accelerator_type for these)."""
        caps = capacity() if capacity is not None else {}
        return [FlavorOut.of(f, caps.get(f.name)) for f in store.flavors()]

    @app.put(f"{API_PREFIX}/flavors", response_model=list[FlavorOut], tags=["flavors"])
    def set_flavors(body: FlavorsIn, who: Principal = Depends(principal)) -> list[FlavorOut]:
        """Replace the flavor table (admin). A flavor live jobs run on cannot be removed (400
        naming them)."""
        with audited(who, "set_flavors", f"{len(body.flavors)} flavors"):
            auth.check_admin(who, "setting the flavor table")
            table = store.set_flavors([ResourceFlavor(**f.model_dump() | {"resources": tuple(f.resources)})
                                       for f in body.flavors])
        caps = capacity() if capacity is not None else {}
        return [FlavorOut.of(f, caps.get(f.name)) for f in table]

    @app.post(f"{API_PREFIX}/teams/{{name}}/tokens", response_model=TokenOut, status_code=201, tags=["teams"])
    def issue_token(name: Annotated[TeamRef, PathParam()], who: Principal = Depends(principal)) -> TokenOut:
        """A new token for the team, returned once (only its hash is kept)."""
        with audited(who, "issue_token", f"team {name}"):
            auth.check_admin(who, "issuing a token")
            _team_or_404(store, name)
            token = store.issue_token(name)
        return TokenOut(team=name, token=token)

    @app.delete(f"{API_PREFIX}/teams/{{name}}/tokens", response_model=RevokedOut, tags=["teams"])
    def revoke_tokens(name: Annotated[TeamRef, PathParam()], who: Principal = Depends(principal)) -> RevokedOut:
        """Revoke every token of the team."""
        with audited(who, "revoke_tokens", f"team {name}"):
            auth.check_admin(who, "revoking tokens")
            _team_or_404(store, name)
            revoked = store.revoke_tokens(name)
        return RevokedOut(team=name, revoked=revoked)

    return app


def _team_or_404(store: Store, name: str) -> Team:
    try:
        return store.team(name)
    except ServiceInputError:
        known = ", ".join(t.name for t in store.teams()) or "none"
        raise ApiError(404, f"unknown team {quote(name)} (known: {known})", "team") from None


def _read_log(path: Path, offset: int, limit: int) -> tuple[bytes, int]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = min(offset, size)
            f.seek(start)
            data = f.read(limit)
    except FileNotFoundError:
        return b"", offset
    return data, start + len(data)


# ----------------------------------------------------------------------------- serving


class ServiceHandle:
    """A running API: ``url`` to reach it, ``stop()`` to shut it down (waits for the thread)."""

    def __init__(self, server, thread: threading.Thread, sock: socket.socket, url: str):
        self._server, self._thread, self._sock, self.url = server, thread, sock, url

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> "ServiceHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(store: Store, host: str = "127.0.0.1", port: int = 0, *,
          log_dir: Union[str, os.PathLike, None] = None,
          cluster_workers: Union[int, Callable[[], Optional[int]], None] = None,
          base_dir: Optional[str] = None,
          progress: Optional[Callable[[list[JobRecord]], dict[int, JobProgress]]] = None,
          capacity: Optional[Callable[[], dict[str, dict[str, float]]]] = None) -> ServiceHandle:
    """Run the API with uvicorn on a background thread (port 0: a free one) and return once it
    accepts connections. The socket is bound here, so a port in use fails in the caller."""
    import uvicorn

    app = create_app(store, log_dir=log_dir, cluster_workers=cluster_workers, base_dir=base_dir, progress=progress,
                     capacity=capacity)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (0 does
    # not), and without it a response's body waits for the client's delayed ACK of its headers
    # (40 ms a request on a kept-alive connection).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is taken (another process listens on it): give the job "
                            f"service another --port, or stop that process") from None
        raise UserError(f"the job service cannot listen on {host}:{port}: {e.strerror or e}; check --host "
                        f"and --port") from None
    # log_config=None: uvicorn leaves the process's logging as it is (its records propagate).
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=True, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="raytrain-sys-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise UserError(f"the job service did not start on {host}:{port} within {SERVE_START_TIMEOUT_S} s")
        time.sleep(0.01)
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://[{bound_host}]:{bound_port}" if family == socket.AF_INET6 else f"http://{bound_host}:{bound_port}"
    log.info("job service API at %s (store %s)", url, store.url)
    return ServiceHandle(server, thread, sock, url)


__all__ = ["create_app", "serve", "ServiceHandle", "API_PREFIX"]
