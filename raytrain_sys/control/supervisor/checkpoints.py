"""Durable checkpoints of the committed step: whether one may be resumed, the members' save
and load calls, the commit of the manifest, and its record.

Owns: the Checkpointer and its store (the one writer of checkpoints under the checkpoint root;
the manifest, written last, is what makes one visible), the checkpoint records of summary.json
(``checkpoints``, ``newest_checkpoint``, ``resumed_from``), of MLflow and of Prometheus (save
seconds and bytes). It never rebuilds the group and records no state transition: ``save``
returns ``Saved`` or ``WriterLost`` (a member lost while saving: the Supervisor rebuilds and
asks again), ``settle`` and ``save_held`` return what happened, in words for the record. The
long calls are watched by the ``watch`` the Supervisor passes in (``liveness.watch``).

A background save (``checkpoint.async_save``) is the ``PendingSave`` in ``pending`` (at most one,
which only this module writes): the members' snapshots were taken at its step, their writes run
while training goes on, and ``settle`` commits it once every writer's file is durable, or
abandons it (a writer left, died or failed; ``abandon``: an older checkpoint is restored).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import ray

from raytrain_sys.version import __version__
from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo, split_checkpoint_uri
from raytrain_sys.control.run_record import RunSummary
from raytrain_sys.control.supervisor.liveness import WorkerLost
from raytrain_sys.control.supervisor.policy import PING_TIMEOUT_S
from raytrain_sys.control.supervisor.probe import ping_all
from raytrain_sys.control.worker_group import Worker, WorkerGroup
from raytrain_sys.errors import CheckpointError, StorageError, find_user_error
from raytrain_sys.monitor.metrics import RunMetrics
from raytrain_sys.spec import JobSpec, from_dict

log = logging.getLogger(__name__)

# Test hook: crash the driver after a checkpoint's data files are written and before its
# manifest, at this step. Used to prove that a half-written checkpoint stays invisible.
FAULT_BEFORE_MANIFEST_ENV = "RAYTRAIN_SYS_FAULT_BEFORE_MANIFEST_STEP"


def started_from_another_root(resumed_uri: str, checkpoint_root: str) -> bool:
    """Whether the checkpoint a run resumed from (``.../step_NNNNNNNN``) lies outside the run's own
    checkpoint root (a PBT segment's, from its donor's): its state is then saved in the run's own
    root first, as the other run's retention may delete that checkpoint."""
    split = split_checkpoint_uri(resumed_uri)
    return (split[0] if split is not None else "") != checkpoint_root.rstrip("/")


def check_compatible(spec: JobSpec, info: CheckpointInfo) -> None:
    """Refuse to resume a checkpoint written with other training settings, naming them."""
    meta = info.manifest
    if meta.get("training_hash") == spec.training_hash():
        return
    old = from_dict(meta["spec"]) if "spec" in meta else None
    if old is not None and spec.checkpoint.resume_changes and \
            with_values_of(spec, old, spec.checkpoint.resume_changes).training_hash() == meta.get("training_hash"):
        return  # only the fields the spec allows to change differ (a PBT segment's mutated values)
    diffs = []
    if old is not None:
        a, b = old.flat(), spec.flat()
        diffs = [k for k in a if k.split(".")[0] in ("model", "optim") and a[k] != b.get(k)]
        diffs += [k for k in ("data.seed", "data.shuffle_window", "data.shuffle_block_rows",
                              "data.sequences", "train.global_batch_size", "train.precision",
                              "train.seed") if a.get(k, b.get(k)) != b.get(k)]
    raise CheckpointError(
        f"checkpoint {info.uri} was written with different training settings "
        f"({', '.join(diffs) or 'training hash differs'}); resuming would not continue the same "
        f"run: restore those fields or start a new run")


def with_values_of(spec: JobSpec, other: JobSpec, fields: list[str]) -> JobSpec:
    """A copy of ``spec`` with each dotted field of ``fields`` set to its value in ``other``."""
    out = copy.deepcopy(spec)
    for dotted in fields:
        section, name = dotted.split(".", 1)
        setattr(getattr(out, section), name, getattr(getattr(other, section), name))
    return out


@dataclass
class PendingSave:
    """A background save in flight: snapshots of ``step`` taken, files being written."""
    step: int
    data_cursor: int
    world_size: int
    writers: list  # (Worker, reference of its checkpoint_written call), for the members that own blocks
    stall_s: float  # the step boundary's wait for the snapshots
    snapshot_bytes_per_rank: int  # the largest member's snapshot
    started_at: float  # time.perf_counter() when the snapshots were asked for


@dataclass(frozen=True)
class Saved:
    """The members saved the step: committed (``info``), or snapshots taken and written in the
    background (``pending``, checkpoint.async_save)."""

    info: CheckpointInfo | None = None
    pending: PendingSave | None = None


@dataclass(frozen=True)
class WriterLost:
    """A member died or went silent while saving: nothing was committed."""

    worker: Worker
    reason: str


class Checkpoints:
    def __init__(self, spec: JobSpec, checkpointer: Checkpointer, checkpoint_root: str, manifest,
                 summary: RunSummary, tracker, metrics: RunMetrics):
        self.spec, self.checkpointer, self.checkpoint_root = spec, checkpointer, checkpoint_root
        self.manifest, self.summary, self.tracker = manifest, summary, tracker
        self.metrics = metrics
        # The background save in flight (checkpoint.async_save): at most one, committed or
        # abandoned at a later boundary (``settle``).
        self.pending: PendingSave | None = None

    def latest(self) -> CheckpointInfo | None:
        return self.checkpointer.latest()

    def save_call(self, worker: Worker, step: int, everything: bool = False):
        """Have ``worker`` write the blocks of the state of ``step`` it owns (``everything``:
        all of it, from a replica); the reference of its file records."""
        return worker.actor.save_checkpoint.remote(self.checkpoint_root, self.spec.checkpoint.s3_endpoint_url,
                                                   step, everything=everything,
                                                   stage_dir=self.spec.checkpoint.stage_dir)

    def start_call(self, worker: Worker, step: int):
        """Have ``worker`` snapshot the blocks of ``step`` it owns and write them in the
        background; the reference of its snapshot's size and time."""
        return worker.actor.start_checkpoint.remote(self.checkpoint_root, self.spec.checkpoint.s3_endpoint_url,
                                                    step, stage_dir=self.spec.checkpoint.stage_dir)

    def save(self, group: WorkerGroup, step: int, data_cursor: int, background: bool,
             watch: Callable, final: bool = False) -> Saved | WriterLost:
        """Have every member write the blocks of the state of ``step`` it owns (in a replicated
        layout rank 0 owns all of it), then commit the manifest; with ``background``, have them
        take their snapshots and start writing (``Saved.pending``). ``watch(group, worker, ref,
        what)``: a call's result, raising ``WorkerLost`` when its worker is lost meanwhile.
        ``final``: the run's last checkpoint, whose plots the run's end redraws at once."""
        t0 = time.perf_counter()
        call = self.start_call if background else self.save_call
        refs = [(w, call(w, step)) for w in group.workers]
        try:
            done = [(w, watch(group, w, ref, f"the checkpoint of step {step}")) for w, ref in refs]
        except WorkerLost as lost:
            ray.wait([r for _, r in refs], num_returns=len(refs), timeout=PING_TIMEOUT_S)
            return WriterLost(lost.worker, f"worker {lost.worker.slot} on node {lost.worker.node_id[:8]} "
                                           f"{lost.reason}")
        now = time.perf_counter()
        if background:
            # Timed from the call: every rank's write starts after it (and before the replies
            # reach us), so durable_after_s is never below a rank's own write_s.
            self.pending = self.begin(step, data_cursor, group.world_size, done, now - t0, t0)
            return Saved(pending=self.pending)
        if os.environ.get(FAULT_BEFORE_MANIFEST_ENV) == str(step):
            raise RuntimeError(f"injected fault before the manifest of step {step}")
        files = [record for _, records in done for record in records]
        return Saved(info=self.commit(step, files, data_cursor, group.world_size, {"stall_s": round(now - t0, 4)},
                                      plots=not final))

    def settle(self, group: WorkerGroup, wait: bool, watch: Callable) -> str:
        """The background save in flight (``pending``), if any: committed (manifest last) once
        every writer's file is durable; with ``wait``, block until then, watching the writers.
        Abandoned, never committed, when a writer left the group, died or failed to write: its
        files stay an invisible partial directory and the newest committed checkpoint stays the
        newest. Returns what happened, for the record ("" while the writes run, or none is)."""
        pending = self.pending
        if pending is None:
            return ""
        members = {w.slot for w in group.workers}
        gone = [w.slot for w, _ in pending.writers if w.slot not in members]
        if gone:
            return self.abandon(f"worker(s) {gone} left the group while writing it")
        try:
            if wait:
                results = [watch(group, w, ref, f"the background checkpoint of step {pending.step}")
                           for w, ref in pending.writers]
            else:
                results = self.written(pending)
                if results is None:
                    return ""
        except (WorkerLost, ray.exceptions.RayError) as exc:
            user = find_user_error(exc)
            return self.abandon(str(user) if user is not None else
                                exc.reason if isinstance(exc, WorkerLost) else type(exc).__name__)
        self.pending = None
        timing = {"stall_s": round(pending.stall_s, 4),
                  "durable_after_s": round(time.perf_counter() - pending.started_at, 4),
                  "write_s": round(max((r["write_s"] for r in results), default=0.0), 4),
                  "snapshot_bytes_per_rank": pending.snapshot_bytes_per_rank}
        try:
            info = self.commit(pending.step, [f for r in results for f in r["files"]],
                               pending.data_cursor, pending.world_size, timing)
        except Exception as exc:
            user = find_user_error(exc)
            if user is None or not isinstance(user, (StorageError, CheckpointError)):
                raise
            return f"background checkpoint of step {pending.step} not committed: {user}"
        return (f"checkpoint committed: {info.uri} (written in the background, "
                f"durable {timing['durable_after_s']:.1f} s after its snapshot)")

    def abandon(self, why: str) -> str:
        """Give the background save in flight up (it never gets a manifest): what happened, for
        the record ("" when none was in flight)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return ""
        return (f"background checkpoint of step {pending.step} abandoned ({why}); "
                f"the newest checkpoint stays {self.summary.newest_checkpoint or 'none'}")

    def save_held(self, group: WorkerGroup, step: int, data_cursor: int, replicated: bool,
                  watch: Callable) -> str:
        """The committed state, written by the members that hold it, as the run stops: no
        rebuild, no retry through the failure path. The process group may be broken; a save
        needs none. In a replicated layout any one holder has it all (the next one writes it
        when one fails); in a sharded one every member must still be there (each writes the
        blocks it owns). Returns what happened, to end the run's reason with."""
        held, _, _ = ping_all(group.workers)
        holders = [w for w in group.workers if held.get(w.slot) == step]
        if not holders or (not replicated and len(holders) < len(group.workers)):
            return f"; no complete copy of step {step} left among the workers to save it"
        files = []
        started = time.perf_counter()
        for w in holders:
            try:
                files += watch(group, w, self.save_call(w, step, everything=replicated),
                               f"the final checkpoint of step {step}")
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
        info = self.commit(step, files, data_cursor, group.world_size,
                           {"stall_s": round(time.perf_counter() - started, 4)})
        return f"; state saved at step {step}: {info.uri}"

    def begin(self, step: int, data_cursor: int, world_size: int, started: list, stall_s: float,
              started_at: float) -> PendingSave:
        """The background save whose snapshots ``started`` ((worker, start_checkpoint result)
        pairs) were taken: ask each writer for its records once durable."""
        writers = [(w, w.actor.checkpoint_written.remote(step)) for w, r in started if r["writes"]]
        biggest = max((r["snapshot_bytes"] for _, r in started), default=0)
        return PendingSave(step, data_cursor, world_size, writers, stall_s, biggest, started_at)

    @staticmethod
    def written(pending: PendingSave) -> list[dict] | None:
        """The writers' results once every file is durable, without waiting; None while any
        write is still running. Raises what a writer raised (a Ray error)."""
        refs = [ref for _, ref in pending.writers]
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(ready) < len(refs):
            return None
        return ray.get(refs)

    def commit(self, step: int, files: list[dict], data_cursor: int, world_size: int,
               timing: dict | None = None, plots: bool = True) -> CheckpointInfo:
        """The manifest, written last: the checkpoint becomes visible, and is recorded (with
        ``timing``: the training stall, the write time and snapshot size, when measured); the
        plots redrawn if ``plots`` and the tracker says they are due (``Tracker.plots_due``)."""
        if self.tracker is not None:
            # A new run's MLflow run may still be opening beside the first steps: a checkpoint
            # is committed with its run id (what a resume finds it by), or not if it cannot open.
            self.tracker.opened()
        info = self.checkpointer.commit(step, files, self._meta(data_cursor, world_size))
        # Save seconds: from the members' call to the manifest (a background save's: to durable).
        timing = timing or {}
        self.metrics.checkpoint(timing.get("durable_after_s", timing.get("stall_s", 0.0)),
                                sum(f["bytes"] for f in files))
        self.summary.newest_checkpoint = info.uri
        self.summary.checkpoints.append({"step": info.step, "uri": info.uri, **timing})
        if self.tracker is not None:
            try:
                self.tracker.record_checkpoint(info.step, info.uri, {"data_cursor": data_cursor, **timing})
                if plots and self.tracker.plots_due():  # drawn off the step loop
                    self.tracker.log_plots(self.summary.snapshot(), at_end=False)
            except Exception as exc:
                log.warning("checkpoint %s not recorded in MLflow: %s", info.uri, exc)
        return info

    def saved(self, step: int) -> bool:
        return step in [c["step"] for c in self.summary.checkpoints]

    def _meta(self, data_cursor: int, world_size: int) -> dict:
        return {"data_cursor": data_cursor, "world_size": world_size,
                "spec_hash": self.spec.spec_hash(), "training_hash": self.spec.training_hash(),
                "git_commit": self.summary.git_commit, "raytrain_sys_version": __version__,
                "dataset_hash": self.manifest.content_hash, "spec": self.spec.plain_dict(),
                "mlflow_run_id": self.summary.mlflow_run_id}

    def load(self, group: WorkerGroup, info: CheckpointInfo) -> None:
        """Load a durable checkpoint into every member (each cuts it for its own layout)."""
        steps = ray.get([a.load_checkpoint.remote(info.uri, self.spec.checkpoint.s3_endpoint_url)
                         for a in group.actors()])
        assert len(set(steps)) == 1 and steps[0] == info.step, f"replicas disagree: {steps}"
        self.summary.resumed_from.append(info.uri)
        self.summary.newest_checkpoint = info.uri
