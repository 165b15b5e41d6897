"""What a user (through the API, the CLI or the service actor's methods) writes: requests, never
run-time outcomes.

Owns the conventions between a request and the reconciler that carries it out. Every function
takes the store and who asks (``by``: a team name or "admin"; whether that principal may touch
the job is the API's check, not this module's), makes one guarded write (``Store.transition``),
and records an audit row, ``ok`` or why it was refused. A request that meets a job which moved
meanwhile reads it again and retries (a few times), so a user's pause racing the scheduler's is
not lost.

The conventions (``model.JobState`` lists the edges):

* **submit** validates the spec with ``raytrain_sys.spec`` (a refusal names the field,
  ``spec.<field>``, and writes no job), makes its local paths absolute against ``base_dir`` (the
  runner's process has another working directory), and derives the job's size: a spec with
  ``elastic.max_workers`` set is elastic in ``elastic.min_workers..elastic.max_workers``; one
  without is a gang of ``resources.num_workers``.
* **pause** by a user holds the job (``held``) until the user resumes it: a running job moves to
  pausing (held), the reconciler asks its runner to stop with a checkpoint and records paused;
  a queued, paused, starting or resuming job is marked held (the reconciler pauses a held job
  once it runs). A scheduler's pause (written by the reconciler) leaves ``held`` false: the job
  waits for admission again.
* **resume** clears ``held``; the scheduler admits the job when it fits, and the reconciler
  resumes it from its newest checkpoint.
* **cancel** ends a queued or paused job at once (it holds nothing); a live run moves to
  cancelling and the reconciler stops it at the next step boundary (no checkpoint added).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import yaml

from raytrain_sys.errors import JobStateConflict, ServiceInputError, SpecError
from raytrain_sys.service.model import JobRecord, JobState
from raytrain_sys.service.store import Store
from raytrain_sys.spec import JobSpec, from_dict

RETRIES = 3  # a request that meets a job moving under it reads it again this many times


def parse_spec(spec: Union[dict, str], base_dir: Optional[str] = None) -> JobSpec:
    """A submitted spec (a mapping, or YAML / JSON text) as a validated ``JobSpec`` with its
    local paths absolute. Raises ``ServiceInputError`` on ``spec.<field>``."""
    if isinstance(spec, str):
        try:
            spec = yaml.safe_load(spec)
        except yaml.YAMLError as exc:
            raise ServiceInputError("spec", f"is not YAML or JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ServiceInputError("spec", f"must be a mapping of spec sections, got {type(spec).__name__}")
    raw = json.loads(json.dumps(spec))
    base = os.path.abspath(base_dir or os.getcwd())

    def absolute(section: str, key: str, default: str = "") -> None:
        value = (raw.get(section) or {}).get(key, default) if section else raw.get(key, default)
        if value and "://" not in value and not os.path.isabs(value):
            if section:
                raw.setdefault(section, {})[key] = os.path.join(base, value)
            else:
                raw[key] = os.path.join(base, value)

    try:
        absolute("", "output_dir", JobSpec.output_dir)
        absolute("data", "path", "")
        absolute("checkpoint", "uri", "")
        parsed = from_dict(raw)
    except SpecError as exc:
        raise ServiceInputError(f"spec.{exc.field}", str(exc).split(": ", 1)[-1]) from None
    if parsed.train.stop_at_step:
        raise ServiceInputError("spec.train.stop_at_step",
                                f"got {parsed.train.stop_at_step}; a service job is paused with a pause "
                                f"request, not a step in its spec: leave it 0")
    return parsed


def job_size(spec: JobSpec) -> tuple[int, int, bool]:
    """(min_workers, max_workers, elastic) of a job, from its spec (see the module docstring)."""
    if spec.elastic.max_workers:
        low = max(1, min(spec.elastic.min_workers, spec.elastic.max_workers))
        return low, spec.elastic.max_workers, spec.elastic.max_workers > low
    return spec.resources.num_workers, spec.resources.num_workers, False


def submit(store: Store, *, team: str, spec: Union[dict, str], by: str, priority: int = 0, name: str = "",
           cluster_workers: Optional[int] = None, idempotency_key: Optional[str] = None,
           base_dir: Optional[str] = None) -> JobRecord:
    """Queue a job (see the module docstring). A refusal raises ``ServiceInputError`` naming the
    field; nothing but the audit row is written."""
    try:
        parsed = parse_spec(spec, base_dir)
        low, high, elastic = job_size(parsed)
        job = store.submit(team=team, name=name or parsed.name, spec=json.dumps(parsed.to_dict()),
                           min_workers=low, max_workers=high, elastic=elastic, priority=priority, actor=by,
                           idempotency_key=idempotency_key, cluster_workers=cluster_workers)
    except ServiceInputError as exc:
        store.record_audit(by, "submit", f"team {team}", f"refused: {exc}")
        raise
    store.record_audit(by, "submit", f"job {job.id}", "ok")
    return job


def pause(store: Store, job_id: int, *, by: str, reason: str = "") -> JobRecord:
    """Pause a job and hold it until resumed (see the module docstring)."""
    why = f"paused by {by}" + (f": {reason}" if reason else "") + "; held until resumed"

    def write(job: JobRecord) -> JobRecord:
        if job.state is JobState.RUNNING:
            return store.transition(job.id, job.state, JobState.PAUSING, actor=by, reason=why, held=True)
        if job.state in (JobState.QUEUED, JobState.PAUSED, JobState.STARTING, JobState.RESUMING,
                         JobState.PAUSING):
            return store.transition(job.id, job.state, job.state, actor=by, reason=why, held=True)
        raise JobStateConflict(f"job {job.id} is {job.state.value}: it cannot be paused")

    return _request(store, job_id, by, "pause", write)


def resume(store: Store, job_id: int, *, by: str) -> JobRecord:
    """Let a held job be admitted again (resumed from its checkpoint when it had run)."""

    def write(job: JobRecord) -> JobRecord:
        if job.state.terminal or job.state is JobState.CANCELLING:
            raise JobStateConflict(f"job {job.id} is {job.state.value}: it cannot be resumed")
        if not job.held:
            raise JobStateConflict(f"job {job.id} is {job.state.value} and not held: nothing to resume")
        return store.transition(job.id, job.state, job.state, actor=by, held=False,
                                reason=f"resumed by {by}: waits for admission" if job.state.waiting
                                else f"resumed by {by}")

    return _request(store, job_id, by, "resume", write)


def cancel(store: Store, job_id: int, *, by: str, reason: str = "") -> JobRecord:
    """End a job: at once if it holds nothing, else at its run's next step boundary."""
    why = f"cancelled by {by}" + (f": {reason}" if reason else "")

    def write(job: JobRecord) -> JobRecord:
        if job.state.waiting:
            return store.transition(job.id, job.state, JobState.CANCELLED, actor=by, reason=why,
                                    workers=0, target_workers=0)
        if job.state in (JobState.STARTING, JobState.RUNNING, JobState.RESUMING, JobState.PAUSING):
            return store.transition(job.id, job.state, JobState.CANCELLING, actor=by, reason=why)
        if job.state is JobState.CANCELLING:
            return job
        raise JobStateConflict(f"job {job.id} is {job.state.value}: it has ended")

    return _request(store, job_id, by, "cancel", write)


def _request(store: Store, job_id: int, by: str, action: str, write) -> JobRecord:
    target = f"job {job_id}"
    try:
        for attempt in range(RETRIES):
            try:
                job = write(store.job(job_id))
                break
            except JobStateConflict:
                if attempt == RETRIES - 1:
                    raise
                if store.job(job_id).state.terminal:
                    raise
    except (JobStateConflict, ServiceInputError) as exc:
        store.record_audit(by, action, target, f"refused: {exc}")
        raise
    store.record_audit(by, action, target, "ok")
    return job


def job_dict(job: JobRecord) -> dict[str, Any]:
    """A job as plain data (the API's and the service actor's answer)."""
    from dataclasses import asdict

    out = asdict(job)
    out["state"] = job.state.value
    return out
