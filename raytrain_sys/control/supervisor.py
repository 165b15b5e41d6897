"""The Supervisor: the driver-side owner of a run.

It owns membership (the worker group), the committed-step counter, the data cursor and the MLflow
run. It drives steps, counts a step as committed when every rank reported it, commits
checkpoints (workers write data, the Supervisor writes the manifest last), and records every
state transition with its reason. It never touches tensors.

States: starting -> running <-> checkpointing -> finished | stopped | failed, with restoring
between starting and running when a run resumes from a checkpoint. From running, at a failed
step: rebuilding (survivors re-form the group in place; waiting while below
elastic.min_workers; restoring only when no replica holds the state); at a step boundary:
resizing (newcomers join) and draining (members leave nodes marked for preemption). Every
transition is logged with its reason, in summary.json and as an MLflow event.

Run-ahead: while step k runs, step k+1 is already sent (``_may_run_ahead``) unless the
boundary between them has work to do; the members start it as they finish step k, so the
driver's dispatch and commit are off the critical path. A step k that fails voids step k+1:
its members refuse it or fail in its first collective, and ``_settle`` waits for that before
the rebuild. Nothing is committed out of order: step k+1 is collected only after k committed.

Failure detection (``_collect``): Ray reports a dead actor; survivors' collectives fail when a
peer's socket closes; members still in a step are pinged every LIVENESS_EVERY_S and lost when
silent for PING_TIMEOUT_S (a stopped process, a vanished machine that closes no socket); a
step that outlives its deadline (a multiple of recent step times, elastic.hang_floor_s at
least) is hung even when its members answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import ray

from raytrain_sys import __version__
from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.control.run_record import SAMPLE_LOG_FILE, RunSummary, git_commit
from raytrain_sys.control.worker import RENDEZVOUS_TIMEOUT_S
from raytrain_sys.control.worker_group import Worker, WorkerGroup, clean_up_leftovers, connect_ray
from raytrain_sys.data.order import deal
from raytrain_sys.parallel.mesh import is_data_leader_rank, rank_data_slices
from raytrain_sys.data.batches import GlobalBatch
from raytrain_sys.data.compat import check_spec_against_manifest
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.data.shards import read_manifest
from raytrain_sys.errors import (CheckpointError, DataError, SpecError, StorageError, TrainingFailed,
                                 UserError, find_user_error)
from raytrain_sys.spec import JobSpec, from_dict
from raytrain_sys.tracking import mlflow_tracker as mt
from raytrain_sys.train.tasks import task_for

log = logging.getLogger(__name__)

# Test hook: crash the driver after a checkpoint's data files are written and before its
# manifest, at this step. Used to prove that a half-written checkpoint stays invisible.
FAULT_BEFORE_MANIFEST_ENV = "RAYTRAIN_SYS_FAULT_BEFORE_MANIFEST_STEP"


class State(str, Enum):
    STARTING = "starting"
    RESTORING = "restoring"  # loading a durable checkpoint
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    REBUILDING = "rebuilding"  # a member was lost: survivors re-form the group in place
    RESIZING = "resizing"  # newcomers join at a step boundary
    DRAINING = "draining"  # members on a node marked for preemption leave at a step boundary
    WAITING = "waiting"  # below elastic.min_workers, waiting for workers
    STOPPED = "stopped"  # paused by train.stop_at_step, resumable
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class StepReport:
    step: int  # committed steps so far (1-based index of the step just committed)
    max_steps: int
    loss: float
    lr: float
    tokens_per_s: float
    step_time_s: float
    world_size: int
    eta_s: float


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


@dataclass
class StepOutcome:
    """How one step went on each member, keyed by worker slot."""

    results: dict[int, dict] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)  # dead, hung or unreachable: removed
    errored: dict[int, str] = field(default_factory=dict)  # alive; its collective failed
    blocked: dict[int, str] = field(default_factory=dict)
    failed: bool = False
    detected_at_unix_s: float = 0.0  # when the first failure of the step was seen

    def note_failures(self) -> None:
        self.failed = bool(self.lost or self.errored)
        if self.failed and not self.detected_at_unix_s:
            self.detected_at_unix_s = time.time()


@dataclass
class _Dispatch:
    """A step sent to the members: what its commit (or its redo after a failure) needs."""

    step: int
    members: list[Worker]
    refs: list
    batch: GlobalBatch  # references, sample ids and loss units; never the rows
    ids: object
    shares: list[slice]
    units: int
    deadline_s: float
    t0: float  # when the members could start it (perf_counter)
    data_wait: float
    sent_ahead: bool  # sent while the step before it ran


class WorkerLost(Exception):
    """A member died or stopped answering during a call outside the step."""

    def __init__(self, worker: "Worker", reason: str):
        super().__init__(reason)
        self.worker, self.reason = worker, reason


# A worker that does not answer a ping on its control path within this long is lost (stopped,
# or its node vanished). The control path runs in its own thread, so a busy step does not delay
# the answer; the margin is for a loaded machine.
PING_TIMEOUT_S = 3.0
# Members still in a step after this long are pinged this often (see Supervisor._collect).
LIVENESS_EVERY_S = 1.0
# A draining node's last members keep training while successors start elsewhere, until this
# long before the drain's deadline; then the state goes through a checkpoint instead (a spot
# notice gives 120 s; a checkpoint of a small model takes well under a second).
DRAIN_HANDOVER_MARGIN_S = 20.0


class _MembersLost(Exception):
    """Members found dead or silent while the group re-forms."""

    def __init__(self, dead: list["Worker"], silent: list["Worker"]):
        super().__init__(", ".join([f"worker {w.slot} died" for w in dead]
                                   + [f"worker {w.slot} silent" for w in silent]) or "no answer")
        self.dead, self.silent = dead, silent


def _collective_timeout_s(step_deadline_s: float) -> float:
    """The timeout of the workers' collectives during a step: just past the moment the
    Supervisor acts on a hung or silent member. A peer whose machine vanished closes no socket;
    without this, the survivors would wait in their all-reduce for the timeout the group was
    formed with (minutes) and be given up as lost too, leaving only the checkpoint."""
    return step_deadline_s + LIVENESS_EVERY_S + PING_TIMEOUT_S


def _ping_all(workers: list[Worker]) -> tuple[dict[int, int], list[Worker], list[Worker]]:
    """Ping every worker at once: ({slot: committed steps held} of those that answered, the
    workers Ray reports dead, the workers that did not answer within PING_TIMEOUT_S)."""
    if not workers:
        return {}, [], []
    refs = {w.slot: w.actor.ping.remote() for w in workers}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PING_TIMEOUT_S)
    held, dead, silent = {}, [], []
    for w in workers:
        if refs[w.slot] not in ready:
            silent.append(w)
            continue
        try:
            held[w.slot] = ray.get(refs[w.slot])
        except ray.exceptions.RayError:
            dead.append(w)
    return held, dead, silent


def _resolve_dir(path: str) -> str:
    return path if path.startswith("s3://") else os.path.abspath(path)


class Supervisor:
    def __init__(self, spec: JobSpec, *, resume_run_id: str = "", run_dir: str = "",
                 previous_run_key: str = "", on_step: Callable[[StepReport], None] | None = None):
        self.spec = spec
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
        self.checkpoint_root = _resolve_dir(spec.checkpoint.uri or os.path.join(self.run_dir, "checkpoints"))
        self.summary = RunSummary(job=spec.name, run_dir=self.run_dir)
        self.tracker = None
        self.group: WorkerGroup | None = None
        self.data: DataPlane | None = None
        self.committed_step = 0
        self.data_cursor = 0
        self._local_cluster = False
        self._last_drain_poll = 0.0
        self._resend: dict[int, _Dispatch] = {}  # steps sent before a failure, by step
        self._handover_waits: set[str] = set()  # draining nodes whose members await successors
        self._step_times: deque[float] = deque(maxlen=50)
        self.layout_replicated = True  # set when a process group forms (see _form_group)
        self._departing_pieces: list = []  # state of members leaving a draining node

    # ------------------------------------------------------------------ bookkeeping
    def _transition(self, state: State, reason: str, detected_at_unix_s: float = 0.0) -> None:
        """Record a state change; ``detected_at_unix_s``: when the failure that caused it was
        seen, if earlier (the rebuild decision waits for the rest of the step's members)."""
        log.info("supervisor: %s -> %s (%s)", self.state.value, state.value, reason)
        self.state = state
        self.summary.status = state.value
        record = {"time": time.time(), "state": state.value, "reason": reason,
                  "step": self.committed_step}
        if detected_at_unix_s:
            record["detected_at"] = detected_at_unix_s
        self.summary.transitions.append(record)
        if self.tracker is not None:
            try:
                self.tracker.log_event(self.committed_step, state.value, reason)
            except Exception as exc:
                log.warning("could not record transition in MLflow: %s", exc)
        self.summary.write()

    # ------------------------------------------------------------------ pre-flight
    def _preflight(self) -> CheckpointInfo | None:
        """Everything that can fail on bad input, checked before any Ray resource is taken."""
        spec = self.spec
        os.makedirs(self.run_dir, exist_ok=True)
        _point_latest(self.output_dir, self.run_dir)
        self.manifest = read_manifest(spec.data.path, spec.data.s3_endpoint_url)
        check_spec_against_manifest(spec, self.manifest)
        self.store = open_store(self.checkpoint_root, spec.checkpoint.s3_endpoint_url)
        self.store.check_access()
        self.checkpointer = Checkpointer(self.store, spec.checkpoint.keep_last)
        self.task = task_for(spec.model.name)
        from raytrain_sys.models import model_flops_per_token

        self._flops_per_token = model_flops_per_token(spec.model) if spec.model.name == "gpt" else 0
        if spec.tracking.enabled:
            mt.check_reachable(self.tracking_uri)
        resume = spec.checkpoint.resume_from
        if not resume:
            return None
        if resume == "latest":
            info = self.checkpointer.latest()
            if info is None:
                log.info("checkpoint.resume_from=latest: no complete checkpoint in %s, starting fresh",
                         self.checkpoint_root)
            return info
        from raytrain_sys.checkpoint.checkpointer import open_checkpoint
        _, info = open_checkpoint(resume, spec.checkpoint.s3_endpoint_url)
        return info

    def _check_compatible(self, info: CheckpointInfo) -> None:
        meta = info.manifest
        if meta.get("training_hash") == self.spec.training_hash():
            return
        old = from_dict(meta["spec"]) if "spec" in meta else None
        diffs = []
        if old is not None:
            a, b = old.flat(), self.spec.flat()
            diffs = [k for k in a if k.split(".")[0] in ("model", "optim") and a[k] != b.get(k)]
            diffs += [k for k in ("data.seed", "data.shuffle_window", "data.shuffle_block_rows",
                                  "data.sequences", "train.global_batch_size", "train.precision",
                                  "train.seed") if a.get(k, b.get(k)) != b.get(k)]
        raise CheckpointError(
            f"checkpoint {info.uri} was written with different training settings "
            f"({', '.join(diffs) or 'training hash differs'}); resuming would not continue the same "
            f"run: restore those fields or start a new run")

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        spec = self.spec
        # First, before anything of the run is written: a resume must not touch the record of a
        # run whose earlier driver is still alive.
        removed = self._clean_up_previous_launch()
        try:
            resume_info = self._preflight()
            self.summary.spec_hash = spec.spec_hash()
            self.summary.training_hash = spec.training_hash()
            self.summary.git_commit = git_commit()
            self.summary.tracking_uri = self.tracking_uri
            if resume_info is not None:
                self._check_compatible(resume_info)
                previous = RunSummary.read(self.run_dir)
                if previous is not None:
                    previous.truncate_to(resume_info.step)
                    self.summary = previous
                    self.summary.reason = ""
            self.summary.write()

            self._local_cluster = connect_ray(spec)
            # Ray Data takes seconds to start its first stream: let it run while the workers
            # start, from the cursor the run continues at.
            self.data = DataPlane.for_job(
                spec, self.manifest, end_position=spec.train.max_steps * spec.train.global_batch_size,
                run_dir=self.run_dir, on_skip=lambda reason: self._transition(self.state, reason),
                task=self.task)
            warm = self._warm_data(int(resume_info.manifest["data_cursor"]) if resume_info else 0)
            if removed:
                self._transition(State.STARTING, f"removed {len(removed)} actors/placement groups "
                                 f"left by the lost driver of run {self.previous_run_key}")
            store = mt.prepare_store(self.tracking_uri) if spec.tracking.enabled else None
            self.group = WorkerGroup(spec, self._local_cluster, run_key=self.run_key)
            self.group.start(spec.resources.num_workers)
            if store is not None:
                store.join()
            self._start_tracking()
            self._transition(State.STARTING, f"{self.group.world_size} workers placed")
            self._form_group()
            if resume_info is not None:
                self._restore(resume_info)
            if warm is not None:
                warm.join()
                self.data.wait_s = 0.0  # spent while the workers started, not waited for by them
            self._transition(State.RUNNING, f"training from step {self.committed_step}")
            self._loop()
            saved = [c["step"] for c in self.summary.checkpoints]
            if spec.checkpoint.save_on_exit and self.committed_step not in saved:
                self._checkpoint(final=True)
            if self.committed_step < spec.train.max_steps:
                self._transition(State.STOPPED, f"paused at train.stop_at_step={spec.train.stop_at_step}")
            else:
                self._transition(State.FINISHED, f"reached train.max_steps={spec.train.max_steps}")
            return self._result()
        except BaseException as exc:
            user = find_user_error(exc) if not isinstance(exc, KeyboardInterrupt) else None
            reason = str(user) if user is not None else (
                "interrupted by the user" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}")
            self.summary.reason = reason
            if self.state is not State.FAILED:
                self._transition(State.FAILED, reason)
            if user is not None:
                raise user from None
            raise
        finally:
            self._teardown()

    def _warm_data(self, cursor: int):
        """Read the first global batch in the background (the plane caches it). Only where a
        read has no side effect: with data.on_bad_shard=skip a bad shard changes the stream's
        ledger, which belongs to the step loop. An error here is met again, and reported, by
        the step that needs the batch."""
        if self.spec.data.on_bad_shard != "fail":
            return None

        def read() -> None:
            try:
                self.data.global_batch_refs(cursor)
            except Exception as exc:
                log.debug("data warm-up: %s (the first step will report it)", exc)

        thread = threading.Thread(target=read, name="data-warm-up", daemon=True)
        thread.start()
        return thread

    def _clean_up_previous_launch(self) -> list:
        """A resumed run first removes whatever its lost driver left on the cluster, and refuses
        to start while that driver is still alive (see ``clean_up_leftovers``)."""
        if not self.previous_run_key:
            return []
        if not (ray.is_initialized() or self.spec.resources.ray_address or os.environ.get("RAY_ADDRESS")):
            # A local cluster started now holds nothing of an earlier driver; the one that
            # driver started ended with it.
            return []
        connect_ray(self.spec)
        try:
            return clean_up_leftovers(self.previous_run_key)
        except UserError:
            raise
        except Exception as exc:  # cannot read the cluster's tables: Ray's own clean-up remains
            log.warning("could not look for leftovers of run %s: %s", self.previous_run_key, exc)
            return []

    def _start_tracking(self) -> None:
        spec = self.spec
        if not spec.tracking.enabled:
            return
        tags = {mt.TAG_GIT_COMMIT: self.summary.git_commit, mt.TAG_RUN_DIR: self.run_dir,
                mt.TAG_CHECKPOINT_ROOT: self.checkpoint_root}
        if self.resume_run_id:
            self.tracker = mt.Tracker.resume(self.tracking_uri, self.resume_run_id, spec)
            self.tracker.set_tags(tags)
        else:
            run_name = spec.tracking.run_name or os.path.basename(self.run_dir)
            self.tracker = mt.Tracker.start(
                self.tracking_uri, spec.tracking.experiment, run_name, spec, tags,
                artifact_root=os.path.join(self.output_dir, "mlartifacts"))
        self.summary.mlflow_run_id = self.tracker.run_id

    def _restore(self, info: CheckpointInfo) -> None:
        """Load a durable checkpoint into every member: the fallback when no replica holds state."""
        self._transition(State.RESTORING, f"loading checkpoint {info.uri}")
        steps = ray.get([a.load_checkpoint.remote(info.uri, self.spec.checkpoint.s3_endpoint_url)
                         for a in self.group.actors()])
        assert len(set(steps)) == 1 and steps[0] == info.step, f"replicas disagree: {steps}"
        redone = self.committed_step - info.step
        if redone > 0:
            log.warning("restored step %d: %d committed steps will be redone", info.step, redone)
            self.summary.steps_redone += redone
        self.committed_step = info.step
        self.data_cursor = int(info.manifest["data_cursor"])
        # A resume into a new run dir has no record of earlier steps: keep "index i = step i+1".
        self.summary.truncate_to(info.step)
        missing = info.step - len(self.summary.losses)
        self.summary.losses += [None] * missing
        self.summary.world_sizes += [None] * missing
        self.summary.resumed_from.append(info.uri)
        self.summary.newest_checkpoint = info.uri

    # ------------------------------------------------------------------ the step loop
    def _loop(self) -> None:
        spec = self.spec
        last = spec.train.max_steps
        if spec.train.stop_at_step:
            last = min(last, spec.train.stop_at_step)
        self._sample_log = (open(os.path.join(self.run_dir, SAMPLE_LOG_FILE), "a")
                            if spec.data.log_sample_ids else None)
        self._step_times: deque[float] = deque(maxlen=50)
        self._run_t0 = time.perf_counter()
        self._fetch_wait_s = 0.0
        ahead: _Dispatch | None = None
        try:
            while self.committed_step < last:
                if ahead is None:
                    self._at_step_boundary()
                    cur = self._dispatch(self.committed_step)
                else:
                    cur, ahead = ahead, None
                if self._may_run_ahead(cur.step + 1, last):
                    try:
                        ahead = self._dispatch(cur.step + 1, after=cur)
                    except DataError:
                        pass  # raised again, in step order, when the step is sent in turn
                outcome = self._collect(cur.members, cur.refs, cur.step, cur.deadline_s)
                done_at = time.perf_counter()
                if ahead is not None:
                    ahead.t0 = done_at  # its members start it as they finish this one
                if outcome.failed:
                    # Sent again after the rebuild: their global batches are kept (a batch is
                    # a function of the cursor; the data plane may have dropped the window).
                    self._resend = {d.step: d for d in (cur, ahead) if d is not None}
                    if ahead is not None:
                        self._settle(ahead, outcome)
                        ahead = None
                    self._recover(cur, outcome, done_at - cur.t0)
                    continue
                # Committed: every rank finished its optimizer step.
                results = [outcome.results[w.slot] for w in cur.members]
                self.summary.steps_run_ahead += cur.sent_ahead
                self._commit(cur.step, results, cur.units, cur.ids, cur.shares, done_at - cur.t0,
                             cur.data_wait)
                every = spec.checkpoint.every_steps
                if every and self.committed_step % every == 0 and self.committed_step < last:
                    self._checkpoint(final=False)
        finally:
            if self._sample_log is not None:
                self._sample_log.close()

    def _dispatch(self, step: int, after: "_Dispatch | None" = None) -> "_Dispatch":
        """Send step ``step`` to every member: where its rows of the step's global batch lie
        (object references and row ranges; the driver never holds the rows).

        ``after``: the step still running before this one (run-ahead); the members queue this
        one behind it and start it as they finish that one, with no round trip to the driver.
        """
        spec = self.spec
        wait0 = self.data.wait_s
        kept = self._resend.pop(step, None)
        self._resend = {k: d for k, d in self._resend.items() if k > step}
        members = list(self.group.workers)
        # Each rank's rows: its data-parallel slice (TP/PP peers share one).
        shares = rank_data_slices(spec.parallel, len(members), spec.train.global_batch_size)
        # Pieces read from now on line up with these shares (a rank then fetches its own rows only).
        self.data.share_rows = max(sl.stop - sl.start for sl in shares)
        if kept is not None:
            batch = kept.batch
        else:
            cursor = self.data_cursor + (spec.train.global_batch_size if after is not None else 0)
            batch = self.data.global_batch_refs(cursor)
        if spec.data.delivery == "driver":  # every row through this process: to measure against
            rows, _ = self.data.rows(batch.start, batch.start + spec.train.global_batch_size)
            args = [{k: v[sl] for k, v in rows.items()} for sl in shares]
        else:  # references and row ranges: each rank fetches its rows where they lie
            args = [batch.share(sl) for sl in shares]
        deadline_s = self._step_deadline_s()
        refs = [w.actor.train_step.remote(step, arg, batch.units, _collective_timeout_s(deadline_s))
                for w, arg in zip(members, args)]
        return _Dispatch(step, members, refs, batch, batch.ids, shares, batch.units, deadline_s,
                         time.perf_counter(), self.data.wait_s - wait0, after is not None)

    def _may_run_ahead(self, step: int, last: int) -> bool:
        """Whether step ``step`` may be sent before the one before it is committed: only when
        the boundary between them has nothing to do (no checkpoint due, no draining member, no
        newcomer to take in), so that sending it early changes nothing but the time."""
        spec = self.spec
        if not spec.train.run_ahead or step >= last:
            return False
        every = spec.checkpoint.every_steps
        if every and step % every == 0:
            return False
        if len(self.group.workers) < self._target_size():
            return False  # a boundary may take newcomers in
        now = time.monotonic()
        if now - self._last_drain_poll >= spec.elastic.drain_poll_s:
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

    def _settle(self, ahead: "_Dispatch", outcome: "StepOutcome") -> None:
        """After a failed step: wait for the step sent ahead of it to end on every member still
        in the group. A member whose step failed refuses the next one at once (it holds the
        wrong step); one whose step finished runs into its peers' failure in the next step's
        first collective. Its result is dropped: it was never committed, and the rebuild starts
        from the state the members hold. A member still in it past the collective timeout is lost.
        """
        in_group = {w.slot for w in self.group.workers}
        by_ref = {r: w for r, w in zip(ahead.refs, ahead.members)
                  if w.slot in in_group and w.slot not in outcome.lost}
        if not by_ref:
            return
        _, late = ray.wait(list(by_ref), num_returns=len(by_ref),
                           timeout=_collective_timeout_s(ahead.deadline_s) + PING_TIMEOUT_S)
        if late:
            stuck = [by_ref[r] for r in late]
            log.warning("worker(s) %s still in step %d after step %d failed: treated as lost",
                        ", ".join(str(w.slot) for w in stuck), ahead.step + 1, ahead.step)
            for w in stuck:
                outcome.lost[w.slot] = f"blocked in step {ahead.step + 1} after step {ahead.step} failed"
            self.group.reap(stuck)
            self.group.remove(stuck)

    def _commit(self, step: int, results: list[dict], units: int, ids, shares: list[slice],
                dt: float, data_wait: float, world_size: int | None = None) -> None:
        spec = self.spec
        world = world_size or len(shares)
        self.committed_step = step + 1
        self.data_cursor += spec.train.global_batch_size
        self._step_times.append(dt)
        # The step waited for its rows twice over: the driver for the reads' metadata, and the
        # slowest rank for its fetch from the object store.
        fetch_wait = max((r.get("fetch_s", 0.0) for r in results), default=0.0)
        self._fetch_wait_s += fetch_wait
        data_wait += fetch_wait
        loss = sum(r["loss_sum"] for r in results) / units if units else float("nan")
        self.summary.losses.append(loss)
        self.summary.world_sizes.append(world)
        self.summary.committed_steps = self.committed_step
        self.summary.samples_consumed = self.data_cursor
        self.summary.data_cursor = self.data_cursor
        if self._sample_log is not None:
            self._sample_log.write(_sample_line(self.committed_step, ids, shares))
            self._sample_log.flush()
        # Trained tokens: the targets the loss counted (padding of packed or bucketed rows and
        # document boundaries excluded; one image counts one for a classifier).
        tokens_per_step = units
        steady = list(self._step_times)[min(3, len(self._step_times) - 1):]
        mean_dt = sum(steady) / len(steady)
        metrics = {"loss": loss, "lr": results[0]["lr"], "grad_norm": results[0]["grad_norm"],
                   "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                   "data_wait_s": data_wait, "world_size": float(world)}
        if self._flops_per_token:
            # Model FLOPs utilization (PaLM, appendix B): achieved model FLOP/s over the peak of
            # the devices used; recomputation (activation checkpointing) does not count.
            achieved = tokens_per_step / dt * self._flops_per_token
            metrics["model_tflops_per_s"] = achieved / 1e12
            peak = spec.resources.peak_tflops_per_worker
            if peak:
                metrics["mfu"] = achieved / (world * peak * 1e12)
        if self.tracker is not None:  # queued: the step loop never waits on MLflow
            self.tracker.log_metrics(self.committed_step, metrics)
        if self.on_step is not None:
            remaining = spec.train.max_steps - self.committed_step
            self.on_step(StepReport(self.committed_step, spec.train.max_steps, loss, results[0]["lr"],
                                    tokens_per_step / mean_dt, dt, world, remaining * mean_dt))
        if self.committed_step % spec.train.log_every_steps == 0:
            self.summary.throughput = {
                "tokens_per_s": tokens_per_step / mean_dt, "step_time_s": mean_dt,
                "data_wait_fraction": (self.data.wait_s + self._fetch_wait_s)
                / max(time.perf_counter() - self._run_t0, 1e-9)}
            self.summary.write()

    # ------------------------------------------------------------------ failure detection
    def _step_deadline_s(self) -> float:
        """A step slower than this is hung: a multiple of recent step times, with a floor."""
        e = self.spec.elastic
        if len(self._step_times) < 3:  # first steps include warm-up: use the generous limit
            return self.spec.train.step_timeout_s
        times = sorted(self._step_times)
        return min(self.spec.train.step_timeout_s, max(e.hang_floor_s, e.hang_factor * times[len(times) // 2]))

    def _collect(self, members: list[Worker], refs: list, step: int,
                 deadline_s: float | None = None) -> "StepOutcome":
        """Wait for a step on every member; classify each as done, errored or lost.

        Lost = dead (Ray reports the actor died), or not answering a ping on its control path
        (a stopped process or a vanished node). Members still in the step after LIVENESS_EVERY_S
        are pinged every LIVENESS_EVERY_S; one silent for PING_TIMEOUT_S is lost at once, long
        before the step deadline (a vanished machine closes no socket: without this its peers
        would wait in their all-reduce until the deadline). The deadline itself catches members
        that answer but do not progress. Survivors whose collective failed because a peer
        vanished report an error quickly; a peer blocked in a collective still answers pings.
        """
        outcome = StepOutcome()
        by_ref = dict(zip(refs, members))
        pending = list(refs)
        if deadline_s is None:
            deadline_s = self._step_deadline_s()
        t_start = time.monotonic()
        deadline = t_start + deadline_s
        pings: dict[int, tuple[object, float]] = {}  # slot -> (ping ref, sent at)
        while pending:
            # Once something failed, the rest finish (or fail) fast: their collective broke.
            now = time.monotonic()
            limit = deadline if not outcome.failed else min(deadline, now + 2.0)
            if now >= limit:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(limit - now, LIVENESS_EVERY_S))
            for ref in ready:
                w = by_ref[ref]
                try:
                    outcome.results[w.slot] = ray.get(ref)
                except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError,
                        ray.exceptions.RayActorError) as exc:
                    outcome.lost[w.slot] = f"died ({type(exc).__name__})"
                except ray.exceptions.RayTaskError as exc:
                    outcome.errored[w.slot] = str(exc).strip().splitlines()[-1][:300]
                outcome.note_failures()
            if pending and time.monotonic() - t_start >= LIVENESS_EVERY_S:
                silent = self._check_liveness([by_ref[r] for r in pending], pings)
                for w in silent:
                    outcome.lost[w.slot] = (f"hung: no answer on its control path for "
                                            f"{PING_TIMEOUT_S:g} s (stopped, or its node is unreachable)")
                if silent:
                    outcome.note_failures()
                    break
        if pending:
            stuck = [by_ref[r] for r in pending if by_ref[r].slot not in outcome.lost]
            # A liveness ping still in flight counts from when it was sent: a worker silent
            # since before the deadline is not given a fresh PING_TIMEOUT_S.
            now = time.monotonic()
            answers, wait_until = {}, now
            for w in stuck:
                ref, sent = pings.get(w.slot, (None, 0.0))
                if ref is None or ray.wait([ref], timeout=0)[0]:
                    ref, sent = w.actor.ping.remote(), now
                answers[w.slot] = ref
                wait_until = max(wait_until, sent + PING_TIMEOUT_S)
            done, _ = ray.wait(list(answers.values()), num_returns=len(answers),
                               timeout=max(0.0, wait_until - time.monotonic()))
            for w in stuck:
                if answers[w.slot] in done:
                    try:
                        ray.get(answers[w.slot])
                        outcome.blocked[w.slot] = "alive but blocked in the step"
                        continue
                    except ray.exceptions.RayError:
                        pass
                outcome.lost[w.slot] = (f"hung: no answer within the {deadline_s:.1f} s step deadline"
                                        if not outcome.lost and not outcome.errored
                                        else "unreachable (node lost?)")
            outcome.note_failures()
            stuck = [by_ref[r] for r in pending]
            # Kill what is lost so that blocked peers' collectives fail, then wait for them.
            silent = [w for w in stuck if w.slot in outcome.lost]
            self.group.reap(silent)
            self.group.remove(silent)
            still = [r for r in pending if by_ref[r].slot in outcome.blocked]
            if still:
                # Their collective fails as soon as the lost members' sockets close, or at the
                # latest at its timeout (a vanished machine closes none).
                done, late = ray.wait(still, num_returns=len(still),
                                      timeout=max(30.0, _collective_timeout_s(deadline_s) + PING_TIMEOUT_S))
                for ref in done:
                    w = by_ref[ref]
                    outcome.blocked.pop(w.slot)
                    try:
                        outcome.results[w.slot] = ray.get(ref)
                    except ray.exceptions.RayActorError:
                        outcome.lost[w.slot] = "died"
                    except ray.exceptions.RayTaskError as exc:
                        outcome.errored[w.slot] = str(exc).strip().splitlines()[-1][:300]
                for ref in late:
                    outcome.lost[by_ref[ref].slot] = "blocked in a collective after its peers were lost"
                outcome.blocked.clear()
        outcome.note_failures()
        return outcome

    @staticmethod
    def _check_liveness(workers: list[Worker], pings: dict[int, tuple[object, float]]) -> list[Worker]:
        """Ping each worker (one ping in flight per worker); return those silent too long."""
        now = time.monotonic()
        silent = []
        for w in workers:
            ref, sent = pings.get(w.slot, (None, 0.0))
            if ref is not None:
                answered, _ = ray.wait([ref], timeout=0)
                if not answered:
                    if now - sent >= PING_TIMEOUT_S:
                        silent.append(w)
                    continue
                # Answered (or raised: then the step's own result reports the death).
            if now - sent >= LIVENESS_EVERY_S:
                pings[w.slot] = (w.actor.ping.remote(), now)
        return silent

    # ------------------------------------------------------------------ recovery
    def _count_failure(self, reason: str) -> None:
        e = self.spec.elastic
        now = time.time()
        self._failures = [t for t in getattr(self, "_failures", []) if now - t < e.failure_window_s]
        self._failures.append(now)
        self.summary.failures += 1
        if len(self._failures) > e.max_failures:
            self._fail_with_checkpoint(
                f"{len(self._failures)} membership failures within elastic.failure_window_s="
                f"{e.failure_window_s:g} s (elastic.max_failures={e.max_failures}); last: {reason}")

    def _recover(self, sent: _Dispatch, outcome: "StepOutcome", step_time_s: float) -> None:
        """Rebuild in place after a failed step: survivors keep their state; nothing committed is lost.

        ``sent.members`` and ``sent.shares`` are the step's, rank by rank (``_collect`` may
        already have removed hung members from the group)."""
        step, members, batch, shares = sent.step, sent.members, sent.batch, sent.shares
        lost = [w for w in members if w.slot in outcome.lost]
        reason = "; ".join([f"worker {w.slot} on node {w.node_id[:8]} {outcome.lost[w.slot]}" for w in lost]
                           + [f"worker {s} error: {m}" for s, m in outcome.errored.items()])

        def commit_if_finished(held: dict[int, int]) -> None:
            # Did the step finish on some replica? Then its update is complete and correct (every
            # rank's gradient went into the all-reduce): commit it instead of redoing it.
            if max(held.values()) == step + 1:
                degrees = self.spec.parallel.degrees(len(members))
                done = [i for i, w in enumerate(members) if w.slot in outcome.results
                        and is_data_leader_rank(degrees, i)]  # the ranks whose loss counts
                units = sum(int(batch.row_units[shares[i]].sum()) for i in done)
                results = [outcome.results[members[i].slot] for i in done]
                self._commit(step, results, units, sent.ids, shares, step_time_s, sent.data_wait,
                             world_size=len(members))
                log.info("step %d had finished on a survivor: committed, not redone", step + 1)

        self._rebuild_without(lost, f"step {step + 1} failed: {reason}", commit_if_finished,
                              detected_at_unix_s=outcome.detected_at_unix_s)

    def _rebuild_without(self, lost: list[Worker], reason: str,
                         before_reform: Callable[[dict[int, int]], None] | None = None,
                         detected_at_unix_s: float = 0.0) -> None:
        """Drop ``lost`` members and re-form the group from the survivor holding the newest step;
        with no survivor, fall back to the newest durable checkpoint."""
        self._transition(State.REBUILDING, reason, detected_at_unix_s)
        self.group.remove(lost)
        held = self._survivors_held()
        if held and before_reform is not None:
            before_reform(held)
        # After the commit of a step that had finished: should the budget stop the run, the
        # state it saves is the newest one.
        self._count_failure(reason)
        if not self.group.workers:
            self._restore_all_lost()
            return
        self._reform(source_slot=max(held, key=held.get))

    def _survivors_held(self) -> dict[int, int]:
        """Steps held by the members; members that died or stopped answering meanwhile (a
        second fault during the first one's recovery) are removed as well."""
        held, dead, silent = _ping_all(self.group.workers)
        if dead or silent:
            log.warning("lost during the rebuild: %s",
                        ", ".join(f"worker {w.slot}" for w in dead + silent))
            self.group.reap(silent)
            self.group.remove(dead + silent)
        return held

    def _watch(self, worker: Worker, ref, what: str, ping_every_s: float = LIVENESS_EVERY_S):
        """The result of ``ref`` (a call on ``worker``), waiting as long as the worker stays
        responsive: a call that may rightly take long (a checkpoint of a big model) gets no
        deadline, but a worker that stops answering its control path is lost (SIGSTOP, a vanished
        node)."""
        while True:
            ready, _ = ray.wait([ref], timeout=ping_every_s)
            if ready:
                try:
                    return ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise WorkerLost(worker, f"died during {what} ({type(exc).__name__})") from None
            _, dead, silent = _ping_all([worker])
            if dead:
                raise WorkerLost(worker, f"died during {what}")
            if silent:
                self.group.reap([worker])
                raise WorkerLost(worker, f"hung during {what}: no answer on its control path")

    def _target_size(self) -> int:
        return self.spec.elastic.max_workers or self.spec.resources.num_workers

    def _reform(self, source_slot: int | None = None, reason: str = "") -> None:
        """New process group over the members (+ ready newcomers); equalize state from a member
        that holds the committed step (``source_slot`` when it still can)."""
        for attempt in range(5):
            self._request_replacements()
            newcomers = self.group.ready_pending(timeout_s=0.0)
            self._wait_for_min_workers(extra=len(newcomers))
            newcomers += self.group.ready_pending(timeout_s=0.0)
            self.group.add(newcomers)
            members = list(self.group.workers)
            try:
                # Members known lost now (e.g. a node gone since the last step) would stall
                # the rendezvous until its timeout: leave them out from the start.
                held, dead, silent = _ping_all(members)
                if dead or silent:
                    raise _MembersLost(dead, silent)
                members = self._fit_to_layout(members, held)
                results = self._form_group(timeout_s=RENDEZVOUS_TIMEOUT_S + 30.0)
                held, dead, silent = _ping_all(members)
                if dead or silent:
                    raise _MembersLost(dead, silent)
                holders = [w.slot for w in members if held[w.slot] == self.committed_step]
                if not holders:
                    # Every replica of the committed step is gone (they died during this
                    # rebuild): only a durable checkpoint can continue the run.
                    self._restore_all_lost()
                    return
                if any(r["stashed"] for r in results) or not all(r["replicated"] for r in results):
                    if not self._share_state_as_pieces(members, held):
                        return  # restored from a checkpoint instead
                elif len(set(held.values())) > 1:
                    src_slot = source_slot if source_slot in holders else holders[0]
                    src = next(i for i, w in enumerate(members) if w.slot == src_slot)
                    ray.get([w.actor.sync_state.remote(src) for w in members], timeout=120)
                held, dead, silent = _ping_all(members)
                if dead or silent:
                    raise _MembersLost(dead, silent)
                assert set(held.values()) == {self.committed_step}, \
                    f"members hold {held} after the state sync, committed {self.committed_step}"
            except (_MembersLost, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if not isinstance(exc, _MembersLost):
                    exc = _MembersLost(*_ping_all(members)[1:])
                lost = exc.dead + exc.silent
                log.warning("rebuild attempt %d failed (%s); dropping %d lost workers", attempt + 1,
                            exc, len(lost))
                # Nobody lost (a timeout): retry with the same members; never drop a healthy
                # one, it may hold the only copy of the state.
                self.group.reap(exc.silent)
                self.group.remove(lost)
                if not self.group.workers:
                    self._restore_all_lost()
                    return
                continue
            self._transition(State.RUNNING, reason or f"rebuilt: world {len(members)}, generation "
                             f"{self.group.generation}, {len(newcomers)} newcomers")
            return
        self._fail_with_checkpoint("could not re-form the process group after 5 attempts")

    def _form_group(self, timeout_s: float = 120.0) -> list[dict]:
        results = self.group.form_process_group(timeout_s=timeout_s)
        # Whether every member holds a whole copy (plain DDP): then any one of them can save it.
        self.layout_replicated = all(r["replicated"] for r in results)
        return results

    def _fit_to_layout(self, members: list[Worker], held: dict[int, int]) -> list[Worker]:
        """The members the parallel degrees can use: the largest usable world, holders of the
        committed step first; the rest wait on standby for a larger world."""
        usable = self.spec.parallel.usable_world_size(len(members))
        if usable == len(members):
            return members
        if usable == 0:
            raise TrainingFailed(f"{len(members)} workers cannot hold one copy of the model with "
                                 f"parallel.tp x parallel.pp = {self.spec.parallel.tp * self.spec.parallel.pp}"
                                 f"; raise elastic.min_workers to at least that")
        ordered = sorted(members, key=lambda w: held.get(w.slot) != self.committed_step)
        extra = ordered[usable:]
        self.group.bench(extra)
        log.info("%d worker(s) on standby: parallel degrees need a world of %d, not %d",
                 len(extra), usable, len(members))
        return [w for w in self.group.workers]

    def _share_state_as_pieces(self, members: list[Worker], held: dict[int, int]) -> bool:
        """Members re-cut for a new layout take their blocks of the state the holders of the
        committed step hold (their pieces, passed through Ray's object store; the Supervisor
        never reads them). False when the holders do not cover the state, e.g. the only shard
        of some layer died: then the newest durable checkpoint is restored, resharded."""
        step = self.committed_step
        refs = [w.actor.state_pieces.remote() for w in members if held[w.slot] == step]
        refs += self._departing_pieces  # members that left a draining node just now
        missing = ray.get([w.actor.load_pieces.remote(refs, step) for w in members], timeout=300)
        del refs
        self._departing_pieces = []
        gaps = sorted({k for m in missing for k in m})
        if not gaps:
            return True
        info = self.checkpointer.latest()
        reason = (f"the surviving workers do not hold all of the state of step {step} (no copy "
                  f"of {', '.join(gaps[:2])}{' ...' if len(gaps) > 2 else ''})")
        if info is None:
            raise TrainingFailed(f"{reason} and no checkpoint exists in {self.checkpoint_root}; "
                                 f"set checkpoint.every_steps, or keep replicas (parallel.dp, hsdp)")
        self._transition(State.RESTORING, f"{reason}: restoring {info.uri}")
        self._restore(info)
        self._transition(State.RUNNING, f"restored from {info.uri}, resharded to world {len(members)}")
        return False

    def _request_replacements(self) -> None:
        """Replacements are requested at once; they start in the background."""
        self.group.drop_stale_pending(self.spec.resources.start_timeout_s)
        missing = self._target_size() - len(self.group.workers) - len(self.group.pending)
        for _ in range(max(0, missing)):
            self.group.request()

    def _wait_for_min_workers(self, extra: int = 0) -> None:
        e = self.spec.elastic
        # The parallel degrees set a floor of their own: tp x pp ranks hold one copy of the model.
        need = max(1, e.min_workers, self.spec.parallel.world_granularity())
        if len(self.group.workers) + extra >= need:
            return
        self._transition(State.WAITING, f"{len(self.group.workers) + extra} workers, below "
                         f"{need} (elastic.min_workers={e.min_workers}, parallel degrees): waiting "
                         f"up to {e.below_min_timeout_s:g} s")
        deadline = time.monotonic() + e.below_min_timeout_s
        while len(self.group.workers) + len(self.group.pending) and time.monotonic() < deadline:
            ready = self.group.ready_pending(timeout_s=1.0)
            self.group.add(ready)
            if len(self.group.workers) >= need:
                return
            self._request_replacements()
        self._fail_with_checkpoint(f"the group stayed below elastic.min_workers={e.min_workers} for "
                                   f"elastic.below_min_timeout_s={e.below_min_timeout_s:g} s")

    def _restore_all_lost(self) -> None:
        """No replica holds the state: new workers, newest durable checkpoint."""
        info = self.checkpointer.latest()
        if info is None:
            raise TrainingFailed(f"every worker was lost at step {self.committed_step} and no "
                                 f"checkpoint exists in {self.checkpoint_root}; set "
                                 f"checkpoint.every_steps to survive this")
        self._request_replacements()
        self._wait_for_min_workers()
        self.group.add(self.group.ready_pending(timeout_s=0.0))
        self._form_group(timeout_s=120.0)
        self._restore(info)
        self._transition(State.RUNNING, f"restored from {info.uri} after losing every worker")

    def _fail_with_checkpoint(self, reason: str) -> None:
        """Stop with a clear error, saving the in-memory state first when a replica holds it."""
        saved = ""
        if self.group.workers and self.committed_step not in [c["step"] for c in self.summary.checkpoints]:
            try:
                saved = self._save_before_failing()
            except Exception as exc:  # the failure is the news; the save is a courtesy
                saved = f"; could not save a checkpoint: {exc}"
        raise TrainingFailed(reason + (saved or f"; newest checkpoint: {self.summary.newest_checkpoint or 'none'}"))

    def _save_before_failing(self) -> str:
        """The committed state, written by the members that hold it. No rebuild, no retry
        through the failure path: the run is ending. The process group may be broken; a save
        needs none. In a replicated layout any one holder has it all; in a sharded one every
        member must still be there (each writes the blocks it owns)."""
        step = self.committed_step
        self._transition(State.CHECKPOINTING, f"saving step {step} before stopping")
        held, dead, silent = _ping_all(self.group.workers)
        holders = [w for w in self.group.workers if held.get(w.slot) == step]
        writers = holders[:1] if self.layout_replicated else holders
        if not writers or (not self.layout_replicated and len(holders) < len(self.group.workers)):
            return f"; no complete copy of step {step} left among the workers to save it"
        files = []
        for w in writers:
            ref = w.actor.save_checkpoint.remote(self.checkpoint_root, self.spec.checkpoint.s3_endpoint_url,
                                                 step, everything=self.layout_replicated)
            try:
                files += self._watch(w, ref, f"the final checkpoint of step {step}")
            except (WorkerLost, ray.exceptions.RayError) as exc:
                log.warning("worker %d could not save step %d: %s", w.slot, step, exc)
                if not self.layout_replicated:
                    return f"; worker {w.slot} was lost while saving step {step}: not saved"
                return self._save_before_failing_from(holders[1:], step)
        info = self.checkpointer.commit(step, files, self._checkpoint_meta())
        self._record_checkpoint(info)
        return f"; state saved at step {step}: {info.uri}"

    def _save_before_failing_from(self, holders: list[Worker], step: int) -> str:
        """Replicated layout: the next holder writes everything, until one succeeds."""
        for w in holders:
            ref = w.actor.save_checkpoint.remote(self.checkpoint_root, self.spec.checkpoint.s3_endpoint_url,
                                                 step, everything=True)
            try:
                files = self._watch(w, ref, f"the final checkpoint of step {step}")
            except (WorkerLost, ray.exceptions.RayError) as exc:
                log.warning("worker %d could not save step %d: %s", w.slot, step, exc)
                continue
            info = self.checkpointer.commit(step, files, self._checkpoint_meta())
            self._record_checkpoint(info)
            return f"; state saved at step {step}: {info.uri}"
        return f"; no surviving worker could save step {step}"

    # ------------------------------------------------------------------ membership at step boundaries
    def _at_step_boundary(self) -> None:
        """Between steps: leave draining (preempted) nodes, take in ready newcomers."""
        now = time.monotonic()
        if now - self._last_drain_poll >= self.spec.elastic.drain_poll_s:
            self._last_drain_poll = now
            self._leave_draining_nodes()
        if len(self.group.workers) < self._target_size():
            self._request_replacements()
            ready = self.group.ready_pending(timeout_s=0.0)
            world = self.spec.parallel.usable_world_size(len(self.group.workers) + len(ready))
            if world <= len(self.group.workers):  # not enough for the next usable world yet
                self.group.standby += ready
                ready = []
            if ready:
                self._transition(State.RESIZING, f"{len(ready)} worker(s) ready: growing to "
                                 f"{len(self.group.workers) + len(ready)}")
                self.group.add(ready)
                self._reform(source_slot=self.group.workers[0].slot,
                             reason=f"grown to world {len(self.group.workers)}")

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
        """Members on nodes marked for preemption leave at this step boundary, with no step lost.

        When too few members would remain (below elastic.min_workers, or none), the state has
        to go somewhere first. While the notice leaves time (DRAIN_HANDOVER_MARGIN_S before its
        deadline), the members keep training on the draining node and replacements are brought
        up elsewhere; once they are up they join and take the state over in memory, and then
        the draining members leave. Only when the time runs out does the state go through a
        checkpoint (saved before the node goes, restored on the new members).
        """
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
        need = max(1, self.spec.elastic.min_workers)
        if len(staying) < need:
            ready = [w for w in self.group.ready_pending(timeout_s=0.0) if w.node_id not in draining]
            if len(staying) + len(ready) >= need:
                self._transition(State.DRAINING, f"{len(leaving)} worker(s) on draining node(s) "
                                 f"({when}): {len(ready)} newcomer(s) take the state over at step "
                                 f"{self.committed_step}")
                self.group.add(ready)
                self._reform(source_slot=leaving[0].slot,
                             reason=f"{len(ready)} newcomer(s) hold the state of step {self.committed_step}")
                staying += ready
            elif deadline is None or deadline - time.time() > DRAIN_HANDOVER_MARGIN_S:
                for _ in range(need - len(staying) - len(self.group.pending)):
                    self.group.request()
                if not self._handover_waits & {w.node_id for w in leaving}:
                    self._handover_waits |= {w.node_id for w in leaving}
                    self._transition(State.DRAINING, f"{len(leaving)} worker(s) on draining node(s) "
                                     f"({when}): training on until a replacement is up to take "
                                     f"the state over")
                    self._transition(State.RUNNING, "waiting for replacements of draining workers")
                return
            else:
                self._transition(State.DRAINING, f"{len(leaving)} worker(s) on draining node(s) "
                                 f"({when}): no replacement in time, saving a checkpoint at step "
                                 f"{self.committed_step} before leaving")
                if self.committed_step not in [c["step"] for c in self.summary.checkpoints]:
                    self._checkpoint(final=False)
        else:
            self._transition(State.DRAINING, f"{len(leaving)} worker(s) on draining node(s) "
                             f"({when}): leaving at step {self.committed_step}")
        if not self.layout_replicated:
            # Their shards may be the only copy: their pieces go into the object store before
            # they leave (the node lives until its deadline) and the re-formed group takes them.
            held, _, _ = _ping_all(leaving)
            self._departing_pieces = [w.actor.state_pieces.remote() for w in leaving
                                      if held.get(w.slot) == self.committed_step]
        self.group.remove(leaving)
        if not self.group.workers:
            self._departing_pieces = []
            self._restore_all_lost()
            return
        self._reform(source_slot=self.group.workers[0].slot,
                     reason=f"left draining node(s): world {len(self.group.workers)}")

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, final: bool) -> None:
        step = self.committed_step
        self._transition(State.CHECKPOINTING, f"{'final' if final else 'periodic'} checkpoint at step {step}")
        try:
            files = self._save_checkpoint_files(step)
            if files is None:  # the group fell back to an older checkpoint meanwhile
                return
            if os.environ.get(FAULT_BEFORE_MANIFEST_ENV) == str(step):
                raise RuntimeError(f"injected fault before the manifest of step {step}")
            info = self.checkpointer.commit(step, files, self._checkpoint_meta())
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
        self._record_checkpoint(info)
        self._transition(State.RUNNING, f"checkpoint committed: {info.uri}")

    def _record_checkpoint(self, info: CheckpointInfo) -> None:
        self.summary.newest_checkpoint = info.uri
        self.summary.checkpoints.append({"step": info.step, "uri": info.uri})
        if self.tracker is not None:
            try:
                self.tracker.record_checkpoint(info.step, info.uri, {"data_cursor": self.data_cursor})
            except Exception as exc:
                log.warning("checkpoint %s not recorded in MLflow: %s", info.uri, exc)

    def _save_checkpoint_files(self, step: int) -> list[dict] | None:
        """Have every member write the blocks of the state of ``step`` it owns (in a replicated
        layout rank 0 owns all of it). A member lost mid-save: the group is rebuilt without it
        (its blocks are re-dealt) and the save starts over. None when the group had to fall
        back to an older checkpoint meanwhile."""
        for _ in range(3):
            members = list(self.group.workers)
            refs = [(w, w.actor.save_checkpoint.remote(self.checkpoint_root,
                                                       self.spec.checkpoint.s3_endpoint_url, step))
                    for w in members]
            try:
                return [record for w, ref in refs
                        for record in self._watch(w, ref, f"the checkpoint of step {step}")]
            except WorkerLost as lost:
                ray.wait([r for _, r in refs], num_returns=len(refs), timeout=PING_TIMEOUT_S)
                self._rebuild_without([lost.worker], f"worker {lost.worker.slot} on node "
                                      f"{lost.worker.node_id[:8]} {lost.reason}")
            if self.committed_step != step:
                return None
            self._transition(State.CHECKPOINTING, f"checkpoint at step {step}, retried after a rebuild")
        raise TrainingFailed(f"checkpoint at step {step}: members were lost during three attempts")

    def _checkpoint_meta(self) -> dict:
        return {"data_cursor": self.data_cursor, "world_size": self.group.world_size,
                "spec_hash": self.spec.spec_hash(), "training_hash": self.spec.training_hash(),
                "git_commit": self.summary.git_commit, "raytrain_sys_version": __version__,
                "dataset_hash": self.manifest.content_hash, "spec": self.spec.to_dict(),
                "mlflow_run_id": self.summary.mlflow_run_id}

    # ------------------------------------------------------------------ end
    def _result(self) -> RunResult:
        s = self.summary
        return RunResult(s.status, self.run_dir, self.committed_step, list(s.losses), s.mlflow_run_id,
                         s.newest_checkpoint, s.path, s.reason)

    def _teardown(self) -> None:
        self.summary.finished_at = time.time()
        if self.data is not None:
            self.data.close()
        if self.group is not None:
            self.group.shutdown()
        if self.tracker is not None:
            status = {State.FINISHED: "FINISHED", State.STOPPED: "KILLED"}.get(self.state, "FAILED")
            try:
                self.tracker.finish(status)
            except Exception as exc:
                log.warning("could not close the MLflow run: %s", exc)
        self.summary.write()
        if self._local_cluster:
            ray.shutdown()


def _point_latest(output_dir: str, run_dir: str) -> None:
    """<output_dir>/latest -> the newest run dir, for `raytrain-sys sample runs/latest`."""
    link = os.path.join(output_dir, "latest")
    try:
        tmp = f"{link}.{os.getpid()}"
        os.symlink(os.path.relpath(run_dir, output_dir), tmp)
        os.replace(tmp, link)
    except OSError as exc:  # e.g. a filesystem without symlinks: only a convenience is lost
        log.debug("could not update %s: %s", link, exc)


def _sample_line(step: int, ids, shares: list[slice]) -> str:
    """The audit record of a committed step: the sample ids of each data-parallel shard (TP and
    PP peers of a shard trained on the same rows, listed once)."""
    import json

    distinct = list(dict.fromkeys((sl.start, sl.stop) for sl in shares))
    return json.dumps({"step": step, "ranks": [ids[a:b].tolist() for a, b in distinct]}) + "\n"


def run_job(spec: JobSpec, *, on_step: Callable[[StepReport], None] | None = None) -> RunResult:
    """Run a job to completion on the cluster the spec names (or a local one)."""
    return Supervisor(spec, on_step=on_step).run()


def resume_job(run_id: str, *, tracking_uri: str = "", overrides: list[str] | None = None,
               output_dir: str = "runs", on_step: Callable[[StepReport], None] | None = None) -> RunResult:
    """Continue the MLflow run ``run_id`` from its newest committed checkpoint, in the same run."""
    from raytrain_sys.spec import apply_overrides

    uri = tracking_uri or mt.default_tracking_uri(os.path.abspath(output_dir))
    mt.check_reachable(uri)
    record = mt.Tracker.lookup(uri, run_id)
    raw = apply_overrides(record.spec_dict, overrides or [])
    raw.setdefault("tracking", {})["uri"] = uri
    checkpoint_root = record.tags.get(mt.TAG_CHECKPOINT_ROOT, "")
    if checkpoint_root:
        raw.setdefault("checkpoint", {})["uri"] = checkpoint_root
    raw["checkpoint"]["resume_from"] = "latest"
    # A pause point belongs to the invocation that paused; resuming runs on unless told again.
    if not any(o.startswith("train.stop_at_step=") for o in overrides or []):
        raw.setdefault("train", {})["stop_at_step"] = 0
    spec = from_dict(raw)
    run_dir = record.run_dir if record.run_dir and os.path.isdir(record.run_dir) else ""
    previous_key = os.path.basename(record.run_dir.rstrip("/")) if record.run_dir else ""
    sup = Supervisor(spec, resume_run_id=run_id, run_dir=run_dir, previous_run_key=previous_key,
                     on_step=on_step)
    if Checkpointer(open_store(sup.checkpoint_root, spec.checkpoint.s3_endpoint_url), 1).latest() is None:
        raise CheckpointError(f"MLflow run {run_id} has no complete checkpoint in {sup.checkpoint_root}: "
                              f"nothing to resume; start it again with `raytrain-sys run`")
    return sup.run()
