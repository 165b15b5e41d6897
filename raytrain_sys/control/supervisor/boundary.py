"""A step boundary carried out: the plan's items, one after the other, and nothing else.

The Supervisor's boundary sequence, in a module of its own. Owns: the facts a boundary is
decided on, gathered once (``facts``: the drain lookup every elastic.drain_poll_s, newcomers up,
requests from outside, a straggler to replace, an early stop), and the carrying out of
``policy.plan``'s items (``run``: plan, carry out the first item, plan again on the facts as they
now are, until the plan is empty or ends the step loop). An item it does not know raises. What
the items need it asks of the parts (``membership`` for every change of who is in the group,
``checkpoints``, ``evaluation``, ``stragglers``) and of ``recovery`` for a re-formed group; states
go through the Supervisor's one ``transition``. Nothing here decides: the plan does.

While a lease runs, ``meanwhile`` asks the same plan about the earliest boundary the lease can
end at: items that need no boundary (``policy.AT_ONCE``) are carried out then and there, and the
reason the boundary is needed, if any, is what the Supervisor cuts the lease short for. The
reported steps' per-rank times go to ``stragglers`` as they come (``observe``), so that a slow
rank is judged while a long lease runs; its verdict is a fact of the plan (``Redeal``,
``ReplaceStraggler``). Between leases, a batch still being read is waited for here, a slice at
a time, with the plan asked again between slices (``read_unless_due``): work that arrives while
the data is late is carried out at once, not after the read.

Also the saves a boundary makes (``checkpoint``; a background one is settled after a later
commit, ``settle``), since the run's ending and an evaluation's keep_best ask for them too.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray

from raytrain_sys.control import drain
from raytrain_sys.control.supervisor import policy
from raytrain_sys.control.supervisor.checkpoints import Checkpoints, WriterLost
from raytrain_sys.control.supervisor.evaluation import Evaluation
from raytrain_sys.control.supervisor.journal import State
from raytrain_sys.control.supervisor.launch import InBackground
from raytrain_sys.control.supervisor.liveness import taken_stacks, watch
from raytrain_sys.control.supervisor.membership import Membership, NeedsRestore
from raytrain_sys.control.supervisor.recovery import Recovery
from raytrain_sys.control.supervisor.requests import RunRequests
from raytrain_sys.control.supervisor.steps import Steps, _Dispatch
from raytrain_sys.control.supervisor.stragglers import Rebalance, Replace, Stragglers
from raytrain_sys.control.worker_group import Worker
from raytrain_sys.errors import StorageError, TrainingFailed, find_user_error
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)

# How long a boundary waits for its lookup of the draining nodes before it goes on with the
# newest answer it has (the lookup goes on in its thread: see Boundary._draining).
DRAIN_WAIT_S = 0.5


class Boundary:
    def __init__(self, spec: JobSpec, transition: Callable, membership: Membership, steps: Steps,
                 checkpoints: Checkpoints, evaluation: Evaluation | None, stragglers: Stragglers,
                 requests: RunRequests, recovery: Recovery):
        self.spec, self.transition, self.membership, self.steps = spec, transition, membership, steps
        self.checkpoints, self.evaluation, self.stragglers = checkpoints, evaluation, stragglers
        self.requests, self.recovery, self.group = requests, recovery, membership.group
        self.early_stop = ""  # the reason, once train.early_stop ended the run
        self.straggler: tuple[Worker, str] | None = None  # to replace (elastic.straggler_policy)
        self._straggler_stacks: tuple = ()  # its (phase, stacks) asked at its verdict, mid-step
        self.redeal: tuple[int, tuple[int, ...]] | None = None  # (generation, rows): a rebalance asked
        self._old_split_through = 0  # leases sent before that rebalance: not observed after it
        self.drains: tuple = ()  # (node, deadline) of the draining nodes at the newest lookup
        self._last_drain_poll = -float("inf")
        self._drain_lookup: InBackground | None = None  # a lookup still running in its thread
        self.training_on: set[str] = set()  # draining nodes whose members await successors
        self.step = steps.committed_step  # the committed step at the newest boundary
        self._members_seen: tuple = (None, ())  # (key, members as the plan sees them): see _members

    # ------------------------------------------------------------------ facts and plan
    def run(self, last: int) -> bool:
        """Carry out this boundary's plan item by item, planning again after each on the facts
        as they now are; True when the plan ends the step loop here."""
        step, tried = self.steps.committed_step, set()
        while True:
            if self.steps.committed_step != step:  # a restore moved the boundary: a new one
                step, tried = self.steps.committed_step, set()
            items = policy.plan(self.facts(step, last, step > self.step, frozenset(tried)), self.spec)
            if not items or isinstance(items[0], policy.StopTraining):
                self.step = step
                return bool(items)
            self.carry_out(items[0])
            tried.add(policy.kind(items[0]))

    def meanwhile(self, step: int, last: int) -> str:
        """While a lease runs: the plan for the boundary at ``step``, the earliest the lease can
        end at. Its items that need no boundary are carried out now; returns why it needs the
        boundary ("" when it does not: the lease runs on)."""
        items = policy.plan(self.facts(step, last, just_committed=True), self.spec)
        for item in items:
            if isinstance(item, policy.AT_ONCE):
                self.carry_out(item)
        return next((i.reason for i in items if not isinstance(i, policy.AT_ONCE)), "")

    def sends_ahead(self, step: int, last: int) -> bool:
        """Whether the lease from ``step`` is sent while the one before it runs (run-ahead): the
        plan for the boundary between them is empty (``policy.hold_reason``), and its first batch
        is read (else the dispatch would wait for it, the running lease unfollowed)."""
        return not policy.hold_reason(self.facts(step, last, just_committed=True), self.spec) \
            and not self.reads_awaited(step)

    def read_unless_due(self, step: int, last: int) -> bool:
        """At the boundary of ``step``, its plan carried out: wait for the reads its global batch
        needs, a slice at a time, and return False as soon as the boundary has work meanwhile (a
        pause or cancel, a drain notice, a resize: ``policy.boundary_due``), to plan it first.
        Sending the lease would wait for them inside the dispatch, deaf to that work: a new job's
        first read is made in its runner while its reader processes start, the reads after it
        wait for those (seconds on a busy node), and a pause one second into a job waited 7-8 s
        (benchmarks/scheduler.py --sections pause, 2026-12-06)."""
        while refs := self.reads_awaited(step):
            if policy.boundary_due(self.facts(step, last, just_committed=False), self.spec):
                return False
            ray.wait(refs, num_returns=len(refs), timeout=policy.BOUNDARY_POLL_S, fetch_local=False)
        return True

    def reads_awaited(self, step: int) -> list:
        """The reads in flight that step ``step``'s global batch waits for (``DataPlane.reads_awaited``)."""
        gbs = self.spec.train.global_batch_size
        at = self.steps.data_cursor + (step - self.steps.committed_step) * gbs
        return self.steps.data.reads_awaited(at, at + gbs)

    def facts(self, step: int, last: int, just_committed: bool, tried: frozenset = frozenset()) -> policy.Facts:
        """What the plan of the boundary at ``step`` depends on, gathered once."""
        g, ready = self.group, self.membership.ready()
        ceiling, why = self.requests.max_workers()
        redeal = self.redeal[1] if self.redeal and self.redeal[0] == g.generation else None
        return policy.Facts(
            step, last, members=self._members(), target=policy.target_size(self.spec, ceiling),
            ceiling_reason=why, pending=_seen(w for w in g.pending if w not in ready), ready=_seen(ready),
            draining=self._draining(), training_on=frozenset(self.training_on),
            straggler=(self.straggler[0].slot, self.straggler[1]) if self.straggler else None, redeal=redeal,
            stop=self.requests.stop(), early_stop=self.early_stop, just_committed=just_committed,
            saved=self.checkpoints.saved(step), evaluates=self.evaluation is not None, tried=tried,
            now_unix_s=time.time())

    def _members(self) -> tuple[policy.Member, ...]:
        """The members as the plan sees them, made again only when the group changed: a running
        lease is looked at four times a second, and remaking them is a look's one cost that grows
        with the ranks. The key holds the workers themselves (compared by identity first, so no
        field compare while the group stays as it is)."""
        g = self.group
        key = (g.generation, tuple(g.workers))
        if key != self._members_seen[0]:
            self._members_seen = (key, _seen(g.workers))
        return self._members_seen[1]

    def _draining(self) -> tuple:
        """Draining nodes and their deadlines, looked up every elastic.drain_poll_s (the newest
        answer in between; a failed lookup keeps it: a GCS hiccup must not stop training).

        The lookup runs in a thread of its own, waited for at most ``DRAIN_WAIT_S`` (a few
        milliseconds as a rule): one that takes longer is left running and its answer taken at a
        later boundary, and no other is started meanwhile. While the GCS is down (a head
        restart) a lookup waits for it, and the step loop, waiting in it, trained a step every
        1.7 s instead of every 0.15; no node can be drained meanwhile anyway (a drain is a GCS
        call)."""
        lookup = self._drain_lookup
        if lookup is None and time.monotonic() - self._last_drain_poll >= self.spec.elastic.drain_poll_s:
            self._last_drain_poll = time.monotonic()
            lookup = self._drain_lookup = InBackground(drain.draining_nodes, "drain-lookup").start()
            lookup.join(DRAIN_WAIT_S)
        if lookup is not None and lookup.done:
            self._drain_lookup = None
            try:
                self.drains = tuple((node, d.deadline_unix_s) for node, d in lookup.result().items())
            except Exception as exc:
                log.warning("could not read draining nodes: %s", exc)
        return self.drains

    # ------------------------------------------------------------------ the items
    def carry_out(self, item: policy.Item) -> None:
        m, step, workers = self.membership, self.steps.committed_step, self.group.workers
        if isinstance(item, (policy.Checkpoint, policy.Evaluate)):
            self.steps.after_pause()  # the next lease is no sample of the step deadline
        if isinstance(item, policy.Checkpoint):
            self.checkpoint(final=False, background=item.background)
        elif isinstance(item, policy.Evaluate):
            self._evaluate()
        elif isinstance(item, policy.ReplaceStraggler):
            (worker, why), self.straggler = self.straggler, None
            if worker in workers and len(workers) >= 2:  # else gone meanwhile, or nobody to take its state
                self._keep_straggler_stacks(worker, why)
                self.transition(State.DRAINING, f"straggler: worker {worker.slot} on node {worker.node_id[:8]} "
                                f"({why}) leaves at step {step}; a replacement is requested")
                m.leave([worker], step)
                self.recovery.reform(reason=f"straggler left: world {len(workers)}, replacement requested")
        elif isinstance(item, policy.Redeal):
            self.steps.rows_split, self.redeal = (self.group.generation, list(item.rows)), None
        elif isinstance(item, policy.Release):
            m.release(item.slots)
        elif isinstance(item, policy.LeaveDraining):
            self._leave_draining(m.by_slot(item.slots), item)
        elif isinstance(item, policy.TrainOnDraining):
            m.request(item.request)
            if not self.training_on & set(item.nodes):
                self.training_on |= set(item.nodes)
                self.transition(State.DRAINING, item.reason)
                self.transition(State.RUNNING, "waiting for replacements of draining workers")
        elif isinstance(item, policy.Shrink):
            self.transition(State.RESIZING, item.reason)
            m.release_newcomers(healthy=True)
            m.leave(m.by_slot(item.slots), step, healthy=True)
            self.recovery.reform(reason=f"shrunk to world {len(workers)}")
        elif isinstance(item, policy.RequestWorkers):
            m.request_replacements()
        elif isinstance(item, policy.Grow):
            ready = m.take_ready()
            self.transition(State.RESIZING, f"{len(ready)} worker(s) ready: growing to {len(workers) + len(ready)}")
            m.add(ready)
            self.recovery.reform(reason=f"grown to world {len(workers)}")
        elif isinstance(item, policy.Bench):
            m.bench(m.take_ready())
        else:
            raise TypeError(f"unknown boundary item {item!r}")

    def _leave_draining(self, leaving: list[Worker], item: policy.LeaveDraining) -> None:
        """Members on nodes marked for preemption leave at this boundary with no step lost:
        ready newcomers take the state over first (``HandOver``), or a checkpoint is saved first
        when the notice's time ran out (``SaveThenLeave``)."""
        step = self.steps.committed_step
        self.transition(State.DRAINING, item.reason)
        if isinstance(item.how, policy.HandOver):
            draining = {node for node, _ in self.drains}
            ready = [w for w in self.membership.take_ready() if w.node_id not in draining]
            self.membership.add(ready)
            self.recovery.reform(source_slot=leaving[0].slot,
                                 reason=f"{len(ready)} newcomer(s) hold the state of step {step}")
        elif isinstance(item.how, policy.SaveThenLeave) and not self.checkpoints.saved(step):
            self.checkpoint(final=False)
        self.membership.leave(leaving, step)
        if not self.group.workers:
            self.recovery.restore_from(NeedsRestore([], []))
        else:
            self.recovery.reform(reason=f"left draining node(s): world {len(self.group.workers)}")

    def observe(self, sent: _Dispatch, reports: list[dict], lo: int, hi: int) -> None:
        """The running lease's steps ``lo`` .. ``hi - 1``, reported: their per-rank times into the
        straggler window, then what elastic.straggler_policy asks (``Stragglers.decide``): a new
        split of the global batch (``Redeal`` at the next boundary; the steps of leases sent
        before it are not observed: they ran with the old one), or a slow member to replace."""
        if hi <= lo or sent.lease <= self._old_split_through:
            return
        self.stragglers.observe_reports(sent.part(lo, hi), reports[lo:hi], self.group.generation)
        decision = self.stragglers.decide(sent.step + hi)
        if isinstance(decision, Rebalance):
            self.redeal, self._old_split_through = (self.group.generation, tuple(decision.rows)), self.steps.leases
        elif isinstance(decision, Replace):
            f = decision.flagged
            self.straggler = (sent.members[f.rank], f"rank {f.rank} computes {f.ratio:.2f}x its peers' median")
            actor = self.straggler[0].actor  # where it spends its steps: its stacks now, mid-step
            self._straggler_stacks = (actor.phase.remote(), actor.stacks.remote())
        elif decision is not None:
            raise TypeError(f"unknown straggler decision {decision!r}")

    def _keep_straggler_stacks(self, worker: Worker, why: str) -> None:
        """A straggler replaced: the stacks taken at its verdict (mid-step) go to the log and the
        MLflow run (``Recovery.keep_stacks``) and into its event in summary.json's stragglers."""
        record = taken_stacks(worker, self._straggler_stacks, why, "straggler") if self._straggler_stacks else None
        self._straggler_stacks = ()
        if record is None:
            return
        self.recovery.keep_stacks({worker.slot: record}, "straggler")
        events = self.steps.summary.stragglers
        for i in range(len(events) - 1, -1, -1):  # its replace event, replaced whole (RunSummary.snapshot)
            if events[i]["action"] == "replace":
                events[i] = {**events[i], "top_frame": record["top_frame"], "stack": record["stack"]}
                break

    def _evaluate(self) -> None:
        """Evaluate the committed state; a member lost meanwhile is rebuilt around, and the
        evaluation asked again (of the same state). Then keep its checkpoint if it is the best
        (checkpoint.keep_best) and decide an early stop (train.early_stop)."""
        step, batches = self.steps.committed_step, len(self.evaluation.refs or []) or 1
        for attempt in range(3):
            t0, members = time.perf_counter(), list(self.group.workers)
            outcome = self.evaluation.call(self.group, step, self.steps._step_deadline_s(batches))
            if not outcome.failed:
                metrics = self.evaluation.record(step, outcome, time.perf_counter() - t0)
                break
            lost, reason = outcome.lost_among(members), f"evaluation at step {step} failed: {outcome.describe(members, False)}"
            if not lost and attempt == 2:
                raise TrainingFailed(reason)
            self.recovery.recover(lost, reason)
            if self.steps.committed_step != step:
                return  # restored an older checkpoint: the steps and this evaluation come again
        else:
            raise TrainingFailed(f"evaluation at step {step} failed three times")
        if self.spec.checkpoint.keep_best and self.evaluation.improves(metrics):
            if not self.checkpoints.saved(step):
                self.checkpoint(final=False)
            saved = [c for c in self.steps.summary.checkpoints if c["step"] == step]
            if saved:
                self.evaluation.mark_best(step, saved[-1]["uri"], metrics)
                self.checkpoints.checkpointer.keep_steps = {step}
        stop = self.evaluation.early_stop()
        if stop is not None:
            self.early_stop = f"{stop.reason} (at step {step})"

    # ------------------------------------------------------------------ saves
    def checkpoint(self, final: bool, background: bool = False) -> None:
        """Save the committed step (``Checkpoints.save``); a member lost meanwhile is rebuilt
        around and the save starts over. ``background`` (checkpoint.async_save): only the
        snapshots are waited for here, ``settle`` commits it later. A save in flight is settled
        first: a new one waits for it. A storage error fails a final save; a periodic one is
        tried again at the next interval (the state is still in memory)."""
        self.settle(wait=True)
        step = self.steps.committed_step
        if self.checkpoints.saved(step):
            return
        how = "periodic background" if background else "final" if final else "periodic"
        self.transition(State.CHECKPOINTING, f"{how} checkpoint at step {step}")
        try:
            for _ in range(3):
                saved = self.checkpoints.save(self.group, step, self.steps.data_cursor, background, watch, final)
                if isinstance(saved, WriterLost):
                    self.recovery.recover([saved.worker], saved.reason)
                    if self.steps.committed_step != step:
                        return  # the group fell back to an older checkpoint meanwhile
                    self.transition(State.CHECKPOINTING, f"checkpoint at step {step}, retried after a rebuild")
                    continue
                self.transition(State.RUNNING, f"checkpoint committed: {saved.info.uri}" if saved.info else
                                f"checkpoint of step {step}: snapshots taken in {saved.pending.stall_s:.2f} s, "
                                f"written in the background")
                return
            raise TrainingFailed(f"checkpoint at step {step}: members were lost during three attempts")
        except Exception as exc:
            user = find_user_error(exc)
            if user is None or not isinstance(user, StorageError):
                raise
            if final:
                raise StorageError(f"final checkpoint at step {step} could not be saved: {user}") from None
            log.warning("checkpoint at step %d failed, training continues: %s", step, user)
            self.transition(State.RUNNING, f"checkpoint at step {step} failed: {user}")

    def settle(self, wait: bool) -> None:
        """The background save in flight, if any: committed or abandoned (``Checkpoints.settle``)."""
        note = self.checkpoints.settle(self.group, wait, watch)
        if note:
            self.transition(None, note)


def _seen(workers) -> tuple[policy.Member, ...]:
    """Workers as the boundary plan sees them."""
    return tuple(policy.Member(w.slot, w.node_id) for w in workers)
