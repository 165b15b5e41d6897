"""The step traffic: send a step to the members, settle one that a failure voided, commit one.

Owns: the committed-step counter and the data cursor (only ``Steps`` writes them: ``commit``
advances them, ``rewind`` sets them to a restored checkpoint's), the recent step times, the
steps kept to be sent again after a rebuild, and the per-step records of summary.json
(losses, world sizes, throughput, committed_steps, data_cursor, steps_redone), the step
metrics sent to MLflow and the sample log. Calls no other part of the Supervisor.

Run-ahead: while step k runs, step k+1 is already sent (``dispatch(k + 1, after=...)``) when
the boundary between them has nothing to do; the members start it as they finish step k, so
the driver's dispatch and commit are off the critical path. A step k that fails voids step
k+1: its members refuse it or fail in its first collective, and ``settle`` waits for that
before the rebuild. Nothing is committed out of order: step k+1 is collected only after k
committed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import ray

from raytrain_sys.control.run_record import SAMPLE_LOG_FILE, RunSummary
from raytrain_sys.control.supervisor.liveness import StepOutcome
from raytrain_sys.control.supervisor.policy import PING_TIMEOUT_S, collective_timeout_s, step_deadline_s
from raytrain_sys.control.worker_group import Worker, WorkerGroup
from raytrain_sys.data.batches import GlobalBatch
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.parallel.mesh import rank_data_slices
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)


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


class Steps:
    """The step ledger and the calls that move it, for one run."""

    def __init__(self, spec: JobSpec, data: DataPlane, group: WorkerGroup, task, summary: RunSummary,
                 tracker, on_step: Callable[[StepReport], None] | None, flops_per_token: float):
        self.spec, self.data, self.group, self.task = spec, data, group, task
        self.summary, self.tracker, self.on_step = summary, tracker, on_step
        self._flops_per_token = flops_per_token
        self.committed_step = 0
        self.data_cursor = 0
        self._resend: dict[int, _Dispatch] = {}  # steps sent before a failure, by step
        self._step_times: deque[float] = deque(maxlen=50)
        self._sample_log = None
        self._run_t0 = time.perf_counter()

    # ------------------------------------------------------------------ the run's step loop
    def open(self, run_dir: str) -> None:
        """The step loop begins: fresh step times, the sample log opened (data.log_sample_ids)."""
        self._sample_log = (open(os.path.join(run_dir, SAMPLE_LOG_FILE), "a")
                            if self.spec.data.log_sample_ids else None)
        self._step_times = deque(maxlen=50)
        self._run_t0 = time.perf_counter()

    def close(self) -> None:
        if self._sample_log is not None:
            self._sample_log.close()

    def keep_for_resend(self, *sent: "_Dispatch | None") -> None:
        """Steps voided by a failure are sent again after the rebuild: their global batches are
        kept (a batch is a function of the cursor; the data plane may have dropped the window)."""
        self._resend = {d.step: d for d in sent if d is not None}

    def _step_deadline_s(self) -> float:
        return step_deadline_s(self._step_times, self.spec)

    def rewind(self, step: int, data_cursor: int) -> None:
        """A durable checkpoint of ``step`` was loaded: the ledger continues from it (steps
        committed after it are redone, and counted)."""
        redone = self.committed_step - step
        if redone > 0:
            log.warning("restored step %d: %d committed steps will be redone", step, redone)
            self.summary.steps_redone += redone
        self.committed_step = step
        self.data_cursor = data_cursor
        # A resume into a new run dir has no record of earlier steps: keep "index i = step i+1".
        self.summary.truncate_to(step)
        missing = step - len(self.summary.losses)
        self.summary.losses += [None] * missing
        self.summary.world_sizes += [None] * missing

    # ------------------------------------------------------------------ dispatch, settle, commit
    def dispatch(self, step: int, after: "_Dispatch | None" = None) -> "_Dispatch":
        """Send step ``step`` to every member: where its rows of the step's global batch lie
        (object references and row ranges; the driver never holds the rows). The references are
        the call's own arguments, so Ray pulls each rank's pieces to its node before the step
        starts there (while the step before it runs, under run-ahead).

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
            args = [({k: v[sl] for k, v in rows.items()},) for sl in shares]
        else:  # references and row ranges: each rank's rows go node to node, never through here
            args = [(share.ranges(), *share.refs()) for share in map(batch.share, shares)]
        deadline_s = self._step_deadline_s()
        timeout_s = collective_timeout_s(deadline_s)
        refs = [w.actor.train_step.remote(step, arg[0], batch.units, timeout_s, *arg[1:])
                for w, arg in zip(members, args)]
        return _Dispatch(step, members, refs, batch, batch.ids, shares, batch.units, deadline_s,
                         time.perf_counter(), self.data.wait_s - wait0, after is not None)

    def settle(self, ahead: "_Dispatch", outcome: StepOutcome) -> None:
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
                           timeout=collective_timeout_s(ahead.deadline_s) + PING_TIMEOUT_S)
        if late:
            stuck = [by_ref[r] for r in late]
            log.warning("worker(s) %s still in step %d after step %d failed: treated as lost",
                        ", ".join(str(w.slot) for w in stuck), ahead.step + 1, ahead.step)
            for w in stuck:
                outcome.lost[w.slot] = f"blocked in step {ahead.step + 1} after step {ahead.step} failed"
            self.group.reap(stuck)
            self.group.remove(stuck)

    def commit(self, step: int, results: list[dict], units: int, ids, shares: list[slice],
               dt: float, data_wait: float, world_size: int | None = None) -> None:
        spec = self.spec
        world = world_size or len(shares)
        self.committed_step = step + 1
        self.data_cursor += spec.train.global_batch_size
        self._step_times.append(dt)
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
                "data_wait_fraction": self.data.wait_s / max(time.perf_counter() - self._run_t0, 1e-9)}
            self.summary.write()


def _sample_line(step: int, ids, shares: list[slice]) -> str:
    """The audit record of a committed step: the sample ids of each data-parallel shard (TP and
    PP peers of a shard trained on the same rows, listed once)."""
    distinct = list(dict.fromkeys((sl.start, sl.stop) for sl in shares))
    return json.dumps({"step": step, "ranks": [ids[a:b].tolist() for a, b in distinct]}) + "\n"
