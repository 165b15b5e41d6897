"""The service's reconciler's part in the sweeps: each live sweep's runner kept, and the trials
still to start counted.

Owns: a sweep's runner's life (``start_runner``, ``stop_runner``) and the reconciler's pass over
the live sweeps (``ensure_runners``): a queued sweep's runner started, a lost one started again
(Tune restores its experiment: ``runner.drive``) within ``max_restarts``, else the sweep failed
with its trials cancelled; and how many of their trials have not started a job yet
(``trials_to_start``, pure), for which the reconciler keeps spare runners. Writes in the store:
the sweep's start, its runner's restarts and its failure (the runner writes its end).

* **On the safe nodes**: the runner asks what ``control_options`` gives a control actor, so a
  spot reclaim does not take it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import ray

from raytrain_sys.control.control_actors import control_options
from raytrain_sys.control.spares import NAMESPACE
from raytrain_sys.errors import JobStateConflict
from raytrain_sys.service import requests
from raytrain_sys.service.model import JobRecord, JobState, SweepRecord, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.names import find_runner, runner_name
from raytrain_sys.service.sweeps.runner import SweepRunner
from raytrain_sys.service.sweeps.spec import spec_of
from raytrain_sys.service.sweeps.tracking import prepare_tracking

log = logging.getLogger(__name__)


def start_runner(sweep: SweepRecord, db_url: str, base_dir: str, log_dir: str):
    os.makedirs(log_dir, exist_ok=True)
    return SweepRunner.options(name=runner_name(sweep), namespace=NAMESPACE, lifetime="detached",
                               get_if_exists=True, **control_options()).remote(
        sweep.id, db_url, base_dir, os.path.join(log_dir, f"sweep-{sweep.id}.log"))


def ensure_runners(store: Store, db_url: str, base_dir: str, log_dir: str, max_restarts: int,
                   status_timeout_s: float = 10.0, started: Optional[dict] = None,
                   asks: Optional[dict] = None) -> int:
    """One pass over the live sweeps: a queued one gets its runner and runs; a running one whose
    runner is gone gets another (``Tuner.restore``), within ``max_restarts``, else fails with
    its trials cancelled; a runner whose driver raised fails its sweep. ``started`` (the
    caller's, kept across passes) holds the handles of the runners this caller started: a runner
    just created may not be found by its name yet (seen: on the pass 0.3 s after its start), and
    is not lost for that; one whose process is gone is. A runner's status is asked and read
    without waiting (``asks``, the caller's too): an answer not in yet is read by a later pass,
    and one not in within ``status_timeout_s`` is asked again. (Waited for up to a second here,
    a busy Tune driver's answer held the whole pass, and with it the admission of the job an
    ASHA stop had just made room for.) Returns the live sweeps' trials still to start
    (``trials_to_start``): the reconciler keeps spare runners for them."""
    started = {} if started is None else started
    asks = {} if asks is None else asks
    live = store.sweeps(states=[SweepState.QUEUED, SweepState.RUNNING])
    for sweep_id in set(started) - {s.id for s in live}:
        del started[sweep_id]
    for sweep_id in set(asks) - {s.id for s in live}:
        del asks[sweep_id]
    coming = 0
    for sweep in live:
        try:
            _ensure(store, sweep, db_url, base_dir, log_dir, max_restarts, status_timeout_s, started, asks)
        except JobStateConflict as exc:  # a request landed meanwhile: next pass
            log.info("sweep %d moved meanwhile: %s", sweep.id, exc)
        coming += trials_to_start(spec_of(sweep).trial_count, store.trials(sweep.id))
    return coming


def trials_to_start(trial_count: int, jobs: list[JobRecord]) -> int:
    """A sweep's trials whose job has not started yet, of ``trial_count``: not submitted (Tune
    has not started their proxies), or queued. A PBT segment is its trial's, not one more."""
    started = {j.trial_id for j in jobs if j.state is not JobState.QUEUED}
    return max(0, trial_count - len(started))


def _ensure(store: Store, sweep: SweepRecord, db_url: str, base_dir: str, log_dir: str, max_restarts: int,
            status_timeout_s: float, started: dict, asks: dict) -> None:
    if sweep.state is SweepState.QUEUED:
        store.transition_sweep(sweep.id, SweepState.QUEUED, SweepState.RUNNING, actor="reconciler",
                               reason="its sweep runner starts")
        started[sweep.id] = start_runner(sweep, db_url, base_dir, log_dir)
        prepare_tracking(sweep)
        return
    handle = find_runner(sweep) or started.get(sweep.id)
    status: Optional[dict] = None
    lost = "not found"
    if handle is not None:
        actor_id = handle._actor_id.hex()
        ask = asks.get(sweep.id)
        if ask is None or ask[2] != actor_id:  # none yet, or a question to a runner since replaced
            ask = asks[sweep.id] = (handle.status.remote(), time.monotonic(), actor_id)
        if not ray.wait([ask[0]], timeout=0)[0]:
            if time.monotonic() - ask[1] >= status_timeout_s:
                del asks[sweep.id]  # busy, or still starting: asked again next pass
            return
        del asks[sweep.id]
        try:
            status = ray.get(ask[0])
        except ray.exceptions.ActorUnavailableError:
            return  # still starting, or restarting: asked again next pass
        except ray.exceptions.RayActorError as exc:
            handle, lost = None, type(exc).__name__
    if handle is not None and status is not None and status["done"]:
        if status["error"]:
            _fail(store, sweep, f"its Tune driver raised: {status['error']}")
        ray.kill(handle)
        started.pop(sweep.id, None)
        return
    if handle is not None:
        return
    started.pop(sweep.id, None)
    if sweep.runner_restarts >= max_restarts:
        _fail(store, sweep, f"its sweep runner was lost {sweep.runner_restarts + 1} times (budget {max_restarts})")
        return
    store.transition_sweep(sweep.id, SweepState.RUNNING, SweepState.RUNNING, actor="reconciler",
                           reason=f"its sweep runner was lost ({lost}): started again ({sweep.runner_restarts + 1} of "
                                  f"{max_restarts}), Tune restores its experiment",
                           runner_restarts=sweep.runner_restarts + 1)
    started[sweep.id] = start_runner(sweep, db_url, base_dir, log_dir)


def _fail(store: Store, sweep: SweepRecord, why: str) -> None:
    store.transition_sweep(sweep.id, sweep.state, SweepState.FAILED, actor="reconciler", reason=why)
    for job in store.trials(sweep.id):
        if not job.state.terminal and job.state is not JobState.CANCELLING:
            try:
                requests.cancel(store, job.id, by="reconciler", reason=f"its sweep {sweep.id} failed: {why}")
            except JobStateConflict:
                pass


def stop_runner(sweep: SweepRecord) -> None:
    handle = find_runner(sweep)
    if handle is not None:
        ray.kill(handle)
