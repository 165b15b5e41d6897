"""The Supervisor: the driver-side owner of a run, and the one that sequences its parts.

It owns the run's state (``journal``: every transition goes through ``_transition``, logged
with its reason, in summary.json and as an MLflow event), its start, its step loop and its end;
it decides nothing itself. What a step boundary does is ``policy.plan`` (facts in, typed items
out), carried out by ``boundary``; whether the next lease is sent ahead is that same plan being
empty; a failed lease is rebuilt around by ``recovery``; how the run ends is ``policy.ending``.
The parts return outcomes and never call one another: ``launch`` (pre-flight, tracking,
warm-up, a resume's record), ``steps`` (dispatch, settle, commit; the committed-step counter
and data cursor), ``liveness`` (how a step went, is a member alive), ``membership`` (the one
writer of who is in the group; re-forming it, sharing state), ``checkpoints`` (save, load, the
manifest), ``evaluation``, ``stragglers`` and ``probe``. It never touches tensors.

States: starting -> running <-> checkpointing -> finished | stopped | failed, with restoring
between starting and running when a run resumes from a checkpoint. From running, at a failed
step: rebuilding (survivors re-form the group in place; waiting while below
elastic.min_workers; restoring only when no replica holds the state); at a step boundary:
resizing (newcomers join) and draining (members leave nodes marked for preemption). The
allowed moves are ``journal.State.allowed``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import ray

from raytrain_sys.checkpoint.checkpointer import CheckpointInfo
from raytrain_sys.control.run_record import RunSummary, git_commit
from raytrain_sys.control.spares import SpareSource
import raytrain_sys.control.supervisor.launch as launch
import raytrain_sys.control.supervisor.policy as policy
from raytrain_sys.control.supervisor.boundary import Boundary
from raytrain_sys.control.supervisor.checkpoints import Checkpoints, check_compatible, started_from_another_root
from raytrain_sys.control.supervisor.evaluation import Evaluation
from raytrain_sys.control.supervisor.journal import State, transition_record
from raytrain_sys.control.supervisor.liveness import LeaseWatch, StepOutcome
from raytrain_sys.control.supervisor.membership import Membership
from raytrain_sys.control.supervisor.recovery import MustStop, Recovery
from raytrain_sys.control.supervisor.requests import RunRequests
from raytrain_sys.control.supervisor.steps import StepReport, Steps, _Dispatch
from raytrain_sys.control.supervisor.stragglers import Stragglers
from raytrain_sys.control.worker_group import WorkerGroup, connect_ray
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.errors import CheckpointCorrupt, DataError, find_user_error
from raytrain_sys.monitor.cost import CostMeter
from raytrain_sys.monitor.metrics import RunMetrics
from raytrain_sys.parallel.mesh import is_data_leader_rank
from raytrain_sys.spec import JobSpec
from raytrain_sys.tracking import mlflow_store as ms
from raytrain_sys.tracking import mlflow_tracker as mt

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    status: str
    run_dir: str
    committed_steps: int
    losses: list[float]
    mlflow_run_id: str
    newest_checkpoint: str
    summary_path: str
    reason: str = ""


class Supervisor:
    def __init__(self, spec: JobSpec, *, resume_run_id: str = "", run_dir: str = "",
                 previous_run_key: str = "", on_step: Callable[[StepReport], None] | None = None,
                 requests: RunRequests | None = None, spares: SpareSource | None | str = "here", team: str = "-",
                 lost_at_step: int = 0):
        self.spec = spec
        self.lost_at_step = lost_at_step  # a resume's: the step its lost driver was seen to commit (0: unknown)
        # Prometheus series (tracking.metrics) labelled with the job and its service team ("-": none).
        self.metrics = RunMetrics(spec.name, team, enabled=spec.tracking.metrics)
        self.cost = CostMeter(spec.resources.cost_per_worker_hour)  # paid worker-time, summary.json's cost
        self._recovering_since = 0.0  # when the current rebuild began (time.time()); 0: none
        self.spares = spares  # warm workers (control.spares); "here": SpareSource.here() once connected
        # Pause, cancel and resize from outside the run (the job service's runner, a notebook).
        self.requests = requests or RunRequests()
        self.resume_run_id = resume_run_id
        # The run key of the launch this one continues: its leftovers are removed before start.
        self.previous_run_key = previous_run_key
        self.on_step = on_step
        self.state = State.STARTING
        self.output_dir = os.path.abspath(spec.output_dir)
        self.run_dir = run_dir or os.path.join(
            self.output_dir, f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 10000}")
        # Names this run's actors and placement groups; a resume into the same run dir keeps it.
        self.run_key = os.path.basename(self.run_dir.rstrip("/"))
        self.tracking_uri = spec.tracking.uri or mt.default_tracking_uri(self.output_dir)
        self.checkpoint_root = launch.resolve_dir(spec.checkpoint.uri or os.path.join(self.run_dir, "checkpoints"))
        self.summary = RunSummary(job=spec.name, run_dir=self.run_dir)
        self._redone_on_resume: tuple[int, int] | None = None  # steps a lost driver committed, trained again
        self._adoption = None  # a resume's look for its lost driver's live workers (control.adoption)
        self._completing = None  # the adopted launch's lease to complete first (adoption.Running)
        self.tracker = None
        self.group: WorkerGroup | None = None
        self.data: DataPlane | None = None
        # The parts, made as the run starts (see ``run``).
        self.steps: Steps | None = None
        self.membership: Membership | None = None
        self.checkpoints: Checkpoints | None = None
        self.evaluation: Evaluation | None = None
        self.stragglers: Stragglers | None = None
        self._local_cluster = False
        self._warm = None  # the data warm-up thread (launch.warm_data), joined before teardown
        self._phase: launch.Phases | None = None  # the start's record, until the MLflow run's opening joins it
        self._recovery: Recovery | None = None  # made from the parts once they exist (``recovery``)
        self._boundary: Boundary | None = None

    @property
    def committed_step(self) -> int:
        return self.steps.committed_step if self.steps is not None else 0

    @property
    def data_cursor(self) -> int:
        return self.steps.data_cursor if self.steps is not None else 0

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = Recovery(self.spec, self._transition, self.membership, self.checkpoints, self.steps,
                                      self.metrics)
        return self._recovery

    @property
    def boundary(self) -> Boundary:
        if self._boundary is None:
            self._boundary = Boundary(self.spec, self._transition, self.membership, self.steps, self.checkpoints,
                                      self.evaluation, self.stragglers, self.requests, self.recovery)
        return self._boundary

    # ------------------------------------------------------------------ bookkeeping
    def _transition(self, state: State | None, reason: str, detected_at_unix_s: float = 0.0) -> None:
        """The one place the state changes: a move ``State`` does not allow raises. Records it
        (None: a note in the current state); ``detected_at_unix_s``: when the failure that
        caused it was seen, if earlier (the rebuild decision waits for the rest of the step's
        members)."""
        state = state or self.state
        self.state.check_move(state)
        log.info("supervisor: %s -> %s (%s)", self.state.value, state.value, reason)
        now = time.time()
        if self.group is not None:  # membership changes at transitions: the paid time's steps
            self.cost.hold(self.group.held, now)
        if state is State.REBUILDING and not self._recovering_since:
            self._recovering_since = now
        elif state is State.RUNNING and self._recovering_since:
            self.metrics.recovered(now - self._recovering_since)
            self._recovering_since = 0.0
        self.state = state
        self.summary.status = state.value
        self.summary.transitions.append(
            transition_record(state, reason, self.committed_step, now, detected_at_unix_s,
                              self.group.world_size if self.group is not None else None))
        if self.tracker is not None:
            try:
                self.tracker.log_event(self.committed_step, state.value, reason)
            except Exception as exc:
                log.warning("could not record transition in MLflow: %s", exc)
        self.summary.write()

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        spec = self.spec
        # First, before anything of the run is written: a resume takes over the live workers its
        # lost driver left (``control.adoption``), and removes whatever else that driver left; it
        # must not touch the record of a run whose earlier driver is still alive.
        adoption = self._adoption = launch.adopt_previous_launch(spec, self.previous_run_key)
        adopted = adoption is not None and adoption.adopted
        if self.resume_run_id:  # nothing adopted: a checkpoint to resume from, or an error (record untouched)
            launch.check_resumable(spec, self.checkpoint_root, self.resume_run_id, adoption)
        removed = launch.clean_up_previous_launch(spec, self.previous_run_key)
        phase = self._phase = launch.Phases()
        phase.record(self.summary)  # filled as the start goes (a failed one keeps its part)
        commit = launch.InBackground(git_commit, "git-commit").start()  # two git calls: beside the pre-flight
        try:
            found = launch.preflight(spec, self.output_dir, self.run_dir, self.checkpoint_root,
                                     self.tracking_uri)
            phase("preflight")
            resume_info = found.resume_info
            self.summary.spec_hash = spec.spec_hash()
            self.summary.training_hash = spec.training_hash()
            self.summary.git_commit = commit.result()
            self.summary.tracking_uri = self.tracking_uri
            if resume_info is not None:
                check_compatible(spec, resume_info)
            if resume_info is not None or adopted:
                previous = RunSummary.read(self.run_dir)
                if previous is not None:
                    if not adopted:  # the workers and their state are gone: back to the checkpoint
                        self._redone_on_resume = previous.resumed_at(resume_info.step, seen=self.lost_at_step)
                    self.summary = previous
                    self.summary.reason = ""
                    phase.record(self.summary)  # the newest start's, not the earlier run's
            self.summary.write()

            self._local_cluster = connect_ray(spec)
            phase("ray")
            # The first reads (reader processes start, shards are checked) run while the workers
            # start, from the cursor the run continues at.
            self.data = DataPlane.for_job(
                spec, found.manifest, end_position=spec.train.max_steps * spec.train.global_batch_size,
                run_dir=self.run_dir, on_skip=lambda reason: self._transition(self.state, reason),
                task=found.task)
            self.data.on_read_hang = self._read_hung
            cursor = int(resume_info.manifest["data_cursor"]) if resume_info else 0
            if adopted:  # read on from the lost driver's record (the steps after it are committed first)
                cursor = self._adopted_from(adoption)[1]
            warm = self._warm = launch.warm_data(spec, self.data, cursor)
            phase("data")
            if removed:
                self._transition(State.STARTING, f"removed {len(removed)} actors/placement groups "
                                 f"left by the lost driver of run {self.previous_run_key}")
            if adoption is not None and not adopted:
                self._transition(State.STARTING, f"could not adopt the lost driver's workers: {adoption.why}; "
                                                 f"resuming from the newest checkpoint")
            if self._redone_on_resume:
                first, last = self._redone_on_resume
                self.metrics.redone(last - first + 1)
                self._transition(State.STARTING, f"steps {first}..{last} were committed by the lost driver and are "
                                 f"trained again from the checkpoint of step {first - 1} ({last - first + 1} "
                                 f"steps redone)")
            # A resume reopens its run, which the start waits for; a new run opens in its
            # tracker's writer (Tracker.begin), beside the start and the first steps.
            store = ms.prepare_store(self.tracking_uri) if spec.tracking.enabled and self.resume_run_id else None

            def start_tracking():
                if store is not None:
                    store.join()
                return launch.start_tracking(spec, self.summary, self.tracking_uri, self.resume_run_id,
                                             self.run_dir, self.output_dir, self.checkpoint_root)

            # The MLflow run begins to open (seconds on a busy node) once the slots are placed: a
            # job that cannot be placed leaves no run behind.
            tracking = launch.InBackground(start_tracking, "mlflow-run")
            if self.spares == "here":
                self.spares = SpareSource.here()
            self.group = WorkerGroup(spec, self._local_cluster, run_key=self.run_key, spares=self.spares)
            try:
                if adopted:
                    self.group.adopt(adoption)
                    tracking.start()
                else:
                    self.group.start(spec.resources.num_workers, on_placed=tracking.start)
            except BaseException:
                if tracking.started:  # teardown ends the run that was opened, as failed
                    with contextlib.suppress(Exception):
                        self.tracker = tracking.result()
                raise
            phase.add(self.group.start_phases)
            self.tracker = tracking.result()
            if self._redone_on_resume and self.tracker is not None:
                first, last = self._redone_on_resume
                # The lost driver logged these steps' metrics already: the ones logged now come
                # later in each metric's history (MLflow keeps both), and the run says which.
                self.tracker.set_tags({"raytrain.steps_redone": f"{first}..{last}: trained again after the driver "
                                       f"was lost; each of their metrics has two values, the later one current"})
            phase("tracking")
            if self.resume_run_id and tracking.span is not None:
                phase.beside("mlflow_run", tracking.span, tracking.seconds)
            if found.fallback:  # recorded in summary.json and as an MLflow event
                self._transition(State.STARTING, found.fallback)
            self.membership = Membership(spec, self.group, target_size=self._target_size, summary=self.summary)
            self.steps = Steps(spec, self.data, self.group, found.task, self.summary, self.tracker,
                               self.on_step, found.flops_per_token, self.metrics, self.cost)
            self.stragglers = Stragglers(spec, self.summary, self.tracker, team=self.metrics.tags["team"])
            self.checkpoints = Checkpoints(spec, found.checkpointer, self.checkpoint_root, found.manifest,
                                           self.summary, self.tracker, self.metrics)
            if found.eval_set is not None:
                self.evaluation = Evaluation(spec, found.task, self.summary, self.tracker, found.eval_set)
                self.evaluation.start_reading()  # while the group forms
                if self.summary.best_checkpoint:
                    found.checkpointer.keep_steps = {self.summary.best_checkpoint["step"]}
            if adopted:
                self._transition(State.STARTING, f"adopted the {self.group.world_size} live workers of the lost "
                                 f"driver at step {adoption.step} (their lease ended {adoption.waited_s:g} s after "
                                 f"the look began): the same processes and process group, nothing restored")
                self.membership.adopt(all(r.state["replicated"] for r in adoption.ranks))
                phase("group")
                self._continue_adopted(adoption)
                self._completing = running = adoption.running
                if running is not None:
                    self._transition(State.STARTING, f"lease {running.lease} (steps {running.first + 1}.."
                                     f"{running.first + running.count}), sent ahead by the lost driver, was begun by "
                                     f"{len(running.began)} of the workers and never reached the other "
                                     f"{len(running.missing)}: they are sent their part of it now")
                phase("adopt")
            else:
                spares = f" ({self.group.spares_used} warm spares)" if self.group.spares_used else ""
                self._transition(State.STARTING, f"{self.group.world_size} workers placed{spares}")
                self.membership.form_group()
                phase("group")
            if resume_info is not None and not adopted:
                self._restore_at_start(resume_info, found.checkpointer)
                if started_from_another_root(resume_info.uri, self.checkpoint_root):
                    # Resumed from another run's checkpoint (a PBT segment from its donor's):
                    # the state is saved in this run's own root first, so that its recovery, a
                    # pause and its resume never need that checkpoint, which the other run's
                    # retention may delete.
                    self.boundary.checkpoint(final=False)
                phase("restore")
            if warm is not None:
                warm.join()
                self.data.wait_s = 0.0  # spent while the workers started, not waited for by them
                phase.beside("first_read", warm.span, warm.seconds)
            phase("first_batch")
            phase.end()
            self._tracking_opened()
            self._transition(State.RUNNING, f"training from step {self.committed_step}")
            self._train()
            return self._result()
        except BaseException as exc:
            user = find_user_error(exc) if not isinstance(exc, KeyboardInterrupt) else None
            reason = str(user) if user is not None else (
                "interrupted by the user" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}")
            self.summary.reason = reason
            if not self.state.terminal:
                self._transition(State.FAILED, reason)
            if user is not None:
                raise user from None
            raise
        finally:
            self._teardown()

    def _train(self) -> None:
        """The step loop, then the run's ending (``policy.ending``: save first or not, and the
        state it ends in); a run that cannot go on (``MustStop``) saves its state and fails."""
        try:
            self._loop()
            self.boundary.settle(wait=True)  # a background save started is finished, whatever ends the run
            self._tracking_opened(wait=True)  # a run ends with its MLflow run open, or fails
            stop = self.requests.stop()
            while (policy.ending(self.committed_step, self.spec, stop, self.boundary.early_stop).save
                   and not self.checkpoints.saved(self.committed_step)):
                self.boundary.checkpoint(final=True)
                # Every member lost during the final save: an older checkpoint was restored, and
                # the steps after it are trained again before the run can end (a stop asked
                # for meanwhile ends it at the restored step: that one is durable).
                self._loop()
            end = policy.ending(self.committed_step, self.spec, stop, self.boundary.early_stop)
            if end.reason == self.boundary.early_stop:
                self.summary.reason = end.reason
            self._transition(State(end.state), end.reason)
        except MustStop as stop:
            self.recovery.fail_with_checkpoint(str(stop))

    def _restore_at_start(self, info: CheckpointInfo, checkpointer) -> None:
        """Load the checkpoint the run resumes from. One whose files are found corrupt while
        loading (a sha256 the pre-flight size check cannot see) is refused naming the newest
        intact older checkpoint and the field that resumes from it, or with
        checkpoint.on_corrupt=previous replaced by it (``launch.fall_back``)."""
        while True:
            try:
                self.recovery.restore(info)
                return
            except Exception as exc:
                corrupt = find_user_error(exc)
                if not isinstance(corrupt, CheckpointCorrupt):
                    raise
                info, note = launch.fall_back(self.spec, checkpointer, info, str(corrupt))
                self._transition(State.RESTORING, note)  # recorded in summary.json and as an MLflow event

    def _continue_adopted(self, adoption) -> None:
        """The ledger of an adopted launch: from the lost driver's record on to the step its
        workers hold (``Steps.adopt``: the steps between committed from what the workers kept,
        their metrics logged once: the MLflow run's newest step is where its driver stopped)."""
        recorded, cursor = self._adopted_from(adoption)
        if self.tracker is not None:
            try:
                self.steps.logged_through = self.tracker.newest_step()
            except Exception as exc:  # noqa: BLE001: unreadable: its steps may be logged twice, said so
                log.warning("could not read the MLflow run's newest step: %s", exc)
        unknown = self.steps.adopt(self.run_dir, recorded, cursor, adoption.step, adoption.lease)
        if adoption.step > recorded:
            self._transition(State.STARTING, f"steps {recorded + 1}..{adoption.step} were trained while no driver "
                             f"was up: committed from the workers' record"
                             + (f" ({unknown} with their loss unknown)" if unknown else ""))

    def _adopted_from(self, adoption) -> tuple[int, int]:
        """The step the lost driver's record reached (at most the adopted workers') and its data
        cursor: where an adoption's ledger goes on from."""
        recorded = min(self.summary.committed_steps, adoption.step)
        return recorded, self.summary.data_cursor - (self.summary.committed_steps - recorded) * \
            self.spec.train.global_batch_size

    def _target_size(self) -> int:
        """The world the run grows back to: the spec's, under a ceiling asked for from outside."""
        return policy.target_size(self.spec, self.requests.max_workers()[0])

    # ------------------------------------------------------------------ the step loop
    def _loop(self) -> None:
        """Leases of steps, committed in order at each lease's end; at each boundary its plan is
        carried out (``Boundary.run``); while the plan for the next one is empty and its batch
        read (``Boundary.read_unless_due``), the lease after the running one is sent before it
        ends (run-ahead), and a running lease is cut short as soon as the plan for the earliest
        boundary it can end at needs the members."""
        t = self.spec.train
        last = min(t.max_steps, t.stop_at_step) if t.stop_at_step else t.max_steps
        self.steps.open(self.run_dir)
        self.boundary.step = self.committed_step
        ahead: _Dispatch | None = None
        try:
            while True:
                self._tracking_opened()
                if ahead is None and self._completing is not None:
                    # An adopted launch's lease that only some members began: completed first
                    # (no boundary before it: its lost driver had sent it ahead, with none due).
                    cur, self._completing = self.steps.complete(self._completing), None
                elif ahead is None:
                    if self.boundary.run(last):
                        break  # the plan ends the step loop here (see ``_train``)
                    if not self.boundary.read_unless_due(self.committed_step, last):
                        continue  # work came while the batch was read: planned first
                    cur = self.steps.dispatch(self.committed_step, self.steps.lease_steps(self.committed_step, last))
                else:
                    cur, ahead = ahead, None
                if self.boundary.sends_ahead(cur.end, last):
                    try:
                        ahead = self.steps.dispatch(cur.end, self.steps.lease_steps(cur.end, last), after=cur)
                    except DataError:
                        pass  # raised again, in step order, when the step is sent in turn
                outcome, reports = self._follow(cur, ahead, last)
                self._check_reported(cur, outcome, reports)
                done_at = time.perf_counter()
                if ahead is not None:
                    ahead.t0 = done_at  # its members start it as they finish this one
                if outcome.failed:
                    self.steps.forget_agents(cur)
                    self.steps.keep_for_resend(cur, ahead)
                    if ahead is not None:
                        self.steps.settle(ahead, outcome)
                        ahead = None
                    self._recover_lease(cur, outcome, done_at - cur.t0)
                    continue
                ran = cur.part(0, len(reports))
                if reports and reports[-1]["cut"]:  # cut short: the rest, and the lease sent ahead, later
                    self.steps.keep_for_resend(cur.part(ran.count, cur.count), ahead)
                    if ahead is not None:
                        self.steps.drop(ahead)
                        ahead = None
                if reports:  # committed: every rank finished these steps (each report is their agreement)
                    self.summary.steps_run_ahead += ran.count if cur.sent_ahead else 0
                    self.steps.commit_lease(ran, reports, done_at - cur.t0)
                self.boundary.settle(wait=False)
        finally:
            self.steps.close()

    def _read_hung(self, record: dict) -> None:
        """A read the trainers waited on was found hung (``DataPlane._await_read``): kept in
        summary.json's read_hangs, and its reason in the run's transitions and the job's log."""
        record["step"] = self.committed_step + 1  # the step it held up
        self.summary.read_hangs.append(record)
        self._transition(None, record["reason"] + ("; its process was ended and the read is made again"
                                                         if record["hang"] == 1 else ""))

    @staticmethod
    def _check_reported(cur: _Dispatch, outcome: StepOutcome, reports: list[dict]) -> None:
        """A lease that ended well reported every one of its steps, or was cut short (its last
        report says so). One that ended with fewer, neither cut nor failed, would have its
        unreported steps never committed while the lease sent ahead went on past them: a step
        skipped in silence (seen once, on a clean clone's run under load, cause not found). It is
        made a failure of rank 0's instead: the recovery commits what the ranks finished
        (``commit_finished``) and sends the rest again, and the run's record names it."""
        if outcome.failed or len(reports) >= cur.count or (reports and reports[-1]["cut"]):
            return
        why = (f"lease {cur.lease} (steps {cur.step + 1}..{cur.end}) ended after {len(reports)} reported "
               f"step(s), neither cut short nor failed")
        log.error("supervisor: %s: recovered as a failure, no step skipped", why)
        outcome.errored[cur.members[0].slot] = why
        outcome.note_failures()

    def _follow(self, cur: _Dispatch, ahead: _Dispatch | None, last: int) -> tuple[StepOutcome, list[dict]]:
        """The running lease followed to its end (``LeaseWatch``): its reported steps observed
        as they come (``Boundary.observe``), and the lease cut short (with the one sent ahead)
        when the plan for the earliest boundary it can end at needs that boundary."""
        watch = LeaseWatch(self.group, cur.members, cur.member_refs, cur.reporter, cur.step, cur.end - 1,
                           self.steps._step_deadline_s(), copies=bool(self.membership.peers))
        newest, seen, observed, observed_at = ahead or cur, 0, 0, time.monotonic()
        while True:
            outcome = watch.wait(policy.BOUNDARY_POLL_S)
            seen = len(watch.reports)
            # The straggler window takes the reported steps at most every OBSERVE_EVERY_S, and at
            # the lease's end: its arrays and decision cost about as much as following the lease.
            if seen > observed and (outcome is not None or time.monotonic() - observed_at >= policy.OBSERVE_EVERY_S):
                self.boundary.observe(cur, watch.reports, observed, seen)
                observed, observed_at = seen, time.monotonic()
            if outcome is not None:
                return outcome, watch.reports
            earliest = min(cur.step + seen + 1, cur.end)
            if self.boundary.meanwhile(earliest, last) and self.steps.cut_through < newest.lease \
                    and (earliest < cur.end or ahead is not None):
                self.steps.cut(cur, newest.lease, earliest)

    def _recover_lease(self, sent: _Dispatch, outcome: StepOutcome, lease_time_s: float) -> None:
        """Rebuild in place after a failed lease: survivors keep their state; the lease's steps
        that finished on a survivor (with peer copies: that it agreed) are committed, not redone
        (``sent.members`` and ``sent.shares`` are the lease's, rank by rank)."""
        degrees, agreed_only = self.spec.parallel.degrees(len(sent.members)), bool(self.membership.peers)

        def commit_if_finished(held: dict[int, int]) -> None:
            self.steps.commit_finished(sent, outcome, min(max(held.values()), sent.end),
                                       lambda i: is_data_leader_rank(degrees, i), lease_time_s, agreed_only)

        where = f"step {sent.step + 1}" if sent.count == 1 else f"steps {sent.step + 1}..{sent.end}"
        self.recovery.recover(outcome.lost_among(sent.members), f"{where} failed: {outcome.describe(sent.members)}",
                              commit_if_finished, outcome.detected_at_unix_s, outcome.hangs)

    def _tracking_opened(self, wait: bool = False) -> None:
        """A new run's MLflow run opens beside the start and its first steps (``Tracker.begin``):
        at each lease, and waited for (``wait``) before the run ends, a failed opening fails the
        run with its TrackingError; once open, its span joins the start's record."""
        if self.tracker is None:
            return
        if wait:
            self.tracker.opened()
        self.tracker.check_open()
        self._note_open_span()

    def _note_open_span(self) -> None:
        """The MLflow run's opening in ``start_spans``, once it is open (in this thread, the one
        that writes the summary)."""
        span = self.tracker.open_span if self.tracker is not None else None
        if span is not None and self._phase is not None:
            self._phase.beside("mlflow_run", span, span[1] - span[0])
            self._phase = None

    def _step_deadline_s(self) -> float:
        """A step slower than this is hung: a multiple of recent step times, with a floor."""
        return self.steps._step_deadline_s()

    # ------------------------------------------------------------------ end
    def _result(self) -> RunResult:
        s = self.summary
        return RunResult(s.status, self.run_dir, self.committed_step, list(s.losses), s.mlflow_run_id,
                         s.newest_checkpoint, s.path, s.reason)

    def _teardown(self) -> None:
        self.summary.finished_at = time.time()
        if self.steps is not None:
            self.steps.end()  # the workers are held until the group's shutdown below: near enough
        self.metrics.flush()
        if self._warm is not None:
            # A run that failed while the workers started: the warm-up read may still hold (or
            # be about to take) object references. Closed under it, the plane would get them
            # back, and Ray aborts a process (exit 1) whose references outlive its shutdown.
            self._warm.join(timeout=30.0)
        if self.data is not None:
            self.data.close()
        if self.group is not None:  # a run that ended as asked gives its warm spares back to the pool
            self.group.shutdown(healthy=self.state in (State.FINISHED, State.STOPPED, State.CANCELLED))
        if self.tracker is not None:
            status = {State.FINISHED: "FINISHED", State.STOPPED: "KILLED",
                      State.CANCELLED: "KILLED"}.get(self.state, "FAILED")
            try:
                self.tracker.log_plots(self.summary.snapshot())
                self.tracker.finish(status)  # a run still opening is opened first
                self._note_open_span()
            except Exception as exc:
                log.warning("could not close the MLflow run: %s", exc)
        self.summary.write()
        if self._local_cluster:
            ray.shutdown()


def run_job(spec: JobSpec, *, on_step: Callable[[StepReport], None] | None = None,
            requests: RunRequests | None = None, spares: SpareSource | None | str = "here") -> RunResult:
    """Run a job to completion on the cluster the spec names (or a local one); ``requests``
    lets another thread pause, cancel or resize it. ``spares``: "here" takes the warm spares of
    a pool this process may use (``SpareSource.here``), None starts fresh worker processes."""
    return Supervisor(spec, on_step=on_step, requests=requests, spares=spares).run()


def resume_job(run_id: str, *, tracking_uri: str = "", overrides: list[str] | None = None,
               output_dir: str = "runs", on_step: Callable[[StepReport], None] | None = None,
               requests: RunRequests | None = None, objects: dict | None = None) -> RunResult:
    """Continue the MLflow run ``run_id`` from its newest committed checkpoint, in the same run.
    ``objects``: dotted field -> the Python object a run was given for an extension point
    (``{"model.factory": build}``), which its record names but cannot hold."""
    return resume_supervisor(run_id, tracking_uri=tracking_uri, overrides=overrides, output_dir=output_dir,
                             on_step=on_step, requests=requests, objects=objects).run()


def resume_supervisor(run_id: str, *, tracking_uri: str = "", overrides: list[str] | None = None,
                      output_dir: str = "runs", on_step: Callable[[StepReport], None] | None = None,
                      requests: RunRequests | None = None, objects: dict | None = None,
                      spares: SpareSource | None | str = "here", team: str = "-",
                      lost_at_step: int = 0) -> Supervisor:
    """The Supervisor that ``resume_job`` runs, not yet started: for a caller that reads its
    state while it runs (the job service's runner). The run's record is read by
    ``launch.resumed_run``; its ``run`` raises ``CheckpointError`` when the run has no complete
    checkpoint and no live workers of its lost driver to adopt.
    ``lost_at_step``: the step its lost driver was last seen to commit, by whoever watched it
    (the job service), counted with the run's own record (``RunSummary.resumed_at``)."""
    found = launch.resumed_run(run_id, tracking_uri, overrides, output_dir, objects)
    return Supervisor(found.spec, resume_run_id=run_id, run_dir=found.run_dir, previous_run_key=found.previous_key,
                      on_step=on_step, requests=requests, spares=spares, team=team, lost_at_step=lost_at_step)
