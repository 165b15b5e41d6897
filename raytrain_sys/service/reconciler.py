"""The reconciler: the one writer of run-time transitions.

Owns: every job state change that follows from what runs (starting, running, pausing, paused,
resuming, finished, failed, cancelled, and the same-state notes: world size, resize targets,
restarts), the runners' lifecycle (create, re-attach, kill), and carrying out the scheduler's
actions. It decides nothing itself: which job starts, grows, shrinks or pauses is
``scheduler.decide``'s; how a start is going is ``starts.watch_start``'s; how a run's end is
recorded is ``finish.finish_decision``'s; who may ask for what is the API's; the requests the
API writes (``service/requests.py``: pausing, cancelling, held) are read here and carried out.

One pass (``run_once``), in order:

1. **Observe**: every live job that should have a runner is looked up (a cached handle, or
   ``runner.find_runner`` after a service restart: by its name, or among the spare runners)
   and asked for its ``status``.
2. **Record**: checkpoints (``store.record_checkpoint``, so the scheduler's work-at-risk is
   right), world sizes (a same-state note), starting/resuming -> running once the Supervisor
   trains, and a run's end (the runner's ``RunnerResult``) as ``finish.finish_decision``'s case
   says: finished, failed, paused, cancelled, or a start not placed given up (then the runner is
   killed: it is detached and would otherwise outlive its job).
3. **Requests**: pausing -> ``runner.pause``; cancelling -> ``runner.cancel``; a running job a
   user holds -> pausing. A stop that does not land within ``stop_deadline_s`` is made hard by
   killing the runner (its workers and placement groups die with it), but a pause never kills
   a job that has no committed checkpoint: it keeps waiting, and says so.
4. **Decide and act**: ``decide(store.snapshot(cluster_workers, flavor_states), now)``; each
   action is logged with its reason (and the pass's number, as is a runner ended in step 2: what
   one pass saw end and what it decided read together) and carried out as **intent first, then act**: Admit writes
   starting (or resuming), with the flavor it was admitted on, before the runner is created (its
   launch sets the flavor's node labels and price in the run's spec: ``launch_overrides``); Shrink/Grow write the new target before
   ``runner.resize``; Pause writes pausing before ``runner.pause``. A pass that dies between
   the two leaves the intent, and the next pass (of this service or a restarted one) finishes
   it: a starting job with no runner gets one (only when ``find_runner`` finds none; a named
   create uses ``get_if_exists``: an existing runner is adopted, never a second), a target the
   runner has not heard of is sent again. Before a runner is created, the job's SQLite MLflow
   store is made here, once (``mlflow_store.ensure_store``): jobs admitted together never
   make one at the same moment. After the actions, spare runners are started ahead
   up to ``spare_runners`` (``_keep_spare_runners``), more while a sweep's trials are to start
   (``spare_runners_wanted``): a launch takes one instead of a process start.
   The snapshot also feeds the queue and quota gauges per team (``monitor.metrics.ServiceMetrics``).
   With autoscaling on, the pass asks Ray's autoscaler for the queue's demand once it has
   decided, before it carries the actions out (``autoscale.demand``: every admitted job at its
   target, the head of the queue per flavor; a launch's seconds are not added to the nodes'
   start), only when it changed, and clears it when nothing waits (``_ask_autoscaler``).
5. **Say why**: every job not running yet has a wait reason (``WaitCause`` and a sentence): a
   queued or paused job the scheduler's ``Wait``, a starting or resuming job the step its runner
   reports (``service/starts.py``). They are written in one ``store.note_waits`` a pass, only
   those that changed (hundreds of waiting jobs cost no write while nothing changes), and feed
   the waiting-jobs gauge per team and cause.

A start that stays in one step longer than ``start_stall_s`` (its runner not answering, its
workers not placed, ...) is given up: the runner is killed (its placement groups and workers
with it), then the job goes back to the queue (a resume: to paused) with that reason, or fails
once ``max_start_returns`` starts in a row were given up (``starts.watch_start``); a start the
run abandons itself (not placed within ``resources.start_timeout_s``) counts the same way. The
count is reset when the job runs.

Runner death (the actor gone while its job is live): a job that was starting, running or
resuming is restarted from its newest committed checkpoint (a fresh start if it has none) as
long as its ``restarts`` are within ``max_restarts``; past the budget it fails with the reason.
A job pausing or cancelling whose runner died has stopped: paused (from its newest checkpoint)
or cancelled. The restart count is written (the intent) before the new runner is created, so
a service that dies in between costs the job one restart of its budget, never a second runner.

Every write is a guarded transition from the state this pass read; a job that moved meanwhile
(a user's request landed) raises ``JobStateConflict``, and the job is left for the next pass.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray

from raytrain_sys.control.launches import end_launches_of
from raytrain_sys.control.owners import owner_gone
from raytrain_sys.control.spares import end_spares_of, find_pool
from raytrain_sys.errors import JobStateConflict, ServiceInputError, UserError
from raytrain_sys.monitor.metrics import ServiceMetrics
from raytrain_sys.service import autoscale, packages
from raytrain_sys.service import runner as runners
from raytrain_sys.service import starts
from raytrain_sys.service.finish import (NO_RESULT, RAN_UNSEEN, Cancelled, EndedWhileCancelling, Failed, Finished,
                                         Paused, PausedThenCancelled, finish_decision)
from raytrain_sys.service.flavors import FlavorState, ResourceFlavor
from raytrain_sys.service.model import LIVE_STATES, JobRecord, JobState, TransitionNotAllowed, WaitCause
from raytrain_sys.service.scheduler.actions import Action, Admit, Grow, Pause, Shrink, Wait
from raytrain_sys.service.scheduler import decide
from raytrain_sys.service.store import Store
from raytrain_sys.tracking import mlflow_store as ms
from raytrain_sys.tracking import mlflow_tracker as mt

log = logging.getLogger(__name__)

ACTOR = "reconciler"
SCHEDULER = "scheduler"
PRUNE_EVERY_S = 3600.0  # how often unused code packages are looked for
SLOW_PASS_S = 1.0  # a pass at least this long logs the seconds of each of its parts
# How long a node whose runner stopped answering gets no new runner: longer than Ray takes to
# declare a lost node dead (its health checks: 5 x 3 s by default), after which it is gone anyway.
LOST_NODE_AVOID_S = 60.0
# How long a pass waits for the GCS to have an unreachable runner it killed dead (``_unreachable``).
UNREACHABLE_KILL_WAIT_S = 10.0
# MLflow stores the spare runners keep open: a few, as a service's jobs mostly share their team's
# server or file; each costs a spare a SQLAlchemy engine or an HTTP session.
TRACKING_URIS_KEPT = 4
# States whose job has (or is being given) a runner.
WITH_RUNNER = (JobState.STARTING, JobState.RUNNING, JobState.RESUMING, JobState.PAUSING, JobState.CANCELLING)
STARTS = (JobState.STARTING, JobState.RESUMING)


@dataclass
class ReconcilerConfig:
    log_dir: str  # job-<id>.log files
    max_restarts: int = 3  # runner deaths a job survives (each restart from its newest checkpoint)
    # A pause or cancel not done by then is made hard (the runner killed). Generous: a pause
    # first finishes the step in flight and writes a checkpoint.
    stop_deadline_s: float = 120.0
    # A pass waits this long for the runners' answers; one that answers later is read by a later
    # pass (its question stays asked), so a runner slow to answer (busy starting, or on a loaded
    # node) never holds the other jobs' passes: 1 s, where a healthy runner answers in ms.
    status_wait_s: float = 1.0
    # A question unanswered this long is dropped and asked again; the runner is not declared dead
    # (Ray says when it is), the start it is in is watched by start_stall_s.
    status_timeout_s: float = 10.0
    # Runners started ahead for the next launches (runner.new_spare_runner): two, so that a job
    # admitted right after another (a reclaim) does not wait for the spare the first one used
    # to be replaced while the cluster is busy; 0 for none.
    spare_runners: int = 2
    # While a sweep's trials are to start, up to this many spare runners (at least spare_runners),
    # one per trial still to start (spare_runners_wanted): Tune starts a sweep's first trials
    # together, the next ones start as stops free workers, and each trial's job would otherwise
    # wait for a runner process of its own to start and import torch behind the training (20 s
    # at a load of 29 on 2 cores, 57-88 s beside 4 training workers; 2-8 s on a spare). 4: each
    # spare is a process with torch imported, kept idle until a launch takes it.
    sweep_spare_runners: int = 4
    # While a sweep's trials are to start, up to this many warm spare workers (cluster-wide) that
    # jobs give back at their end are kept beyond the pool's per-node count instead of being
    # ended (control/spares.py, SparePool.keep_extra): the next trials start on them. No process
    # is started for them; each holds about 0.4 GB until a start takes it or the sweeps' trials
    # have all started.
    sweep_spare_workers: int = 4
    # A code package (packages.py) that no waiting or running job names and no job submitted
    # within this long named is deleted from the store (looked at once an hour); 0 keeps all.
    package_retention_s: float = 7 * 86400.0
    # A start that stays this long in one step (its runner not answering, its workers not placed
    # or not starting, ...) is given up: back to the queue. 10 minutes: a healthy start's steps
    # take seconds here (a minute on a loaded machine); the spec's own placement bound
    # (resources.start_timeout_s, 60 s by default) usually acts first. Loading a checkpoint is
    # not bounded (see starts.py).
    start_stall_s: float = 600.0
    # Starts given up in a row before the job fails with the reason: a job the cluster cannot
    # start never bounces between queued and starting forever; 3 rides out a busy spell.
    max_start_returns: int = 3
    # A start admitted against capacity being provisioned (autoscaling) waits this long for its
    # nodes before it is given up: 10 minutes, where a cloud VM's boot, image pull and Ray's join
    # take 2-5 (a GPU node's drivers more); its run's own placement bound is set to it at launch.
    provisioning_timeout_s: float = 600.0
    # Ask Ray's autoscaler for the queue's demand after each pass (service/autoscale.py); the
    # scheduler then admits against the ceiling (service/capacity.py). Off: a fixed cluster.
    autoscaling: bool = False
    # Sweeps (raytrain_sys/service/sweeps): the store's URL and the base directory their runners and trial
    # proxies open and resolve paths against; "" drives no sweep (a reconciler of jobs only).
    db_url: str = ""
    base_dir: str = ""
    # Sweep runners lost and started again (each through Tuner.restore) before the sweep fails:
    # 3, as for a job's runner.
    sweep_runner_restarts: int = 3

    def __post_init__(self) -> None:
        if not self.start_stall_s > 0:
            raise ServiceInputError("start_stall_s", f"got {self.start_stall_s!r}; must be a number of seconds > 0")
        if isinstance(self.max_start_returns, bool) or not isinstance(self.max_start_returns, int) \
                or self.max_start_returns < 0:
            raise ServiceInputError("max_start_returns", f"got {self.max_start_returns!r}; must be an integer >= 0")
        if not self.provisioning_timeout_s > 0:
            raise ServiceInputError("provisioning_timeout_s",
                                    f"got {self.provisioning_timeout_s!r}; must be a number of seconds > 0")


def spare_runners_wanted(base: int, trials_coming: int, cap: int) -> int:
    """The spare runners to keep: ``base``, or, while sweeps have ``trials_coming`` trials whose
    jobs have not started, one for each, up to ``cap``: free workers or not, since a trial that
    waits for workers starts the moment a stop or an end frees them, and a runner process
    started then waited behind the training (57-88 s at a load of 4 training workers on 2 cores,
    against 2-8 s on a spare). 0 with ``base`` 0: spares are off."""
    if base <= 0:
        return 0
    return max(base, min(trials_coming, cap))


def spare_workers_kept(trials_coming: int, cap: int) -> int:
    """The warm spare workers kept beyond the pool's per-node count from those that jobs give
    back: one for each of the ``trials_coming`` trials whose jobs have not started, up to
    ``cap``; 0 with no trial to start."""
    return max(0, min(trials_coming, cap))


@dataclass
class _Seen:
    """One runner's answer this pass: its status, or that it is gone, or that it did not answer."""

    status: Optional[runners.RunnerStatus] = None
    gone: bool = False
    error: str = ""
    pending: bool = False  # asked, no answer yet (within status_timeout_s): read by a later pass


class Reconciler:
    def __init__(self, store: Store, config: ReconcilerConfig, cluster_workers: Callable[[], int],
                 step_hook: Optional[Callable] = None, clock: Callable[[], float] = time.time,
                 flavor_states: Optional[Callable[[tuple[ResourceFlavor, ...]], tuple[FlavorState, ...]]] = None,
                 request_resources: Optional[Callable[[list, Optional[list]], None]] = None):
        self.store = store
        self.config = config
        self.cluster_workers = cluster_workers
        # The capacity of each flavor of the table (service/capacity.py); None: the implicit
        # flavor of cluster_workers, and a table's flavors of unknown capacity (quotas only).
        self.flavor_states = flavor_states
        self._table: dict[str, ResourceFlavor] = {}  # the flavor table as this pass read it
        self._sweep_runners: dict[int, Any] = {}  # the sweep runners this reconciler started (ensure_runners)
        self._sweep_asks: dict[int, tuple] = {}  # their status questions not answered yet (ensure_runners)
        # Ray's autoscaler SDK (bundles, label selectors); a test may watch the calls.
        self.request_resources = request_resources or _request_resources
        self.requested: Optional[autoscale.Request] = None  # the last request Ray accepted
        self.requested_at_s: Optional[float] = None
        self.step_hook = step_hook
        self.clock = clock
        self._handles: dict[int, Any] = {}  # job id -> runner handle (created or re-attached)
        self._lost_nodes: dict[str, float] = {}  # node id -> when a runner there stopped answering (_unreachable)
        self._created: set[int] = set()  # jobs whose runner this process created or found alive
        self._waits: dict[int, str] = {}  # the last Wait reason logged per job
        self._notes: dict[int, tuple[JobState, WaitCause, str]] = {}  # this pass's wait reasons
        self._watching: dict[int, float] = {}  # job id -> when this process first watched its start
        self._delete_errors: dict[int, str] = {}  # job id -> why its checkpoints could not be deleted yet
        self._runner_ids: dict[int, str] = {}  # job id -> its runner's actor id (the owner of its spares)
        # Jobs whose runs are ending and have let their workers go (still closing their MLflow
        # runs): the scheduler leaves them out (``Snapshot.released``).
        self._released: set[int] = set()
        # job id -> the step its live runner reported committed last: a restart counts the steps
        # the lost runner committed past its checkpoint from it (trained again).
        self._committed_seen: dict[int, int] = {}
        self._asked: dict[int, tuple[Any, float]] = {}  # job id -> its runner's status question, asked when (monotonic)
        self._spares: list[tuple[Any, Any]] = []  # spare runners and their ready refs
        # The MLflow stores of the newest launches, newest last: spare runners open them ahead.
        self._tracking_uris: list[str] = []
        self._spares_adopted = False  # a restarted service first adopts the idle spares it finds
        self._spares_wanted = config.spare_runners  # this pass's (spare_runners_wanted)
        self._spare_workers_kept = 0  # told to the pool (spare_workers_kept)
        self._next_prune_s = 0.0  # when the store's unused code packages are looked at next
        self.metrics = ServiceMetrics()  # queue and quota per team, each pass
        self.passes = 0  # passes done: the number of the pass in progress, as its log lines say

    # ------------------------------------------------------------------ one pass
    def run_once(self) -> list[Action]:
        parts = _PassParts()
        now = self.clock()
        self._table = {f.name: f for f in self.store.flavors()}  # before any launch: a job's flavor
        jobs = self.store.jobs(states=LIVE_STATES)
        self._notes = {}
        self.metrics.waiting(jobs)  # the reasons as the last pass wrote them
        for job_id in set(self._watching) - {j.id for j in jobs if j.state in STARTS}:
            del self._watching[job_id]
        parts.end("read the store")
        seen = self._observe([j for j in jobs if j.state in WITH_RUNNER])
        parts.end("runners' status")
        for job in jobs:
            if job.state in WITH_RUNNER:
                try:
                    self._reconcile(job, seen.get(job.id, _Seen(gone=True)), now)
                except JobStateConflict as exc:  # a request landed meanwhile: next pass
                    log.info("job %d moved meanwhile, left for the next pass: %s", job.id, exc)
                except TransitionNotAllowed as exc:  # a bug here must not stop the other jobs
                    log.error("job %d: %s", job.id, exc)
        for job_id in list(self._handles):
            if job_id not in {j.id for j in jobs}:
                self._forget(job_id)
        parts.end("runners' requests and ends")
        trials_coming = 0
        if self.config.db_url:
            from raytrain_sys.service.sweeps.reconcile import ensure_runners

            trials_coming = ensure_runners(self.store, self.config.db_url, self.config.base_dir, self.config.log_dir,
                                           self.config.sweep_runner_restarts, self.config.status_timeout_s,
                                           self._sweep_runners, self._sweep_asks)
        parts.end("sweep runners")
        snapshot = self.store.snapshot(self.cluster_workers(), self._flavor_states()).released(self._released)
        self.metrics.observe(snapshot)
        actions = decide(snapshot, self.clock())
        parts.end("snapshot and decision")
        # Asked before the actions are carried out: the demand is the decision's, and carrying
        # an admission out (the job's MLflow store, its runner) took 1.2 s of the 1.25 s from a
        # submit to the request (benchmarks/autoscale.py, quiet), seconds every node start waited.
        self._ask_autoscaler(snapshot, actions)
        states = {j.id: j.state for j in snapshot.jobs}
        for action in actions:
            try:
                self._carry_out(action)
            except JobStateConflict as exc:
                log.info("%s: not carried out, the job moved meanwhile: %s", action, exc)
            if isinstance(action, Wait):
                self._notes[action.job_id] = (states[action.job_id], action.cause, action.reason)
        parts.end(f"{len(actions)} action(s)")
        self.store.note_waits(self._notes, now_s=self.clock())
        self._spares_wanted = spare_runners_wanted(self.config.spare_runners, trials_coming,
                                                   self.config.sweep_spare_runners)
        self._keep_spare_runners()
        self._keep_spare_workers(trials_coming)
        self._delete_cancelled_checkpoints()
        self._prune_packages()
        parts.end("waits and spares")
        self.passes += 1
        parts.log_if_slow(self.passes)
        return actions

    def _ask_autoscaler(self, snapshot, actions: list[Action]) -> None:
        """With autoscaling: ask Ray's autoscaler for the queue's demand (``autoscale.demand``),
        when it changed; clear it when nothing waits. A failure is logged and asked again next pass."""
        if not self.config.autoscaling:
            return
        request = autoscale.demand(snapshot, actions)
        if request == self.requested:
            return
        try:
            self.request_resources(request.bundle_dicts(), request.selector_dicts())
        except Exception as exc:  # noqa: BLE001: the GCS briefly away: the next pass asks again
            log.warning("could not ask Ray's autoscaler (asked again next pass): %s", exc)
            return
        self.requested, self.requested_at_s = request, self.clock()
        log.info("asked Ray's autoscaler for %s", request.describe())

    def _flavor_states(self) -> tuple[FlavorState, ...]:
        table = tuple(self._table.values())
        if self.flavor_states is not None:
            return self.flavor_states(table)
        return tuple(FlavorState(f, ()) for f in table)

    # ------------------------------------------------------------------ code packages
    def _prune_packages(self) -> None:
        """Delete unused code packages past ``package_retention_s`` (``Store.prune_packages``)."""
        keep, now = self.config.package_retention_s, self.clock()
        if not keep or now < self._next_prune_s:
            return
        self._next_prune_s = now + PRUNE_EVERY_S
        try:
            gone = self.store.prune_packages(now - keep)
        except Exception as exc:  # noqa: BLE001: the database is away: the next look, not this pass's jobs
            log.warning("code packages not pruned (tried again in %.0f s): %s", PRUNE_EVERY_S, exc)
            return
        for sha256, team in gone:
            log.info("code package %s of team %s deleted: no job has used it for %.0f days", sha256[:12], team,
                     keep / 86400)

    # ------------------------------------------------------------------ cancel --delete-checkpoints
    def _delete_cancelled_checkpoints(self) -> None:
        """A cancelled job whose cancel asked for it loses its checkpoints (its runner has ended:
        nothing writes there any more). The deletion is recorded in its history; one that fails
        (storage unreachable) is tried again next pass, and said once."""
        for job in self.store.cancelled_with_checkpoints_to_delete():
            try:
                root = mt.spec_checkpoint_root(json.loads(job.spec), job.mlflow_run_id)
                if not root:
                    reason = "no checkpoints to delete: the job never ran"
                else:
                    from raytrain_sys.checkpoint.store import open_store

                    store = open_store(root, json.loads(job.spec).get("checkpoint", {}).get("s3_endpoint_url", ""))
                    count = len(store.list())
                    store.delete_prefix("")
                    reason = f"checkpoints deleted as the cancel asked: {root} ({count} files)"
            except Exception as exc:  # noqa: BLE001: storage or MLflow unreachable: next pass
                if self._delete_errors.get(job.id) != str(exc):
                    log.warning("job %d: could not delete its checkpoints (tried again): %s", job.id, exc)
                    self._delete_errors[job.id] = str(exc)
                continue
            self._delete_errors.pop(job.id, None)
            if self.store.checkpoints_deleted(job.id, actor=ACTOR, reason=reason):
                log.info("job %d: %s", job.id, reason)

    # ------------------------------------------------------------------ the spare runner
    def _keep_spare_runners(self) -> None:
        """``spare_runners`` runners started ahead (more while a sweep's trials are to start:
        ``spare_runners_wanted``), for the next launches (after a restart: the idle spares of
        the previous service first, any beyond the count ended)."""
        wanted = self._spares_wanted
        if len(self._spares) >= wanted:
            return
        idle = [] if self._spares_adopted else runners.idle_spare_runners()
        self._spares_adopted = True
        for extra in idle[wanted:]:
            ray.kill(extra, no_restart=True)
        for handle in idle[:wanted]:
            self._spares.append((handle, handle.job.remote()))
        while len(self._spares) < wanted:
            handle = runners.new_spare_runner()
            self._spares.append((handle, handle.job.remote()))
            if self._tracking_uris:
                handle.warm_tracking.remote(list(self._tracking_uris))

    def _keep_spare_workers(self, trials_coming: int) -> None:
        """Tell the warm spares' pool how many given-back spares to keep beyond its per-node
        count (``spare_workers_kept``), when that changed."""
        kept = spare_workers_kept(trials_coming, self.config.sweep_spare_workers)
        if kept == self._spare_workers_kept:
            return
        self._spare_workers_kept = kept
        pool = find_pool()  # none: warm spares are off (or autoscaling)
        if pool is None:
            return
        pool.set_keep_extra.remote(kept)
        log.info("pass %d: warm spare workers given back kept beyond the pool's per-node count: %d "
                 "(%d sweep trials to start)", self.passes, kept, trials_coming)

    def _remember_tracking(self, tracking_uri: str) -> None:
        """A launch's MLflow store: the idle spare runners open it ahead when it is new to them
        (``JobRunner.warm_tracking``), and the ones started later open it first thing."""
        known = tracking_uri in self._tracking_uris
        self._tracking_uris = [u for u in self._tracking_uris if u != tracking_uri][-(TRACKING_URIS_KEPT - 1):]
        self._tracking_uris.append(tracking_uri)
        if not known:
            for handle, _ in self._spares:
                handle.warm_tracking.remote([tracking_uri])

    def spare_runners(self) -> dict:
        """Spare runners kept (``spare_runners``) and how many of them are up."""
        refs = [ready for _, ready in self._spares]
        up, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        return {"wanted": self._spares_wanted, "up": len(up), "starting": len(refs) - len(up)}

    def _take_spare_runner(self):
        """A spare runner that is up (its imports done), else None (the launch starts a new one)."""
        if not self._spares:
            return None
        done, _ = ray.wait([ready for _, ready in self._spares], num_returns=1, timeout=0)
        for entry in self._spares:
            if entry[1] in done:
                self._spares.remove(entry)
                return entry[0]
        return None

    def close(self) -> None:
        """End the idle spare runners (the jobs' runners train on)."""
        for handle, _ in self._spares:
            ray.kill(handle, no_restart=True)
        self._spares = []

    # ------------------------------------------------------------------ observe
    def _observe(self, jobs: list[JobRecord]) -> dict[int, _Seen]:
        """Each runner's status. A question is asked once and waited for at most
        ``status_wait_s`` by the pass that asked it; an answer not in yet is read by a later pass
        without waiting again, and a question unanswered for ``status_timeout_s`` is dropped
        (asked again next pass). (Every pass waited for every question still open: while a
        runner started, busy with its imports, each pass took the whole ``status_wait_s``, and
        every other job's request or admission waited with it.)"""
        seen: dict[int, _Seen] = {}
        new: list = []  # the questions this pass asks
        for job in jobs:
            handle = self._handles.get(job.id)
            if handle is None:
                handle = runners.find_runner(job.id)
                if handle is None:
                    seen[job.id] = _Seen(gone=True)
                    continue
                log.info("job %d: re-attached to its runner", job.id)
                self._handles[job.id] = handle
                self._created.add(job.id)
            if job.id not in self._asked:
                self._asked[job.id] = (handle.status.remote(), time.monotonic())
                new.append(self._asked[job.id][0])
        asked = {job.id: self._asked[job.id] for job in jobs if job.id in self._asked}
        if not asked:
            return seen
        if new:
            ray.wait(new, num_returns=len(new), timeout=self.config.status_wait_s)
        ready, _ = ray.wait([ref for ref, _ in asked.values()], num_returns=len(asked), timeout=0)
        ready_set, now = set(ready), time.monotonic()
        for job_id, (ref, asked_at) in asked.items():
            if ref not in ready_set:
                if now - asked_at < self.config.status_timeout_s:
                    seen[job_id] = _Seen(pending=True)
                    continue
                del self._asked[job_id]
                seen[job_id] = _Seen(error=f"no answer in {now - asked_at:.0f} s")
                continue
            del self._asked[job_id]
            try:
                seen[job_id] = _Seen(status=ray.get(ref))
                self._runner_ids[job_id] = seen[job_id].status.actor_id
            except ray.exceptions.RayActorError as exc:
                seen[job_id] = _Seen(gone=True, error=str(exc).splitlines()[0])
                handle = self._handles.pop(job_id, None)
                if isinstance(exc, ray.exceptions.ActorUnavailableError) and handle is not None:
                    self._unreachable(job_id, handle)
            except ray.exceptions.RayError as exc:
                seen[job_id] = _Seen(error=str(exc).splitlines()[0])
        return seen

    def _unreachable(self, job_id: int, handle) -> None:
        """A runner that cannot be reached: its node lost, which Ray declares dead only seconds
        later (its health checks), and lists alive meanwhile, the runner with it, name and all.
        The replacement, started under the same name, would be handed this one, and placed on
        that node: so it is killed here (waited for, at most UNREACHABLE_KILL_WAIT_S, until the
        cluster's tables have it dead and its name free), and its node is avoided by the control actors started for the next LOST_NODE_AVOID_S."""
        from ray._private import state

        actor_id, node = handle._actor_id.hex(), ""
        with contextlib.suppress(Exception):
            node = (state.actors(actor_id=actor_id) or {}).get("Address", {}).get("NodeID", "")
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
        # The kill is sent, not done: until the GCS has let its name go, the name still finds it
        # (on a clean clone's CI the replacement launched at once was handed it, and failed with it).
        deadline = time.monotonic() + UNREACHABLE_KILL_WAIT_S
        while time.monotonic() < deadline and not (owner_gone(actor_id) and self._name_free(job_id, actor_id)):
            time.sleep(0.05)
        if node:
            log.warning("job %d: its runner's node %s does not answer: no control actor goes there for %g s",
                        job_id, node[:8], LOST_NODE_AVOID_S)
            self._lost_nodes[node] = time.monotonic()

    @staticmethod
    def _name_free(job_id: int, actor_id: str) -> bool:
        """Whether the job's runner name no longer finds the runner ``actor_id``."""
        try:
            found = ray.get_actor(runners.runner_name(job_id), namespace=runners.NAMESPACE)
        except ValueError:
            return True
        return found._actor_id.hex() != actor_id

    def _avoid(self) -> list[str]:
        """Nodes lost a moment ago (``_unreachable``) that no runner is placed on."""
        now = time.monotonic()
        self._lost_nodes = {n: t for n, t in self._lost_nodes.items() if now - t < LOST_NODE_AVOID_S}
        return list(self._lost_nodes)

    # ------------------------------------------------------------------ record and carry out requests
    def _reconcile(self, job: JobRecord, seen: _Seen, now: float) -> None:
        if seen.pending:  # its answer is read by a later pass; nothing new is known of it
            return
        if seen.error and not seen.gone:
            log.warning("job %d: runner did not answer (%s); asked again next pass", job.id, seen.error)
            if job.state in STARTS:
                self._watch_start(job, None, now)
            return
        if seen.gone:
            self._runner_gone(job, seen)
            return
        status = seen.status
        self._committed_seen[job.id] = status.committed_step
        if status.checkpoint_step is not None and status.checkpoint_step != job.last_checkpoint_step:
            self.store.record_checkpoint(job.id, status.checkpoint_step, status.checkpoint_at_s)
            job = self.store.job(job.id)
        if status.steps_redone > job.steps_redone:  # the run's record counted steps trained again
            self.store.record_steps_redone(job.id, status.steps_redone)
            job = self.store.job(job.id)
        if status.done:
            self._finish(job, status)
            return
        if status.released and job.id not in self._released:
            self._released.add(job.id)
            log.info("pass %d: job %d (%s): its run is ending and has let its %d workers go",
                     self.passes, job.id, job.state.value, job.workers)
        trains = status.state.trains
        if job.state in (JobState.STARTING, JobState.RESUMING) and trains:
            job = self.store.transition(
                job.id, job.state, JobState.RUNNING, actor=ACTOR,
                reason=f"training at step {status.committed_step} on {status.world_size} workers "
                       f"(MLflow run {status.mlflow_run_id}, {status.run_dir})",
                workers=status.world_size, mlflow_run_id=status.mlflow_run_id or None, started_at_s=now,
                start_returns=0)
        elif job.state in STARTS and status.start_step:
            self._watch_start(job, status.start_step, now)
        if job.state is JobState.RUNNING:
            if trains and status.world_size != job.workers:
                job = self.store.transition(
                    job.id, JobState.RUNNING, JobState.RUNNING, actor=ACTOR,
                    reason=f"world size {job.workers} -> {status.world_size} at step {status.committed_step}",
                    workers=status.world_size,
                    **({"mlflow_run_id": status.mlflow_run_id}
                       if status.mlflow_run_id and status.mlflow_run_id != job.mlflow_run_id else {}))
            if job.held:  # a user's pause that arrived while the job was starting
                job = self.store.transition(job.id, JobState.RUNNING, JobState.PAUSING, actor=ACTOR,
                                            reason=f"paused by {self._held_by(job)} while it started, held "
                                                   f"until resumed: pausing now that it runs")
            elif status.max_workers != job.target_workers and job.target_workers > 0:
                # A resize written (the intent) but not yet heard by the runner.
                self._handle(job.id).resize.remote(job.target_workers, job.message, SCHEDULER)
        if job.state in (JobState.PAUSING, JobState.CANCELLING):
            self._stop(job, status, now)

    def _stop(self, job: JobRecord, status: runners.RunnerStatus, now: float) -> None:
        """Ask the runner to stop (again: the request is idempotent), and make the stop hard
        once its deadline has passed."""
        runners.ask_to_stop(self._handle(job.id), job, self._last_actor(job))
        since = self._since(job)
        if now - since < self.config.stop_deadline_s:
            return
        waited = f"did not stop within {self.config.stop_deadline_s:g} s"
        if job.state is JobState.PAUSING:
            if job.last_checkpoint_step is None:
                log.warning("job %d %s, but it has no committed checkpoint: not killed (a pause never "
                            "loses the whole run); still waiting", job.id, waited)
                return
            self._kill(job.id, f"pause {waited}")
            self._to_paused(job, f"{job.message}; {waited}: runner killed, resumes from its checkpoint at "
                                 f"step {job.last_checkpoint_step}")
        else:
            self._kill(job.id, f"cancel {waited}")
            self.store.transition(job.id, JobState.CANCELLING, JobState.CANCELLED, actor=ACTOR,
                                  reason=f"{job.message}; {waited}: runner killed", workers=0, target_workers=0)

    def _finish(self, job: JobRecord, status: runners.RunnerStatus) -> None:
        """The Supervisor returned: record its end as ``finish.finish_decision`` says, then end the
        runner."""
        decision = finish_decision(job.state, status.result, committed_step=status.committed_step,
                                   message=job.message, wait_cause=job.wait_cause, start_returns=job.start_returns,
                                   max_start_returns=self.config.max_start_returns)
        # The run's MLflow run id goes with the moves that record the run itself (running, its end,
        # paused), not with the notes of a stop or a cancel nor a give-up.
        ids = {"mlflow_run_id": status.mlflow_run_id} if status.mlflow_run_id else {}
        if isinstance(decision, Finished):
            if decision.run_unseen:
                job = self._ran_unseen(job, status, ids)
            self.store.transition(job.id, job.state, JobState.FINISHED, actor=ACTOR, reason=decision.reason,
                                  workers=0, target_workers=0, **ids)
        elif isinstance(decision, Paused):
            if decision.run_unseen:
                job = self._ran_unseen(job, status, ids)
            if decision.pausing_reason:
                job = self.store.transition(job.id, JobState.RUNNING, JobState.PAUSING, actor=ACTOR,
                                            reason=decision.pausing_reason, held=True)
            self._to_paused(job, decision.reason, **ids)
        elif isinstance(decision, (PausedThenCancelled, EndedWhileCancelling)):
            self.store.transition(job.id, job.state, JobState.CANCELLED, actor=ACTOR, reason=decision.reason,
                                  workers=0, target_workers=0)
        elif isinstance(decision, Cancelled):
            if decision.cancelling_reason:
                job = self.store.transition(job.id, job.state, JobState.CANCELLING, actor=ACTOR,
                                            reason=decision.cancelling_reason)
            self.store.transition(job.id, JobState.CANCELLING, JobState.CANCELLED, actor=ACTOR, reason=decision.reason,
                                  workers=0, target_workers=0, **ids)
        elif isinstance(decision, starts.GiveUp):
            self._give_up(job, decision)
        elif isinstance(decision, Failed):
            self.store.transition(job.id, job.state, JobState.FAILED, actor=ACTOR, reason=decision.reason,
                                  workers=0, target_workers=0, **ids)
        else:
            raise TypeError(f"unknown finish decision {decision!r}")
        self._kill(job.id, f"its run ended {(status.result or NO_RESULT).outcome.value}")

    def _ran_unseen(self, job: JobRecord, status: runners.RunnerStatus, ids: dict) -> JobRecord:
        """A start whose run ended before a pass saw it train: recorded running first (it ran)."""
        return self.store.transition(job.id, job.state, JobState.RUNNING, actor=ACTOR, reason=RAN_UNSEEN,
                                     started_at_s=status.started_at_s, **ids)

    def _to_paused(self, job: JobRecord, reason: str, **ids: Any) -> None:
        self.store.transition(job.id, JobState.PAUSING, JobState.PAUSED, actor=ACTOR, reason=reason,
                              workers=0, target_workers=0, waiting_since_s=self.clock(), **ids)

    def _runner_gone(self, job: JobRecord, seen: _Seen) -> None:
        """No live runner for a job that should have one."""
        created = job.id in self._created
        lost_at = self._committed_seen.get(job.id, 0)
        # Its launch (node agents and workers, which outlive a runner) stays while a new runner
        # may adopt it (a restart that resumes the run): ended in every other case.
        runner_id = self._forget(job.id, end_workers=False)
        resumes = job.last_checkpoint_step is not None and bool(job.mlflow_run_id)  # as _launch decides
        restarts = job.state not in (JobState.PAUSING, JobState.CANCELLING) and \
            not (job.state in (JobState.STARTING, JobState.RESUMING) and not created) and \
            job.restarts < self.config.max_restarts
        if not (restarts and resumes):
            self._end_workers_of(runner_id)
        if job.state is JobState.PAUSING:
            where = (f"resumes from its checkpoint at step {job.last_checkpoint_step}"
                     if job.last_checkpoint_step is not None else "no checkpoint: it starts over when resumed")
            self._to_paused(job, f"{job.message}; the runner is gone ({seen.error or 'not found'}): {where}")
            return
        if job.state is JobState.CANCELLING:
            self.store.transition(job.id, job.state, JobState.CANCELLED, actor=ACTOR, workers=0, target_workers=0,
                                  reason=f"{job.message}; the runner is gone ({seen.error or 'not found'})")
            return
        if job.state in (JobState.STARTING, JobState.RESUMING) and not created:
            # The intent was written, the runner never made (or made by a service that died
            # before it was seen): finish the start.
            log.info("job %d is %s with no runner: launching it (finishing the recorded intent)",
                     job.id, job.state.value)
            self._launch(job, job.target_workers, job.message, resume=job.state is JobState.RESUMING)
            return
        # Lost while it ran (or while it started): restart it within its budget.
        lost = f"its runner was lost ({seen.error or 'actor not found'})"
        if job.restarts >= self.config.max_restarts:
            self.store.transition(job.id, job.state, JobState.FAILED, actor=ACTOR, workers=0, target_workers=0,
                                  reason=f"{lost}; restart budget used up ({job.restarts} of "
                                         f"{self.config.max_restarts} restarts)")
            log.error("job %d failed: %s; restart budget used up", job.id, lost)
            return
        workers = max(job.target_workers, job.min_workers)
        where = (f"from its checkpoint at step {job.last_checkpoint_step}" if job.last_checkpoint_step is not None
                 else "from the start (no checkpoint)")
        from_step = job.last_checkpoint_step if resumes else 0
        redone = max(0, lost_at - from_step)
        again = (f": it was seen at step {lost_at}, so steps {from_step + 1}..{lost_at} are trained again "
                 f"({redone} steps)" if redone else "")
        if resumes:  # the new runner adopts the live workers when they are all left (control.adoption)
            where = f"adopting its live workers, or if they are gone {where}"
            again = again.replace("are trained again", "would be trained again")
        if redone and not resumes:
            # A new run: its record starts at 0 and will never count them. (A resumed run's record
            # does, from lost_at_step, and its runner reports it.)
            self.store.record_steps_redone(job.id, job.steps_redone + redone)
        job = self.store.transition(job.id, job.state, job.state, actor=ACTOR, restarts=job.restarts + 1,
                                    workers=0, target_workers=workers,
                                    reason=f"{lost}; restarting {where} on {workers} workers (restart "
                                           f"{job.restarts + 1} of {self.config.max_restarts}){again}",
                                    **(self._admitted(workers, job.wait_cause is WaitCause.PROVISIONING)
                                       if job.state.pending else {}))
        self._watching.pop(job.id, None)
        log.warning("job %d: %s", job.id, job.message)
        self._launch(job, workers, job.message, resume=True, lost_at_step=lost_at)

    # ------------------------------------------------------------------ the scheduler's actions
    def _carry_out(self, action: Action) -> None:
        if isinstance(action, Wait):
            if self._waits.get(action.job_id) != action.reason:
                self._waits[action.job_id] = action.reason
                log.info("pass %d: %s", self.passes, action)
            return
        log.info("pass %d: %s", self.passes, action)
        self._waits.pop(action.job_id, None)
        job = self.store.job(action.job_id)
        if isinstance(action, Admit):
            resume = job.state is JobState.PAUSED
            to = JobState.RESUMING if resume else JobState.STARTING
            job = self.store.transition(job.id, job.state, to, actor=SCHEDULER, reason=action.reason,
                                        workers=0, target_workers=action.workers, flavor=action.flavor,
                                        **self._admitted(action.workers, action.provisioning))
            self._launch(job, action.workers, action.reason, resume=resume)
        elif isinstance(action, (Grow, Shrink)):
            verb = "grow" if isinstance(action, Grow) else "shrink"
            job = self.store.transition(job.id, JobState.RUNNING, JobState.RUNNING, actor=SCHEDULER,
                                        reason=f"{verb} to {action.to_workers}: {action.reason}",
                                        target_workers=action.to_workers)
            self._handle(job.id).resize.remote(action.to_workers, action.reason, SCHEDULER)
        elif isinstance(action, Pause):
            job = self.store.transition(job.id, JobState.RUNNING, JobState.PAUSING, actor=SCHEDULER,
                                        reason=f"paused by the scheduler: {action.reason}", held=False)
            self._handle(job.id).pause.remote(job.message, SCHEDULER)
        else:
            raise TypeError(f"unknown scheduler action {action!r}")

    # ------------------------------------------------------------------ starts
    def _admitted(self, workers: int, provisioning: bool = False) -> dict:
        """A new start's wait reason, written with its transition (the intent): its runner is
        starting, or (admitted against capacity being provisioned) its nodes are coming."""
        if provisioning:
            return {"wait_cause": WaitCause.PROVISIONING,
                    "wait_reason": starts.admitted_reason(workers, self.config.provisioning_timeout_s)}
        return {"wait_cause": WaitCause.RUNNER_START, "wait_reason": starts.admitted_reason(workers)}

    def _start_view(self, job: JobRecord, now: float) -> starts.StartView:
        watched = self._watching.setdefault(job.id, now)
        since = watched if job.wait_cause_since_s is None else max(job.wait_cause_since_s, watched)
        return starts.StartView(state=job.state, workers=job.target_workers, checkpoint_step=job.last_checkpoint_step,
                                cause=job.wait_cause, reason=job.wait_reason, since_s=since,
                                start_returns=job.start_returns)

    def _watch_start(self, job: JobRecord, step: Optional[str], now: float) -> None:
        """Note why a start is not running yet (``step``: its runner's, None when it did not
        answer), or give it up (``starts.watch_start``)."""
        outcome = starts.watch_start(self._start_view(job, now), step, now, self.config.start_stall_s,
                                     self.config.max_start_returns, self.config.provisioning_timeout_s)
        if isinstance(outcome, starts.GiveUp):
            # The act before the write, unlike an admission: a service that dies in between
            # leaves a starting job with no runner, which the next pass starts afresh; the other
            # order would leave a queued job whose stalled runner a new admission adopts by name.
            self._kill(job.id, f"its start was given up: {outcome.reason}")
            self._give_up(job, outcome)
        else:
            self._notes[job.id] = (job.state, outcome.cause, outcome.reason)

    def _give_up(self, job: JobRecord, outcome: starts.GiveUp) -> None:
        """A start ended without running (its runner is gone or being ended): back where the job
        waited, with the reason, or failed."""
        wait = ({"wait_cause": outcome.cause, "wait_reason": outcome.reason} if outcome.to.pending else {})
        self.store.transition(job.id, job.state, outcome.to, actor=ACTOR, reason=outcome.reason, workers=0,
                              target_workers=0, start_returns=outcome.start_returns, **wait)
        (log.error if outcome.to is JobState.FAILED else log.warning)("job %d: %s", job.id, outcome.reason)

    # ------------------------------------------------------------------ runners
    def _launch(self, job: JobRecord, workers: int, reason: str, resume: bool, lost_at_step: int = 0) -> None:
        """Create the job's runner (or adopt the live one under its name); a job with a code
        package gets a new runner with the package as its working directory (``packages.py``),
        or fails, saying why, when the package cannot be put in the cluster."""
        spec = json.loads(job.spec)
        run_id = job.mlflow_run_id if resume and job.last_checkpoint_step is not None else None
        launch = runners.Launch(job_id=job.id, spec=spec, workers=workers, log_dir=self.config.log_dir,
                                resume_run_id=run_id or "", tracking_uri=mt.spec_tracking_uri(spec), reason=reason,
                                team=job.team, package=job.package or "", overrides=self.launch_overrides(job),
                                lost_at_step=lost_at_step if run_id else 0)
        tracked = self._make_tracking_store(job.id, spec, launch.tracking_uri)
        runtime_env = None
        if job.package:
            try:
                runtime_env = packages.runtime_env(job.package, self.store.package_data)
            except UserError as exc:
                self.store.transition(job.id, job.state, JobState.FAILED, actor=ACTOR, workers=0, target_workers=0,
                                      reason=f"failed at start: {exc}")
                log.error("job %d failed at start: %s", job.id, exc)
                return
        spare = None if runtime_env else self._take_spare_runner()
        if tracked:  # the spares left open it for the next launches (not the one taken: it starts now)
            self._remember_tracking(launch.tracking_uri)
        self._handles[job.id] = runners.launch_runner(launch, self.step_hook, spare=spare, runtime_env=runtime_env,
                                                      avoid=self._avoid())
        self._created.add(job.id)
        log.info("job %d: runner %s launched (%s on %d workers)", job.id,
                 "(a spare)" if spare is not None else runners.runner_name(job.id),
                 f"resume of MLflow run {run_id}" if run_id else "start", workers)

    def _make_tracking_store(self, job_id: int, spec: dict, tracking_uri: str) -> bool:
        """The job's MLflow store made here, once (``mlflow_store.ensure_store``; a second job on it
        costs nothing), before its runner starts: the runners of jobs admitted together never
        make a new store at the same moment. A store that cannot be made is left to the runner,
        whose start fails saying why. True: made, the job tracks to it."""
        if not (spec.get("tracking") or {}).get("enabled", True):
            return False
        try:
            ms.ensure_store(tracking_uri)
        except UserError as exc:
            log.warning("job %d: its MLflow store is not ready (its start will say why): %s", job_id, exc)
            return False
        return True

    def launch_overrides(self, job: JobRecord) -> tuple[str, ...]:
        """What a launch sets in the job's spec (``Launch.overrides``): its flavor's node labels
        (``ResourceFlavor.node_selector``: the workers' placement) and price per worker hour
        (``ResourceFlavor.usd_per_worker_hour``: the run's cost per token, spot and on-demand priced
        apart; an unpriced flavor leaves the spec's own price), and for a start admitted against
        capacity being provisioned a placement bound of ``provisioning_timeout_s``."""
        out = []
        flavor = self._table.get(job.flavor or "")
        if flavor is not None:
            out += [f"{key}={value}" for key, value in flavor.node_selector().items()]
            price = flavor.usd_per_worker_hour(job.shape)
            if price > 0:
                out.append(f"resources.cost_per_worker_hour={price!r}")
        if job.wait_cause is WaitCause.PROVISIONING:
            out.append(f"resources.start_timeout_s={self.config.provisioning_timeout_s!r}")
        return tuple(out)

    def runner(self, job_id: int):
        """The handle this service holds to the job's runner (started or re-attached), or None; no
        Ray call: the jobs page's poll asks it from the API's threads."""
        return self._handles.get(job_id)

    def _handle(self, job_id: int):
        handle = self._handles.get(job_id) or runners.find_runner(job_id)
        if handle is None:
            raise JobStateConflict(f"job {job_id} has no runner (yet)")
        self._handles[job_id] = handle
        return handle

    def _kill(self, job_id: int, why: str) -> None:
        handle = self._handles.get(job_id) or runners.find_runner(job_id)
        if handle is not None:
            log.info("pass %d: job %d: ending its runner: %s", self.passes, job_id, why)
            ray.kill(handle, no_restart=True)
        self._forget(job_id)  # after the kill: its spares are ended once, with no runner left to adopt more

    def _forget(self, job_id: int, end_workers: bool = True) -> str:
        """The job's runner is gone or being ended: with ``end_workers``, the warm spares it
        claimed and its launch (node agents, their ranks and slots, which outlive a runner:
        ``launches``) are ended now rather than when they notice (the spares asked of the pool,
        which may be slow; the launch killed through the GCS, milliseconds). Returns the
        runner's owner id (for ``_end_workers_of``)."""
        self._handles.pop(job_id, None)
        self._asked.pop(job_id, None)  # a question to the runner that is gone (or a new one's predecessor)
        self._created.discard(job_id)
        self._released.discard(job_id)
        self._committed_seen.pop(job_id, None)
        runner_id = self._runner_ids.pop(job_id, "")
        if end_workers:
            self._end_workers_of(runner_id)
        return runner_id

    @staticmethod
    def _end_workers_of(runner_id: str) -> None:
        end_spares_of(runner_id, wait=False)  # asked; the pass goes on
        if runner_id:
            end_launches_of(runner_id)

    def _last_actor(self, job: JobRecord) -> str:
        history = self.store.history(job.id)
        return history[-1].actor if history else ""

    def _held_by(self, job: JobRecord) -> str:
        """Who last held the job (the actor of its newest note that set held)."""
        for t in reversed(self.store.history(job.id)):
            if t.reason.startswith("paused by "):
                return t.actor
        return "its team"

    def _since(self, job: JobRecord) -> float:
        """When the job entered its current state (from its transitions)."""
        for t in reversed(self.store.history(job.id)):
            if t.from_state is not job.state:
                return t.at_s
        return job.updated_at_s


def _request_resources(bundles: list, selectors: Optional[list]) -> None:
    """``ray.autoscaler.sdk.request_resources``: the bundles the cluster should hold (a floor on
    its size, replacing the last request; [] clears it), each with its label selector."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles, bundle_label_selectors=selectors)


class _PassParts:
    """The seconds each part of one reconciler pass took; logged when the pass took SLOW_PASS_S
    or more (under load a pass took 1-2 s, and what a stop's successor waited for is in it)."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.parts: list[tuple[str, float]] = []

    def end(self, part: str) -> None:
        now = time.perf_counter()
        self.parts.append((part, now - self.last))
        self.last = now

    def log_if_slow(self, number: int) -> None:
        total = self.last - self.started
        if total >= SLOW_PASS_S:
            log.info("pass %d took %.2f s: %s", number, total,
                     ", ".join(f"{part} {seconds:.2f}" for part, seconds in self.parts))
