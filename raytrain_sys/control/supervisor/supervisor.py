"""The Supervisor: the driver-side owner of a run, and the one that sequences its parts.

It owns the run's state (``journal``: every transition goes through ``_transition``, logged
with its reason, in summary.json and as an MLflow event) and decides what happens next; the
parts it calls return outcomes and never call one another: ``launch`` (pre-flight, tracking,
warm-up), ``steps`` (dispatch, settle, commit; the committed-step counter and data cursor),
``liveness`` (how a step went, is a member alive), ``membership`` (who is in, re-forming the
group, sharing state), ``checkpoints`` (save, load, the manifest), ``stragglers`` (per-rank
step times, slow ranks and what elastic.straggler_policy asks); with two that decide or
ask without acting: ``policy`` (pure decisions: step deadline, run-ahead, failure budget,
layout fit, drain plan) and ``probe`` (which step each member holds). It never touches
tensors.

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
from raytrain_sys.control.supervisor.checkpoints import Checkpoints, PendingSave, check_compatible
from raytrain_sys.control.supervisor.evaluation import Evaluation
from raytrain_sys.control.supervisor.journal import State, transition_record
from raytrain_sys.control.supervisor.liveness import StepOutcome, WorkerLost, collect, watch
from raytrain_sys.control.supervisor.probe import ping_all
from raytrain_sys.control.supervisor.membership import (Membership, MembersLost, NoHolders, Reformed,
                                                        Uncovered)
from raytrain_sys.control.supervisor.requests import CANCEL, RunRequests
from raytrain_sys.control.supervisor.steps import StepReport, Steps, _Dispatch
from raytrain_sys.control.supervisor.stragglers import Rebalance, Replace, Stragglers
from raytrain_sys.control.worker_group import Worker, WorkerGroup, connect_ray
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.errors import CheckpointError, DataError, StorageError, TrainingFailed, find_user_error
from raytrain_sys.monitor.cost import CostMeter
from raytrain_sys.monitor.metrics import RunMetrics
from raytrain_sys.parallel.mesh import is_data_leader_rank
from raytrain_sys.spec import JobSpec
from raytrain_sys.tracking import mlflow_tracker as mt

log = logging.getLogger(__name__)

# Test hook: crash the driver after a checkpoint's data files are written and before its
# manifest, at this step. Used to prove that a half-written checkpoint stays invisible.
FAULT_BEFORE_MANIFEST_ENV = "RAYTRAIN_SYS_FAULT_BEFORE_MANIFEST_STEP"


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
                 requests: RunRequests | None = None, spares: SpareSource | None = None, team: str = "-"):
        self.spec = spec
        # Prometheus series (tracking.metrics) labelled with the job and its service team ("-": none).
        self.metrics = RunMetrics(spec.name, team, enabled=spec.tracking.metrics)
        self.cost = CostMeter(spec.resources.cost_per_worker_hour)  # paid worker-time, summary.json's cost
        self._recovering_since = 0.0  # when the current rebuild began (time.time()); 0: none
        self.spares = spares  # warm worker processes for the first gang (control.spares)
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
        self.tracker = None
        self.group: WorkerGroup | None = None
        self.data: DataPlane | None = None
        # The parts, made as the run starts (see ``run``).
        self.steps: Steps | None = None
        self.membership: Membership | None = None
        self.checkpoints: Checkpoints | None = None
        self.evaluation: Evaluation | None = None
        self.stragglers: Stragglers | None = None
        self._straggler_leaving: tuple[Worker, str] | None = None  # elastic.straggler_policy=replace
        # The background save in flight (checkpoint.async_save): at most one, committed or
        # abandoned at a later boundary (``_settle_save``).
        self._pending_save: PendingSave | None = None
        self._early_stop = ""  # the reason, once train.early_stop ended the run
        self._local_cluster = False
        self._warm = None  # the data warm-up thread (launch.warm_data), joined before teardown
        self._last_drain_poll = 0.0
        self._failures: list[float] = []  # unix times of recent membership failures
        self._handover_waits: set[str] = set()  # draining nodes whose members await successors

    @property
    def committed_step(self) -> int:
        return self.steps.committed_step if self.steps is not None else 0

    @property
    def data_cursor(self) -> int:
        return self.steps.data_cursor if self.steps is not None else 0

    # ------------------------------------------------------------------ bookkeeping
    def _transition(self, state: State, reason: str, detected_at_unix_s: float = 0.0) -> None:
        """The one place the state changes: a move ``State`` does not allow raises. Records it;
        ``detected_at_unix_s``: when the failure that caused it was seen, if earlier (the
        rebuild decision waits for the rest of the step's members)."""
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
            transition_record(state, reason, self.committed_step, now, detected_at_unix_s))
        if self.tracker is not None:
            try:
                self.tracker.log_event(self.committed_step, state.value, reason)
            except Exception as exc:
                log.warning("could not record transition in MLflow: %s", exc)
        self.summary.write()

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        spec = self.spec
        # First, before anything of the run is written: a resume must not touch the record of a
        # run whose earlier driver is still alive.
        removed = launch.clean_up_previous_launch(spec, self.previous_run_key)
        phase = _Phases()
        self.summary.start_phases = phase.phases  # filled as the start goes (a failed one keeps its part)
        try:
            found = launch.preflight(spec, self.output_dir, self.run_dir, self.checkpoint_root,
                                     self.tracking_uri)
            phase("preflight")
            resume_info = found.resume_info
            self.summary.spec_hash = spec.spec_hash()
            self.summary.training_hash = spec.training_hash()
            self.summary.git_commit = git_commit()
            self.summary.tracking_uri = self.tracking_uri
            if resume_info is not None:
                check_compatible(spec, resume_info)
                previous = RunSummary.read(self.run_dir)
                if previous is not None:
                    previous.truncate_to(resume_info.step)
                    self.summary = previous
                    self.summary.reason = ""
                    self.summary.start_phases = phase.phases  # the newest start's, not the earlier run's
            self.summary.write()

            self._local_cluster = connect_ray(spec)
            phase("ray")
            # The first reads (reader processes start, shards are checked) run while the workers
            # start, from the cursor the run continues at.
            self.data = DataPlane.for_job(
                spec, found.manifest, end_position=spec.train.max_steps * spec.train.global_batch_size,
                run_dir=self.run_dir, on_skip=lambda reason: self._transition(self.state, reason),
                task=found.task)
            warm = self._warm = launch.warm_data(spec, self.data,
                                    int(resume_info.manifest["data_cursor"]) if resume_info else 0)
            phase("data")
            if removed:
                self._transition(State.STARTING, f"removed {len(removed)} actors/placement groups "
                                 f"left by the lost driver of run {self.previous_run_key}")
            store = mt.prepare_store(self.tracking_uri) if spec.tracking.enabled else None

            def start_tracking():
                if store is not None:
                    store.join()
                return launch.start_tracking(spec, self.summary, self.tracking_uri, self.resume_run_id,
                                             self.run_dir, self.output_dir, self.checkpoint_root)

            # The MLflow run opens (seconds on a busy node) while the workers start, once the
            # slots are placed: a job that cannot be placed leaves no run behind.
            tracking = launch.InBackground(start_tracking, "mlflow-run")
            self.group = WorkerGroup(spec, self._local_cluster, run_key=self.run_key, spares=self.spares)
            try:
                self.group.start(spec.resources.num_workers, on_placed=tracking.start)
            except BaseException:
                if tracking.started:  # teardown ends the run that was opened, as failed
                    with contextlib.suppress(Exception):
                        self.tracker = tracking.result()
                raise
            phase.add(self.group.start_phases)
            self.tracker = tracking.result()
            phase("tracking")
            if found.fallback:  # recorded in summary.json and as an MLflow event
                self._transition(State.STARTING, found.fallback)
            self.membership = Membership(spec, self.group, target_size=self._target_size)
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
            spares = f" ({self.group.spares_used} warm spares)" if self.group.spares_used else ""
            self._transition(State.STARTING, f"{self.group.world_size} workers placed{spares}")
            self.membership.form_group()
            phase("group")
            if resume_info is not None:
                self._restore(resume_info)
                phase("restore")
            if warm is not None:
                warm.join()
                self.data.wait_s = 0.0  # spent while the workers started, not waited for by them
            phase("first_batch")
            phase.end()
            self._transition(State.RUNNING, f"training from step {self.committed_step}")
            self._loop()
            self._settle_save(wait=True)  # a background save started is finished, whatever ends the run
            stop = self.requests.stop()
            cancelled = stop is not None and stop.how == CANCEL
            save = not cancelled and (spec.checkpoint.save_on_exit or stop is not None)  # a pause saves
            while save and not self.checkpoints.saved(self.committed_step):
                self._checkpoint(final=True)
                # Every member lost during the final save: an older checkpoint was restored, and
                # the steps after it are trained again before the run can end (a stop asked
                # for meanwhile ends it at the restored step: that one is durable).
                self._loop()
            if self._early_stop and stop is None:
                self.summary.reason = self._early_stop
                self._transition(State.FINISHED, self._early_stop)
            elif self.committed_step < spec.train.max_steps and stop is not None:
                self._transition(State.CANCELLED if cancelled else State.STOPPED,
                                 f"{stop.describe()} (at step {self.committed_step})")
            elif self.committed_step < spec.train.max_steps:
                self._transition(State.STOPPED, f"paused at train.stop_at_step={spec.train.stop_at_step}")
            else:
                self._transition(State.FINISHED, f"reached train.max_steps={spec.train.max_steps}")
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

    def _restore(self, info: CheckpointInfo) -> None:
        """Load a durable checkpoint into every member: the fallback when no replica holds state."""
        self._abandon_save("an older checkpoint is restored")
        self._transition(State.RESTORING, f"loading checkpoint {info.uri}")
        self.checkpoints.load(self.group, info)
        self.steps.rewind(info.step, int(info.manifest["data_cursor"]))

    # ------------------------------------------------------------------ the step loop
    def _loop(self) -> None:
        spec = self.spec
        last = spec.train.max_steps
        if spec.train.stop_at_step:
            last = min(last, spec.train.stop_at_step)
        self.steps.open(self.run_dir)
        ahead: _Dispatch | None = None
        try:
            while self.committed_step < last:
                if ahead is None:
                    if self.requests.stop() is not None or self._early_stop:
                        break  # a pause, cancel or early stop: the run ends at this boundary (see ``run``)
                    self._at_step_boundary()
                    step = self.committed_step
                    cur = self.steps.dispatch(step, self.steps.lease_steps(step, last))
                else:
                    cur, ahead = ahead, None
                if self._may_run_ahead(cur.end, last):
                    try:
                        ahead = self.steps.dispatch(cur.end, self.steps.lease_steps(cur.end, last), after=cur)
                    except DataError:
                        pass  # raised again, in step order, when the step is sent in turn
                outcome = collect(self.group, cur.members, cur.refs, cur.step, cur.deadline_s)
                done_at = time.perf_counter()
                if ahead is not None:
                    ahead.t0 = done_at  # its members start it as they finish this one
                if outcome.failed:
                    self.steps.keep_for_resend(cur, ahead)
                    if ahead is not None:
                        self.steps.settle(ahead, outcome)
                        ahead = None
                    self._recover(cur, outcome, done_at - cur.t0)
                    continue
                # Committed: every rank finished its optimizer steps.
                self.summary.steps_run_ahead += cur.count if cur.sent_ahead else 0
                results = [outcome.results[w.slot] for w in cur.members]
                self.stragglers.observe(cur, results, self.group.generation)
                self.steps.commit_lease(cur, results, done_at - cur.t0)
                self._act_on_stragglers(cur.members)
                every = spec.checkpoint.every_steps
                # A lease ends where a checkpoint is due (policy.lease_steps).
                if self._pending_save is not None:
                    self._settle_save(wait=False)
                if every and self.committed_step % every == 0 and self.committed_step < last:
                    self._checkpoint(final=False, background=spec.checkpoint.async_save)
                if self.evaluation is not None and (policy.eval_due(self.committed_step, spec)
                                                    or self.committed_step == spec.train.max_steps):
                    self._evaluate()
        finally:
            self.steps.close()

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self) -> None:
        """Evaluate the committed state; a member lost meanwhile is rebuilt around, and the
        evaluation asked again (of the same state). Then keep its checkpoint if it is the best
        (checkpoint.keep_best) and decide an early stop (train.early_stop)."""
        step = self.committed_step
        batches = len(self.evaluation.refs or []) or 1
        for attempt in range(3):
            t0 = time.perf_counter()
            members = list(self.group.workers)
            outcome = self.evaluation.call(self.group, step, self.steps._step_deadline_s(batches))
            if not outcome.failed:
                metrics = self.evaluation.record(step, outcome, time.perf_counter() - t0)
                break
            lost = [w for w in members if w.slot in outcome.lost]
            reason = "; ".join([f"worker {w.slot} {outcome.lost[w.slot]}" for w in lost]
                               + [f"worker {s} error: {m}" for s, m in outcome.errored.items()])
            if not lost and attempt == 2:
                raise TrainingFailed(f"evaluation at step {step} failed: {reason}")
            self._rebuild_without(lost, f"evaluation at step {step} failed: {reason}")
            if self.committed_step != step:
                return  # restored an older checkpoint: the steps and this evaluation come again
        else:
            raise TrainingFailed(f"evaluation at step {step} failed three times")
        if self.spec.checkpoint.keep_best and self.evaluation.improves(metrics):
            if not self.checkpoints.saved(step):
                self._checkpoint(final=False)
            saved = [c for c in self.summary.checkpoints if c["step"] == step]
            if saved:
                self.evaluation.mark_best(step, saved[-1]["uri"], metrics)
                self.checkpoints.checkpointer.keep_steps = {step}
        stop = self.evaluation.early_stop()
        if stop is not None:
            self._early_stop = f"{stop.reason} (at step {step})"

    def _step_deadline_s(self) -> float:
        """A step slower than this is hung: a multiple of recent step times, with a floor."""
        return self.steps._step_deadline_s()

    def _may_run_ahead(self, step: int, last: int) -> bool:
        """Whether step ``step`` may be sent before the one before it is committed: only when
        the boundary between them has nothing to do (``policy.run_ahead_hold``) and no member
        is on a draining node."""
        if policy.run_ahead_hold(step, last, self.spec, len(self.group.workers), self._target_size()):
            return False
        if self.requests.stop() is not None or len(self.group.workers) > self._target_size():
            return False  # a stop or a shrink asked for: the next boundary is kept for it
        if self._straggler_leaving is not None:
            return False  # a straggler leaves at the next boundary
        now = time.monotonic()
        if now - self._last_drain_poll >= self.spec.elastic.drain_poll_s:
            # The drain poll, done now while the members compute: a draining member must leave
            # at the coming boundary, so that boundary is kept.
            draining = self._draining_nodes()
            if draining is None:
                return False
            everyone = self.group.workers + self.group.pending + self.group.standby
            if any(w.node_id in draining for w in everyone):
                return False
            self._last_drain_poll = now
        return True

    # ------------------------------------------------------------------ recovery
    def _count_failure(self, reason: str, kind: str) -> None:
        self._failures, decision = policy.failure_budget(self._failures, time.time(), self.spec.elastic, reason)
        self.summary.failures += 1
        self.metrics.failure(kind)
        if isinstance(decision, policy.Stop):
            self._fail_with_checkpoint(decision.reason)
        elif not isinstance(decision, policy.Continue):
            raise TypeError(f"unknown failure decision {decision!r}")

    def _recover(self, sent: _Dispatch, outcome: StepOutcome, lease_time_s: float) -> None:
        """Rebuild in place after a failed lease: survivors keep their state; nothing committed is lost.

        ``sent.members`` and ``sent.shares`` are the lease's, rank by rank (``collect`` may
        already have removed hung members from the group)."""
        members = sent.members
        lost = [w for w in members if w.slot in outcome.lost]
        reason = "; ".join([f"worker {w.slot} on node {w.node_id[:8]} {outcome.lost[w.slot]}" for w in lost]
                           + [f"worker {s} error: {m}" for s, m in outcome.errored.items()])
        degrees = self.spec.parallel.degrees(len(members))

        def commit_if_finished(held: dict[int, int]) -> None:
            # Steps of the lease that finished on some replica are committed, not redone.
            self.steps.commit_finished(sent, outcome, min(max(held.values()), sent.end),
                                       lambda i: is_data_leader_rank(degrees, i), lease_time_s)

        where = f"step {sent.step + 1}" if sent.count == 1 else f"steps {sent.step + 1}..{sent.end}"
        self._rebuild_without(lost, f"{where} failed: {reason}", commit_if_finished,
                              detected_at_unix_s=outcome.detected_at_unix_s)

    def _rebuild_without(self, lost: list[Worker], reason: str,
                         before_reform: Callable[[dict[int, int]], None] | None = None,
                         detected_at_unix_s: float = 0.0) -> None:
        """Drop ``lost`` members and re-form the group from the survivor holding the newest step;
        with no survivor, fall back to the newest durable checkpoint."""
        self._transition(State.REBUILDING, reason, detected_at_unix_s)
        self.group.remove(lost)
        held = self.membership.survivors_held()
        if held and before_reform is not None:
            before_reform(held)
        # After the commit of a step that had finished: should the budget stop the run, the
        # state it saves is the newest one.
        self._count_failure(reason, "worker_lost" if lost else "worker_error")
        if not self.group.workers:
            self._restore_all_lost()
            return
        self._reform(source_slot=max(held, key=held.get))

    def _reform(self, source_slot: int | None = None, reason: str = "") -> None:
        """New process group over the members (+ ready newcomers), state equalized
        (``Membership.reform``); a checkpoint restored when the members cannot hold the state."""
        for attempt in range(5):
            self.membership.request_replacements()
            newcomers = self.group.ready_pending(timeout_s=0.0)
            self._wait_for_min_workers(extra=len(newcomers))
            newcomers += self.group.ready_pending(timeout_s=0.0)
            members = list(self.group.workers) + newcomers
            try:
                outcome = self.membership.reform(newcomers, self.committed_step, source_slot)
                members = outcome.members
                if isinstance(outcome, NoHolders):
                    # Every replica of the committed step is gone (they died during this
                    # rebuild): only a durable checkpoint can continue the run.
                    self._restore_all_lost()
                    return
                if isinstance(outcome, Uncovered):
                    self._restore_uncovered(outcome)
                    return
                if not isinstance(outcome, Reformed):
                    raise TypeError(f"unknown membership outcome {outcome!r}")
            except (MembersLost, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if not isinstance(exc, MembersLost):
                    exc = MembersLost(*ping_all(members)[1:])
                log.warning("rebuild attempt %d failed (%s); dropping %d lost workers", attempt + 1,
                            exc, len(exc.dead + exc.silent))
                self.membership.drop(exc)
                if not self.group.workers:
                    self._restore_all_lost()
                    return
                continue
            self._transition(State.RUNNING, reason or f"rebuilt: world {len(members)}, generation "
                             f"{self.group.generation}, {len(newcomers)} newcomers")
            return
        self._fail_with_checkpoint("could not re-form the process group after 5 attempts")

    def _restore_uncovered(self, outcome: Uncovered) -> None:
        """The surviving pieces miss part of the state: the newest durable checkpoint, resharded."""
        step, gaps = self.committed_step, outcome.gaps
        info = self.checkpoints.latest()
        reason = (f"the surviving workers do not hold all of the state of step {step} (no copy "
                  f"of {', '.join(gaps[:2])}{' ...' if len(gaps) > 2 else ''})")
        if info is None:
            raise TrainingFailed(f"{reason} and no checkpoint exists in {self.checkpoint_root}; "
                                 f"set checkpoint.every_steps, or keep replicas (parallel.dp, hsdp)")
        self._transition(State.RESTORING, f"{reason}: restoring {info.uri}")
        self._restore(info)
        self._transition(State.RUNNING, f"restored from {info.uri}, resharded to world {len(outcome.members)}")

    def _wait_for_min_workers(self, extra: int = 0) -> None:
        e = self.spec.elastic
        need = policy.min_world(self.spec)
        if len(self.group.workers) + extra >= need:
            return
        self._transition(State.WAITING, f"{len(self.group.workers) + extra} workers, below "
                         f"{need} (elastic.min_workers={e.min_workers}, parallel degrees): waiting "
                         f"up to {e.below_min_timeout_s:g} s")
        if self.membership.wait_for(need, e.below_min_timeout_s):
            return
        self._fail_with_checkpoint(f"the group stayed below elastic.min_workers={e.min_workers} for "
                                   f"elastic.below_min_timeout_s={e.below_min_timeout_s:g} s")

    def _restore_all_lost(self) -> None:
        """No replica holds the state: new workers, newest durable checkpoint."""
        info = self.checkpoints.latest()
        if info is None:
            raise TrainingFailed(f"every worker was lost at step {self.committed_step} and no "
                                 f"checkpoint exists in {self.checkpoint_root}; set "
                                 f"checkpoint.every_steps to survive this")
        self.membership.request_replacements()
        self._wait_for_min_workers()
        self.group.add(self.group.ready_pending(timeout_s=0.0))
        self.membership.form_group(timeout_s=120.0)
        self._restore(info)
        self._transition(State.RUNNING, f"restored from {info.uri} after losing every worker")

    def _fail_with_checkpoint(self, reason: str) -> None:
        """Stop with a clear error, saving the in-memory state first when a replica holds it."""
        saved = ""
        try:
            self._settle_save(wait=True)
        except Exception as exc:  # the failure is the news
            log.warning("the background checkpoint in flight could not be committed: %s", exc)
        if self.group.workers and not self.checkpoints.saved(self.committed_step):
            try:
                saved = self._save_before_failing()
            except Exception as exc:  # the failure is the news; the save is a courtesy
                saved = f"; could not save a checkpoint: {exc}"
        raise TrainingFailed(reason + (saved or f"; newest checkpoint: {self.summary.newest_checkpoint or 'none'}"))

    def _save_before_failing(self) -> str:
        """The committed state, written by the members that hold it. No rebuild, no retry
        through the failure path: the run is ending. The process group may be broken; a save
        needs none. In a replicated layout any one holder has it all (the next one writes it
        when one fails); in a sharded one every member must still be there (each writes the
        blocks it owns)."""
        step = self.committed_step
        replicated = self.membership.layout_replicated
        self._transition(State.CHECKPOINTING, f"saving step {step} before stopping")
        held, dead, silent = ping_all(self.group.workers)
        holders = [w for w in self.group.workers if held.get(w.slot) == step]
        if not holders or (not replicated and len(holders) < len(self.group.workers)):
            return f"; no complete copy of step {step} left among the workers to save it"
        files = []
        started = time.perf_counter()
        for w in holders:
            ref = self.checkpoints.save_call(w, step, everything=replicated)
            try:
                files += watch(self.group, w, ref, f"the final checkpoint of step {step}")
            except (WorkerLost, ray.exceptions.RayError) as exc:
                log.warning("worker %d could not save step %d: %s", w.slot, step, exc)
                if not replicated:
                    return f"; worker {w.slot} was lost while saving step {step}: not saved"
                continue
            if replicated:
                break
        else:
            if replicated:
                return f"; no surviving worker could save step {step}"
        info = self.checkpoints.commit(step, files, self.data_cursor, self.group.world_size,
                                       {"stall_s": round(time.perf_counter() - started, 4)})
        return f"; state saved at step {step}: {info.uri}"

    # ------------------------------------------------------------------ membership at step boundaries
    def _target_size(self) -> int:
        """The world the run grows back to: the spec's, under a ceiling asked for from outside."""
        return policy.target_size(self.spec, self.requests.max_workers()[0])

    def _at_step_boundary(self) -> None:
        """Between steps: leave draining (preempted) nodes, shrink to a requested ceiling, take
        in ready newcomers."""
        if self._straggler_leaving is not None:
            self._replace_straggler()
        now = time.monotonic()
        if now - self._last_drain_poll >= self.spec.elastic.drain_poll_s:
            self._last_drain_poll = now
            self._leave_draining_nodes()
        target = self._target_size()
        if len(self.group.workers) > target:
            self._shrink_to(target)
        elif len(self.group.workers) == target and (self.group.pending or self.group.standby):
            self.group.remove(self.group.pending + self.group.standby)  # asked for before a shrink
        if len(self.group.workers) < target:
            self.membership.request_replacements()
            ready = self.group.ready_pending(timeout_s=0.0)
            if not policy.grows(self.spec.parallel, len(self.group.workers), len(ready)):
                self.group.standby += ready  # not enough for the next usable world yet
                ready = []
            if ready:
                self._transition(State.RESIZING, f"{len(ready)} worker(s) ready: growing to "
                                 f"{len(self.group.workers) + len(ready)}")
                self.group.add(ready)
                self._reform(source_slot=self.group.workers[0].slot,
                             reason=f"grown to world {len(self.group.workers)}")

    def _shrink_to(self, target: int) -> None:
        """Members above a requested ceiling leave at this boundary, as from a draining node:
        their state stays with the others (their shards handed over first when sharded), so no
        step is lost; their workers are released."""
        leaving = policy.shrink_leavers(self.group.workers, target)
        _, why = self.requests.max_workers()
        self._transition(State.RESIZING, f"shrinking to {target} worker(s) at step {self.committed_step}"
                         + (f": {why}" if why else ""))
        self.group.remove(self.group.pending + self.group.standby)
        self.membership.take_leavers_pieces(leaving, self.committed_step)
        self._reform(source_slot=self.group.workers[0].slot, reason=f"shrunk to world {len(self.group.workers)}")

    def _act_on_stragglers(self, members: list[Worker]) -> None:
        """What elastic.straggler_policy asks after a commit (``Stragglers.decide``): a rebalanced
        split for the next dispatches of this process group, or a slow member to replace at the
        next boundary (nothing is sent ahead across it)."""
        decision = self.stragglers.decide(self.committed_step)
        if isinstance(decision, Rebalance):
            self.steps.rows_split = (self.group.generation, decision.rows)
        elif isinstance(decision, Replace):
            f = decision.flagged
            self._straggler_leaving = (members[f.rank], f"rank {f.rank} computes {f.ratio:.2f}x its peers' median")
        elif decision is not None:
            raise TypeError(f"unknown straggler decision {decision!r}")

    def _replace_straggler(self) -> None:
        """A slow member leaves at this boundary as from a draining node: its state stays with the
        others (its shards handed over first when sharded), so no step is lost; a replacement is
        asked for and joins when it is up."""
        worker, why = self._straggler_leaving
        self._straggler_leaving = None
        if worker not in self.group.workers or len(self.group.workers) < 2:
            return  # gone meanwhile, or nobody to hand its state to
        self._transition(State.DRAINING, f"straggler: worker {worker.slot} on node {worker.node_id[:8]} "
                         f"({why}) leaves at step {self.committed_step}; a replacement is requested")
        self.membership.take_leavers_pieces([worker], self.committed_step)
        self._reform(source_slot=self.group.workers[0].slot,
                     reason=f"straggler left: world {len(self.group.workers)}, replacement requested")

    @staticmethod
    def _draining_nodes() -> dict | None:
        """Nodes marked for preemption, by node id; None when the lookup failed."""
        try:
            from raytrain_sys.control.drain import draining_nodes

            return draining_nodes()
        except Exception as exc:  # a GCS hiccup must not stop training
            log.debug("could not read draining nodes: %s", exc)
            return None

    def _leave_draining_nodes(self) -> None:
        """Members on nodes marked for preemption leave at this step boundary, with no step lost
        (``policy.drain_plan``: leave now; hand the state over to ready newcomers; train on
        while replacements start; or, when the notice's time runs out, save a checkpoint first)."""
        draining = self._draining_nodes()
        if not draining:
            return
        self.group.remove([w for w in self.group.pending + self.group.standby if w.node_id in draining])
        leaving = [w for w in self.group.workers if w.node_id in draining]
        if not leaving:
            return
        deadlines = [d for d in (draining[w.node_id].deadline_unix_s for w in leaving) if d]
        deadline = min(deadlines) if deadlines else None
        when = f"deadline in {deadline - time.time():.0f} s" if deadline else "no deadline"
        staying = [w for w in self.group.workers if w not in leaving]
        need = policy.drain_floor(self.spec.elastic)
        ready = ([w for w in self.group.ready_pending(timeout_s=0.0) if w.node_id not in draining]
                 if len(staying) < need else [])
        plan = policy.drain_plan(len(staying), len(ready), len(self.group.pending), need, deadline, time.time())
        what = f"{len(leaving)} worker(s) on draining node(s) ({when})"
        if isinstance(plan, policy.HandOver):
            self._transition(State.DRAINING, f"{what}: {len(ready)} newcomer(s) take the state over at "
                             f"step {self.committed_step}")
            self.group.add(ready)
            self._reform(source_slot=leaving[0].slot,
                         reason=f"{len(ready)} newcomer(s) hold the state of step {self.committed_step}")
        elif isinstance(plan, policy.TrainOn):
            for _ in range(plan.request):
                self.group.request()
            if not self._handover_waits & {w.node_id for w in leaving}:
                self._handover_waits |= {w.node_id for w in leaving}
                self._transition(State.DRAINING, f"{what}: training on until a replacement is up to "
                                 f"take the state over")
                self._transition(State.RUNNING, "waiting for replacements of draining workers")
            return
        elif isinstance(plan, policy.SaveThenLeave):
            self._transition(State.DRAINING, f"{what}: no replacement in time, saving a checkpoint at "
                             f"step {self.committed_step} before leaving")
            if not self.checkpoints.saved(self.committed_step):
                self._checkpoint(final=False)
        elif isinstance(plan, policy.Leave):
            self._transition(State.DRAINING, f"{what}: leaving at step {self.committed_step}")
        else:
            raise TypeError(f"unknown drain plan {plan!r}")
        self.membership.take_leavers_pieces(leaving, self.committed_step)
        if not self.group.workers:
            self.membership.departing_pieces = []
            self._restore_all_lost()
            return
        self._reform(source_slot=self.group.workers[0].slot,
                     reason=f"left draining node(s): world {len(self.group.workers)}")

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, final: bool, background: bool = False) -> None:
        """Save the committed step; ``background`` (checkpoint.async_save): only the members'
        snapshots are waited for here, the manifest is written by ``_settle_save`` once every
        file is durable. A save in flight is settled first: a new one waits for it."""
        self._settle_save(wait=True)
        step = self.committed_step
        if self.checkpoints.saved(step):
            return
        how = "periodic background" if background else "final" if final else "periodic"
        self._transition(State.CHECKPOINTING, f"{how} checkpoint at step {step}")
        t0 = time.perf_counter()
        try:
            saved = self._save_checkpoint_files(step, background)
            if saved is None:  # the group fell back to an older checkpoint meanwhile
                return
            if background:
                now = time.perf_counter()
                self._pending_save = self.checkpoints.begin(step, self.data_cursor, self.group.world_size,
                                                            saved, now - t0, now)
                self._transition(State.RUNNING, f"checkpoint of step {step}: snapshots taken in "
                                 f"{now - t0:.2f} s, written in the background")
                return
            if os.environ.get(FAULT_BEFORE_MANIFEST_ENV) == str(step):
                raise RuntimeError(f"injected fault before the manifest of step {step}")
            info = self.checkpoints.commit(step, saved, self.data_cursor, self.group.world_size,
                                           {"stall_s": round(time.perf_counter() - t0, 4)})
        except Exception as exc:
            user = find_user_error(exc)
            if user is None or not isinstance(user, StorageError):
                raise
            if final:
                raise StorageError(f"final checkpoint at step {step} could not be saved: {user}") from None
            # Training state is still in memory: keep going, try again at the next interval.
            log.warning("checkpoint at step %d failed, training continues: %s", step, user)
            self._transition(State.RUNNING, f"checkpoint at step {step} failed: {user}")
            return
        self._transition(State.RUNNING, f"checkpoint committed: {info.uri}")

    def _save_checkpoint_files(self, step: int, background: bool = False) -> list | None:
        """Have every member write the blocks of the state of ``step`` it owns (in a replicated
        layout rank 0 owns all of it): their file records; with ``background``, have them take
        their snapshots and start writing: (member, snapshot) pairs. A member lost mid-save:
        the group is rebuilt without it (its blocks are re-dealt) and the save starts over.
        None when the group had to fall back to an older checkpoint meanwhile."""
        call = self.checkpoints.start_call if background else self.checkpoints.save_call
        for _ in range(3):
            members = list(self.group.workers)
            refs = [(w, call(w, step)) for w in members]
            try:
                done = [(w, watch(self.group, w, ref, f"the checkpoint of step {step}")) for w, ref in refs]
                return done if background else [record for _, records in done for record in records]
            except WorkerLost as lost:
                ray.wait([r for _, r in refs], num_returns=len(refs), timeout=policy.PING_TIMEOUT_S)
                self._rebuild_without([lost.worker], f"worker {lost.worker.slot} on node "
                                      f"{lost.worker.node_id[:8]} {lost.reason}")
            if self.committed_step != step:
                return None
            self._transition(State.CHECKPOINTING, f"checkpoint at step {step}, retried after a rebuild")
        raise TrainingFailed(f"checkpoint at step {step}: members were lost during three attempts")

    def _settle_save(self, wait: bool) -> None:
        """The background save in flight, if any: committed (manifest last) once every writer's
        file is durable; with ``wait``, block until then, watching the writers. Abandoned,
        never committed, when a writer left the group, died or failed to write: its files stay
        an invisible partial directory and the newest committed checkpoint stays the newest."""
        pending = self._pending_save
        if pending is None:
            return
        members = {w.slot for w in self.group.workers}
        gone = [w.slot for w, _ in pending.writers if w.slot not in members]
        if gone:
            self._abandon_save(f"worker(s) {gone} left the group while writing it")
            return
        try:
            if wait:
                results = [watch(self.group, w, ref, f"the background checkpoint of step {pending.step}")
                           for w, ref in pending.writers]
            else:
                results = self.checkpoints.written(pending)
                if results is None:
                    return
        except (WorkerLost, ray.exceptions.RayError) as exc:
            user = find_user_error(exc)
            self._abandon_save(str(user) if user is not None else
                               exc.reason if isinstance(exc, WorkerLost) else type(exc).__name__)
            return
        self._pending_save = None
        timing = {"stall_s": round(pending.stall_s, 4),
                  "durable_after_s": round(time.perf_counter() - pending.started_at, 4),
                  "write_s": round(max((r["write_s"] for r in results), default=0.0), 4),
                  "snapshot_bytes_per_rank": pending.snapshot_bytes_per_rank}
        try:
            info = self.checkpoints.commit(pending.step, [f for r in results for f in r["files"]],
                                           pending.data_cursor, pending.world_size, timing)
        except Exception as exc:
            user = find_user_error(exc)
            if user is None or not isinstance(user, (StorageError, CheckpointError)):
                raise
            self._transition(self.state, f"background checkpoint of step {pending.step} not committed: {user}")
            return
        self._transition(self.state, f"checkpoint committed: {info.uri} (written in the background, "
                         f"durable {timing['durable_after_s']:.1f} s after its snapshot)")

    def _abandon_save(self, why: str) -> None:
        """Give the background save in flight up: it never gets a manifest."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        self._transition(self.state, f"background checkpoint of step {pending.step} abandoned ({why}); "
                         f"the newest checkpoint stays {self.summary.newest_checkpoint or 'none'}")

    # ------------------------------------------------------------------ end
    def _result(self) -> RunResult:
        s = self.summary
        return RunResult(s.status, self.run_dir, self.committed_step, list(s.losses), s.mlflow_run_id,
                         s.newest_checkpoint, s.path, s.reason)

    def _teardown(self) -> None:
        self.summary.finished_at = time.time()
        if self.steps is not None:
            self.steps.record_cost()  # the workers are held until the group's shutdown below: near enough
        self.metrics.flush()
        if self._warm is not None:
            # A run that failed while the workers started: the warm-up read may still hold (or
            # be about to take) object references. Closed under it, the plane would get them
            # back, and Ray aborts a process (exit 1) whose references outlive its shutdown.
            self._warm.join(timeout=30.0)
        if self.data is not None:
            self.data.close()
        if self.group is not None:
            self.group.shutdown()
        if self.tracker is not None:
            status = {State.FINISHED: "FINISHED", State.STOPPED: "KILLED",
                      State.CANCELLED: "KILLED"}.get(self.state, "FAILED")
            try:
                self.tracker.log_plots(self.summary.snapshot())
                self.tracker.finish(status)
            except Exception as exc:
                log.warning("could not close the MLflow run: %s", exc)
        self.summary.write()
        if self._local_cluster:
            ray.shutdown()


class _Phases:
    """The start's phases for ``RunSummary.start_phases``: each call records the seconds since
    the previous one under its name; ``add`` records phases timed elsewhere (which the next
    call's interval then leaves out); ``end`` adds the total."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self.t0 = self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self.last, 3)
        self.last = now

    def add(self, timed: dict[str, float]) -> None:
        for name, seconds in timed.items():
            self.phases[name] = round(seconds, 3)
        self.last += sum(timed.values())

    def end(self) -> None:
        self.phases["total"] = round(time.perf_counter() - self.t0, 3)


def run_job(spec: JobSpec, *, on_step: Callable[[StepReport], None] | None = None,
            requests: RunRequests | None = None) -> RunResult:
    """Run a job to completion on the cluster the spec names (or a local one); ``requests``
    lets another thread pause, cancel or resize it."""
    return Supervisor(spec, on_step=on_step, requests=requests).run()


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
                      spares: SpareSource | None = None, team: str = "-") -> Supervisor:
    """The Supervisor that ``resume_job`` runs, not yet started: for a caller that reads its
    state while it runs (the job service's runner). The run's record is read by
    ``launch.resumed_run``; raises ``CheckpointError`` when the run has no complete checkpoint."""
    found = launch.resumed_run(run_id, tracking_uri, overrides, output_dir, objects)
    sup = Supervisor(found.spec, resume_run_id=run_id, run_dir=found.run_dir, previous_run_key=found.previous_key,
                     on_step=on_step, requests=requests, spares=spares, team=team)
    launch.check_resumable(found.spec, sup.checkpoint_root, run_id)
    return sup
