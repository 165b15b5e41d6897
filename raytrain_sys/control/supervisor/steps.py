"""The step traffic: send a step to the members, settle one that a failure voided, commit one.

Owns: the committed-step counter and the data cursor (only ``Steps`` writes them: ``commit``
advances them, ``rewind`` sets them to a restored checkpoint's), the recent step times, the
steps kept to be sent again after a rebuild, and the per-step records of summary.json
(losses, world sizes, throughput, committed_steps, data_cursor, steps_redone, and the refresh
of cost), the step metrics sent to MLflow and to Prometheus (``monitor.metrics``) and the sample
log. Calls no other part of the Supervisor.

Leases: one call to each member carries ``count`` consecutive steps (``policy.lease_steps``:
one while step times are unknown, many when steps are short), so the driver's cost per call
(a Ray call per member, sent and collected) is shared by the steps of the lease. Rank 0's call
reports each finished step as it goes (``TrainWorker.report_steps``, a Ray generator: one
report a step, or every REPORT_EVERY_S), and each report holds every rank's parts of the step
(the ranks agree on them in the step's all-gather), so the driver learns how the lease goes
without a call per rank per step; the other ranks' calls return how many steps they ran. Each
step is committed on its own, in order, at the lease's end (``commit_lease``, from the reports).
A lease is cut short when a boundary becomes due (``cut``: one call to rank 0, agreed by every
rank at the end of the step it is in); its remaining steps, and the lease sent ahead of it
(which then never starts), are sent again after the boundary. A member keeps the results of its
recent steps (``TrainWorker.lease_results``): when a lease fails part-way, the steps that
finished on the survivors are committed from them, not redone.

Run-ahead: while lease k runs, the next one is already sent (``dispatch(k + n, after=...)``)
when the boundary between them has nothing to do; the members start it as they finish lease k,
so the driver's dispatch and commit are off the critical path. A lease that fails voids the one
after it: its members refuse it or fail in its first collective, and ``settle`` waits for that
before the rebuild. Nothing is committed out of order: a lease is collected only after the one
before it committed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import ray

from raytrain_sys.control.adoption import Running
from raytrain_sys.control.run_record import SAMPLE_LOG_FILE, RunSummary
from raytrain_sys.control.supervisor.liveness import StepOutcome
from raytrain_sys.control.supervisor.policy import (GROUP_WARMUP_STEPS, PING_TIMEOUT_S, collective_timeout_s,
                                                    lease_steps, node_agents_on, steady_step, step_deadline_s,
                                                    summary_due)
from raytrain_sys.control.worker import AGREED, ranks_loss
from raytrain_sys.control.worker_group import Worker, WorkerGroup
from raytrain_sys.data.batches import GlobalBatch, rank_plans
from raytrain_sys.data.plane import DataPlane
from raytrain_sys.monitor.cost import CostMeter
from raytrain_sys.monitor.metrics import RunMetrics
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


# How much of the sample log's end is read for its newest step (``sampled_through``): more than a
# line (a step's ids: a global batch of 4,096 rows is about 30 KB).
SAMPLE_TAIL_BYTES = 1 << 20


@dataclass
class _Dispatch:
    """A lease sent to the members (steps ``step`` .. ``end - 1``): what their commits (or their
    redo after a failure) need."""

    step: int  # the lease's first step
    members: list[Worker]
    refs: list  # one call per member; each returns a list of per-step results
    batches: list[GlobalBatch]  # one per step: references, sample ids and loss units; never the rows
    shares: list[slice]
    deadline_s: float  # of the whole lease
    t0: float  # when the members could start it (perf_counter)
    data_wait: float
    sent_ahead: bool  # sent while the lease before it ran
    lease: int = -1  # the lease's id: the run's leases in the order sent
    reporter: object = None  # rank 0's reports (TrainWorker.report_steps, a Ray generator)
    # Sent through node agents (``node_agent``): ``refs`` holds rank 0's alone until the
    # failure path asks for the others (``member_refs``); per agent, (agent, its lease call,
    # the member indices it submitted for, in order).
    agents: list = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.batches)

    @property
    def end(self) -> int:
        return self.step + len(self.batches)

    def member_refs(self) -> list:
        """One reference per member (rank order) of its call of the lease. Sent through agents,
        the others' are asked of their agents here, once (the happy path never needs them); a
        member whose agent is lost or does not answer gets the asking call's reference, which
        reads as its death, or as silence (then ``collect`` pings the member itself)."""
        if self.agents and None in self.refs:
            refs = list(self.refs)
            asked = [(agent.refs.remote(self.lease), idx) for agent, _, idx in self.agents]
            for ask, idx in asked:
                try:
                    got = ray.get(ask, timeout=PING_TIMEOUT_S)
                except (ray.exceptions.RayError, TimeoutError):
                    got = None
                for k, i in enumerate(idx):
                    refs[i] = got[k] if got is not None and k < len(got) else ask
            self.refs[:] = refs  # shared with the lease's parts (``part``)
        return self.refs

    def part(self, lo: int, hi: int) -> "_Dispatch":
        """The lease's steps ``step + lo`` .. ``step + hi - 1`` (the ones a cut lease ran, or did not)."""
        return dataclasses.replace(self, step=self.step + lo, batches=self.batches[lo:hi])


def _answers(refs: list) -> list:
    """Each call's answer, or None where it failed or did not come within PING_TIMEOUT_S."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=PING_TIMEOUT_S))
        except (ray.exceptions.RayError, TimeoutError):
            out.append(None)
    return out


def rank_results(reports: list[dict]) -> list[list[dict]]:
    """Per member (rank order), one result per step, from rank 0's reports of the steps
    (``TrainWorker._agree``: every rank's parts of each step; lr and grad norm are every rank's)."""
    rows = [(r["lr"], r["grad_norm"], r["ranks"].tolist()) for r in reports]
    return [[{**dict(zip(AGREED, ranks[i])), "lr": lr, "grad_norm": norm} for lr, norm, ranks in rows]
            for i in range(len(reports[0]["ranks"]))] if reports else []


def report_results(reports: list[dict]) -> list[dict]:
    """Each step's result from rank 0's reports of a lease, as ``commit`` reads it: the ranks'
    losses summed (in rank order, as a sum over their results would: a running sum, for every
    step of the lease at once), the step's lr and grad norm, and the slowest rank's compute; no
    record per rank."""
    if not reports:
        return []
    ranks = np.stack([r["ranks"] for r in reports])  # (steps, ranks, AGREED)
    loss = ranks_loss(ranks).tolist()
    compute = ranks[:, :, AGREED.index("compute_s")].max(axis=1).tolist()
    return [{"loss_sum": s, "lr": r["lr"], "grad_norm": r["grad_norm"], "compute_s": c}
            for r, s, c in zip(reports, loss, compute)]


# RAYTRAIN_NODE_AGENTS: auto (unset: from policy.NODE_AGENTS_FROM members), on or off; 1 and 0
# as before auto existed.
_NODE_AGENTS_ENV = os.environ.get("RAYTRAIN_NODE_AGENTS", "")


class Steps:
    """The step ledger and the calls that move it, for one run."""

    # One call per agent per lease (``node_agent``: each node's ranks answer to its agent), not one
    # per rank, from policy.NODE_AGENTS_FROM members on (auto, the default): below it the agent's
    # hop costs a small run more than its fan-in saves (2-4 ranks: 25% more wall time on the
    # fault-tolerance tests' runs; 16-32 paced stand-ins: no driver CPU saved). The ranks answer to
    # their agents in every mode. "on" and "off" are kept to measure (benchmarks/control_plane.py).
    node_agents = {"": "auto", "1": "on", "0": "off"}.get(_NODE_AGENTS_ENV, _NODE_AGENTS_ENV)

    def __init__(self, spec: JobSpec, data: DataPlane, group: WorkerGroup, task, summary: RunSummary,
                 tracker, on_step: Callable[[StepReport], None] | None, flops_per_token: float,
                 metrics: RunMetrics, cost: CostMeter):
        self.spec, self.data, self.group, self.task = spec, data, group, task
        self.summary, self.tracker, self.on_step = summary, tracker, on_step
        self.metrics, self.cost = metrics, cost
        self._flops_per_token = flops_per_token
        self.committed_step = 0
        self.data_cursor = 0
        self._resend: dict[int, GlobalBatch] = {}  # batches of steps voided by a failure, by step
        self._members: list[Worker] = []  # of the newest lease sent: whose nodes a new group may have lost
        self._step_times: deque[float] = deque(maxlen=50)
        # The steady ones among them, which the step deadline is learned from (policy.steady_step),
        # and the first step of the lease after a checkpoint or an evaluation (``after_pause``).
        self._steady_times: deque[float] = deque(maxlen=50)
        self._pause_step = -1
        self._sample_log = None
        self._run_t0 = time.perf_counter()
        self._compute_s: list[float] = []  # train.compile: the first steps' compute times
        # (generation, rows per data index): the split of the global batch a straggler's
        # rebalance asked for (stragglers.Rebalance), for that process group only; else even.
        self.rows_split: tuple[int, list[int]] | None = None
        self.leases = 0  # leases sent so far: the newest one's id
        self._group_steps = (0, 0)  # (generation, steps committed by that process group)
        self.cut_through = -1  # the newest lease a cut was asked for (``cut``)
        self._summary_written = (0.0, 0.0)  # the step loop's last summary.json write: (end, seconds)
        # Steps whose metrics the run's MLflow run has already (an adopted launch's lost driver
        # logged them): not logged twice (``adopt``).
        self.logged_through = 0

    # ------------------------------------------------------------------ the run's step loop
    def open(self, run_dir: str) -> None:
        """The step loop begins: fresh step times, the sample log opened (data.log_sample_ids)."""
        if self._sample_log is None and self.spec.data.log_sample_ids:  # (open already: an adoption's)
            self._sample_log = open(os.path.join(run_dir, SAMPLE_LOG_FILE), "a")
        self._step_times, self._steady_times = deque(maxlen=50), deque(maxlen=50)
        self._run_t0 = time.perf_counter()

    def close(self) -> None:
        if self._sample_log is not None:
            self._sample_log.close()
            self._sample_log = None

    def keep_for_resend(self, *sent: "_Dispatch | None") -> None:
        """Steps voided by a failure are sent again after the rebuild: their global batches are
        kept (a batch is a function of the cursor; the data plane may have dropped the window)."""
        self._resend = {d.step + i: b for d in sent if d is not None for i, b in enumerate(d.batches)}

    def _step_deadline_s(self, steps: int = 1) -> float:
        generation, in_group = self._group_steps
        new_group = generation != self.group.generation or in_group < GROUP_WARMUP_STEPS
        return step_deadline_s(self._steady_times, self.spec, steps, new_group)

    def after_pause(self) -> None:
        """A checkpoint or an evaluation at this boundary: the lease after it is no sample of the
        step deadline (``policy.steady_step``)."""
        self._pause_step = self.committed_step

    def lease_steps(self, step: int, last: int) -> int:
        """How many steps the call sending ``step`` carries (``policy.lease_steps``; the steps
        read ahead, reads finished but not yet taken included, are counted from where step
        ``step``'s global batch begins)."""
        gbs = self.spec.train.global_batch_size
        at = self.data_cursor + (step - self.committed_step) * gbs
        ready = self.data.rows_ahead(at, finished_reads=True) // gbs
        generation, in_group = self._group_steps
        in_group = in_group + (step - self.committed_step) if generation == self.group.generation else 0
        return lease_steps(step, last, self.spec, self._step_times, ready, in_group)

    def rewind(self, step: int, data_cursor: int) -> None:
        """A durable checkpoint of ``step`` was loaded: the ledger continues from it (steps
        committed after it are redone, and counted)."""
        redone = self.committed_step - step
        if redone > 0:
            log.warning("restored step %d: %d committed steps will be redone", step, redone)
            self.summary.steps_redone += redone
            self.metrics.redone(redone)
        self.committed_step = step
        self.data_cursor = data_cursor
        self.cost.rewind(step)
        # A resume into a new run dir has no record of earlier steps: keep "index i = step i+1".
        self.summary.truncate_to(step)
        missing = step - len(self.summary.losses)
        self.summary.losses += [None] * missing
        self.summary.world_sizes += [None] * missing
        self.summary.step_times += [None] * (step - len(self.summary.step_times))

    def adopt(self, run_dir: str, recorded: int, data_cursor: int, step: int, newest_lease: int) -> int:
        """The ranks of an adopted launch hold step ``step`` (``control.adoption``); the run's record
        ends at ``recorded`` (data cursor ``data_cursor``), its MLflow run at ``logged_through``.
        The steps between ``recorded`` and ``step`` were committed by the lost driver after its
        last record, or trained while no Supervisor was up: they are committed here from what the
        ranks kept of them (``TrainWorker.kept_results``, the two newest leases: every rank's loss
        as agreed), in order, each step's batch read again for its units and sample ids; a step
        no rank kept is committed with its loss unknown (NaN, in ``losses_partial``). Recorded
        steps whose metrics the lost driver had not yet sent to MLflow are logged now, from the
        ranks' results or the record. Leases are numbered on after ``newest_lease``. Returns how
        many steps had no kept result."""
        self.rewind(recorded, data_cursor)
        self.leases = max(self.leases, newest_lease)
        sampled = sampled_through(os.path.join(run_dir, SAMPLE_LOG_FILE))  # before the log is opened
        self.open(run_dir)
        first = min(recorded, self.logged_through)
        members = self.group.workers
        kept: dict[int, dict] = {}
        for w in members:  # any rank's kept results carry the whole step's loss (loss_all)
            kept = _answers([w.actor.kept_results.remote(first, step)])[0] or {}
            if len(kept) == step - first:
                break
        kept = {s: k for s, k in kept.items() if "loss_all" in k}
        gbs = self.spec.train.global_batch_size

        def units(s: int) -> int:  # step s's loss units: the ranks were given them (else read again)
            k = kept.get(s)
            return int(k["units"]) if k is not None and "units" in k else \
                self.data.global_batch_refs(data_cursor + (s - recorded) * gbs).units

        for s in range(first, recorded):  # recorded, not yet in MLflow: logged late
            k, dt = kept.get(s), self.summary.step_times[s]
            loss = self.summary.losses[s]
            world = self.summary.world_sizes[s] or len(members)
            metrics = self._step_metrics(loss if loss is not None else float("nan"),
                                         k or {"lr": float("nan"), "grad_norm": float("nan")},
                                         units(s), dt or float("nan"), 0.0, world)
            if self.tracker is not None:
                self.tracker.log_metrics(s + 1, metrics)
        shares = rank_data_slices(self.spec.parallel, len(members), gbs, None)
        for s in range(recorded, step):
            # The rows' ids only for the sample log (data.log_sample_ids), and only for the steps
            # the lost driver had not written there yet: else nothing is read.
            ids = self.data.global_batch_refs(data_cursor + (s - recorded) * gbs).ids \
                if self._sample_log is not None and s + 1 > sampled else None
            k = kept.get(s)
            if k is not None:
                dt = k["data_wait_s"] + k["compute_s"] + k["collective_s"] + k["optimizer_s"]
                self.commit(s, [{**k, "loss_sum": k["loss_all"]}], units(s), ids, shares, dt, 0.0, sample=False)
            else:
                self.commit(s, [], units(s), ids, shares, float("nan"), 0.0, world_size=len(members),
                            loss_units=0, sample=False)
        return sum(1 for s in range(recorded, step) if s not in kept)

    # ------------------------------------------------------------------ dispatch, settle, commit
    def dispatch(self, step: int, count: int = 1, after: "_Dispatch | None" = None) -> "_Dispatch":
        """Send steps ``step`` .. ``step + count - 1`` to every member, in one call each: where
        its rows of each step's global batch lie (object references and row ranges; the driver
        never holds the rows). The references are the call's own arguments, so Ray pulls each
        rank's pieces to its node before the lease starts there (while the one before it runs,
        under run-ahead).

        ``after``: the lease still running before this one (run-ahead); the members queue this
        one behind it and start it as they finish that one, with no round trip to the driver.
        """
        wait0 = self.data.wait_s
        members, batches, shares, sent = self._plan(step, count)
        deadline_s = self._step_deadline_s(count)
        timeout_s = collective_timeout_s(self._step_deadline_s())  # a collective is one step's
        self.leases += 1
        # Rank 0 reports as it goes; its generator's end stands for its call among the others'.
        reporter = members[0].actor.report_steps.remote(step, sent[0][0], timeout_s, *sent[0][1], lease=self.leases)
        refs, agents = [reporter.completed()] + [None] * (len(members) - 1), []
        if self.spec.data.delivery != "driver":
            agents = self._through_agents(members, sent, step, timeout_s, after)
        through = {i for _, _, idx in agents for i in idx}
        for i in [i for i in range(1, len(members)) if i not in through]:  # the driver's own calls
            plan, piece = sent[i]
            refs[i] = members[i].actor.train_steps.remote(step, plan, timeout_s, *piece, lease=self.leases)
        return _Dispatch(step, members, refs, batches, shares, deadline_s, time.perf_counter(),
                         self.data.wait_s - wait0, after is not None, self.leases, reporter, agents)

    def complete(self, running: Running) -> "_Dispatch":
        """The lease an adopted launch's lost driver had sent that only some members began
        (``control.adoption.Running``): the others (rank 0 among them) are sent their part of it
        now, the same lease (its id, its steps, their rows of the same batches: a function of
        the data cursor), and the ones that began it are followed to its end on their control
        path (``TrainWorker.lease_end``: their call of it was the lost driver's, or its agent's).
        Its steps are committed as any lease's. The lease after it waits for those ends on its
        members (``_through_agents``' ``after``), a lease's run-ahead given up once."""
        wait0 = self.data.wait_s
        members, batches, shares, sent = self._plan(running.first, running.count)
        timeout_s = collective_timeout_s(self._step_deadline_s())
        self.leases = max(self.leases, running.lease)
        missing = set(running.missing)
        assert members[0].slot in missing, "rank 0 of a lease to complete began it"
        reporter = members[0].actor.report_steps.remote(running.first, sent[0][0], timeout_s, *sent[0][1],
                                                        lease=running.lease)
        refs = [reporter.completed()]
        for w, (plan, piece) in zip(members[1:], sent[1:]):
            refs.append(w.actor.train_steps.remote(running.first, plan, timeout_s, *piece, lease=running.lease)
                        if w.slot in missing else w.actor.lease_end.remote(running.lease))
        return _Dispatch(running.first, members, refs, batches, shares, self._step_deadline_s(running.count),
                         time.perf_counter(), self.data.wait_s - wait0, False, running.lease, reporter)

    def _plan(self, step: int, count: int) -> tuple[list[Worker], list, list[slice], list]:
        """The members, the global batches of steps ``step`` .. ``step + count - 1``, each
        member's rows of them, and each member's call arguments (its plan, its pieces)."""
        spec = self.spec
        gbs = spec.train.global_batch_size
        members = list(self.group.workers)
        slots = {w.slot for w in members}  # by slot: Worker's dataclass equality compares every field
        departed = {w.node_id for w in self._members if w.slot not in slots}
        departed -= {w.node_id for w in members} if departed else set()
        self._members = members
        if departed and spec.data.delivery != "driver" and self.data.reread_lost(self.data_cursor, departed):
            self._resend = {}  # members left with their nodes, and read pieces there: the batches made anew
        # Each rank's rows: its data-parallel slice (TP/PP peers share one).
        split = self.rows_split
        rows = split[1] if split is not None and split[0] == self.group.generation else None
        shares = rank_data_slices(spec.parallel, len(members), gbs, rows)
        # Pieces read from now on line up with these shares (a rank then fetches its own rows only).
        self.data.share_rows = max(sl.stop - sl.start for sl in shares)
        batches = []
        for s in range(step, step + count):
            kept = self._resend.pop(s, None)
            # A batch is a function of the cursor: step s starts (s - committed) batches on.
            batches.append(kept if kept is not None else
                           self.data.global_batch_refs(self.data_cursor + (s - self.committed_step) * gbs))
        self._resend = {k: b for k, b in self._resend.items() if k >= step + count}
        if spec.data.delivery == "driver":  # every row through this process: to measure against
            rows = [self.data.rows(batch.start, batch.start + gbs)[0] for batch in batches]
            sent = [([({k: v[sl] for k, v in r.items()}, batch.units, ()) for batch, r in zip(batches, rows)], [])
                    for sl in shares]
        else:  # references and row ranges: each rank's rows go node to node, never through here
            # One plan of the lease shared by every rank, and per rank its rows and its pieces'
            # references, each once (a piece holds the rows of several steps; Ray's cost is per
            # reference passed), as the call's own arguments: nothing per rank per step.
            sent = rank_plans(batches, shares)
        return members, batches, shares, sent

    def _through_agents(self, members: list[Worker], sent: list, step: int, timeout_s: float,
                        after: "_Dispatch | None") -> list:
        """The lease to members 1.. in one call per agent (``node_agent``: the members that answer
        to it): the plan's bytes once, each rank's rows and piece map, the node's pieces each once.
        Returns, per agent, (agent, its call, the member indices it submitted for). A member's
        leases go through its agent once it answers to it (``NodeAgents.hand_over``: the agent
        is up; until then the driver calls it itself). A rank runs its leases in the order they
        reach it, and two callers' calls have no order: so when a member's lease before this one
        (``after``, sent ahead) was the driver's own call, the agent's waits for it (that call's
        reference is an argument of its call: Ray sends a call only once its arguments are
        ready), which costs that one lease its run-ahead on that member."""
        count, steps, entries = sent[0][0][:3]
        agents = self.group.agents
        agents.hand_over()
        before = {i for _, _, idx in after.agents for i in idx} if after is not None else set()
        runs: dict[tuple, list[int]] = {}
        for i in range(1, len(members)):
            if members[i].agent in agents.handles:
                runs.setdefault(members[i].agent, []).append(i)
        out = []
        for key, idx in runs.items():
            if not node_agents_on(self.node_agents, len(members), len(idx)):
                continue
            if not agents.handed(key, [members[i].slot for i in idx]):
                continue
            waits = [None if after is None or i in before else after.refs[i] for i in idx]
            if any(w is None and after is not None and i not in before for w, i in zip(waits, idx)):
                continue  # (the driver's call of the lease before is unknown: the driver's own, again)
            pieces: dict = {}
            ranks = [(members[i].slot, *sent[i][0][3:],
                      tuple(pieces.setdefault(r, len(pieces)) for r in sent[i][1]), wait)
                     for i, wait in zip(idx, waits)]
            call = agents.handles[key].lease.remote(self.leases, step, count, steps, entries, timeout_s, ranks,
                                                   list(pieces))
            out.append((agents.handles[key], call, idx))
        self.summary.agent_calls += len(out)
        return out

    def forget_agents(self, dispatch: "_Dispatch") -> None:
        """After a failed lease: an agent whose lease call failed is dead (its node lost), and its
        ranks with it (their claim): the group forgets it."""
        for agent, call, _ in dispatch.agents:
            if ray.wait([call], timeout=0)[0]:
                try:
                    ray.get(call)
                except ray.exceptions.RayError:
                    self.group.agents.lost(agent)

    def cut(self, running: "_Dispatch", through: int, end: int) -> None:
        """Cut the running lease short after step ``end - 1`` (or the step its rank 0 is in, if
        later), and the leases sent ahead of it up to ``through`` with it: one call to rank 0,
        on its control path (``TrainWorker.cut_lease``). Not waited for."""
        running.members[0].actor.cut_lease.remote(through, end)
        self.cut_through = through

    def drop(self, ahead: "_Dispatch") -> None:
        """The lease sent ahead of one that was cut short: its members end it at once, unstarted
        (``keep_for_resend`` keeps its batches)."""
        refs = ahead.member_refs()
        ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT_S)

    def settle(self, ahead: "_Dispatch", outcome: StepOutcome) -> None:
        """After a failed lease: wait for the lease sent ahead of it to end on every member still
        in the group. A member whose lease failed refuses the next one at once (it holds the
        wrong step); one whose lease finished runs into its peers' failure in the next lease's
        first collective. Its result is dropped: it was never committed, and the rebuild starts
        from the state the members hold. A member still in it past the collective timeout is lost
        (killed, and named in ``outcome.lost`` for the rebuild to remove).
        """
        in_group = {w.slot for w in self.group.workers}
        by_ref = {r: w for r, w in zip(ahead.member_refs(), ahead.members)
                  if w.slot in in_group and w.slot not in outcome.lost}
        if not by_ref:
            return
        _, late = ray.wait(list(by_ref), num_returns=len(by_ref),
                           timeout=collective_timeout_s(self._step_deadline_s()) + PING_TIMEOUT_S)
        while ray.wait([ahead.reporter], timeout=0)[0]:  # its refusal, read (not logged as unhandled)
            try:
                ray.get(next(ahead.reporter))
            except StopIteration:
                break
            except ray.exceptions.RayError:
                pass
        if late:
            stuck = [by_ref[r] for r in late]
            log.warning("worker(s) %s still in step %d after the lease before it failed: treated as lost",
                        ", ".join(str(w.slot) for w in stuck), ahead.step + 1)
            for w in stuck:
                outcome.lost[w.slot] = f"blocked in step {ahead.step + 1} after the lease before it failed"
            self.group.reap(stuck)

    def commit_lease(self, sent: "_Dispatch", reports: list[dict], elapsed_s: float) -> None:
        """Every member finished the lease: commit its steps in order (``reports``: rank 0's, one a
        step, every rank's parts as one array). The lease's time is shared evenly by its steps."""
        for i, (batch, result) in enumerate(zip(sent.batches, report_results(reports))):
            self.commit(sent.step + i, [result], batch.units, batch.ids, sent.shares,
                        elapsed_s / sent.count, sent.data_wait if i == 0 else 0.0, sample=sent.step != self._pause_step)
        self.metrics.ranks(rank_results(reports[-1:]), sent.members)  # the gauges show the last step
        self.summary.leases += 1

    def commit_finished(self, sent: "_Dispatch", outcome: StepOutcome, finished: int,
                        is_data_leader: Callable[[int], bool], elapsed_s: float, agreed_only: bool = False) -> None:
        """After a failed lease: commit its steps before ``finished`` (the newest step a survivor
        holds): they finished on some replica, so their updates are complete and correct (every
        rank's gradient went into the all-reduce). The loss is the whole step's when a survivor
        passed the step's agreement (``loss_all``), else that of the ranks whose results are
        known: the survivors' kept results of the steps they finished (``TrainWorker.lease_results``).
        ``agreed_only`` (peer copies): only the steps whose agreement a survivor passed, those
        every rank's copy of which is whole (raytrain_sys.control.peer_copies)."""
        members = sent.members
        if agreed_only and finished > sent.step:
            asked = [w.actor.agreed_steps.remote(sent.step) for w in members
                     if w.slot not in outcome.lost and w in self.group.workers]
            counts = [n for n in _answers(asked) if isinstance(n, int)]
            finished = sent.step + min(finished - sent.step, max(counts, default=0))
        if finished <= sent.step:
            return
        leaders = [i for i in range(len(members)) if is_data_leader(i)]  # the ranks whose loss counts
        known: dict[int, list[dict]] = {}
        asked = {i: members[i].actor.lease_results.remote(sent.step, finished) for i in range(len(members))
                 if members[i].slot not in outcome.lost and members[i] in self.group.workers}
        for i, kept in zip(asked, _answers(list(asked.values()))):
            # None: lost since, its rows' loss is not counted
            if kept is not None and len(kept) == finished - sent.step:
                known[i] = kept
        world = len(members)
        for j in range(finished - sent.step):
            batch = sent.batches[j]
            whole = next((kept[j] for kept in known.values() if "loss_all" in kept[j]), None)
            if whole is not None:  # a survivor passed the step's agreement: it knows every rank's loss
                results, loss_units = [{**whole, "loss_sum": whole["loss_all"]}], None
            else:
                # A peer lost in the agreement: the known data leaders' rows count (a partial
                # loss). With none known, another rank's result gives the step's lr and grad
                # norm (the same on every rank); the loss is then unknown (no units: NaN).
                done = [i for i in leaders if i in known]
                loss_units = sum(int(batch.row_units[sent.shares[i]].sum()) for i in done)
                results = [known[i][j] for i in done] or [known[i][j] for i in list(known)[:1]]
            self.commit(sent.step + j, results, batch.units, batch.ids, sent.shares, elapsed_s / sent.count,
                        sent.data_wait if j == 0 else 0.0, world_size=world, loss_units=loss_units, sample=False)
        self.summary.leases += 1
        log.info("steps %d..%d had finished on a survivor: committed, not redone", sent.step + 1, finished)

    def commit(self, step: int, results: list[dict], units: int, ids, shares: list[slice],
               dt: float, data_wait: float, world_size: int | None = None, loss_units: int | None = None,
               sample: bool = True) -> None:
        """``units``: the step's loss units (its trained tokens). ``loss_units``: those that the
        ``results`` count, when some ranks' results were lost (``commit_finished``): the loss is
        then theirs alone (NaN with none) and the step is in ``summary.losses_partial``.
        ``sample``: its time may teach the step deadline (not a failed lease's, nor the lease's
        after a checkpoint or an evaluation)."""
        spec = self.spec
        world = world_size or len(shares)
        self.committed_step = step + 1
        self.data_cursor += spec.train.global_batch_size
        generation, in_group = self._group_steps
        self._group_steps = (generation, in_group + 1) if generation == self.group.generation else \
            (self.group.generation, 1)
        if dt == dt:  # (NaN: the step's time is unknown, an adopted step no rank kept: not a sample)
            self._step_times.append(dt)
        if steady_step(self._group_steps[1], after_pause=not sample):
            self._steady_times.append(dt)
        counted = units if loss_units is None else loss_units
        loss = sum(r["loss_sum"] for r in results) / counted if counted else float("nan")
        if loss_units is not None and loss_units < units:
            self.summary.losses_partial.append(self.committed_step)
            log.warning("step %d's loss counts %d of its %d units: the results of ranks lost in its "
                        "agreement are gone", self.committed_step, loss_units, units)
        self.summary.losses.append(loss)
        self.summary.world_sizes.append(world)
        self.summary.step_times.append(dt)
        self.summary.committed_steps = self.committed_step
        if spec.train.compile and len(self._compute_s) < 4 and results:
            # The first step compiles: its compute time beyond the third one's is the compile time.
            self._compute_s.append(max(r.get("compute_s", 0.0) for r in results))
            if len(self._compute_s) == 4:
                self.summary.compile_s = max(0.0, self._compute_s[0] - sorted(self._compute_s[1:])[1])
                log.info("train.compile: about %.1f s of compilation in the first step", self.summary.compile_s)
                if self.tracker is not None:
                    self.tracker.log_metrics(self.committed_step, {"compile_s": self.summary.compile_s})
        self.summary.samples_consumed = self.data_cursor
        self.summary.data_cursor = self.data_cursor
        if self._sample_log is not None and ids is not None:  # (None: written by an adopted launch's lost driver)
            self._sample_log.write(_sample_line(self.committed_step, ids, shares))
            self._sample_log.flush()
        # Trained tokens: the targets the loss counted (padding of packed or bucketed rows and
        # document boundaries excluded; one image counts one for a classifier).
        tokens_per_step = units
        steady = list(self._step_times)[min(3, len(self._step_times) - 1):]
        mean_dt = sum(steady) / len(steady) if steady else float("nan")
        # The step's lr and grad norm (the same on every rank); unknown only when a failed lease's
        # step finished on ranks all lost since (commit_finished).
        first = results[0] if results else {"lr": float("nan"), "grad_norm": float("nan")}
        metrics = self._step_metrics(loss, first, tokens_per_step, dt, data_wait, world)
        if self.tracker is not None and self.committed_step > self.logged_through:  # queued: never waited on
            self.tracker.log_metrics(self.committed_step, metrics)
        self.cost.committed(self.committed_step, tokens_per_step)
        self.metrics.committed({**metrics, "samples_per_s": spec.train.global_batch_size / dt,
                                "committed_step": self.committed_step}, self.data, self.data_cursor)
        if self.on_step is not None:
            remaining = spec.train.max_steps - self.committed_step
            self.on_step(StepReport(self.committed_step, spec.train.max_steps, loss, first["lr"],
                                    tokens_per_step / mean_dt, dt, world, remaining * mean_dt))
        if self.committed_step % spec.train.log_every_steps == 0:
            self.summary.throughput = {
                "tokens_per_s": tokens_per_step / mean_dt, "step_time_s": mean_dt,
                "data_wait_fraction": self.data.wait_s / max(time.perf_counter() - self._run_t0, 1e-9)}
            self.record_cost()
            now = time.perf_counter()
            if summary_due(now, *self._summary_written):
                self.summary.write()
                self._summary_written = (time.perf_counter(), time.perf_counter() - now)

    def _step_metrics(self, loss: float, result: dict, tokens: int, dt: float, data_wait: float,
                      world: int) -> dict[str, float]:
        """A committed step's metrics (MLflow's, Prometheus'): ``result`` gives its lr and grad norm."""
        metrics = {"loss": loss, "lr": result["lr"], "grad_norm": result["grad_norm"],
                   "tokens_per_s": tokens / dt, "step_time_s": dt,
                   "data_wait_s": data_wait, "world_size": float(world)}
        if self._flops_per_token:
            # Model FLOPs utilization (PaLM, appendix B): achieved model FLOP/s over the peak of
            # the devices used; recomputation (activation checkpointing) does not count.
            achieved = tokens / dt * self._flops_per_token
            metrics["model_tflops_per_s"] = achieved / 1e12
            peak = self.spec.resources.peak_tflops_per_worker
            if peak:
                metrics["mfu"] = achieved / (world * peak * 1e12)
        return metrics

    def end(self) -> None:
        """The run ends: its cost refreshed."""
        self.record_cost()

    def record_cost(self) -> None:
        """Refresh summary.json's cost (when priced) in the record, MLflow and Prometheus."""
        if not self.cost.priced:
            return
        now = time.time()
        self.cost.hold(self.group.held, now)
        cost = self.summary.cost = self.cost.record(now)
        if self.tracker is not None:
            self.tracker.log_metrics(self.committed_step, {
                "cost_usd": cost["usd"], "cost_usd_per_million_tokens": cost["usd_per_million_tokens"],
                "goodput_cost_usd_per_million_tokens": cost["goodput_usd_per_million_tokens"]})
        self.metrics.cost(cost)


def sampled_through(path: str) -> int:
    """The newest step in the sample log at ``path`` (0: none, or no log). A last line cut short
    (its writer killed in the middle of it) is removed: that step is written again, whole."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - SAMPLE_TAIL_BYTES))
            tail = f.read()
            whole = tail.rfind(b"\n") + 1
            if whole < len(tail):  # a line cut short
                f.truncate(size - (len(tail) - whole))
    except FileNotFoundError:
        return 0
    lines = tail[:whole].splitlines()
    return int(json.loads(lines[-1])["step"]) if lines and lines[-1].strip() else 0


def _sample_line(step: int, ids, shares: list[slice]) -> str:
    """The audit record of a committed step: the sample ids of each data-parallel shard (TP and
    PP peers of a shard trained on the same rows, listed once)."""
    distinct = list(dict.fromkeys((sl.start, sl.stop) for sl in shares))
    return json.dumps({"step": step, "ranks": [ids[a:b].tolist() for a, b in distinct]}) + "\n"
