"""A trial's checkpoints as Tune sees them, and PBT's segments.

Owns: Tune's checkpoint of a trial, a pointer to its job's committed checkpoint (``Pointer``: a
small JSON file, never a copy of the model), made at each report (``Reporter``); and which job a
trial's proxy follows (``segment_plan``, pure). Writes in the store: the cancel of an exploited
trial's segment (``end_exploited``, through ``requests``); in MLflow: a segment's donor marks
(``mark_segment``).

* **PBT's exploit is a new segment**: Tune restarts an exploited trial's proxy with its donor's
  pointer; the proxy cancels the trial's job and submits the trial's next segment, a job of its
  own that starts from the donor's committed checkpoint with the mutated values (``segment_plan``;
  ``spec.trial_spec``); the segment's MLflow run is tagged with its donor. PBT runs synchronous,
  so that every trial it ranks holds a checkpoint (``scheduler.make_scheduler``).
* **A pointer at a checkpoint step** waits for that step's checkpoint under PBT (its exploits
  start from it); ASHA's and FIFO's only mark how far Tune has read (``checkpoint_wait_s``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from raytrain_sys.errors import JobStateConflict
from raytrain_sys.service import requests
from raytrain_sys.service.model import JobRecord
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.spec import SweepSpec, get_field, tracking_uri
from raytrain_sys.service.sweeps.tracking import (TAG_DONOR_CHECKPOINT, TAG_DONOR_STEP, TAG_DONOR_TRIAL, TAG_SEGMENT,
                                                  mark_segment_run)

log = logging.getLogger(__name__)

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


def end_exploited(store: Store, sweep_id: int, plan: SegmentPlan) -> None:
    """Cancel the trial's previous segment (``plan.end_job``), still live when PBT exploited it."""
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
    donor = plan.donor
    if donor is None or not job.mlflow_run_id:
        return False
    raw = json.loads(job.spec)  # the values the segment's job runs with
    mutated = {key: float(value) for key, d in spec.space.items() if d.kind != "grid"
               for value in [get_field(raw, key)] if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return mark_segment_run(tracking_uri(spec), job.mlflow_run_id,
                            {TAG_SEGMENT: str(plan.segment), TAG_DONOR_TRIAL: donor.trial_id,
                             TAG_DONOR_STEP: str(donor.step), TAG_DONOR_CHECKPOINT: donor.uri},
                            mutated, donor.step)
