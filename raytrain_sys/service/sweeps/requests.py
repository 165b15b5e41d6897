"""What a user asks of a sweep: submit, pause, resume, cancel. The one implementation behind the
HTTP API, the service actor, the CLI and the local ``raytrain-sys sweep`` (as
``service/requests.py`` is for jobs; the API adds authentication and ownership).

* **submit** validates the whole sweep spec (``sweeps.spec.parse_sweep``) and checks that one
  trial could ever start in the team (its quota and the cluster, as a job's submit checks, on
  ``base.<field>``), before anything is written: no trial starts from a refused sweep. The
  reconciler then starts its runner.
* **pause** holds every live trial (``requests.pause``) and the sweep waits paused; its runner
  and the proxies stay, following jobs that do not move. **resume** releases them.
* **cancel** ends the sweep, stops its runner, and cancels every live trial.

Each writes an audit row (``ok`` or the refusal) like a job's request.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from raytrain_sys.errors import JobStateConflict, ServiceInputError, SpecError
from raytrain_sys.service import auth
from raytrain_sys.service import requests as job_requests
from raytrain_sys.service.model import JobState, SweepRecord, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.spec import parse_yaml
from raytrain_sys.service.sweeps.spec import SweepSpec, parse_sweep, sweep_json_schema  # noqa: F401: the API's sweep schema

SWEEPS_DIR = "raytrain-sys-sweeps"  # Tune's experiments, beside the store's log directory


def parse(sweep: Union[dict, str], base_dir: Optional[str] = None) -> SweepSpec:
    """A sweep spec from a mapping or YAML text, validated (``ServiceInputError`` on the field)."""
    raw = sweep
    if isinstance(sweep, str):
        try:
            raw = parse_yaml(sweep, field="sweep", source="the sweep spec")
        except SpecError as exc:
            raise ServiceInputError("sweep", str(exc).split(": ", 1)[-1]) from None
    return parse_sweep(raw, base_dir=base_dir)


def submit(store: Store, *, team: str, sweep: Union[dict, str], by: str, priority: int = 0,
           base_dir: Optional[str] = None, storage_path: str = "", cluster_workers: Optional[int] = None,
           capacity: Optional[dict[str, dict[str, float]]] = None) -> SweepRecord:
    """Queue a sweep (see the module docstring); its Tune experiment goes under ``storage_path``
    (default: ``raytrain-sys-sweeps`` beside the store's log directory: one a store, so that two
    stores' sweep 1 never share an experiment)."""
    from raytrain_sys.spec import from_dict

    try:
        spec = parse(sweep, base_dir)
        job = from_dict(spec.base)
        low, _, _ = job_requests.job_size(job)
        storage = os.path.abspath(storage_path or os.path.join(os.path.dirname(store.log_dir(base_dir=base_dir or "")),
                                                               SWEEPS_DIR))
        try:
            record = store.submit_sweep(team=team, name=spec.name, spec=json.dumps(spec.to_dict()), priority=priority,
                                        max_workers=spec.max_workers, storage_path=storage, actor=by,
                                        trial_min_workers=low, shape=job_requests.shape_of(job),
                                        cluster_workers=cluster_workers, capacity=capacity)
        except ServiceInputError as exc:
            if exc.field == "elastic.min_workers":
                field = "base.elastic.min_workers" if job.elastic.max_workers else "base.resources.num_workers"
                raise ServiceInputError(field, f"one trial could never start: {exc.message}") from None
            if exc.field.startswith("resources."):
                raise ServiceInputError(f"base.{exc.field}", exc.message) from None
            raise
    except ServiceInputError as exc:
        auth.record(store, by, "submit_sweep", f"team {team}", f"refused (400): {exc}")
        raise
    auth.record(store, by, "submit_sweep", f"sweep {record.id} (team {team})", "ok")
    store.requested()
    return record


def _trials_do(store: Store, sweep: SweepRecord, action, by: str, reason: str) -> None:
    for job in store.trials(sweep.id):
        if job.state.terminal or job.state is JobState.CANCELLING:
            continue
        try:
            action(store, job.id, by=by, reason=reason)
        except JobStateConflict:  # held already, or it ended meanwhile
            pass


def pause(store: Store, sweep_id: int, *, by: str, reason: str = "") -> SweepRecord:
    why = f"sweep {sweep_id} paused by {by}" + (f": {reason}" if reason else "")
    return _request(store, sweep_id, by, "pause", (SweepState.QUEUED, SweepState.RUNNING), SweepState.PAUSED, why,
                    job_requests.pause)


def resume(store: Store, sweep_id: int, *, by: str, reason: str = "") -> SweepRecord:
    why = f"sweep {sweep_id} resumed by {by}" + (f": {reason}" if reason else "")
    return _request(store, sweep_id, by, "resume", (SweepState.PAUSED,), SweepState.RUNNING, why,
                    job_requests.resume)


def cancel(store: Store, sweep_id: int, *, by: str, reason: str = "") -> SweepRecord:
    why = f"sweep {sweep_id} cancelled by {by}" + (f": {reason}" if reason else "")
    from raytrain_sys.service.sweeps.reconcile import stop_runner

    def stop(store: Store, job_id: int, *, by: str, reason: str) -> Any:
        return job_requests.cancel(store, job_id, by=by, reason=reason)

    record = _request(store, sweep_id, by, "cancel", (SweepState.QUEUED, SweepState.RUNNING, SweepState.PAUSED),
                      SweepState.CANCELLED, why, stop,
                      before_trials=lambda: _stop_quietly(stop_runner, store.sweep(sweep_id)))
    return record


def _stop_quietly(stop_runner, sweep: SweepRecord) -> None:
    """Stop the sweep's runner before its trials, so that no proxy submits another; without
    Ray (a store-only caller) the reconciler's pass finds the sweep ended and leaves it."""
    import ray

    if ray.is_initialized():
        stop_runner(sweep)


def _request(store: Store, sweep_id: int, by: str, action: str, expected: tuple, to: SweepState, why: str,
             on_trial, before_trials=None) -> SweepRecord:
    target = f"sweep {sweep_id}"
    try:
        sweep = store.sweep(sweep_id)
        if sweep.state not in expected:
            raise JobStateConflict(f"sweep {sweep_id} is {sweep.state.value}: cannot {action} it ({action} applies "
                                   f"to a {' or '.join(s.value for s in expected)} sweep); nothing was changed")
        record = store.transition_sweep(sweep_id, expected, to, actor=by, reason=why)
    except (JobStateConflict, ServiceInputError) as exc:
        code = 409 if isinstance(exc, JobStateConflict) else 400
        auth.record(store, by, f"{action}_sweep", target, f"refused ({code}): {exc}")
        raise
    if before_trials is not None:
        before_trials()
    _trials_do(store, record, on_trial, by, why)
    auth.record(store, by, f"{action}_sweep", target, "ok")
    store.requested()
    return record


def sweep_dict(sweep: SweepRecord, trials: Optional[list] = None) -> dict[str, Any]:
    """A sweep as plain data (the API's and the CLI's answer), with its trials when given."""
    out = {k: getattr(sweep, k) for k in sweep.__dataclass_fields__ if k != "spec"}
    out["state"] = sweep.state.value
    out["spec"] = json.loads(sweep.spec)
    if trials is not None:
        out["trials"] = [{"job_id": j.id, "trial_id": j.trial_id, "state": j.state.value, "workers": j.workers,
                          "rung": j.rung, "segment": j.segment, "last_checkpoint_step": j.last_checkpoint_step}
                         for j in trials]
    return out
