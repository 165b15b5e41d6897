"""The job service's HTTP API (``/v1``): the FastAPI app, its routes, who may ask and the
statuses of its errors; ``serve`` runs it with uvicorn on a thread.

Owns: the paths, their status codes and their published description (``DESCRIPTION``);
authentication (a team acts on its own jobs only, the admin on every team's) and the teams'
admin calls; the refusals only the API sees (401, 403, 404) and their audit rows (``auth``). The
schema every request is held to and every response's form are ``service/schema.py``'s (its
models are the OpenAPI document's). The requests themselves (submit, pause, resume, cancel: what
each writes, in which states) are ``service/requests.py``'s, called once a request passed its
checks here; it never writes a run-time transition (the reconciler's). The front door
(``service/door.py``) bounds every body and answers every refusal in one shape.

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
from typing import Annotated, Any, Optional, Union

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from raytrain_sys.errors import JobStateConflict, ServiceInputError, ServiceStoreError, UserError, quote
from raytrain_sys.service import auth, door, packages, requests
from raytrain_sys.service.flavors import ResourceFlavor
from raytrain_sys.service.model import JobProgress, JobRecord, JobState, SweepRecord
from raytrain_sys.service.teams import FlavorQuota, Team
from raytrain_sys.service.schema import (LOG_CHUNK_BYTES, ActionIn, CancelIn, ErrorOut, FlavorName, FlavorOut,
                                         FlavorsIn, HealthOut, JobId, JobOut, LogLimit, LogOffset, PackageOut,
                                         ProgressOut, QuotasIn, RevokedOut, Sha256, SubmitIn, SweepId, SweepOut,
                                         SweepSubmitIn, TeamAddIn, TeamOut, TeamRef, TeamUpdateIn, TokenOut,
                                         TransitionOut)
from raytrain_sys.service.store import Principal, Store
from raytrain_sys.service.sweeps import requests as sweep_requests

log = logging.getLogger(__name__)

# The OpenAPI document's description (/openapi.json, /docs): what a client reads, kept apart from
# the contract above so that either may change without the other.
DESCRIPTION = """The job service's HTTP API (``/v1``): submit, list, inspect, pause, resume and cancel jobs;
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
1 MiB), 503 the database is unreachable."""

API_PREFIX = "/v1"
SERVE_START_TIMEOUT_S = 10.0  # uvicorn binds no port itself (we pass the socket); startup is ~0.1 s
PAGE_FILE = Path(__file__).with_name("page") / "jobs.html"
BEARER = HTTPBearer(auto_error=False, description="a service token: 'Authorization: Bearer rts_...' "
                                                  "(service init-admin; teams token NAME)")


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
                  description=DESCRIPTION,
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
    def logs(job_id: JobId, offset: LogOffset = 0, limit: LogLimit = LOG_CHUNK_BYTES,
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
