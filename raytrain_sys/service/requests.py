"""What a user (through the API, the CLI or the service actor's methods) writes: requests, never
run-time outcomes. The one implementation of submit, pause, resume and cancel: the HTTP API
(``api.py``) adds authentication, ownership (403), its status codes and models, and calls these.

Owns the conventions between a request and the reconciler that carries it out. Every function
takes the store and who asks (``by``: a team name or "admin"; whether that principal may touch
the job is the API's check, not this module's), makes one guarded write (``Store.transition``,
guarded on the state read and on ``held``), and records an audit row: ``ok``, or
``refused (409): ...`` / ``refused (400): ...`` (the status the API answers with, so the audit
reads the same whichever way a request came). A request that meets a job which moved
meanwhile reads it again and retries (a few times), so a user's pause racing the scheduler's is
not lost.

The conventions (``model.JobState`` lists the edges):

* **submit** validates the spec with ``raytrain_sys.spec`` after its ``overrides``
  ("dotted.key=value"); a refusal names the request field, ``spec.<field>`` (``spec`` itself
  for text that is not a YAML mapping, ``overrides`` for a malformed override), and writes no
  job. Its local paths (output_dir, data.path, checkpoint.uri and resume_from) are made absolute
  against ``base_dir`` (the runner's process has another working directory; the API's and the
  service actor's base dir is the directory the service was started from). ``train.stop_at_step``
  is refused: a service job stops with a pause request. The job's size: a spec with
  ``elastic.max_workers`` set is elastic in ``elastic.min_workers..elastic.max_workers``; one
  without is a gang of ``resources.num_workers`` (the runner starts a run on the admitted count
  and the Supervisor grows only up to ``elastic.max_workers or resources.num_workers``, so a
  spec without a max could never grow back past its admission). A size the team could never
  get is refused on the field that sets it (``spec.elastic.min_workers`` or
  ``spec.resources.num_workers``). Its workers' shape (``shape_of``: CPUs, GPUs, memory,
  accelerator type, market) is stored with it; with a flavor table, a shape that fits no flavor is
  refused on the spec field whose change alone would let it (``spec.resources.market``, ...). **The store holds the validated spec as JSON**
  (``json.dumps(spec.to_dict())``), the one format: the reconciler reads it with ``json.loads``.
* **upload** of a code package (``packages.py``) keeps it for the team; a submit naming a
  package the team has not uploaded is refused on ``package``.
* **pause** by a user holds the job (``held``) until the user resumes it: a running job moves to
  pausing (held), the reconciler asks its runner to stop with a checkpoint and records paused;
  a queued, paused, starting, resuming or pausing (the scheduler's) job not held yet is marked
  held (the reconciler pauses a held job once it runs; the scheduler leaves a held job waiting).
  A scheduler's pause (written by the reconciler) leaves ``held`` false: the job waits for
  admission again. The transition's reason is ``paused by <by>[: reason]; held until resumed``
  (the reconciler names the holder from it).
* **resume** clears ``held`` of a job that has not ended and is not cancelling; a waiting job's
  ``waiting_since_s`` starts again (held time does not age a job). The scheduler admits it when
  it fits, and the reconciler resumes it from its newest checkpoint; a hold that had not been
  carried out yet (starting, resuming, running) is simply dropped.
* **cancel** ends a queued or paused job at once (it holds nothing); a live run (starting,
  running, resuming, pausing) moves to cancelling and the reconciler stops it at the next step
  boundary (no checkpoint added). ``delete_checkpoints`` is recorded with it.
* A request that would change nothing (a pause of a job already held, a resume of one not held,
  a cancel of a job cancelling or ended) is refused with ``JobStateConflict`` naming the state
  and what the request applies to; nothing is written but the audit row.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any, Callable, Optional, Union

from raytrain_sys.errors import JobStateConflict, ServiceInputError, SpecError
from raytrain_sys.service import auth, packages
from raytrain_sys.service.flavors import WorkerShape
from raytrain_sys.service.model import JobRecord, JobState
from raytrain_sys.service.store import Store
from raytrain_sys.spec import JobSpec, apply_overrides, describe_object, from_dict, parse_yaml

RETRIES = 3  # a request that meets a job moving under it reads it again this many times
# A full spec holds about 150 values in 3 levels; model.args and train.task_args add a user's own.
SPEC_MAX_VALUES = 10_000
SPEC_MAX_DEPTH = 32

# What each request applies to (the 409's words; the edges are in pause/resume/cancel below).
APPLIES_TO = {
    "pause": "a queued, paused, starting, resuming or pausing job not held yet, or a running one",
    "resume": "a job its team paused (held) that has not ended and is not cancelling",
    "cancel": "a job that has not ended and is not cancelling already",
}
_LIVE_RUN = (JobState.STARTING, JobState.RUNNING, JobState.RESUMING, JobState.PAUSING)


def parse_spec(spec: Union[dict, str], base_dir: Optional[str] = None,
               overrides: Optional[list[str]] = None) -> JobSpec:
    """A submitted spec (a mapping, or YAML / JSON text) with its overrides, as a validated
    ``JobSpec`` with its local paths absolute. Raises ``ServiceInputError`` on ``spec.<field>``
    (``spec`` for text that is not a mapping, ``overrides`` for a malformed override)."""
    raw = spec
    if isinstance(spec, str):
        try:  # its error names the line and column
            raw = parse_yaml(spec, field="spec", source="the spec")
        except SpecError as exc:
            raise ServiceInputError("spec", str(exc).split(": ", 1)[-1]) from None
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ServiceInputError("spec", f"the spec must hold a mapping of sections, got {type(raw).__name__}")
    if not isinstance(raw, dict):
        raise ServiceInputError("spec", f"must be a mapping of spec sections, got {type(raw).__name__}")
    too_big = _size_problem(raw)
    if too_big:
        raise ServiceInputError("spec", too_big)
    try:
        raw = apply_overrides(raw, list(overrides or []))
    except SpecError as exc:
        raise ServiceInputError("overrides", str(exc)) from None
    try:
        parsed = from_dict(raw)
    except SpecError as exc:
        raise ServiceInputError(f"spec.{exc.field}", str(exc).split(": ", 1)[-1]) from None
    objects = _python_objects(parsed.to_dict())
    if objects:
        field, value = objects[0]
        raise ServiceInputError(f"spec.{field}", f"is a Python object ({describe_object(value)}); the job service "
                                f"stores specs as data and runs them in its own processes: give an import "
                                f"path 'package.module:name' that the cluster's Python can import, or send "
                                f"its module with the job (jobs submit --working-dir DIR)")
    if parsed.train.stop_at_step:
        raise ServiceInputError("spec.train.stop_at_step",
                                f"got {parsed.train.stop_at_step}; a service job is paused with a pause "
                                f"request, not a step in its spec: leave it 0")
    base = os.path.abspath(base_dir or os.getcwd())

    def absolute(value: str) -> str:
        if value and value != "latest" and "://" not in value and not os.path.isabs(value):
            return os.path.join(base, value)
        return value

    parsed.output_dir = absolute(parsed.output_dir)
    parsed.data.path = absolute(parsed.data.path)
    parsed.checkpoint.uri = absolute(parsed.checkpoint.uri)
    parsed.checkpoint.resume_from = absolute(parsed.checkpoint.resume_from)
    return parsed


def _size_problem(raw: Any) -> Optional[str]:
    """Why ``raw`` is too large to be a spec (``SPEC_MAX_VALUES``, ``SPEC_MAX_DEPTH``), or None.
    Counts a value each time it is reached, so YAML aliases that repeat one list a billion
    times are stopped at the bound, not expanded."""
    stack, count = [(raw, 1)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > SPEC_MAX_VALUES:
            return f"holds more than {SPEC_MAX_VALUES} values; a spec is a few sections of settings"
        if depth > SPEC_MAX_DEPTH:
            return f"is nested more than {SPEC_MAX_DEPTH} deep; a spec is a few sections of settings"
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)
    return None


def _python_objects(raw: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted field, value) of every value in a spec mapping that is not plain data."""
    if isinstance(raw, dict):
        return [found for k, v in raw.items() for found in _python_objects(v, f"{prefix}.{k}" if prefix else k)]
    if isinstance(raw, (list, tuple)):
        return [found for i, v in enumerate(raw) for found in _python_objects(v, f"{prefix}[{i}]")]
    if raw is None or isinstance(raw, (str, int, float, bool)):
        return []
    return [(prefix, raw)]


def job_size(spec: JobSpec) -> tuple[int, int, bool]:
    """(min_workers, max_workers, elastic) of a job, from its spec (see the module docstring)."""
    if spec.elastic.max_workers:
        low = max(1, min(spec.elastic.min_workers, spec.elastic.max_workers))
        return low, spec.elastic.max_workers, spec.elastic.max_workers > low
    return spec.resources.num_workers, spec.resources.num_workers, False


def shape_of(spec: JobSpec) -> WorkerShape:
    """What one worker of the job asks: its spec's ``resources`` (the flavors it may draw from)."""
    r = spec.resources
    return WorkerShape(cpu=r.cpus_per_worker, gpu=r.gpus_per_worker, memory_gb=r.memory_per_worker_gb,
                       accelerator=r.accelerator_type, market=r.market)


def stored_spec(spec: JobSpec) -> str:
    """The spec as the store holds it and the reconciler reads it (``json.loads``)."""
    return json.dumps(spec.to_dict())


def submit(store: Store, *, team: str, spec: Union[dict, str], by: str, priority: int = 0, name: str = "",
           overrides: Optional[list[str]] = None, cluster_workers: Optional[int] = None,
           idempotency_key: Optional[str] = None, base_dir: Optional[str] = None,
           package: Optional[str] = None, capacity: Optional[dict[str, dict[str, float]]] = None,
           sweep_id: Optional[int] = None, trial_id: Optional[str] = None, segment: int = 0) -> JobRecord:
    """Queue a job (see the module docstring), with the code package ``package`` (a sha256 the
    team uploaded, ``packages.py``) when given. ``capacity``: each flavor's ceiling (the service's
    ``flavor_capacity``), else ``cluster_workers`` without a flavor table. A sweep's trial names
    its ``sweep_id``, ``trial_id`` and ``segment`` (a trial's segment submitted again gets its job
    back). A refusal raises
    ``ServiceInputError`` naming the field; nothing but the audit row is written."""
    try:
        parsed = parse_spec(spec, base_dir, overrides)
        low, high, elastic = job_size(parsed)
        try:
            job = store.submit(team=team, name=name or parsed.name, spec=stored_spec(parsed),
                               min_workers=low, max_workers=high, elastic=elastic, priority=priority, actor=by,
                               idempotency_key=idempotency_key, cluster_workers=cluster_workers,
                               package=package or None, shape=shape_of(parsed), capacity=capacity,
                               sweep_id=sweep_id, trial_id=trial_id, segment=segment)
        except ServiceInputError as exc:
            if exc.field == "name" and not name:  # the spec's name: the store's bounds are the spec's too
                raise ServiceInputError("spec.name", str(exc).split(": ", 1)[-1]) from None
            if exc.field.startswith("resources."):  # the shape fits no flavor: the spec's field
                raise ServiceInputError(f"spec.{exc.field}", str(exc).split(": ", 1)[-1]) from None
            if exc.field not in ("elastic.min_workers", "elastic.max_workers"):
                raise
            field = "spec.elastic.min_workers" if parsed.elastic.max_workers else "spec.resources.num_workers"
            gang = "" if parsed.elastic.max_workers else (" (a spec without elastic.max_workers is a gang of "
                                                          "resources.num_workers)")
            raise ServiceInputError(field, str(exc).split(": ", 1)[-1] + gang) from None
    except ServiceInputError as exc:
        auth.record(store, by, "submit", f"team {team}", f"refused (400): {exc}")
        raise
    auth.record(store, by, "submit", f"job {job.id} (team {team})", "ok")
    store.requested()
    return job


def upload_package(store: Store, *, team: str, sha256: str, data: bytes, by: str) -> dict[str, Any]:
    """Keep a team's code package for its submits (``packages.check``: the bytes must have the
    sha256 they are named by). Uploading one the team has is not an error. Returns its info."""
    target = f"package {sha256[:12]} (team {team})"
    try:
        files = packages.check(data, sha256)
        added = store.put_package(sha256=sha256, team=team, data=data, files=files)
    except ServiceInputError as exc:
        auth.record(store, by, "upload", target, f"refused (400): {exc}")
        raise
    auth.record(store, by, "upload", target, "ok" if added else "ok (had it)")
    return store.package_info(sha256, team)


def pause(store: Store, job_id: int, *, by: str, reason: str = "") -> JobRecord:
    """Pause a job and hold it until resumed (see the module docstring)."""
    why = f"paused by {by}" + (f": {reason}" if reason else "") + "; held until resumed"

    def write(job: JobRecord) -> Optional[JobRecord]:
        if job.state is JobState.RUNNING:
            return store.transition(job.id, job.state, JobState.PAUSING, actor=by, reason=why, held=True,
                                    expected_held=job.held)
        if job.state in (JobState.QUEUED, JobState.PAUSED, JobState.STARTING, JobState.RESUMING,
                         JobState.PAUSING) and not job.held:
            return store.transition(job.id, job.state, job.state, actor=by, reason=why, held=True,
                                    expected_held=False)
        return None

    return _request(store, job_id, by, "pause", write)


def resume(store: Store, job_id: int, *, by: str, reason: str = "") -> JobRecord:
    """Let a held job be admitted again (resumed from its checkpoint when it had run)."""
    why = f"resumed by {by}" + (f": {reason}" if reason else "")

    def write(job: JobRecord) -> Optional[JobRecord]:
        if job.state.terminal or job.state is JobState.CANCELLING or not job.held:
            return None
        changes: dict[str, Any] = {"waiting_since_s": time.time()} if job.state.waiting else {}
        return store.transition(job.id, job.state, job.state, actor=by, held=False, expected_held=True,
                                reason=f"{why}; waits for admission" if job.state.waiting else why, **changes)

    return _request(store, job_id, by, "resume", write)


def cancel(store: Store, job_id: int, *, by: str, reason: str = "", delete_checkpoints: bool = False) -> JobRecord:
    """End a job: at once if it holds nothing, else at its run's next step boundary."""
    why = f"cancelled by {by}" + (f": {reason}" if reason else "")
    intent = {"delete_checkpoints": True} if delete_checkpoints else {}

    def write(job: JobRecord) -> Optional[JobRecord]:
        if job.state.waiting:
            return store.transition(job.id, job.state, JobState.CANCELLED, actor=by, reason=why,
                                    workers=0, target_workers=0, **intent)
        if job.state in _LIVE_RUN:
            return store.transition(job.id, job.state, JobState.CANCELLING, actor=by, reason=why, **intent)
        return None

    return _request(store, job_id, by, "cancel", write)


def _request(store: Store, job_id: int, by: str, action: str,
             write: Callable[[JobRecord], Optional[JobRecord]]) -> JobRecord:
    """Read the job, write the request's edge (None: it does not apply, a 409 naming the state);
    a guarded write that meets a job which moved is tried again on a fresh read."""
    target = f"job {job_id}"
    try:
        for attempt in range(RETRIES):
            job = store.job(job_id)
            try:
                done = write(job)
            except JobStateConflict:  # moved between the read and the guarded write
                if attempt == RETRIES - 1:
                    raise
                continue
            if done is None:
                state = f"{job.state.value}{' and held' if job.held else ''}"
                raise JobStateConflict(f"job {job_id} is {state}: cannot {action} it ({action} applies to "
                                       f"{APPLIES_TO[action]}); nothing was changed")
            break
    except JobStateConflict as exc:
        auth.record(store, by, action, target, f"refused (409): {exc}")
        raise
    except ServiceInputError as exc:  # no such job
        auth.record(store, by, action, target, f"refused (400): {exc}")
        raise
    auth.record(store, by, action, target, "ok")
    store.requested()
    return done


def job_dict(job: JobRecord) -> dict[str, Any]:
    """A job as plain data (the API's and the service actor's answer)."""
    out = asdict(job)
    out["state"] = job.state.value
    out["wait_cause"] = job.wait_cause.value if job.wait_cause is not None else None
    return out
