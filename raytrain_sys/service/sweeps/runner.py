"""A sweep's runner: Ray Tune decides, the job service places, runs and restarts every trial.

Owns: the Tune driver of one sweep (``drive``: a new ``Tuner``, or ``Tuner.restore`` of the
sweep's experiment after its runner was lost, which never reruns a finished trial), the trial
proxy (``run_trial``) and what each of Tune's decisions does to the trial's job
(``ServiceActions``). Writes in the store: the trials' jobs (through ``requests``, as a user
would), their ``rung``, and the sweep's end (finished with its best trial, or failed); the
reconciler writes the sweep's start and its runner's restarts (``ensure_runners``).

* **A trial is a proxy** that needs no CPU (a 1 MiB memory bundle: Tune will not run a trial of no
  resource, and a fraction of a CPU would take a worker slot's CPU from the cluster). It submits
  its job (``(sweep, trial, segment)`` unique: a trial driven again re-attaches to its job),
  hears each of the job's evaluations from the job's runner as the run records it
  (``RunnerEvaluations``; MLflow while no runner answers, and once the job has ended) and
  reports each as ``step`` (the committed step: the schedulers' ``time_attr``) with the metric, and as Tune's checkpoint a pointer to the job's
  committed checkpoint of that step (``Pointer``: a small JSON file, never a copy of the model).
  The job trains,
  shrinks, grows, pauses and recovers as any service job: a lost worker is the job's business,
  never a trial error, and the trial keeps training while the sweep's runner is down. The
  sweep's MLflow parent run is made beside Tune's start (``ParentRun``), and a proxy submits no
  job before it is recorded.
* **PBT's exploit is a new segment**: Tune restarts an exploited trial's proxy with its donor's
  pointer; the proxy cancels the trial's job and submits the trial's next segment, a job of its
  own that starts from the donor's committed checkpoint with the mutated values
  (``segment_plan``; ``trial_spec``); the segment's MLflow run is tagged with its donor. PBT runs
  synchronous, so that every trial it ranks holds a checkpoint (``make_scheduler``).
* **Tune's stop is a service action**: when a trial ends while its job is live (ASHA stopped it,
  or its proxy failed) the job is cancelled, or paused and held with ``keep_stopped``
  (``stop_action``), ASHA's stop at its decision (``make_scheduler``); the service's reconciler
  is woken, and its pass gives the workers to the next trial or grows the survivors. Each rung a
  trial passes (ASHA's milestones reached while it runs on) is written to its job's ``rung``:
  the scheduler grows it before trials that passed fewer.
* **On the safe nodes**: the runner and the proxies ask what ``control_options`` gives a
  control actor, so a spot reclaim takes neither.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import ray

from raytrain_sys.control.control_actors import control_options
from raytrain_sys.control.spares import NAMESPACE
from raytrain_sys.errors import JobStateConflict, ServiceStoreError
from raytrain_sys.niceness import set_niceness
from raytrain_sys.service import requests
from raytrain_sys.service.model import JobRecord, JobState, SweepRecord, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.spec import SweepSpec, pbt_mutations, sweep_from_dict, trial_spec, tune_space

log = logging.getLogger(__name__)

SWEEP_RUNNER_PREFIX = "raytrain-sys-sweep-"
POLL_S = 1.0  # a proxy reads MLflow this often while no runner answers: an evaluation is seconds apart at best
# A proxy rides out a store it cannot read this long (SQLite busy past its timeout on a loaded
# machine, a PostgreSQL failover): its job trains on meanwhile, and Tune must not see a trial error.
STORE_OUTAGE_S = 300.0
# The nice value of a sweep's Tune driver and its trial proxies (Ray starts them at 15; why 0:
# raytrain_sys/niceness.py).
CONTROL_NICENESS = 0
PROXY_MEMORY_BYTES = 2 ** 20  # the proxy's whole bundle (see the module docstring)
ACTOR = "sweep-runner"


def runner_name(sweep: SweepRecord) -> str:
    """The runner's actor name: the sweep's id and submit second (``experiment_name``), so that a
    sweep of another store on the same cluster (``raytrain-sys sweep`` beside a service, a test's
    fresh store) never finds this one's runner as its own."""
    return f"{SWEEP_RUNNER_PREFIX}{experiment_name(sweep)[len('sweep-'):]}"


def experiment_name(sweep: SweepRecord) -> str:
    """Tune's experiment of the sweep: its id and submit second, so that a store made again in
    the same place never restores another sweep's experiment."""
    return f"sweep-{int(sweep.id)}-{int(sweep.submitted_at_s)}"


def spec_of(sweep: SweepRecord) -> SweepSpec:
    return sweep_from_dict(json.loads(sweep.spec))


# ----------------------------------------------------------------------------- the trial proxy


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


def mlflow_history(job: JobRecord, metric: str) -> list[tuple[int, float]]:
    """The job's evaluations of ``metric`` as its MLflow run logged them (none before it runs)."""
    if not job.mlflow_run_id:
        return []
    from raytrain_sys.tracking.mlflow_tracker import metric_history, spec_tracking_uri

    return metric_history(spec_tracking_uri(json.loads(job.spec)), job.mlflow_run_id, metric)


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
            _end_exploited(store, sweep_id, plan)
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
    runner makes it beside Tune's start (``drive``); raises ``TrialJobFailed`` when the sweep is
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


# ----------------------------------------------------------------------------- PBT's segments


POINTER_FILE = "raytrain_sys_checkpoint.json"
# How long a report at a checkpoint step waits for that checkpoint to be committed (an evaluation
# and the checkpoint of one step land at the same boundary, in either order): PBT's donor then
# names the checkpoint of the step it was ranked at.
CHECKPOINT_WAIT_S = 30.0


@dataclass(frozen=True)
class Pointer:
    """What a trial gives Tune as its checkpoint: where its job's committed checkpoint is (our
    checkpointer wrote it), never a copy of the model. PBT hands a donor's to the trial it
    exploits."""

    trial_id: str
    segment: int
    job_id: int
    step: int
    uri: str


@dataclass(frozen=True)
class SegmentPlan:
    """What a trial's proxy follows: ``segment`` (submitted, or re-attached to), started from
    ``donor`` (None: its own start or its own checkpoints), after ending ``end_job`` (the
    trial's previous segment, still live) when not None; ``new``: a segment from a donor not
    submitted yet."""

    segment: int
    donor: Optional[Pointer] = None
    end_job: Optional[int] = None
    new: bool = False


def segment_plan(trial_id: str, pointer: Optional[Pointer], newest: Optional[JobRecord],
                 max_steps: int) -> SegmentPlan:
    """The segment a trial's proxy follows, from the checkpoint Tune started it with and the
    trial's newest segment's job. No checkpoint, or the trial's own (Tune paused it, or restored
    it after its runner was lost): its newest segment (0 when it has none). A donor's (PBT
    exploited it): the segment already started from that checkpoint (the proxy driven again),
    else the next one, the newest ended first; but a donor's checkpoint at ``max_steps`` has no
    step left to train: the newest segment."""
    if pointer is None or pointer.trial_id == trial_id or (pointer.step >= max_steps and newest is not None):
        return SegmentPlan(newest.segment if newest is not None else 0)
    if newest is not None and resumed_from(newest) == pointer.uri:
        return SegmentPlan(newest.segment, pointer)
    if newest is None:
        return SegmentPlan(1, pointer, new=True)
    return SegmentPlan(newest.segment + 1, pointer, None if newest.state.terminal else newest.id, new=True)


def resumed_from(job: JobRecord) -> str:
    return json.loads(job.spec).get("checkpoint", {}).get("resume_from", "")


def newest_segment(trials: list[JobRecord], trial_id: str) -> Optional[JobRecord]:
    """The trial's job of its highest segment, None before it has one."""
    return max((j for j in trials if j.trial_id == trial_id), key=lambda j: j.segment, default=None)


def read_pointer(checkpoint) -> Optional[Pointer]:
    """The pointer in a Tune checkpoint (``tune.get_checkpoint()``), None without one."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as path:
        with open(os.path.join(path, POINTER_FILE)) as f:
            return Pointer(**json.load(f))


def checkpoint_exists(uri: str, spec: SweepSpec) -> bool:
    from raytrain_sys.checkpoint.checkpointer import open_checkpoint
    from raytrain_sys.errors import CheckpointError

    try:
        open_checkpoint(uri, spec.base["checkpoint"]["s3_endpoint_url"])
        return True
    except CheckpointError:
        return False


def _end_exploited(store: Store, sweep_id: int, plan: SegmentPlan) -> None:
    donor = plan.donor
    why = (f"exploited by PBT: its trial continues as segment {plan.segment} from trial {donor.trial_id}'s "
           f"checkpoint at step {donor.step}")
    try:
        requests.cancel(store, plan.end_job, by=f"sweep {sweep_id}", reason=why)
    except JobStateConflict as exc:  # it ended or is ending meanwhile
        log.info("job %d: %s", plan.end_job, exc)


def newest_checkpoint(root: str, step: int, s3_endpoint_url: str = ""):
    """The newest committed checkpoint (CheckpointInfo) at ``step`` or before in the checkpoint
    root ``root``, None before the first."""
    from raytrain_sys.checkpoint.checkpointer import Checkpointer
    from raytrain_sys.checkpoint.store import open_store

    if not root:
        return None
    done = [c for c in Checkpointer(open_store(root, s3_endpoint_url), None).list_complete() if c.step <= step]
    return max(done, key=lambda c: c.step, default=None)


def checkpoint_wait_s(scheduler: str) -> float:
    """How long a report at a checkpoint step waits for that step's checkpoint: PBT ranks a
    trial by the checkpoint of the step it reported (its exploits start from it); ASHA's and
    FIFO's pointers only mark how far Tune has read (a restored proxy goes on after it), and the
    newest committed one will do. A wait at a rung's step is a wait for ASHA's decision on it."""
    return CHECKPOINT_WAIT_S if scheduler == "pbt" else 0.0


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint as a runner lists it: its step and URI."""

    step: int
    uri: str


class Reporter:
    """The proxy's ``report``: each evaluation to Tune with a pointer to the job's committed
    checkpoint at that step (waited for up to CHECKPOINT_WAIT_S at a checkpoint step under PBT,
    else the newest before it, as the job's runner lists them when it answered); a segment
    started from a donor's checkpoint gets its MLflow run marked (donor, step, mutated values)
    at its first report after the store has its run's id (``mark``)."""

    def __init__(self, store: Store, spec: SweepSpec, trial_id: str, plan: SegmentPlan, config: dict,
                 wait_s: Optional[float] = None, sleep: Callable[[float], None] = time.sleep,
                 runner_checkpoints: Optional[Callable[[int], Optional[list]]] = None):
        self.store, self.spec, self.trial_id, self.plan, self.config = store, spec, trial_id, plan, config
        self.wait_s = checkpoint_wait_s(spec.scheduler.type) if wait_s is None else wait_s
        self.sleep = sleep
        # job id -> the checkpoints its runner committed ([(step, uri)]), None when no runner answered
        self.runner_checkpoints = runner_checkpoints or (lambda job_id: None)
        self._marked = plan.donor is None
        self._roots: dict[int, str] = {}  # job id -> its checkpoint root (read from its MLflow run once)

    def __call__(self, result: dict) -> None:
        import tempfile

        from ray import tune

        job = self.store.job(int(result["job_id"]))
        self.mark(job)
        info = self._checkpoint(job, int(result["step"]))
        if info is None:
            tune.report(result)
            return
        pointer = Pointer(self.trial_id, job.segment, job.id, info.step, info.uri)
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, POINTER_FILE), "w") as f:
                json.dump(vars(pointer), f)
            tune.report({**result, "checkpoint_step": info.step}, checkpoint=tune.Checkpoint.from_directory(tmp))

    def mark(self, job: JobRecord) -> None:
        """Mark a segment's MLflow run once (``mark_segment``), as soon as the store records its
        id: a first evaluation, read from the runner, can come before the pass that records it
        (the run opens beside the first steps)."""
        if not self._marked and job.mlflow_run_id:
            mark_segment(job, self.spec, self.plan, self.config)
            self._marked = True

    def _root(self, job: JobRecord) -> str:
        if not self._roots.get(job.id):
            from raytrain_sys.tracking.mlflow_tracker import spec_checkpoint_root

            self._roots[job.id] = spec_checkpoint_root(json.loads(job.spec), job.mlflow_run_id)
        return self._roots[job.id]

    def _checkpoint(self, job: JobRecord, step: int):
        listed = self.runner_checkpoints(job.id)
        if not self.wait_s and listed is not None:  # as its runner listed them: no MLflow, no listing
            committed = [(s, uri) for s, uri in listed if s <= step]
            return Committed(*max(committed)) if committed else None
        every = int(self.spec.base["checkpoint"]["every_steps"])
        s3 = self.spec.base["checkpoint"]["s3_endpoint_url"]
        deadline = time.monotonic() + self.wait_s
        while True:
            info = newest_checkpoint(self._root(job), step, s3)
            if (info is not None and info.step == step) or not every or step % every or job.state.terminal \
                    or time.monotonic() > deadline:
                return info
            self.sleep(0.2)
            job = self.store.job(job.id)


def mark_segment(job: JobRecord, spec: SweepSpec, plan: SegmentPlan, config: dict) -> bool:
    """Tag a segment's MLflow run with its donor (trial, step, checkpoint) and log its mutated
    values as metrics at its start step; False when it has no run yet or was marked before."""
    from raytrain_sys.service.sweeps.spec import tracking_uri
    from raytrain_sys.tracking import mlflow_tracker as mt

    donor = plan.donor
    if donor is None or not job.mlflow_run_id:
        return False
    raw = json.loads(job.spec)  # the values the segment's job runs with
    mutated = {key: float(value) for key, d in spec.space.items() if d.kind != "grid"
               for value in [_dotted(raw, key)] if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return mt.mark_segment(tracking_uri(spec), job.mlflow_run_id,
                           {mt.TAG_SEGMENT: str(plan.segment), mt.TAG_DONOR_TRIAL: donor.trial_id,
                            mt.TAG_DONOR_STEP: str(donor.step), mt.TAG_DONOR_CHECKPOINT: donor.uri},
                           mutated, donor.step)


# ----------------------------------------------------------------------------- Tune's decisions


def rungs_passed(step: int, grace: int, factor: int, max_t: int) -> int:
    """ASHA's milestones (grace, grace x factor, ...) below max_t that a trial reporting ``step``
    has reached: it was promoted past each one it runs on from."""
    rung, milestone = 0, grace
    while milestone < max_t and step >= milestone:
        rung += 1
        milestone *= factor
    return rung


def make_callback(sweep_id: int, db_url: str, parent: Optional[ParentRun] = None):
    """The Tune callback that turns Tune's decisions into service actions (a class made here so
    that importing this module does not import Ray Tune); with ``parent``, it ends the
    experiment (raising) at Tune's next step once making the parent run failed: the proxies
    would wait for it. Tune pickles the callback (and its class, made here: no closure over
    ``parent``, whose thread would not pickle)."""
    from ray.tune import Callback

    class ServiceActions(Callback):
        def __init__(self):
            self._store: Optional[Store] = None
            self._rungs: dict[str, int] = {}
            self._parent: Optional[ParentRun] = None

        def on_step_begin(self, iteration, trials, **info):
            if self._parent is not None and self._parent.error is not None:
                raise self._parent.error

        @property
        def store(self) -> Store:
            if self._store is None:
                self._store = Store.open(db_url)
            return self._store

        def __getstate__(self):  # Tune pickles its callbacks with the experiment: no open store, no thread
            return {"_store": None, "_rungs": dict(self._rungs), "_parent": None}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            log.info("trial %s: %s at step %s (job %s, checkpoint step %s)", trial.trial_id,
                     {k: v for k, v in result.items() if k.startswith("eval_")}, result.get("step"),
                     result.get("job_id"), result.get("checkpoint_step"))
            spec = spec_of(self.store.sweep(sweep_id))
            if spec.scheduler.type != "asha":
                return
            rung = rungs_passed(int(result.get("step", 0)), spec.scheduler.grace_period_steps,
                                spec.scheduler.reduction_factor, spec.max_steps)
            if rung > self._rungs.get(trial.trial_id, 0) and "job_id" in result:
                self._rungs[trial.trial_id] = rung
                self.store.set_rung(int(result["job_id"]), rung)

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._ended(trial, STOPPED)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._ended(trial, "its trial proxy failed")

        def _ended(self, trial, why: str) -> None:
            step = int(trial.last_result["step"]) if trial.last_result and "step" in trial.last_result else None
            stop_trial_job(self.store, sweep_id, trial.trial_id, step, why)

    actions = ServiceActions()
    actions._parent = parent
    return actions


STOPPED = "stopped by the sweep's scheduler"


def stop_action(state: JobState, step: Optional[int], max_steps: int, keep_stopped: bool) -> Optional[str]:
    """What Tune's end of a trial (ASHA's stop, or its proxy's failure) does to the trial's job,
    last reported at ``step``: "cancel", "pause" (``keep_stopped``: held, resumable), or None.
    None when the job has ended or is being stopped so already (the stop is carried out at
    ASHA's decision and again when Tune ends the trial), and when the trial reached ``max_steps``
    (ASHA ends every trial at max_t: its job is finishing on its own, and a cancel would skip its
    last checkpoint)."""
    if state.terminal or state is JobState.CANCELLING:
        return None
    if keep_stopped and state in (JobState.PAUSING, JobState.PAUSED):
        return None
    if step is not None and step >= max_steps:
        return None
    return "pause" if keep_stopped else "cancel"


def stop_trial_job(store: Store, sweep_id: int, trial_id: str, step: Optional[int], why: str) -> None:
    """Carry out ``stop_action`` on the trial's newest job, and wake the service's reconciler:
    the next scheduling pass gives the job's workers to another trial now, not at its period."""
    job = newest_segment(store.trials(sweep_id), trial_id)
    if job is None:
        return  # never submitted
    spec = spec_of(store.sweep(sweep_id))
    action = stop_action(job.state, step, spec.max_steps, spec.keep_stopped)
    if action is None:
        return
    at = f" at step {step}" if step is not None else ""
    by = f"sweep {sweep_id}"
    try:
        if action == "pause":
            stopping = requests.pause(store, job.id, by=by, reason=f"{why}{at} (keep_stopped)")
        else:
            stopping = requests.cancel(store, job.id, by=by, reason=f"{why}{at}")
    except JobStateConflict as exc:  # it ended or was held meanwhile
        log.info("trial %s: %s", trial_id, exc)
        return
    log.info("trial %s: job %d %s: %s%s", trial_id, job.id, "paused" if action == "pause" else "cancelled", why, at)
    if job.state is JobState.RUNNING and stopping.state in (JobState.PAUSING, JobState.CANCELLING):
        tell_runner(stopping, by)
    wake_service()


# How long telling a stop to a spare runner waits for the spares to say which job each runs.
TELL_RUNNER_SPARE_WAIT_S = 1.0


def tell_runner(job: JobRecord, by: str) -> None:
    """The stop the store now holds (pausing or cancelling), told to the running job's runner at
    once, in the background: the reconciler's pass tells it too (the runner's pause and cancel
    are idempotent), but under load a pass comes 0.8-2 s after the wake (sweep.py, 2026-11-28:
    the store's cancel to the runner's hearing it), while the trial's job trains on."""
    def tell() -> None:
        from raytrain_sys.service.runner import ask_to_stop, find_runner

        try:
            handle = find_runner(job.id, spare_wait_s=TELL_RUNNER_SPARE_WAIT_S)
            if handle is not None:
                ask_to_stop(handle, job, by)
        except Exception as exc:  # noqa: BLE001: the reconciler's pass tells it anyway
            log.debug("job %d: stop not told to its runner at once: %s", job.id, exc)

    threading.Thread(target=tell, name=f"tell-runner-{job.id}", daemon=True).start()


def wake_service() -> None:
    """Ask the job service for a reconciler pass now (a request written through another
    process's store does not wake it); nothing when no service runs (``raytrain-sys sweep``)."""
    from raytrain_sys.service.names import SERVICE_NAME

    try:
        ray.get_actor(SERVICE_NAME, namespace=NAMESPACE).wake.remote()
    except Exception as exc:  # noqa: BLE001: no service, or one without wake: its next pass comes at its period
        log.debug("no service to wake: %s", exc)


def make_scheduler(spec: SweepSpec, sweep_id: Optional[int] = None, db_url: str = ""):
    """Tune's scheduler of the sweep. ASHA's stops are carried out at its decision
    (``stop_trial_job``, with ``sweep_id`` and ``db_url``): Tune would end the trial only after
    the result's checkpoint (a pointer, at a checkpoint step) is saved."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    s = spec.scheduler
    if s.type == "asha":
        if sweep_id is None:
            return ASHAScheduler(time_attr="step", max_t=spec.max_steps, grace_period=s.grace_period_steps,
                                 reduction_factor=s.reduction_factor)

        class StopsAtDecision(ASHAScheduler):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self._store: Optional[Store] = None

            def __getstate__(self):  # pickled with the Tuner: no open store
                return {**self.__dict__, "_store": None}

            def on_trial_result(self, tune_controller, trial, result):
                decision = super().on_trial_result(tune_controller, trial, result)
                if decision == self.STOP:
                    if self._store is None:
                        self._store = Store.open(db_url)
                    stop_trial_job(self._store, sweep_id, trial.trial_id, result.get("step"), STOPPED)
                return decision

        return StopsAtDecision(time_attr="step", max_t=spec.max_steps, grace_period=s.grace_period_steps,
                               reduction_factor=s.reduction_factor)
    if s.type == "pbt":
        # Synchronous: the population is ranked once every trial has reached the interval, so every
        # trial ranked in the upper quantile holds a checkpoint (a trial waiting for the others is
        # paused with its newest pointer). Tune's asynchronous PBT gives a trial a checkpoint only if
        # it ranked in the upper quantile when it itself reached the interval, and skips an exploit
        # from a donor that ranked first, alone ("Skip exploit"). Pausing a proxy pauses no job.
        return PopulationBasedTraining(time_attr="step", perturbation_interval=s.perturbation_interval_steps,
                                       hyperparam_mutations=pbt_mutations(spec), quantile_fraction=s.quantile_fraction,
                                       resample_probability=s.resample_probability, synch=True)
    return FIFOScheduler()


def trainable(sweep_id: int, db_url: str, base_dir: str, log_path: str = ""):
    """The proxy as Tune runs it: its parameters bound, on a bundle of no CPU (the safe nodes'
    resource too when the cluster has them)."""
    from ray import tune

    resources = {"cpu": 0, "memory": PROXY_MEMORY_BYTES, **control_options().get("resources", {})}
    return tune.with_resources(tune.with_parameters(run_trial, sweep_id=sweep_id, db_url=db_url, base_dir=base_dir,
                                                    log_path=log_path),
                               resources)


def drive(sweep_id: int, db_url: str, base_dir: str, log_path: str = "") -> Optional[SweepRecord]:
    """Run (or, when its experiment exists, restore and finish) the sweep's Tune experiment, then
    record its end: finished with the best trial and value. Returns the sweep as recorded, or
    None when it was no longer running (cancelled or paused meanwhile: nothing recorded)."""
    from ray import tune

    store = Store.open(db_url)
    try:
        sweep = store.sweep(sweep_id)
        log.info("sweep %d: its runner drives Tune (%.1f s after its submit)", sweep_id, time.time() - sweep.submitted_at_s)
        spec = spec_of(sweep)
        # MLflow imported here, before the two threads that would import it at once: Tune's own
        # start imports it (its usage tags load ray.air.integrations.mlflow) while the parent run's
        # thread does, and Python's import locks then raised _DeadlockError in one of them (seen
        # in benchmarks/sweep.py: the sweep failed with "its Tune driver raised").
        import mlflow  # noqa: F401

        # The parent run is made beside Tune's start and its proxies' (each proxy waits for it
        # before it submits its trial's job: ``with_parent_run``): a new SQLite MLflow store's
        # first run took 8 s at a load of 29, as long again as Tune took to start its proxies.
        parent = ParentRun(db_url, sweep)
        # Tune's own CSV, JSON and TensorBoard loggers of each trial's results are not made: the
        # trials' runs are MLflow's, and they were a writer thread per trial in this process.
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
        fn = trainable(sweep_id, db_url, base_dir, log_path)
        path = os.path.join(sweep.storage_path, experiment_name(sweep))
        if tune.Tuner.can_restore(path):
            log.info("sweep %d: restoring its Tune experiment from %s", sweep_id, path)
            tuner = tune.Tuner.restore(path, fn, resume_unfinished=True, resume_errored=True)
        else:
            tuner = tune.Tuner(
                fn, param_space=tune_space(spec),
                tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode,
                                            scheduler=make_scheduler(spec, sweep_id, db_url),
                                            num_samples=spec.num_samples),
                run_config=tune.RunConfig(name=experiment_name(sweep), storage_path=sweep.storage_path,
                                          callbacks=[make_callback(sweep_id, db_url, parent)], verbose=0))
        results = tuner.fit()
        sweep = parent.result()  # raises what its making raised
        wait_for_trials_to_end(store, sweep_id)
        table = trial_table(store, sweep_id, spec)
        best_trial, best_value = best_of(table, spec.mode)
        if best_trial is None:
            errors = sorted({str(r.error).splitlines()[-1] for r in results if r.error})
            why = f"no trial reported {spec.metric}" + (f": {'; '.join(errors)[:400]}" if errors else "")
            store.transition_sweep(sweep_id, SweepState.RUNNING, SweepState.FAILED, actor=ACTOR, reason=why)
            return store.sweep(sweep_id)
        record_outcome(sweep, spec, table, best_trial, best_value)
        try:
            return store.transition_sweep(sweep_id, SweepState.RUNNING, SweepState.FINISHED, actor=ACTOR,
                                          reason=f"{len(results)} trials ended; best {best_trial} "
                                                 f"({spec.metric} {best_value})",
                                          best_trial=best_trial, best_value=best_value)
        except JobStateConflict as exc:
            log.info("sweep %d: its end not recorded: %s", sweep_id, exc)
            return None
    finally:
        store.close()


# How long the sweep's end waits for the jobs of trials Tune ended (an ASHA stop is a cancel, which
# the reconciler carries out at the job's next boundary, or kills past its stop deadline, 120 s).
TRIALS_END_WAIT_S = 300.0


def wait_for_trials_to_end(store: Store, sweep_id: int, timeout_s: float = TRIALS_END_WAIT_S,
                           poll_s: float = 0.5) -> bool:
    """Wait until every trial's job has ended, or is paused (a trial stopped with keep_stopped):
    a sweep is not finished while a stopped trial's job still holds its workers (Tune returns as
    soon as it has stopped following the trial).
    False (and a warning) when some are still live after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = [t.id for t in store.trials(sweep_id) if not (t.state.terminal or t.state is JobState.PAUSED)]
        if not live:
            return True
        if time.monotonic() > deadline:
            log.warning("sweep %d: trial jobs %s still live %.0f s after Tune ended; the sweep's end is "
                        "recorded all the same", sweep_id, live, timeout_s)
            return False
        time.sleep(poll_s)


class ParentRun:
    """``parent_run`` made in a thread of its own, on a store of its own; ``result`` waits for
    it and returns the sweep with it, or raises what making it raised (``error``: that, once it
    did)."""

    def __init__(self, db_url: str, sweep: SweepRecord):
        self.error: Optional[BaseException] = None
        self._sweep = sweep
        self._thread = threading.Thread(target=self._make, args=(db_url,), name="sweep-parent-run", daemon=True)
        self._thread.start()

    def _make(self, db_url: str) -> None:
        store = Store.open(db_url)
        try:
            self._sweep = parent_run(store, self._sweep)
            log.info("sweep %d: MLflow parent run %s", self._sweep.id, self._sweep.mlflow_parent_run_id)
        except BaseException as exc:  # noqa: BLE001: raised again by result() and Tune's next step
            log.exception("sweep %d: its MLflow parent run could not be made", self._sweep.id)
            self.error = exc
        finally:
            store.close()

    def result(self) -> SweepRecord:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self._sweep


def parent_run(store: Store, sweep: SweepRecord) -> SweepRecord:
    """The sweep with its MLflow parent run: made once (the space, scheduler and metric as
    params), recorded in the store before any trial is submitted, so that every trial's run is
    its child; a restored runner finds it recorded."""
    if sweep.mlflow_parent_run_id:
        return sweep
    from raytrain_sys.service.sweeps.spec import tracking_uri
    from raytrain_sys.tracking.mlflow_tracker import TAG_SWEEP, start_parent_run

    spec = spec_of(sweep)
    params = {"space": json.dumps(spec.to_dict()["space"]), "scheduler": json.dumps(spec.to_dict()["scheduler"]),
              "metric": spec.metric, "mode": spec.mode, "num_samples": str(spec.num_samples),
              "trials": str(spec.trial_count)}
    run_id = start_parent_run(tracking_uri(spec), spec.base["tracking"]["experiment"], f"sweep-{sweep.id}-{sweep.name}",
                              params, {TAG_SWEEP: str(sweep.id)})
    return store.transition_sweep(sweep.id, SweepState.RUNNING, SweepState.RUNNING, actor=ACTOR,
                                  reason=f"MLflow parent run {run_id}", mlflow_parent_run_id=run_id)


def trial_table(store: Store, sweep_id: int, spec: SweepSpec) -> list[dict]:
    """Every trial of the sweep, in the order of their first jobs: its newest segment's job,
    state, MLflow run and config (the values it ended with), its segments (job, run, the step it
    started at) and its curve of the metric across its segments (``trial_curve``: each
    evaluation its jobs logged, also those after Tune stopped following it: a stopped trial's
    job trains on until its cancel lands at its next boundary)."""
    by_trial: dict[str, list[JobRecord]] = {}
    for job in store.trials(sweep_id):
        by_trial.setdefault(job.trial_id, []).append(job)
    table = []
    for trial_id, jobs in by_trial.items():
        jobs = sorted(jobs, key=lambda j: j.segment)
        newest = jobs[-1]
        raw = json.loads(newest.spec)
        segments = [{"segment": j.segment, "job": j.id, "mlflow_run_id": j.mlflow_run_id,
                     "start_step": checkpoint_step_of(resumed_from(j))} for j in jobs]
        table.append({"trial": trial_id, "job": newest.id, "state": newest.state.value,
                      "mlflow_run_id": newest.mlflow_run_id, "config": {key: _dotted(raw, key) for key in spec.space},
                      "segments": segments,
                      "curve": trial_curve([(s["start_step"], mlflow_history(j, spec.metric))
                                            for s, j in zip(segments, jobs)])})
    return table


def checkpoint_step_of(uri: str) -> int:
    """The step of a checkpoint directory's URI (``.../step_00000012``: 12); 0 for "" (a
    segment started from scratch)."""
    from raytrain_sys.checkpoint.checkpointer import split_checkpoint_uri

    split = split_checkpoint_uri(uri)
    return split[1] if split is not None else 0


def trial_curve(segments: list[tuple[int, list[tuple[int, float]]]]) -> list[tuple[int, float]]:
    """A trial's curve across its PBT segments, each (start step, its job's curve) in segment
    order: a segment's points up to the next segment's start, then the next one's. The points
    an exploited segment logged past the step its successor started from (its job trained on
    until its cancel landed) are not the trial's: the trial went on from the donor's
    checkpoint."""
    curve: list[tuple[int, float]] = []
    for i, (start, points) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else None
        curve.extend((step, value) for step, value in points if step > start and (end is None or step <= end))
    return curve


def best_of(table: list[dict], mode: str) -> tuple[Optional[str], Optional[float]]:
    """The trial whose job logged the best value of the metric (the lowest with mode "min"), and
    that value; (None, None) when no trial logged any. The jobs' curves, not Tune's results,
    decide: the best model is the one a job trained, and Tune stops reading a trial's results
    when it stops the trial. A tie goes to the trial first in the table."""
    best: tuple[Optional[str], Optional[float]] = (None, None)
    for row in table:
        for _, value in row["curve"]:
            if best[1] is None or (value < best[1] if mode == "min" else value > best[1]):
                best = (row["trial"], float(value))
    return best


def record_outcome(sweep: SweepRecord, spec: SweepSpec, table: list[dict], best_trial: Optional[str],
                   best_value: Optional[float]) -> None:
    """The parent run's end: the best trial and value, the trials' table (``trial_table``) and
    the plot of their curves (``sweep_curves.png``)."""
    from raytrain_sys.monitor.plots import sweep_curves_figure
    from raytrain_sys.service.sweeps.spec import tracking_uri
    from raytrain_sys.tracking.mlflow_tracker import end_parent_run

    best = next((row for row in table if row["trial"] == best_trial), None)
    metrics = {f"best_{spec.metric}": best_value} if best_value is not None else {}
    tags = {"best_trial": str(best_trial), "best_job": str(best["job"] if best else ""),
            "best_run_id": str(best["mlflow_run_id"] if best else "")}
    figure = sweep_curves_figure(table, spec.metric, best_trial)
    end_parent_run(tracking_uri(spec), sweep.mlflow_parent_run_id, metrics, tags, {"trials.json": table},
                   figures={"sweep_curves.png": figure} if figure is not None else {})


def _dotted(raw: dict, key: str):
    node = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


_LOGGED_TO: set[str] = set()


def log_to(log_path: str) -> None:
    """Append this process's sweep lines to the sweep's log (once a process): ours (the runner's
    and its proxies', each line timed to the millisecond: how late Tune's decisions come is read
    from them), and Tune's schedulers' decisions (PBT's exploits, or a "Skip exploit" of a trial
    with no checkpoint)."""
    if not log_path or log_path in _LOGGED_TO:
        return
    _LOGGED_TO.add(log_path)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"))
    for name in ("raytrain_sys", "ray.tune.schedulers"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)


@ray.remote(num_cpus=0, max_restarts=0)
class SweepRunner:
    """A sweep's Tune driver, detached and named (``raytrain-sys-sweep-<id>``): it drives Tune in
    a thread, answers ``status`` meanwhile; the reconciler starts another when it is lost."""

    def __init__(self, sweep_id: int, db_url: str, base_dir: str, log_path: str = ""):
        log_to(log_path)
        set_niceness(CONTROL_NICENESS)
        self.sweep_id = sweep_id
        self.log_path = log_path
        self._error = ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(db_url, base_dir), daemon=True)
        self._thread.start()

    def _run(self, db_url: str, base_dir: str) -> None:
        try:
            drive(self.sweep_id, db_url, base_dir, self.log_path)
        except Exception as exc:  # the reconciler records it and fails the sweep
            log.exception("sweep %d: its Tune driver raised", self.sweep_id)
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()

    def status(self) -> dict:
        return {"sweep_id": self.sweep_id, "done": self._done.is_set(), "error": self._error, "pid": os.getpid()}


# ----------------------------------------------------------------------------- the reconciler's part


def find_runner(sweep: SweepRecord):
    try:
        return ray.get_actor(runner_name(sweep), namespace=NAMESPACE)
    except ValueError:
        return None


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


def prepare_tracking(sweep: SweepRecord) -> threading.Thread:
    """Make the sweep's MLflow store (a new SQLite store's tables: 5.8 s at a load of 49) in a
    thread of the caller's process while its runner's process starts: the runner's parent run
    then opens a finished store (``mlflow_tracker.ensure_store`` makes it once, under a lock). A
    failure is only logged: the parent run meets it again and fails the sweep with it."""
    from raytrain_sys.service.sweeps.spec import tracking_uri
    from raytrain_sys.tracking.mlflow_tracker import ensure_store

    def make() -> None:
        try:
            ensure_store(tracking_uri(spec_of(sweep)))
        except Exception as exc:  # noqa: BLE001: the runner's parent run reports it
            log.info("sweep %d: its MLflow store not made ahead: %s", sweep.id, exc)

    thread = threading.Thread(target=make, name=f"sweep-{sweep.id}-tracking", daemon=True)
    thread.start()
    return thread


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


__all__ = ["run_trial", "follow", "drive", "SweepRunner", "ensure_runners", "rungs_passed", "runner_name",
           "TrialJobFailed", "make_scheduler", "stop_runner", "best_of", "trial_table", "trials_to_start"]
