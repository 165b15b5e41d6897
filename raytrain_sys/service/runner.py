"""One job's run inside the cluster: ``JobRunner``, a detached named Ray actor per job.

Owns: one Supervisor (run in a thread of the actor, so that ``status`` and the requests are
answered while it trains), its ``RunRequests`` (pause, cancel, resize at the next step
boundary), and the job's log file ``<log_dir>/job-<id>.log`` (the ``raytrain_sys`` loggers of
this process: the Supervisor's transitions with their reasons; the API serves the file).
Writes nothing of the service's store: the reconciler reads ``status()`` (a ``RunnerStatus``, with
the run's end as a ``RunnerResult`` once the Supervisor has returned) and is the one writer of
the job's transitions.

Why an actor of its own, and why so configured:

* **Detached and named** (``raytrain-sys-job-<id>`` in namespace ``raytrain-sys``): the job
  lives neither in a client nor in the service's process. A service that restarts finds it
  again by name (``find_runner``) instead of starting the job twice; creating it uses
  ``get_if_exists``, so a second create adopts the first.
* **num_cpus=0**: it sequences, it does not train; its workers take the job's CPU slots.
* **max_restarts=0**: Ray never restarts it on its own. A restart is the reconciler's decision
  (from the newest committed checkpoint, within the job's restart budget), recorded in the
  store like every other run-time transition.
* Its TrainWorkers and placement groups are created by this process: when it dies (killed,
  its node lost), Ray removes them (a non-detached actor dies with its owner; a placement
  group with the detached actor that created it). Killing the runner is therefore the hard
  stop of a job.
* **On a safe node** when the cluster has one (``control/control_actors.py``: it asks the
  ``raytrain_control`` resource and no spot node): its loss would end the job's run, so a spot
  reclaim must not take it; its workers run on the job's flavor, where a reclaim is a drain.

Spare runners (``new_spare_runner``, named ``raytrain-sys-runner-spare-<id>``): the reconciler
keeps two started ahead, imports done and the MLflow stores of the service's newest jobs opened
(``warm_tracking``: the process's client of each store, which the job's run then opens on), and
a launch starts the job on one (``start``) rather than waiting about 2 s for a process to start
and import torch and MLflow, and 0.2-2 s more to open the store.
Once started it is the job's runner in every respect; ``find_runner`` finds it by asking the
spares which job they run.

A start runs the job's spec at the admitted number of workers; a resume continues its MLflow
run from the newest committed checkpoint (``resume_supervisor``). Either way the admitted
number is also the ceiling (``RunRequests.resize``): the job grows past it only when the
reconciler resizes it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import ray

from raytrain_sys.control.control_actors import control_options
from raytrain_sys.control.spares import NAMESPACE, SpareSource
from raytrain_sys.errors import find_user_error
from raytrain_sys.monitor.report import progress
from raytrain_sys.service.names import (RUNNER_PREFIX, SPARE_RUNNER_PREFIX,  # noqa: F401 (their home was here)
                                        SPARE_START_TIMEOUT_S, find_runner, runner_name, spare_runners)
from raytrain_sys.niceness import process_niceness, set_niceness
from raytrain_sys.service.model import JobRecord, JobState, RunOutcome, RunnerResult, RunnerState
from raytrain_sys.spec import apply_overrides, from_dict

if TYPE_CHECKING:  # imported in the runner's __init__, at RUN_NICENESS (torch: most of a start's CPU)
    from raytrain_sys.control.supervisor import Supervisor

log = logging.getLogger(__name__)


def ask_to_stop(handle, job: JobRecord, by: str) -> None:
    """Ask a job's runner to stop as the store says: a pausing job with a checkpoint, a
    cancelling one without. Idempotent on the runner, so every reconciler pass may ask again
    and a sweep's stop may ask before the pass (``sweeps.stops.tell_runner``)."""
    (handle.pause if job.state is JobState.PAUSING else handle.cancel).remote(job.message, by)

# How often ``evaluations`` looks at the run's evaluations while it waits: in this process, for
# nothing; an evaluation is seconds apart at best.
EVALUATIONS_POLL_S = 0.05
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The nice value a runner runs its job at, from its process's imports (torch, MLflow: 2-4 s of
# CPU) to its run's end; a spare runner's warm-up too, then it idles at Ray's 15. At Ray's 15
# beside training workers at 0 (raytrain_sys/niceness.py) a runner is starved of what little
# CPU it needs, and everything it does waits: a runner process took 57-88 s to its job's first
# step (25 s of it pre-flight, against 0.1 s at 0), a growth's newcomer 6.8-8.8 s from the
# decision to its first step (1.1-1.2 s at 0), a stopped job's end 12-31 s (2.5-8.6 s)
# (benchmarks/sweep.py, 4 training workers on 2 cores). None: Ray's throughout.
RUN_NICENESS: Optional[int] = 0


def reported_state(state: RunnerState, tracking: bool, run_id: str) -> RunnerState:
    """The Supervisor's state as the runner reports it. A new run trains while its MLflow run is
    still opening (``Tracker.begin``); until its run id is known the runner reports it starting
    (start step ``workers``: "the MLflow run, ..."), so that a job the store records running
    always carries its MLflow run id, which its resume after a lost runner or a hard pause
    needs. A run that ended, or tracks nothing, is reported as it is."""
    if tracking and not run_id and state.trains:
        return RunnerState.STARTING
    return state


def job_log_path(log_dir: str, job_id: int) -> str:
    """Where a job's log lines go (one file a job, appended to across its starts and resumes)."""
    return os.path.join(log_dir, f"job-{int(job_id)}.log")


@dataclass(frozen=True)
class Launch:
    """What the reconciler asks of a new runner."""

    job_id: int
    spec: dict  # the job's spec as stored (paths made absolute at submit)
    workers: int  # admitted: the run starts on this many, and grows past it only when resized
    log_dir: str
    resume_run_id: str = ""  # continue this MLflow run from its newest committed checkpoint
    tracking_uri: str = ""  # where that run is recorded
    reason: str = ""  # why it was admitted (the scheduler's words)
    team: str = "-"  # the job's team: the run's metrics carry it
    package: str = ""  # the code package it runs with (its runner's working_dir): no warm spare then
    # Set by the service at each launch ("dotted.key=value"): the flavor it was admitted on (its
    # market and accelerator type: the workers' label selector), the flavor's price per worker
    # hour, and a provisioning start's placement bound (the reconciler's launch_overrides).
    overrides: tuple[str, ...] = ()
    # A restart's: the step its lost runner was last seen to commit (the service's passes saw it),
    # so that the resumed run counts the steps it trains again from what was seen, not only from
    # the lost run's last summary.json (written at most every few seconds): 0 when not known.
    lost_at_step: int = 0

    def run_overrides(self) -> list[str]:
        return run_overrides(self.workers, self.overrides)


def run_overrides(workers: int, overrides: tuple[str, ...] = ()) -> list[str]:
    """What a start or a resume changes in the job's spec: the admitted workers, then ``overrides``."""
    return [f"resources.num_workers={int(workers)}", *overrides]


def start_spec(spec: dict, workers: int, overrides: tuple[str, ...] = ()) -> dict:
    """The spec a start runs: the job's, on the admitted number of workers, with ``overrides``."""
    return apply_overrides(spec, run_overrides(workers, overrides))


@dataclass(frozen=True)
class RunnerStatus:
    """The run as its runner sees it now (``JobRunner.status``): what the reconciler records. It
    crosses the actor boundary pickled, every pass, for every live job."""

    job_id: int
    state: RunnerState  # the Supervisor's (reported_state: starting until a new run's MLflow run id is known)
    start_step: str  # where its start is (JobRunner._start_step, service/starts.py); "" once it trains or ended
    committed_step: int
    world_size: int  # its workers now; 0 once done
    released: bool  # the run has let its workers go (its group shut down): it is ending, closing its MLflow run
    max_workers: Optional[int]  # the ceiling its requests hold: the last resize it heard
    mlflow_run_id: str  # "" until its MLflow run is open
    run_dir: str
    checkpoint_step: Optional[int]  # its newest committed checkpoint
    checkpoint_at_s: Optional[float]  # when this runner first saw that checkpoint committed (unix s)
    done: bool  # the Supervisor has returned: ``result`` says how
    result: Optional[RunnerResult]  # None while it runs (a done run without one is read as failed)
    pid: int
    nice: int  # the runner process's nice value now (RUN_NICENESS while it runs its job)
    actor_id: str  # the owner of its warm spares and its launch: the reconciler ends them with it
    started_at_s: float  # when this runner started the run (unix s)
    launch: Launch  # what it was asked, its spec left out (large; the store has it)
    steps_redone: int = 0  # its run's record's (summary.json): steps committed, then trained again


class JobRunner:
    """One Supervisor in a thread; see the module docstring. Create with ``launch_runner``;
    with no launch, a spare that ``start`` gives one later (``new_spare_runner``)."""

    def __init__(self, launch: Optional[Launch] = None,
                 step_hook: Optional[Callable[[int, Supervisor, Any], None]] = None):
        self.launch: Optional[Launch] = None
        self.job_id: Optional[int] = None
        self._lock = threading.Lock()
        self._sup: Optional[Supervisor] = None
        self._result: Optional[RunnerResult] = None
        self._done = threading.Event()
        self._born_nice = process_niceness()  # Ray's: a spare idles at it
        set_niceness(RUN_NICENESS, why="a job's runner")
        # torch, and what a start needs of it: at RUN_NICENESS
        import raytrain_sys.control.supervisor  # noqa: F401

        if launch is None:  # a spare: what a start would import and open first, done now
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

            from raytrain_sys.train.check import warm_up

            warm_up()
            set_niceness(self._born_nice)  # idle until a launch takes it
            return
        self.start(launch, step_hook)

    def start(self, launch: Launch, step_hook: Optional[Callable[[int, Supervisor, Any], None]] = None) -> int:
        """Run ``launch`` (once: a runner runs one job). Returns this process's pid."""
        from raytrain_sys.control.supervisor import RunRequests

        with self._lock:
            if self.launch is not None:
                raise RuntimeError(f"this runner runs job {self.job_id} already")
            self.launch = launch
        self.job_id = launch.job_id
        set_niceness(RUN_NICENESS, why="a job's runner")  # the thread below inherits it
        self._log_handler = log_to_file(job_log_path(launch.log_dir, launch.job_id))
        self.requests = RunRequests()
        self.requests.resize(launch.workers, launch.reason or f"admitted on {launch.workers} workers",
                             by="scheduler")
        self._step_hook = step_hook  # tests and notebooks: called at each committed step, in this process
        self._sup: Optional[Supervisor] = None
        self._result: Optional[RunnerResult] = None
        self._done = threading.Event()
        self._checkpoint_seen_at: dict[int, float] = {}  # step -> when this runner first saw it committed
        self._started_at_s = time.time()
        self._thread = threading.Thread(target=self._run, name=f"job-{launch.job_id}", daemon=True)
        self._thread.start()
        return os.getpid()

    def job(self) -> Optional[int]:
        """The job this runner runs; None for a spare."""
        return self.job_id

    def warm_tracking(self, uris: list[str]) -> None:
        """A spare: open these MLflow stores ahead (``mlflow_store.warm``), those the service's
        newest jobs track to, so that the next job's run opens on a warm client; a runner that
        runs a job already has its own."""
        from raytrain_sys.tracking import mlflow_store as ms

        for uri in uris:
            if self.launch is None:
                ms.warm(uri)

    # ------------------------------------------------------------------ the run
    def _run(self) -> None:
        from raytrain_sys.control.supervisor import Supervisor, resume_supervisor

        launch = self.launch
        how = (f"resuming MLflow run {launch.resume_run_id} from its newest checkpoint"
               if launch.resume_run_id else "starting")
        log.info("job %d: %s on %d workers (%s)", launch.job_id, how, launch.workers, launch.reason)
        try:
            if launch.resume_run_id:
                self._sup = resume_supervisor(
                    launch.resume_run_id, tracking_uri=launch.tracking_uri,
                    overrides=launch.run_overrides(),
                    on_step=self._on_step, requests=self.requests, spares=self._spares(),
                    team=launch.team, lost_at_step=launch.lost_at_step)
            else:
                self._sup = Supervisor(from_dict(start_spec(launch.spec, launch.workers, launch.overrides)),
                                       on_step=self._on_step, requests=self.requests,
                                       spares=self._spares(), team=launch.team)
            result = self._sup.run()
            # A status the Supervisor ends in that is not an outcome raises here: a failed run, saying so.
            self._result = RunnerResult(RunOutcome(result.status), result.reason or self._last_reason())
        except BaseException as exc:  # the run failed: the reconciler records why
            user = find_user_error(exc)
            reason = str(user) if user is not None else f"{type(exc).__name__}: {exc}"
            self._result = RunnerResult(RunOutcome.FAILED, reason, type(user if user is not None else exc).__name__)
            log.error("job %d failed: %s", launch.job_id, reason, exc_info=user is None)
        finally:
            log.info("job %d: runner done: %s", launch.job_id,
                     json.dumps(None if self._result is None else asdict(self._result)))
            self._log_handler.flush()
            self._done.set()

    def _spares(self) -> Optional[SpareSource]:
        """Warm spare workers, unless the job brings its code (they were started without it)."""
        return None if self.launch.package else SpareSource.here()

    def _on_step(self, report) -> None:
        if self._step_hook is not None and self._sup is not None:
            self._step_hook(self.job_id, self._sup, report)

    def _last_reason(self) -> str:
        sup = self._sup
        if sup is None or not sup.summary.transitions:
            return ""
        return sup.summary.transitions[-1]["reason"]

    # ------------------------------------------------------------------ what the reconciler calls
    def status(self) -> RunnerStatus:
        """The run as it is now (``RunnerStatus``): the Supervisor's state, the step of its
        start, committed step, world size, MLflow run id, newest checkpoint, run dir; ``released``
        once the run has let its workers go; ``done`` and ``result`` once the Supervisor has
        returned."""
        sup = self._sup
        state = self._state()
        checkpoint_step, checkpoint_at_s = None, None
        world_size, committed, run_dir, run_id, released, redone = 0, 0, "", "", False, 0
        if sup is not None:
            committed = sup.committed_step
            redone = sup.summary.steps_redone
            run_dir = sup.run_dir
            run_id = sup.summary.mlflow_run_id
            group = sup.group
            world_size = len(group.workers) if group is not None and not self._done.is_set() else 0
            released = group is not None and group.released
            checkpoints = list(sup.summary.checkpoints)
            if checkpoints:
                checkpoint_step = int(checkpoints[-1]["step"])
                checkpoint_at_s = self._checkpoint_seen_at.setdefault(checkpoint_step, time.time())
        ceiling, _ = self.requests.max_workers()
        return RunnerStatus(
            job_id=self.job_id, state=state, start_step=self._start_step(), committed_step=committed,
            world_size=world_size, released=released, max_workers=ceiling, mlflow_run_id=run_id, run_dir=run_dir,
            checkpoint_step=checkpoint_step, checkpoint_at_s=checkpoint_at_s, done=self._done.is_set(),
            result=self._result, pid=os.getpid(), nice=process_niceness(),
            actor_id=ray.get_runtime_context().get_actor_id(), started_at_s=self._started_at_s,
            launch=replace(self.launch, spec={}), steps_redone=redone)

    def _state(self) -> RunnerState:
        sup = self._sup
        if sup is None:
            return RunnerState.LAUNCHING
        return reported_state(RunnerState(sup.state.value), sup.spec.tracking.enabled, sup.summary.mlflow_run_id)

    def evaluations(self, key: str, after_step: int, wait_s: float = 0.0) -> dict:
        """The run's evaluations of ``key`` (a summary key: ``loss``, as MLflow's ``eval_loss``)
        after ``after_step``, ``[(step, value)]`` in step order, the values its MLflow run logs;
        waits up to ``wait_s`` for one (a sweep's trial proxy asks, and hears of an evaluation
        at once instead of polling MLflow). ``done``: the run has ended, and the list is all it
        will log (read before the list). ``checkpoints``: the run's committed checkpoints, [(step,
        URI)], those retention deleted since included."""
        deadline = time.monotonic() + wait_s
        while True:
            done, sup = self._done.is_set(), self._sup
            points = [] if sup is None else sorted(
                (int(e["step"]), float(e[key])) for e in list(sup.summary.evals)
                if int(e["step"]) > after_step and key in e)
            if points or done or time.monotonic() >= deadline:
                checkpoints = [] if sup is None else [(int(c["step"]), c["uri"]) for c in list(sup.summary.checkpoints)]
                return {"evaluations": points, "done": done, "checkpoints": checkpoints}
            time.sleep(EVALUATIONS_POLL_S)

    def _start_step(self) -> str:
        """Where the run's start is, for the job's wait reason (``service/starts.py``):
        ``supervisor`` (the Supervisor is being built: a resume first reads its run's record),
        ``preparing`` (pre-flight checks, Ray, the first reads), ``placement`` (the workers'
        slots asked of the cluster), ``workers`` (their processes, the MLflow run, the process
        group, the first batch), ``restore`` (a checkpoint loading); "" once it trains or ended."""
        sup = self._sup
        if self._done.is_set():
            return ""
        if sup is None:
            return "supervisor"
        state = self._state()
        if not state.starting:
            return ""
        if state is RunnerState.RESTORING:
            return "restore"
        group = sup.group  # made once the data plane is set up (Supervisor.run)
        if group is None:
            return "preparing"
        return "placement" if "placement" not in group.start_phases else "workers"

    def progress(self) -> Optional[dict]:
        """The run's live numbers for the jobs page (``monitor.report.progress``: recent losses,
        throughput, per-rank step times, cost when recorded); None before the Supervisor exists.
        Read from the Supervisor's summary in place, between its steps' writes: cheap to poll."""
        sup = self._sup
        if sup is None:
            return None
        return progress(sup.summary, sup.spec.train.max_steps)

    def pause(self, reason: str, by: str = "") -> None:
        """Stop at the next step boundary with a checkpoint (result outcome ``stopped``)."""
        if self.requests.stop() is None:
            log.info("job %d: pause asked by %s: %s", self.job_id, by or "?", reason)
        self.requests.pause(reason, by)

    def cancel(self, reason: str, by: str = "") -> None:
        """Stop at the next step boundary, no checkpoint added (result outcome ``cancelled``)."""
        stop = self.requests.stop()
        if stop is None or stop.how != "cancel":
            log.info("job %d: cancel asked by %s: %s", self.job_id, by or "?", reason)
        self.requests.cancel(reason, by)

    def resize(self, workers: int, reason: str = "", by: str = "") -> None:
        """Train on at most ``workers`` from the next boundary (members above it leave with no
        step lost); grow back up to it, within the spec's max, when workers are free."""
        if self.requests.max_workers()[0] != workers:
            log.info("job %d: resize to %d asked by %s: %s", self.job_id, workers, by or "?", reason)
        self.requests.resize(workers, reason, by)

    def result(self, timeout_s: Optional[float] = None) -> Optional[RunnerResult]:
        """The run's end (``RunnerResult``: outcome, reason, error_type), waiting up to
        ``timeout_s``; None while it runs."""
        self._done.wait(timeout_s)
        return self._result

    def ping(self) -> int:
        return os.getpid()


# The actor: see the module docstring for each option. Threads, so that status() is answered
# while result() waits.
RemoteJobRunner = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(JobRunner)


def launch_runner(launch: Launch, step_hook: Optional[Callable] = None, spare=None,
                  runtime_env: Optional[dict] = None, avoid: Iterable[str] = ()):
    """Start the job on ``spare`` (a spare runner, see ``new_spare_runner``) when given and it
    takes it; else create the job's runner, or adopt the one that exists under its name (never
    two: the caller, the reconciler, gives a job a spare only when ``find_runner`` found none).
    ``runtime_env``: the new runner's (a job's code package, ``packages.runtime_env``; its
    workers and read tasks inherit it); a job with one is given no spare. ``avoid``: node ids
    the new runner is not placed on (``control_actors.control_options``)."""
    if spare is not None:
        try:
            ray.get(spare.start.remote(launch, step_hook), timeout=SPARE_START_TIMEOUT_S)
            return spare
        except Exception as exc:  # noqa: BLE001: a dead or stuck spare costs a fresh start, not the job
            log.warning("job %d: the spare runner did not take it (%s); starting a new one", launch.job_id,
                        str(exc).splitlines()[0])
            ray.kill(spare, no_restart=True)
    extra = {"runtime_env": runtime_env} if runtime_env else {}
    extra.update(control_options(avoid))  # on a safe node when the cluster has one (control_actors.py)
    return RemoteJobRunner.options(name=runner_name(launch.job_id), namespace=NAMESPACE, lifetime="detached",
                                   get_if_exists=True, **extra).remote(launch, step_hook)


def new_spare_runner():
    """A runner process started ahead of any job, its imports done: the next launch takes it
    (``launch_runner(..., spare=)``) instead of waiting for a process to start and import torch
    and MLflow (about 2 s). Detached like every runner: once started it is the job's runner."""
    return RemoteJobRunner.options(name=f"{SPARE_RUNNER_PREFIX}{uuid.uuid4().hex[:12]}", namespace=NAMESPACE,
                                   lifetime="detached", **control_options()).remote(None)


def idle_spare_runners() -> list:
    """Spare runners that run no job (after a service restart: the previous service's)."""
    return [handle for _, handle, job in spare_runners() if job is None]


def log_to_file(path: str) -> logging.Handler:
    """This process's ``raytrain_sys`` log lines, at INFO, into the job's file as well."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("raytrain_sys")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler
