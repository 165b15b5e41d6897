"""How a run comes back after losing members, and how it stops when it cannot.

The Supervisor's recovery sequence, in a module of its own. Owns: the failure budget's record
(the times of recent membership failures; the decision is ``policy.failure_budget``) and the
order of a rebuild: the lost members out, the finished steps committed, the failure counted,
then ``Membership.rebuild`` until its outcome is final: ``Reformed`` (running again),
``BelowMinimum`` (waiting for workers), ``NeedsRestore`` (the newest durable checkpoint, into
the members or into a fresh group), ``MustStop``. Its states go through the Supervisor's one
``transition``; the parts it calls (``membership``, ``checkpoints``, ``steps``) return outcomes
and call nothing back. It is the lowest of the Supervisor's sequences: the step loop, the
boundary's items and the saves ask it to rebuild; it asks none of them.

A run that cannot go on (the failure budget spent, too few workers for too long, a group that
does not re-form) raises ``MustStop`` up to the Supervisor, which stops it with
``fail_with_checkpoint``: the committed state saved by the members that hold it, then a
``TrainingFailed`` naming the reason. Nothing here is nested: a stop is raised, not called.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from raytrain_sys.checkpoint.checkpointer import CheckpointInfo
from raytrain_sys.control.supervisor import policy
from raytrain_sys.control.supervisor.checkpoints import Checkpoints
from raytrain_sys.control.supervisor.journal import State
from raytrain_sys.control.supervisor.liveness import watch
from raytrain_sys.control.supervisor.membership import (BelowMinimum, Membership, MustStop as StopOutcome,
                                                        NeedsRestore, Reformed)
from raytrain_sys.control.supervisor.steps import Steps
from raytrain_sys.control.worker_group import Worker
from raytrain_sys.errors import TrainingFailed
from raytrain_sys.monitor.metrics import RunMetrics
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)


class MustStop(Exception):
    """The run cannot go on: the Supervisor saves the committed state and fails with this reason."""


class Recovery:
    def __init__(self, spec: JobSpec, transition: Callable, membership: Membership, checkpoints: Checkpoints,
                 steps: Steps, metrics: RunMetrics):
        self.spec, self.transition = spec, transition
        self.membership, self.checkpoints, self.steps, self.metrics = membership, checkpoints, steps, metrics
        self.group = membership.group
        self.failures: list[float] = []  # unix times of recent membership failures
        self.restored = False  # the newest recovery loaded a checkpoint
        self.had_copies = False  # the group that lost members kept peer copies

    def recover(self, lost: list[Worker], reason: str, before_reform: Callable[[dict[int, int]], None] | None = None,
                detected_at_unix_s: float = 0.0, hangs: dict[int, dict] | None = None) -> None:
        """Drop ``lost`` members and re-form the group from the survivor holding the newest step;
        with no survivor, fall back to the newest durable checkpoint. ``before_reform(held)``:
        commits the steps that finished on a survivor; the failure is counted after it, so that
        a budget that stops the run saves the newest state. ``hangs``: the lost members found
        hung (``liveness.hang_record``), whose stacks go to the log, the MLflow run and the
        recovery's record."""
        hung = self.keep_stacks(hangs or {}, "hung")
        self.transition(State.REBUILDING, reason, detected_at_unix_s)
        self.membership.rescue(lost)
        self.membership.remove(lost)
        held = self.membership.survivors_held()
        if held and before_reform is not None:
            before_reform(held)
        self.failures, budget = policy.failure_budget(self.failures, time.time(), self.spec.elastic, reason)
        self.steps.summary.failures += 1
        self.metrics.failure("worker_lost" if lost else "worker_error")
        if isinstance(budget, policy.Stop):
            raise MustStop(budget.reason)
        if not isinstance(budget, policy.Continue):
            raise TypeError(f"unknown failure decision {budget!r}")
        step, redone = self.steps.committed_step, self.steps.summary.steps_redone
        self.restored, self.had_copies = False, bool(self.membership.peers)
        if not self.group.workers:
            self.restore_from(NeedsRestore([], []))
        else:
            self.reform(source_slot=max(held, key=held.get))
        sources = self.membership.last_sources
        self.steps.summary.recoveries.append({
            "step": step, "lost": [w.slot for w in lost], "reason": reason,
            "from": "checkpoint" if self.restored else "peer copies" if "peer copies" in sources else "survivors",
            "steps_redone": self.steps.summary.steps_redone - redone, **({"hung": hung} if hung else {})})

    def keep_stacks(self, records: dict[int, dict], kind: str) -> list[dict]:
        """The stacks of members found hung (or, ``kind`` "straggler", a straggler replaced): each
        one's whole stack in the job's log, and as the MLflow run's artifact
        ``hangs/step-<n>-worker-<slot>.txt`` (the driver writes MLflow: the tracker's queue);
        returns the records for summary.json."""
        kept = []
        for record in records.values():
            log.warning("worker %d (rank %d, pid %s) at step %d, %s\n%s", record["slot"], record["rank"],
                        record.get("pid"), record["step"], record["reason"], record["stack"])
            if self.steps.tracker is not None:
                try:
                    self.steps.tracker.log_stack(record, kind)
                except Exception as exc:  # MLflow trouble never stops a recovery
                    log.warning("could not record the stack in MLflow: %s", exc)
            kept.append(record)
        return kept

    def reform(self, source_slot: int | None = None, reason: str = "") -> None:
        """New process group over the members and ready newcomers, every one holding the
        committed step (``Membership.rebuild``); a checkpoint when they cannot hold it."""
        while True:
            outcome = self.membership.rebuild(self.steps.committed_step, source_slot)
            if isinstance(outcome, BelowMinimum):
                self._wait_for_workers(outcome)
                continue
            if isinstance(outcome, NeedsRestore):
                self.restore_from(outcome)
            elif isinstance(outcome, Reformed):
                sources = " and ".join(self.membership.last_sources)
                self.transition(State.RUNNING, reason or f"rebuilt: world {len(outcome.members)}, "
                                f"generation {self.group.generation}" + (f", state from {sources}" if sources else ""))
            elif isinstance(outcome, StopOutcome):
                raise MustStop(outcome.reason)
            else:
                raise TypeError(f"unknown membership outcome {outcome!r}")
            return

    def _wait_for_workers(self, below: BelowMinimum) -> None:
        e = self.spec.elastic
        self.transition(State.WAITING, f"{below.have} workers, below {below.need} (elastic.min_workers="
                        f"{e.min_workers}, parallel degrees): waiting up to {e.below_min_timeout_s:g} s")
        if not self.membership.wait_for(below.need, e.below_min_timeout_s):
            raise MustStop(f"the group stayed below elastic.min_workers={e.min_workers} for "
                           f"elastic.below_min_timeout_s={e.below_min_timeout_s:g} s")

    def restore_from(self, need: NeedsRestore) -> None:
        """The members cannot hold the committed step: the newest durable checkpoint, resharded
        to them (``need.gaps``: what the survivors miss), or into a fresh group when no member
        holds the step at all."""
        step, info, root = self.steps.committed_step, self.checkpoints.latest(), self.checkpoints.checkpoint_root
        if need.gaps:
            gaps = need.gaps
            reason = (f"the surviving workers do not hold all of the state of step {step} (no copy "
                      f"of {', '.join(gaps[:2])}{' ...' if len(gaps) > 2 else ''}"
                      f"{': its peer copy was lost with it' if self.had_copies else ''})")
            if info is None:
                raise TrainingFailed(f"{reason} and no checkpoint exists in {root}; "
                                     f"set checkpoint.every_steps, or keep replicas (parallel.dp, hsdp)")
            self.transition(State.RESTORING, f"{reason}: restoring {info.uri}")
            done = f"restored from {info.uri}, resharded to world {len(need.members)}"
        else:
            if info is None:
                raise TrainingFailed(f"every worker was lost at step {step} and no checkpoint exists in "
                                     f"{root}; set checkpoint.every_steps to survive this")
            while (below := self.membership.regroup()) is not None:
                self._wait_for_workers(below)
            done = f"restored from {info.uri} after losing every worker"
        self.restore(info)
        self.restored = True
        self.transition(State.RUNNING, done)

    def restore(self, info: CheckpointInfo) -> None:
        """Load a durable checkpoint into every member (a resume, or the fallback when no replica
        holds the state); the steps committed after it are redone."""
        note = self.checkpoints.abandon("an older checkpoint is restored")
        if note:
            self.transition(None, note)
        self.transition(State.RESTORING, f"loading checkpoint {info.uri}")
        self.checkpoints.load(self.group, info)
        self.steps.rewind(info.step, int(info.manifest["data_cursor"]))

    def fail_with_checkpoint(self, reason: str) -> None:
        """Stop with a clear error, saving the in-memory state first when a replica holds it."""
        step, saved = self.steps.committed_step, ""
        try:
            note = self.checkpoints.settle(self.group, True, watch)
            if note:
                self.transition(None, note)
        except Exception as exc:  # the failure is the news
            log.warning("the background checkpoint in flight could not be committed: %s", exc)
        if self.group.workers and not self.checkpoints.saved(step):
            self.transition(State.CHECKPOINTING, f"saving step {step} before stopping")
            try:
                saved = self.checkpoints.save_held(self.group, step, self.steps.data_cursor,
                                                   self.membership.layout_replicated, watch)
            except Exception as exc:  # the failure is the news; the save is a courtesy
                saved = f"; could not save a checkpoint: {exc}"
        newest = self.steps.summary.newest_checkpoint or "none"
        raise TrainingFailed(reason + (saved or f"; newest checkpoint: {newest}"))
