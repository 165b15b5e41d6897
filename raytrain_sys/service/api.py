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

Errors are JSON ``{"error": "...", "field": ...}``: 400 a field is wrong (named), 401 no valid
token, 403 another team's job or an admin-only call, 404 no such job or team, 409 the job's
state does not allow the request (named; nothing changed), 413 a package over its limit, 503 the
database is unreachable.

Why FastAPI + uvicorn rather than Ray Serve: the API is one small process that runs beside the
scheduler loop in the service actor (``serve`` starts it on a thread); Serve would add a
controller actor and proxy actors on every cluster for an endpoint that handles a few requests a
minute, and would tie the API's availability to Serve's. FastAPI gives typed request and response
models (pydantic) and the OpenAPI description (``/openapi.json``, ``/docs``) for free; uvicorn is
a plain ASGI server with no cluster dependency, so the API and its tests need no Ray at all.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from raytrain_sys.errors import JobStateConflict, ServiceInputError, ServiceStoreError, UserError
from raytrain_sys.service import auth, packages, requests
from raytrain_sys.service.model import JobRecord, JobState, Team
from raytrain_sys.service.store import Principal, Store

log = logging.getLogger(__name__)

API_PREFIX = "/v1"
LOG_CHUNK_BYTES = 1 << 20  # one logs answer at most (1 MiB); a follower asks again from next_offset
SERVE_START_TIMEOUT_S = 10.0  # uvicorn binds no port itself (we pass the socket); startup is ~0.1 s
PAGE_FILE = Path(__file__).with_name("page") / "jobs.html"
RESERVED_TEAM_NAMES = frozenset({"admin", auth.ANONYMOUS, auth.BOOTSTRAP})  # audit actors


# ----------------------------------------------------------------------------- models


class ErrorOut(BaseModel):
    error: str = Field(description="one line: what was wrong and what to do")
    field: Optional[str] = Field(None, description="the request or spec field at fault (400)")


class SubmitIn(BaseModel):
    spec: Union[dict[str, Any], str] = Field(description="the job spec: a mapping, or its YAML text")
    team: Optional[str] = Field(None, description="default: the token's team (required with an admin token)")
    priority: int = Field(0, description="higher is more important")
    name: Optional[str] = Field(None, description="default: the spec's name")
    overrides: list[str] = Field(default_factory=list, description='"dotted.key=value" applied to the spec')
    package: Optional[str] = Field(None, description="the sha256 of a code package the team uploaded "
                                                     "(PUT /v1/packages/{sha256}): the job's working directory")


class ActionIn(BaseModel):
    reason: Optional[str] = Field(None, max_length=500, description="recorded with the transition")
    delete_checkpoints: bool = Field(False, description="cancel only: delete the job's checkpoints once it ended")


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
    spec: Optional[str] = Field(None, description="the validated spec as stored: JSON text, local paths absolute (GET /v1/jobs/{id} only)")

    @classmethod
    def of(cls, job: JobRecord, *, with_spec: bool = False) -> "JobOut":
        fields = {name: getattr(job, name) for name in cls.model_fields if name != "spec"}
        return cls(**fields, spec=job.spec if with_spec else None)


class ProgressOut(BaseModel):
    job: JobOut
    progress: Optional[dict[str, Any]] = Field(
        description="its run's live numbers (monitor.report.progress: status, step, max_steps, world_size, "
                    "losses [[step, loss]], tokens_per_s, step_time_s, rank_times, cost, stragglers, "
                    "failures); null before its run starts or when the service cannot read them")


class TransitionOut(BaseModel):
    from_state: Optional[JobState] = Field(description="null: the submit that created the job")
    to_state: JobState
    at_s: float
    actor: str
    reason: str


class TeamIn(BaseModel):
    name: Optional[str] = Field(None, description="POST only; PUT takes it from the path")
    nominal_workers: Optional[int] = Field(None, description="guaranteed workers (required on POST)")
    cohort: Optional[str] = None
    borrowing_limit_workers: Optional[int] = Field(None, description="null: as much as the cohort lends")
    lending_limit_workers: Optional[int] = Field(None, description="null: lends all of its nominal quota")
    weight: Optional[float] = Field(None, description="fair-share weight, default 1")


class TeamOut(BaseModel):
    name: str
    nominal_workers: int
    cohort: Optional[str]
    borrowing_limit_workers: Optional[int]
    lending_limit_workers: Optional[int]
    weight: float

    @classmethod
    def of(cls, team: Team) -> "TeamOut":
        return cls(**{name: getattr(team, name) for name in cls.model_fields})


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
    return JSONResponse({"error": auth.redact(str(exc)), "field": getattr(exc, "field", None)},
                        status_code=status, headers=headers)


REFUSALS = (ApiError, auth.NotAuthenticated, auth.NotAllowed, UserError)


# ----------------------------------------------------------------------------- the app


def create_app(store: Store, *, log_dir: Union[str, os.PathLike, None] = None,
               cluster_workers: Union[int, Callable[[], Optional[int]], None] = None,
               base_dir: Optional[str] = None,
               progress: Optional[Callable[[JobRecord], Optional[dict]]] = None) -> FastAPI:
    """The API over ``store``. Job logs are read from ``<log_dir>/job-<id>.log`` (the runner
    writes them; None: the store's log directory, ``Store.log_dir``, which a given one replaces). ``cluster_workers`` (a number, or a function returning the current one) also
    rejects a submit whose min_workers the cluster could never hold; None: quotas only.
    ``base_dir``: where a submitted spec's relative paths point (default: this process's working
    directory; the runner runs elsewhere, so they are stored absolute). ``progress``: a job's
    live numbers for the jobs page (``service/progress.ProgressSource`` in the service); None:
    the page lists the jobs without them."""
    log_root = Path(store.log_dir(os.fspath(log_dir) if log_dir is not None else ""))
    auth.install_log_redaction()
    app = FastAPI(title="raytrain-sys job service", version="1",
                  description=__doc__.split("\n\nWhy FastAPI")[0],
                  responses={400: {"model": ErrorOut}, 401: {"model": ErrorOut}, 403: {"model": ErrorOut},
                             404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 413: {"model": ErrorOut},
                             503: {"model": ErrorOut}})

    for exc_type in (ApiError, auth.NotAuthenticated, auth.NotAllowed, UserError):
        app.add_exception_handler(exc_type, lambda _request, exc: _error_response(exc))

    @app.exception_handler(RequestValidationError)
    def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        field = ".".join(loc) or None
        return JSONResponse({"error": f"field '{field}': {first.get('msg', 'invalid request')}",
                             "field": field}, status_code=400)

    def principal(request: Request) -> Principal:
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

    def job_of(who: Principal, job_id: int) -> JobRecord:
        """The job, if it exists and the principal's team owns it (refusals raise)."""
        try:
            job = store.job(job_id)
        except ServiceInputError:
            raise ApiError(404, f"no job {job_id}", "job_id") from None
        auth.check_team(who, job.team, f"job {job_id}")
        return job

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
                              cluster_workers=cluster_workers() if callable(cluster_workers) else cluster_workers)
        log.info("job %d submitted by %s for team %s (%d..%d workers)", job.id, who.name, team,
                 job.min_workers, job.max_workers)
        return JobOut.of(job)

    # ------------------------------------------------------------------ code packages

    def package_team(who: Principal, team: Optional[str]) -> str:
        team = team if team is not None else who.team
        if team is None:
            raise ServiceInputError("team", "an admin token must name the team the package is for")
        auth.check_team(who, team, "packages")
        return team

    @app.put(f"{API_PREFIX}/packages/{{sha256}}", response_model=PackageOut, status_code=201, tags=["packages"])
    async def upload_package(sha256: str, request: Request,
                             team: Optional[str] = Query(None, description="admin: the team it is for"),
                             who: Principal = Depends(principal)) -> PackageOut:
        """Keep a code package (a zip, ``service/packages.py``) for the team's submits. The body
        is its bytes; ``sha256`` must be theirs. Sending one the team has is not an error."""
        with audited(who, "upload", f"package {sha256[:12]}", record_ok=False):
            team = package_team(who, team)
            data = await _read_limited(request, packages.MAX_BYTES)
        info = await run_in_threadpool(requests.upload_package, store, team=team, sha256=sha256, data=data,
                                       by=who.name)
        return PackageOut(**info)

    @app.get(f"{API_PREFIX}/packages/{{sha256}}", response_model=PackageOut, tags=["packages"])
    def get_package(sha256: str, team: Optional[str] = Query(None, description="admin: whose"),
                    who: Principal = Depends(principal)) -> PackageOut:
        """Whether the team holds a package (404 when not: upload it)."""
        info = store.package_info(sha256, package_team(who, team))
        if info is None:
            raise ApiError(404, f"no package {sha256} for this team", "sha256")
        return PackageOut(**info)

    @app.get(f"{API_PREFIX}/jobs", response_model=list[JobOut], tags=["jobs"])
    def list_jobs(state: Optional[list[JobState]] = Query(None, description="repeatable"),
                  team: Optional[str] = Query(None, description="admin: one team's jobs; a team token: its own"),
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
    def jobs_progress(team: Optional[str] = Query(None, description="admin: one team's jobs; a team token: its own"),
                      who: Principal = Depends(principal)) -> list[ProgressOut]:
        """The jobs the token may list, each with its run's live numbers (the jobs page polls this)."""
        return [ProgressOut(job=JobOut.of(job), progress=progress(job) if progress is not None else None)
                for job in visible_jobs(who, team, None, "get_progress")]

    @app.get("/", include_in_schema=False)
    def jobs_page() -> FileResponse:
        """The jobs page; it asks for a token itself (no token needed to load it)."""
        return FileResponse(PAGE_FILE, media_type="text/html; charset=utf-8")

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}", response_model=JobOut, tags=["jobs"])
    def get_job(job_id: int, who: Principal = Depends(principal)) -> JobOut:
        with audited(who, "get_job", f"job {job_id}", record_ok=False):
            return JobOut.of(job_of(who, job_id), with_spec=True)

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/transitions", response_model=list[TransitionOut], tags=["jobs"])
    def transitions(job_id: int, who: Principal = Depends(principal)) -> list[TransitionOut]:
        """Every state change of the job, oldest first, with who made it and why."""
        with audited(who, "get_transitions", f"job {job_id}", record_ok=False):
            job_of(who, job_id)
        return [TransitionOut(from_state=t.from_state, to_state=t.to_state, at_s=t.at_s, actor=t.actor,
                              reason=t.reason) for t in store.history(job_id)]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/logs", tags=["jobs"], response_class=Response,
             responses={200: {"content": {"text/plain": {}},
                              "description": "log bytes from offset; header X-Next-Offset is where to ask next"}})
    def logs(job_id: int, offset: int = Query(0, ge=0), limit: int = Query(LOG_CHUNK_BYTES, ge=1, le=LOG_CHUNK_BYTES),
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
        """Check what only the API knows (the body, the job's existence and owner: 400, 404, 403,
        audited here), then write the request through ``requests`` (which audits it: ok or 409)."""
        body = body or ActionIn()
        with audited(who, action, f"job {job_id}", record_ok=False):
            if body.delete_checkpoints and action != "cancel":
                raise ServiceInputError("delete_checkpoints", f"applies to cancel only, not {action}")
            job_of(who, job_id)
        reason = body.reason or ""
        if action == "cancel":
            job = requests.cancel(store, job_id, by=who.name, reason=reason,
                                  delete_checkpoints=body.delete_checkpoints)
        else:
            job = getattr(requests, action)(store, job_id, by=who.name, reason=reason)
        log.info("job %d: %s by %s -> %s%s", job_id, action, who.name, job.state.value, " (held)" if job.held else "")
        return JobOut.of(job)

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/pause", response_model=JobOut, tags=["jobs"])
    def pause(job_id: int, body: Optional[ActionIn] = Body(None), who: Principal = Depends(principal)) -> JobOut:
        """Running: checkpoint and release its workers (-> pausing, held; the reconciler makes
        it paused). Queued, paused, starting, resuming or pausing: held, so the scheduler leaves it
        waiting and the reconciler pauses it once it runs. 409 when it is held already or ended."""
        return request("pause", job_id, body, who)

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/resume", response_model=JobOut, tags=["jobs"])
    def resume(job_id: int, body: Optional[ActionIn] = Body(None), who: Principal = Depends(principal)) -> JobOut:
        """Release a job its team paused (held): it waits for admission again (a paused job that
        is admitted resumes from its checkpoint); a hold not carried out yet is dropped."""
        return request("resume", job_id, body, who)

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/cancel", response_model=JobOut, tags=["jobs"])
    def cancel(job_id: int, body: Optional[ActionIn] = Body(None), who: Principal = Depends(principal)) -> JobOut:
        """Queued or paused: cancelled now. Starting, running, resuming or pausing: cancelling
        (the reconciler stops it, then cancelled). ``delete_checkpoints`` is recorded with it."""
        return request("cancel", job_id, body, who)

    # ------------------------------------------------------------------ teams (admin)

    @app.get(f"{API_PREFIX}/teams", response_model=list[TeamOut], tags=["teams"])
    def list_teams(who: Principal = Depends(principal)) -> list[TeamOut]:
        with audited(who, "list_teams", "teams", record_ok=False):
            auth.check_admin(who, "listing teams")
        return [TeamOut.of(t) for t in store.teams()]

    @app.post(f"{API_PREFIX}/teams", response_model=TeamOut, status_code=201, tags=["teams"])
    def add_team(body: TeamIn, who: Principal = Depends(principal)) -> TeamOut:
        with audited(who, "add_team", f"team {body.name}"):
            auth.check_admin(who, "adding a team")
            if body.name in RESERVED_TEAM_NAMES:
                raise ServiceInputError("team.name", f"{body.name!r} is reserved (it names a principal in the audit)")
            if body.nominal_workers is None:
                raise ServiceInputError("team.nominal_workers", "required")
            fields = body.model_dump(exclude_none=True)
            team = store.add_team(Team(**fields))
        return TeamOut.of(team)

    @app.put(f"{API_PREFIX}/teams/{{name}}", response_model=TeamOut, tags=["teams"])
    def update_team(name: str, body: TeamIn, who: Principal = Depends(principal)) -> TeamOut:
        """Change the fields given (an explicit null clears a limit or the cohort); the others keep
        their values."""
        with audited(who, "update_team", f"team {name}"):
            auth.check_admin(who, "changing a team")
            if body.name not in (None, name):
                raise ServiceInputError("team.name", f"a team cannot be renamed ({name} -> {body.name})")
            current = _team_or_404(store, name)
            given = body.model_dump(include=body.model_fields_set - {"name"})  # a null nominal or weight: Team refuses
            merged = {f: getattr(current, f) for f in TeamOut.model_fields} | given | {"name": name}
            team = store.update_team(Team(**merged))
        return TeamOut.of(team)

    @app.post(f"{API_PREFIX}/teams/{{name}}/tokens", response_model=TokenOut, status_code=201, tags=["teams"])
    def issue_token(name: str, who: Principal = Depends(principal)) -> TokenOut:
        """A new token for the team, returned once (only its hash is kept)."""
        with audited(who, "issue_token", f"team {name}"):
            auth.check_admin(who, "issuing a token")
            _team_or_404(store, name)
            token = store.issue_token(name)
        return TokenOut(team=name, token=token)

    @app.delete(f"{API_PREFIX}/teams/{{name}}/tokens", response_model=RevokedOut, tags=["teams"])
    def revoke_tokens(name: str, who: Principal = Depends(principal)) -> RevokedOut:
        """Revoke every token of the team."""
        with audited(who, "revoke_tokens", f"team {name}"):
            auth.check_admin(who, "revoking tokens")
            _team_or_404(store, name)
            revoked = store.revoke_tokens(name)
        return RevokedOut(team=name, revoked=revoked)

    return app


async def _read_limited(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"package: {int(declared)} bytes, over the {limit} a package may have", "package")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"package: over the {limit} bytes a package may have", "package")
        chunks.append(chunk)
    return b"".join(chunks)


def _team_or_404(store: Store, name: str) -> Team:
    try:
        return store.team(name)
    except ServiceInputError:
        known = ", ".join(t.name for t in store.teams()) or "none"
        raise ApiError(404, f"unknown team {name!r} (known: {known})", "team") from None


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
          progress: Optional[Callable[[JobRecord], Optional[dict]]] = None) -> ServiceHandle:
    """Run the API with uvicorn on a background thread (port 0: a free one) and return once it
    accepts connections. The socket is bound here, so a port in use fails in the caller."""
    import uvicorn

    app = create_app(store, log_dir=log_dir, cluster_workers=cluster_workers, base_dir=base_dir, progress=progress)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
