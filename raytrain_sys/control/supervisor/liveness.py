"""Is a member alive, and how did a step go on each member?

Owns: the verdict on members during a step and during a long call outside it
(``StepOutcome``: how one step went on each member; ``WorkerLost``), and the liveness pings
of those waits (the pings themselves are ``probe.ping_all``). It kills what it finds silent
(``WorkerGroup.reap``: a stopped process closes no socket, and its peers stay blocked until it
is gone) but never changes who is in the group: the lost members go back in the verdict, and
``membership`` removes them. It writes no state, counter or checkpoint; the timings come from
``policy``.

Failure detection: a lease is followed by rank 0's reports (``LeaseWatch``): each report is an
agreement of every rank at a step's end, so while they come every member is alive and nobody is
pinged (the driver's cost does not grow with the members per step). When they stop for
LIVENESS_EVERY_S the members are pinged every LIVENESS_EVERY_S and one silent for
PING_TIMEOUT_S is lost (a stopped process, a vanished machine that closes no socket); a step
that outlives its deadline (learned from the job's step times, elastic.hang_floor_s at least:
``policy.step_deadline_s``) is hung even when its members answer. Then, and at the lease's end,
``collect`` classifies every member's call: Ray reports a dead actor; survivors' collectives
fail when a peer's socket closes.

A step past its deadline whose members all answer: a hung rank and the ranks waiting on it look
alike from outside. Each rank's phase marker (raytrain_sys.parallel.phases, read on its control
path) tells them apart: ``find_hung`` names the ranks that are not inside the collective their
peers wait in (stuck computing, or waiting in another collective: one they skipped ahead to).
Their Python stacks are taken (every thread's, on the control path) before they are ended
(``TrainWorker.end_now``, with ``WorkerGroup.reap`` behind it): their sockets close, so the ranks
waiting on them fail at once instead of waiting out their collective's timeout (measured with
gloo: a killed peer's collectives fail within milliseconds on every other rank, where gloo's own
abort of the process group leaves a pending collective waiting). ``StepOutcome.hangs`` keeps
the findings, stacks included, for the recovery record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import ray

from raytrain_sys.control.supervisor.policy import (BLOCKED_WITH_COPIES_S, LIVENESS_EVERY_S, PING_TIMEOUT_S,
                                                    collective_timeout_s)
from raytrain_sys.control.supervisor.probe import ping_all
from raytrain_sys.control.worker_group import Worker, WorkerGroup
from raytrain_sys.parallel.phases import IN_COLLECTIVE, ORDER, describe


@dataclass
class StepOutcome:
    """How one step went on each member, keyed by worker slot."""

    results: dict[int, dict] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)  # dead, hung or unreachable: removed
    errored: dict[int, str] = field(default_factory=dict)  # alive; its collective failed
    blocked: dict[int, str] = field(default_factory=dict)
    # members found hung at the step's deadline (``find_hung``), each one also in ``lost``: what
    # they were doing, their stacks (``hang_record``)
    hangs: dict[int, dict] = field(default_factory=dict)
    failed: bool = False
    detected_at_unix_s: float = 0.0  # when the first failure of the step was seen

    def lost_among(self, members: list[Worker]) -> list[Worker]:
        return [w for w in members if w.slot in self.lost]

    def describe(self, members: list[Worker], nodes: bool = True) -> str:
        """What failed, for the record: each lost member (with its node), each error."""
        where = (lambda w: f" on node {w.node_id[:8]}") if nodes else (lambda w: "")
        return "; ".join([f"worker {w.slot}{where(w)} {self.lost[w.slot]}" for w in self.lost_among(members)]
                         + [f"worker {s} error: {m}" for s, m in self.errored.items()])

    def note_failures(self) -> None:
        self.failed = bool(self.lost or self.errored)
        if self.failed and not self.detected_at_unix_s:
            self.detected_at_unix_s = time.time()


class WorkerLost(Exception):
    """A member died or stopped answering during a call outside the step."""

    def __init__(self, worker: "Worker", reason: str):
        super().__init__(reason)
        self.worker, self.reason = worker, reason


def collect(group: WorkerGroup, members: list[Worker], refs: list, step: int,
            deadline_s: float, since: float | None = None, blocked_s: float | None = None) -> StepOutcome:
    """Wait for a step on every member; classify each as done, errored or lost.

    Lost = dead (Ray reports the actor died), or not answering a ping on its control path
    (a stopped process or a vanished node). Members still in the step after LIVENESS_EVERY_S
    are pinged every LIVENESS_EVERY_S; one silent for PING_TIMEOUT_S is lost at once, long
    before the step deadline (a vanished machine closes no socket: without this its peers
    would wait in their all-reduce until the deadline). The deadline itself catches members
    that answer but do not progress. Survivors whose collective failed because a peer
    vanished report an error quickly; a peer blocked in a collective still answers pings.
    Members found silent are killed; removing them is the caller's (``membership``).
    ``since``: when the deadline started (``time.monotonic()``; now if None). ``blocked_s``: how
    long members still blocked once the lost are killed are waited for before they count as lost
    too, when some other member is out of the step (default, and otherwise: until their
    collective times out).
    """
    outcome = StepOutcome()
    by_ref = dict(zip(refs, members))
    pending = list(refs)
    t_start = time.monotonic()
    deadline = (t_start if since is None else since) + deadline_s
    pings: dict[int, tuple[object, float]] = {}  # slot -> (ping ref, sent at)
    while pending:
        # Once something failed, the rest finish (or fail) fast: their collective broke.
        now = time.monotonic()
        limit = deadline if not outcome.failed else min(deadline, now + 2.0)
        if now >= limit:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(limit - now, LIVENESS_EVERY_S))
        if ready and pending:
            # Take every result already in, in one call: the members of a step end together,
            # and a wait per member costs the driver O(N) each (O(N^2) a step).
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0, fetch_local=True)
            ready += more
        try:
            values = ray.get(ready)
        except ray.exceptions.RayError:
            values = None  # one of them failed: take them one by one below
        for i, ref in enumerate(ready):
            w = by_ref[ref]
            try:
                outcome.results[w.slot] = values[i] if values is not None else ray.get(ref)
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError,
                    ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError) as exc:
                # OwnerDiedError: the call was made by the member's node agent, which died with
                # its node (node_agent).
                outcome.lost[w.slot] = f"died ({type(exc).__name__})"
            except ray.exceptions.RayTaskError as exc:
                outcome.errored[w.slot] = str(exc).strip().splitlines()[-1][:300]
        outcome.note_failures()
        if pending and time.monotonic() - t_start >= LIVENESS_EVERY_S:
            silent = check_liveness([by_ref[r] for r in pending], pings)
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
        if outcome.blocked and not outcome.lost and not outcome.errored and time.monotonic() >= deadline:
            # Past the deadline, every member still in the step answering: name the hung ones.
            outcome.hangs = name_hung([w for w in stuck if w.slot in outcome.blocked], deadline_s)
            for slot, record in outcome.hangs.items():
                del outcome.blocked[slot]
                outcome.lost[slot] = record["reason"]
        outcome.note_failures()
        stuck = [by_ref[r] for r in pending]
        # Kill what is lost so that blocked peers' collectives fail, then wait for them.
        for w in stuck:
            if w.slot in outcome.hangs:
                w.actor.end_now.remote()  # at once (it answers); the reap below if it does not
            elif outcome.hangs and w.slot in outcome.blocked:
                w.actor.abort_group.remote()  # NCCL: a dead peer does not release it (parallel/backend.py)
        group.reap([w for w in stuck if w.slot in outcome.lost])
        still = [r for r in pending if by_ref[r].slot in outcome.blocked]
        if still:
            # Their collective fails as soon as the lost members' sockets close, or at the
            # latest at its timeout (a vanished machine closes none).
            # A short wait (blocked_s) only where some member is out of the step (it failed or
            # finished): they rebuild the group. Members all blocked may be waiting on a vanished
            # machine, whose sockets close when its processes end: they are waited for.
            short = blocked_s is not None and bool(outcome.errored or outcome.results)
            done, late = ray.wait(still, num_returns=len(still), timeout=blocked_s if short
                                  else max(30.0, collective_timeout_s(deadline_s) + PING_TIMEOUT_S))
            for ref in done:
                w = by_ref[ref]
                outcome.blocked.pop(w.slot)
                try:
                    outcome.results[w.slot] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    outcome.lost[w.slot] = "died"
                except ray.exceptions.RayTaskError as exc:
                    why = str(exc).strip().splitlines()[-1][:300]
                    outcome.errored[w.slot] = f"released when the hung worker(s) ended ({why})" if outcome.hangs else why
            for ref in late:
                outcome.lost[by_ref[ref].slot] = "blocked in a collective after its peers were lost"
            outcome.blocked.clear()
    outcome.note_failures()
    return outcome


def find_hung(phases: dict[int, dict], now_unix_s: float) -> dict[int, str]:
    """Which members of a step past its deadline are hung, from their phases (``{slot:
    TrainWorker.phase()}``): slot -> why, for each one named; {} when none can be named.

    The collective the peers wait in is the earliest one (by step, then by the phase's place in
    the step, ``phases.ORDER``) that any member is inside. Hung are the members that are not in
    it: every member outside any collective (stuck computing: the loss, a data phase, the
    optimizer, or idle while its peers wait in the step), or, when every member is in some
    collective, the members of that collective's process group that are in another one (they
    skipped ahead). Nobody is named when no member is in a collective (all computing: a step
    longer than its deadline) or all are in the same one (they wait on something outside the
    group: a vanished peer is the pings' to find)."""
    waiting = {s: p for s, p in phases.items() if p["phase"] in IN_COLLECTIVE}
    if not waiting:
        return {}
    first = min(waiting.values(), key=lambda p: (p["step"], ORDER[p["phase"]]))
    where = describe(first)
    hung = {s: p for s, p in phases.items() if s not in waiting}
    if not hung:
        at, group = (first["step"], first["phase"]), first["group"]
        hung = {s: p for s, p in phases.items()
                if (p["step"], p["phase"]) != at and (group is None or p["rank"] in group)}
    return {s: (f"skipped {where}, which its peers wait in: it waits in {describe(p)}"
                if s in waiting else
                f"stuck in {describe(p)} for {now_unix_s - p['since_unix_s']:.1f} s while its peers wait in {where}")
            for s, p in hung.items()}


def name_hung(members: list[Worker], deadline_s: float) -> dict[int, dict]:
    """The members of a step past its deadline that are hung (``find_hung`` on their phases,
    read on their control paths), each with its record (``hang_record``): its stacks taken
    before it is ended. {} when a member does not answer or none can be named."""
    asked = {w.slot: w.actor.phase.remote() for w in members}
    done, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=PING_TIMEOUT_S)
    if len(done) < len(asked):
        return {}
    try:
        phases = dict(zip(asked, ray.get(list(asked.values()))))
    except ray.exceptions.RayError:
        return {}
    hung = find_hung(phases, time.time())
    by_slot = {w.slot: w for w in members}
    asked = {slot: by_slot[slot].actor.stacks.remote() for slot in hung}
    ray.wait(list(asked.values()), num_returns=len(asked), timeout=PING_TIMEOUT_S)
    records = {}
    for slot, why in hung.items():
        try:
            stacks = ray.get(asked[slot], timeout=0)
        except Exception as exc:  # (a timeout or a death: named all the same, without its stacks)
            stacks = {"threads": [], "top": {}, "text": f"(no stacks: {type(exc).__name__})"}
        records[slot] = hang_record(by_slot[slot], phases[slot], why, stacks, deadline_s)
    return records


def hang_record(worker: Worker, phase: dict, why: str, stacks: dict, deadline_s: float, kind: str = "hung") -> dict:
    """What is kept of a member found hung (summary.json's recovery record, the log, the MLflow
    run's ``hangs/`` artifact), or of a straggler replaced (``kind``): its phase, why it was
    named, the top frame of its training thread and every thread's stack."""
    top = stacks.get("top") or {}
    short = "/".join(top.get("file", "").split("/")[-2:])
    where = f"; top frame {short}:{top['line']} in {top['function']}" if top else ""
    return {"slot": worker.slot, "rank": phase.get("rank", -1), "node": worker.node_id, "pid": stacks.get("pid"),
            "phase": phase["phase"], "step": phase["step"] + 1, "deadline_s": round(deadline_s, 3),
            "reason": f"{kind}: {why}{where}", "top_frame": top, "threads": stacks.get("threads", []),
            "stack": stacks.get("text", "")}


def taken_stacks(worker: Worker, asked: tuple, why: str, kind: str) -> dict | None:
    """``hang_record`` of ``worker`` from its (phase, stacks) asked earlier (``asked``: the two
    calls' references, made while it trained: a straggler's stacks at its verdict, mid-step);
    None when it did not answer."""
    try:
        phase, stacks = ray.get(list(asked), timeout=PING_TIMEOUT_S)
    except Exception:  # (lost meanwhile, or slow to answer: the straggler leaves all the same)
        return None
    return hang_record(worker, phase, why, stacks, 0.0, kind)


class LeaseWatch:
    """A lease followed while it runs (``wait``): rank 0's reports as they come (``reports``,
    each one every rank's parts of a finished step, agreed by all of them: while reports come,
    every member is alive and nobody is pinged). The report of the lease's last step (or of the
    step it was cut after) ends it: every rank finished it, so nothing more is waited for (the
    other members' calls end by themselves). Members are pinged only when no report came for
    LIVENESS_EVERY_S (one silent for PING_TIMEOUT_S is lost, and killed); the step deadline
    counts from the newest report. When the lease failed or a member was lost, every member's
    call is collected (``collect``) into the lease's ``StepOutcome``."""

    def __init__(self, group: WorkerGroup, members: list[Worker], member_refs: Callable[[], list], reporter,
                 step: int, last_step: int, step_deadline_s: float, copies: bool = False):
        # member_refs: each member's call of the lease, asked for only when they are collected
        # (through node agents the driver holds rank 0's alone until then: _Dispatch.member_refs)
        self.group, self.members, self.member_refs, self.reporter = group, members, member_refs, reporter
        self.step, self.last_step, self.deadline_s = step, last_step, step_deadline_s
        # With peer copies, nothing is lost by giving up on a member blocked after its peers
        # were lost (its copies are rescued): collect waits BLOCKED_WITH_COPIES_S for it.
        self.blocked_s = BLOCKED_WITH_COPIES_S if copies else None
        self._ended = False  # the report of the lease's last step came
        self.reports: list[dict] = []
        self._progress = time.monotonic()  # the newest report (or the lease's start)
        self._pings: dict[int, tuple[object, float]] = {}
        self._error = ""  # rank 0's lease raised this
        self._silent: dict[int, str] = {}  # members found silent while following
        self._detected_at = 0.0
        self._done = False

    def wait(self, timeout_s: float) -> StepOutcome | None:
        """The lease's outcome once it ended; None if it still runs after ``timeout_s``."""
        until = time.monotonic() + timeout_s
        while not self._done:
            now = time.monotonic()
            if until - now < 0.001:  # Ray's wait rounds a timeout under 1 ms to 0: it would spin
                return None
            ready, _ = ray.wait([self.reporter], timeout=min(until - now, LIVENESS_EVERY_S))
            if ready:
                self._take()
            elif time.monotonic() - self._progress >= LIVENESS_EVERY_S:
                self._check()
        return self._outcome()

    def _take(self) -> None:
        try:
            ref = next(self.reporter)
        except StopIteration:  # the lease ended on rank 0
            self._done = True
            return
        try:
            self.reports += ray.get(ref)
            self._progress = time.monotonic()
            self._ended = self._done = self.reports[-1]["cut"] or self.reports[-1]["step"] >= self.last_step
        except ray.exceptions.RayTaskError as exc:  # its step failed: a peer lost, or an error
            self._error, self._done = str(exc).strip().splitlines()[-1][:300], True
        except ray.exceptions.RayError:  # rank 0 died: its call's end says so
            self._done = True

    def _check(self) -> None:
        silent = check_liveness(self.members, self._pings)
        if silent:
            for w in silent:
                self._silent[w.slot] = (f"hung: no answer on its control path for {PING_TIMEOUT_S:g} s "
                                        f"(stopped, or its node is unreachable)")
            self._detected_at = time.time()
            self.group.reap(silent)  # so that its peers' collectives fail, and the lease ends
            self._done = True
        elif time.monotonic() - self._progress >= self.deadline_s:
            self._done = True  # no step finished by the deadline: ``collect`` gives the verdict

    def _outcome(self) -> StepOutcome:
        if self._ended:
            return StepOutcome()  # every rank finished the lease: its last report is their agreement
        outcome = collect(self.group, self.members, self.member_refs(), self.step, self.deadline_s,
                          since=self._progress, blocked_s=self.blocked_s)
        rank0 = self.members[0].slot
        if self._error and rank0 in outcome.results:  # a generator's end is not its error
            del outcome.results[rank0]
            outcome.errored[rank0] = self._error
        for slot, why in self._silent.items():
            outcome.results.pop(slot, None)
            outcome.errored.pop(slot, None)
            outcome.lost[slot] = why
        outcome.note_failures()
        if self._detected_at:
            outcome.detected_at_unix_s = min(outcome.detected_at_unix_s or self._detected_at, self._detected_at)
        return outcome


def check_liveness(workers: list[Worker], pings: dict[int, tuple[object, float]]) -> list[Worker]:
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


def watch(group: WorkerGroup, worker: Worker, ref, what: str, ping_every_s: float = LIVENESS_EVERY_S):
    """The result of ``ref`` (a call on ``worker``), waiting as long as the worker stays
    responsive: a call that may rightly take long (a checkpoint of a big model) gets no
    deadline, but a worker that stops answering its control path is lost (SIGSTOP, a vanished
    node): killed, and ``WorkerLost`` raised."""
    while True:
        ready, _ = ray.wait([ref], timeout=ping_every_s)
        if ready:
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise WorkerLost(worker, f"died during {what} ({type(exc).__name__})") from None
        _, dead, silent = ping_all([worker])
        if dead:
            raise WorkerLost(worker, f"died during {what}")
        if silent:
            group.reap([worker])
            raise WorkerLost(worker, f"hung during {what}: no answer on its control path")
