"""Durable checkpoints of the committed step: whether one may be resumed, the members' save
and load calls, the commit of the manifest, and its record.

Owns: the Checkpointer and its store (the one writer of checkpoints under the checkpoint root;
the manifest, written last, is what makes one visible), the checkpoint records of summary.json
(``checkpoints``, ``newest_checkpoint``, ``resumed_from``), of MLflow and of Prometheus (save
seconds and bytes). It never rebuilds the group and records no state transition: a member lost
while saving surfaces as ``WorkerLost`` from the Supervisor's watch, and the Supervisor decides.

A background save (``checkpoint.async_save``) is a ``PendingSave``: the members' snapshots were
taken at its step, their writes run while training goes on, and ``written`` says whether every
writer's file is durable yet; the Supervisor commits it then, or abandons it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from raytrain_sys import __version__
from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from raytrain_sys.control.run_record import RunSummary
from raytrain_sys.control.worker_group import Worker, WorkerGroup
from raytrain_sys.errors import CheckpointError
from raytrain_sys.monitor.metrics import RunMetrics
from raytrain_sys.spec import JobSpec, from_dict

log = logging.getLogger(__name__)


def check_compatible(spec: JobSpec, info: CheckpointInfo) -> None:
    """Refuse to resume a checkpoint written with other training settings, naming them."""
    meta = info.manifest
    if meta.get("training_hash") == spec.training_hash():
        return
    old = from_dict(meta["spec"]) if "spec" in meta else None
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


@dataclass
class PendingSave:
    """A background save in flight: snapshots of ``step`` taken, files being written."""
    step: int
    data_cursor: int
    world_size: int
    writers: list  # (Worker, reference of its checkpoint_written call), for the members that own blocks
    stall_s: float  # the step boundary's wait for the snapshots
    snapshot_bytes_per_rank: int  # the largest member's snapshot
    started_at: float  # time.perf_counter() when the snapshots were taken


class Checkpoints:
    def __init__(self, spec: JobSpec, checkpointer: Checkpointer, checkpoint_root: str, manifest,
                 summary: RunSummary, tracker, metrics: RunMetrics):
        self.spec, self.checkpointer, self.checkpoint_root = spec, checkpointer, checkpoint_root
        self.manifest, self.summary, self.tracker = manifest, summary, tracker
        self.metrics = metrics

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
               timing: dict | None = None) -> CheckpointInfo:
        """The manifest, written last: the checkpoint becomes visible, and is recorded (with
        ``timing``: the training stall, the write time and snapshot size, when measured)."""
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
                self.tracker.log_plots(self.summary.snapshot())  # drawn off the step loop
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
