"""A sweep's trial proxy: the function trainable Tune runs for each trial.

Owns: what a trial does while Tune runs it (``run_trial``): it submits its trial's job (or finds
it: ``(sweep, trial, segment)`` is unique, so a trial driven again re-attaches to its job), hears
each of the job's evaluations from the job's runner as the run records it (``RunnerEvaluations``;
MLflow while no runner answers, and once the job has ended) and reports each to Tune
(``follow``), as ``step`` (the committed step: the schedulers' ``time_attr``) with the metric and
a pointer to the job's committed checkpoint (``segments.Reporter``). Writes in the store: the
trial's jobs (through ``requests``, as a user would), never the sweep.

* **A trial is a proxy** that needs no CPU (``trainable``: a 1 MiB memory bundle: Tune will not
  run a trial of no resource, and a fraction of a CPU would take a worker slot's CPU from the
  cluster), on the safe nodes (what ``control_options`` gives a control actor), so a spot reclaim
  does not take it. The job trains, shrinks, grows, pauses and recovers as any service job: a
  lost worker is the job's business, never a trial error, and the trial keeps training while the
  sweep's runner is down.
* **No job before the parent run**: a proxy submits nothing until the sweep's MLflow parent run
  is recorded (``with_parent_run``), so that every trial's run is its child.
* **A restart by PBT is a new segment**: the proxy follows the segment ``segments.segment_plan``
  names, ending the trial's previous one first.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import ray

from raytrain_sys.control.control_actors import control_options
from raytrain_sys.errors import ServiceStoreError
from raytrain_sys.niceness import set_niceness
from raytrain_sys.service import requests
from raytrain_sys.service.model import JobRecord, JobState, SweepRecord, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.process import CONTROL_NICENESS, log_to
from raytrain_sys.service.sweeps.segments import (Reporter, checkpoint_exists, end_exploited, newest_segment,
                                                  read_pointer, segment_plan)
from raytrain_sys.service.sweeps.spec import spec_of, trial_spec
from raytrain_sys.service.sweeps.tracking import mlflow_history

log = logging.getLogger(__name__)

POLL_S = 1.0  # a proxy reads MLflow this often while no runner answers: an evaluation is seconds apart at best
# A proxy rides out a store it cannot read this long (SQLite busy past its timeout on a loaded
# machine, a PostgreSQL failover): its job trains on meanwhile, and Tune must not see a trial error.
STORE_OUTAGE_S = 300.0
PROXY_MEMORY_BYTES = 2 ** 20  # the proxy's whole bundle (see the module docstring)


class TrialJobFailed(RuntimeError):
    """The trial's job failed (its own restart budget spent): the trial has no more results."""


def follow(store: Store, job_id: int, metric: str, report: Callable[[dict], None],
           history: Callable[[JobRecord, str], list[tuple[int, float]]], *, after_step: int = 0,
           poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep,
           live: Optional[Callable[[JobRecord, int], Optional[tuple[list, bool]]]] = None,
           store_outage_s: float = STORE_OUTAGE_S) -> JobRecord:
    """Report each evaluation of the job after ``after_step`` once, in step order, until the job
    ends; returns it ended. ``live(job, after)``: the job's evaluations after a step as its
    runner holds them, waiting a little for one (``(points, run_done)``), None when no runner
    answers: the proxy hears of an evaluation as the job records it. MLflow (``history``) is read
    when no runner answers, and once the job has ended: the job is read before its evaluations,
    so a job read as ended has every evaluation it will ever log. Raises ``TrialJobFailed`` when
    it failed. A store that cannot be read is read again every ``poll_s`` for up to
    ``store_outage_s`` (then its ``ServiceStoreError`` is raised): a sweep on SQLite under load
    once failed a trial's proxy, and with it the trial, on one "database is locked"."""
    reported = after_step
    unreadable_since = None
    while True:
        try:
            job = store.job(job_id)
        except ServiceStoreError as e:
            if unreadable_since is None:
                unreadable_since = time.monotonic()
            if time.monotonic() - unreadable_since >= store_outage_s:
                raise
            log.warning("job %d: the store cannot be read (%s): reading it again in %g s", job_id, e, poll_s)
            sleep(poll_s)
            continue
        unreadable_since = None
        asked = None if live is None or job.state.terminal else live(job, reported)
        for step, value in (history(job, metric) if asked is None else asked[0]):
            if step > reported:
                seen = time.monotonic()
                report({"step": step, metric: value, "job_id": job.id,
                        "checkpoint_step": job.last_checkpoint_step or 0})
                log.info("job %d: its evaluation at step %d reported to Tune (%.2f s)", job.id, step,
                         time.monotonic() - seen)
                reported = step
        if job.state is JobState.FAILED:
            raise TrialJobFailed(f"job {job.id} failed: {job.message}")
        if job.state.terminal:
            return job
        if asked is None or asked[1]:  # polling MLflow, or the run ended and the store not yet
            sleep(poll_s)


# How long one ask of a job's runner waits for its next evaluation: the proxy reads its job's
# state in the store between asks (a cancel, a pause), and the ask holds one of the runner's threads.
LIVE_WAIT_S = 1.0


class RunnerEvaluations:
    """``follow``'s ``live``: the evaluations the job's runner holds (``JobRunner.evaluations``),
    its handle looked up by the job's id and kept while it answers; None while the job has no
    runner that answers (queued, paused, between two runs, or its runner lost)."""

    def __init__(self, metric: str, wait_s: float = LIVE_WAIT_S):
        self.key = metric[len("eval_"):] if metric.startswith("eval_") else metric
        self.wait_s = wait_s
        self._handles: dict[int, object] = {}
        self.checkpoints: dict[int, list[tuple[int, str]]] = {}  # job id -> its runner's committed checkpoints

    def __call__(self, job: JobRecord, after: int) -> Optional[tuple[list, bool]]:
        from raytrain_sys.service.names import find_runner

        if job.state not in (JobState.STARTING, JobState.RUNNING, JobState.RESUMING, JobState.PAUSING,
                             JobState.CANCELLING):
            self._handles.pop(job.id, None)
            return None
        handle = self._handles.get(job.id) or find_runner(job.id, spare_wait_s=self.wait_s)
        if handle is None:
            return None
        try:
            got = ray.get(handle.evaluations.remote(self.key, after, self.wait_s), timeout=self.wait_s + 10.0)
        except Exception as exc:  # noqa: BLE001: gone, or not answering: MLflow for now, and look it up again
            log.info("job %d: its runner did not answer (%s): reading MLflow", job.id, str(exc).splitlines()[0][:200])
            self._handles.pop(job.id, None)
            return None
        self._handles[job.id] = handle
        self.checkpoints[job.id] = [(int(c[0]), str(c[1])) for c in got.get("checkpoints", [])]
        if got["done"]:  # a paused job's next run has another runner
            self._handles.pop(job.id, None)
        return [tuple(p) for p in got["evaluations"]], got["done"]


def run_trial(config: dict, *, sweep_id: int, db_url: str, base_dir: str, log_path: str = "") -> None:
    """Tune's function trainable: submit (or find) this trial's job, or the job of its next PBT
    segment when Tune restarted it with a donor's checkpoint (``segment_plan``), and report its
    evaluations, each with a pointer to the job's committed checkpoint as Tune's checkpoint."""
    from ray import tune

    log_to(log_path)
    set_niceness(CONTROL_NICENESS)
    store = Store.open(db_url)
    try:
        sweep = with_parent_run(store, sweep_id)
        spec = spec_of(sweep)
        trial_id = tune.get_context().get_trial_id()
        pointer = read_pointer(tune.get_checkpoint())
        plan = segment_plan(trial_id, pointer, newest_segment(store.trials(sweep_id), trial_id), spec.max_steps)
        donor = plan.donor
        if plan.new and not checkpoint_exists(donor.uri, spec):
            raise TrialJobFailed(f"trial {trial_id} was to continue from trial {donor.trial_id}'s checkpoint "
                                 f"{donor.uri} (step {donor.step}), which its retention deleted meanwhile: raise "
                                 f"base.checkpoint.keep_last ({spec.base['checkpoint']['keep_last']})")
        if plan.end_job is not None:
            end_exploited(store, sweep_id, plan)
        job = requests.submit(store, team=sweep.team,
                              spec=trial_spec(spec, config, sweep_id, trial_id, sweep.mlflow_parent_run_id or "",
                                              segment=plan.segment, donor_checkpoint=donor.uri if donor else ""),
                              by=f"sweep {sweep_id}", priority=sweep.priority,
                              name=f"{sweep.name} {trial_id}{f' s{plan.segment}' if plan.segment else ''}"[:200],
                              base_dir=base_dir, sweep_id=sweep_id, trial_id=trial_id, segment=plan.segment)
        log.info("trial %s of sweep %d follows job %d (segment %d%s)", trial_id, sweep_id, job.id, plan.segment,
                 f", from trial {donor.trial_id}'s checkpoint at step {donor.step}" if donor else "")
        live = RunnerEvaluations(spec.metric)
        report = Reporter(store, spec, trial_id, plan, config, runner_checkpoints=live.checkpoints.get)
        # Tune had every result up to its checkpoint's step (a trial paused or restored goes on
        # after it; a segment's job logs nothing before its donor's step).
        seen = pointer.step if pointer is not None and (donor is not None or pointer.trial_id == trial_id) else 0
        ended = follow(store, job.id, spec.metric, report, mlflow_history, after_step=seen, live=live)
        report.mark(ended)  # its reports all came before its run's id was recorded
    finally:
        store.close()


# How long a trial's proxy waits for the sweep's MLflow parent run (its runner makes it while
# Tune starts the proxies): the first run of a new SQLite store makes its tables, seconds at load.
PARENT_WAIT_S = 600.0


def with_parent_run(store: Store, sweep_id: int, wait_s: float = PARENT_WAIT_S, poll_s: float = 0.1,
                    sleep: Callable[[float], None] = time.sleep) -> SweepRecord:
    """The sweep once its MLflow parent run is recorded: every trial's run is its child. The
    runner makes it beside Tune's start (``runner.drive``); raises ``TrialJobFailed`` when the sweep is
    no longer running first, or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        sweep = store.sweep(sweep_id)
        if sweep.mlflow_parent_run_id:
            return sweep
        if sweep.state is not SweepState.RUNNING or time.monotonic() > deadline:
            raise TrialJobFailed(f"sweep {sweep_id} has no MLflow parent run ({sweep.state.value}: {sweep.message}); "
                                 f"no trial's job is submitted without one")
        sleep(poll_s)


def trainable(sweep_id: int, db_url: str, base_dir: str, log_path: str = ""):
    """The proxy as Tune runs it: its parameters bound, on a bundle of no CPU (the safe nodes'
    resource too when the cluster has them)."""
    from ray import tune

    resources = {"cpu": 0, "memory": PROXY_MEMORY_BYTES, **control_options().get("resources", {})}
    return tune.with_resources(tune.with_parameters(run_trial, sweep_id=sweep_id, db_url=db_url, base_dir=base_dir,
                                                    log_path=log_path),
                               resources)
