"""One scheduling pass: ``decide(snapshot, now_s) -> list[Action]``.

Owns: the choice of which waiting job starts (``Admit``), which running elastic job grows or
shrinks (``Grow``, ``Shrink``), which running job is paused (``Pause``), and why every waiting
job still waits (``Wait``, with its ``WaitCause``). It writes nothing: every action is a value with a reason, carried
out by the reconciler (the one writer of run-time transitions), which logs each one. Pure: no
Ray, no SQL, no clock of its own; the snapshot is never changed (all simulation happens on
private copies: ``FlavorQuotas`` and the ``_Pass`` counters).

A pass, in order:

1. **Admission**, waiting jobs in ``admission_order`` (best-effort FIFO: a job that does not fit
   waits and the next one is considered). A job is admitted at its ``min_workers`` (gang) when
   its team's quota and the cluster's free workers both hold them. Otherwise, if the workers are
   being released (shrinks and pauses in flight), it claims them and waits. Otherwise it tries a
   **reclaim**: first shrink elastic jobs (never below their min; loses no work), then pause jobs
   (least work at risk first), within its cohort, from

   * its own team: shrink jobs of equal or lower priority, pause jobs of lower priority only;
   * other teams that borrow beyond their nominal quota, and only the borrowed part: any of their
     jobs if the waiting job's team stays within its nominal quota (the quota is guaranteed);
     else as for its own team.

   A job of equal or higher priority is never paused for priority's sake. A reclaim is planned
   on a copy and issued only if it makes the job fit, and with no more victims than needed.
   A job that waited ``policy.reserve_after_s`` and is blocked only by free workers keeps them.
2. **Growth**: idle workers go one at a time (``growth_order``) to elastic jobs below their
   max_workers, borrowing within their team's limits. Capacity claimed by waiting jobs is not idle.

**Groups** (a sweep's trials: ``JobView.group``, ``snapshot.group_limits``): the jobs of a group
with a cap hold at most that many workers together (their targets, as quotas count them). A job
the cap blocks waits (``WaitCause.SWEEP_CAP``) and reclaims nothing (its victims would be its
own siblings, or others' jobs for a sweep that could not use them); growth stops at the cap.

A shrink or pause frees workers only when the runner has drained them, so the job it was for is
admitted by a later pass (which sees the smaller ``workers``), never by the same one.

**Flavors** (``snapshot.flavors``, Kueue's ResourceFlavors; none: the implicit flavor of
``cluster_workers`` worker slots, the service as it was). A job draws from the flavors its
shape fits (``ResourceFlavor.refuses``), tried in the table's order: the first where it fits
now, else the first with workers being released for it, else the first where a reclaim makes
room (Kueue's flavor fungibility: try the next flavor before preempting). Its workers then
stay on that flavor (``Admit.flavor``): quotas count per flavor and resource, capacity is per
flavor, victims of a reclaim are jobs on the flavor that is short, growth and reservations are
per flavor. An admission beyond what is up now but within the ceiling (autoscaling) is marked
``Admit.provisioning``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from raytrain_sys.service.flavors import FlavorState, WorkerShape, no_flavor_reason
from raytrain_sys.service.model import JobState, WaitCause
from raytrain_sys.service.scheduler.actions import Action, Admit, Grow, Pause, Shrink, Wait
from raytrain_sys.service.scheduler.snapshot import DEFAULT_POLICY, JobView, Policy, Snapshot
from raytrain_sys.service.teams import Team
from raytrain_sys.service.scheduler.ordering import (admission_order, effective_priority, growth_order,
                                                     pause_order, shrink_order)
from raytrain_sys.service.scheduler.quota import EPS, FlavorQuotas, fitting, never_fits_reason


def _workers(n: float) -> str:
    return f"{n:g} worker{'' if n == 1 else 's'}"


def decide(snapshot: Snapshot, now_s: float, policy: Policy = DEFAULT_POLICY) -> list[Action]:
    """The actions of one scheduling pass over ``snapshot`` at time ``now_s`` (see the module
    docstring). Deterministic: the same snapshot, time and policy give the same list."""
    return _Pass(snapshot, now_s, policy).run()


@dataclass
class _Reclaim:
    """A planned reclaim: the victims and what each gives back."""

    shrinks: list[tuple[JobView, int]]  # (job, its new target)
    pauses: list[JobView]
    released: dict[str, float]  # of each resource the flavor's capacity counts
    within_nominal: bool  # the waiting job's team stays within its nominal quota


class _Room:
    """One flavor's capacity during a pass, per resource: free now, free once the releases in
    flight have landed, and free of what is up now (autoscaling: the rest is being provisioned).
    Claims subtract from all three; a claim on workers being released leaves ``free_now`` at 0."""

    def __init__(self, state: FlavorState):
        self.state = state
        self.flavor = state.flavor
        self.name = state.flavor.name
        self.ceiling = state.capacity()
        self.free_now = dict(self.ceiling)
        self.free_after_release = dict(self.ceiling)
        self.present_free = state.capacity(present=True)
        self.reserved_for: Optional[JobView] = None

    def hold(self, shape: WorkerShape, held: float, releasing: float) -> None:
        """A live job holds ``held`` workers of ``shape`` here, ``releasing`` of them on their way back."""
        for r in self.free_now:
            self.free_now[r] -= held * shape.amount(r)
            self.free_after_release[r] -= (held - releasing) * shape.amount(r)
        for r in self.present_free:
            self.present_free[r] -= held * shape.amount(r)

    def workers_now(self, shape: WorkerShape) -> float:
        return fitting(self.free_now, shape)

    def workers_after_release(self, shape: WorkerShape, released: Optional[dict] = None) -> float:
        free = self.free_after_release if not released else {r: v + released.get(r, 0.0)
                                                             for r, v in self.free_after_release.items()}
        return fitting(free, shape)

    def claim(self, workers: float, shape: WorkerShape) -> bool:
        """Count ``workers`` of ``shape`` taken (free ones first); True when what is up now did
        not hold them (they wait for nodes being provisioned)."""
        provisioning = workers > fitting(self.present_free, shape)
        for r in self.free_now:
            amount = workers * shape.amount(r)
            self.free_now[r] -= min(max(0.0, self.free_now[r]), amount)
            self.free_after_release[r] -= amount
        for r in self.present_free:
            self.present_free[r] -= workers * shape.amount(r)
        return provisioning

    def reserve(self, job: JobView) -> None:
        """Keep what is free now for ``job``: nothing behind it may take it, nothing grows into it."""
        self.reserved_for = job
        for r in self.free_now:
            self.free_after_release[r] -= max(0.0, self.free_now[r])
            self.free_now[r] = min(self.free_now[r], 0.0)

    def describe_free(self, shape: WorkerShape) -> str:
        now, later = max(0, self.workers_now(shape)), max(0, self.workers_after_release(shape))
        return f"room for {_count(now)} now and {_count(max(0, later - now))} more being released"


def _count(x: float) -> str:
    return "any number" if x == math.inf else f"{x:g}"


class _Pass:
    def __init__(self, snapshot: Snapshot, now_s: float, policy: Policy):
        self.now_s = now_s
        self.policy = policy
        self.teams: dict[str, Team] = {t.name: t for t in snapshot.teams}
        self.cluster_workers = snapshot.cluster_workers
        states = snapshot.flavor_states
        self.states = states
        self.rooms: dict[str, _Room] = {s.name: _Room(s) for s in states}
        self.order = [self.rooms[s.name] for s in states]  # the table's order of preference
        self.implicit = len(states) == 1 and states[0].flavor.is_implicit
        flavors = [s.flavor for s in states]
        self.quotas = FlavorQuotas(snapshot.teams, flavors)
        self.unused = FlavorQuotas(snapshot.teams, flavors)  # nobody using anything: the quota ceilings
        self.target: dict[int, int] = {}  # simulated targets of running jobs this pass may change
        self.flavor_of: dict[int, str] = {}  # the flavor each live job's workers are on
        self.candidates: list[JobView] = []  # running jobs that may shrink, pause or grow
        self.waiting: list[JobView] = []
        # A sweep's cap (a group limit) and what its admitted jobs hold (their targets, as quotas count)
        self.group_limit: dict[int, int] = dict(snapshot.group_limits)
        self.group_used: dict[int, int] = {}
        self._fits: dict[WorkerShape, list[_Room]] = {}
        self._ceilings: dict[tuple, float] = {}
        for job in snapshot.jobs:
            if job.state.admitted or job.state.releasing:
                room = self._room_of(job)
                if room is None:
                    continue  # its shape fits no flavor of the table (changed since): nothing to count it on
                self.flavor_of[job.id] = room.name
            if job.state.admitted:
                if job.group is not None:
                    self.group_used[job.group] = self.group_used.get(job.group, 0) + job.target_workers
                if job.team in self.teams:
                    self.quotas.add(job.team, room.name, job.target_workers, job.shape)
                room.hold(job.shape, max(job.workers, job.target_workers), max(0, job.workers - job.target_workers))
                if job.state is JobState.RUNNING and not job.changing and job.team in self.teams:
                    self.candidates.append(job)
                    self.target[job.id] = job.target_workers
            elif job.state.releasing:
                room.hold(job.shape, job.workers, job.workers)
            elif job.state.waiting:
                self.waiting.append(job)
        self.victims: set[int] = set()
        self.touched_teams: set[str] = set()
        self.admitted: dict[int, int] = {}  # job id -> workers, in admission order
        self.admit_reason: dict[int, str] = {}
        self.admit_flavor: dict[int, str] = {}
        self.provisioning: set[int] = set()  # admitted jobs whose workers wait for nodes
        self.admitted_jobs: list[JobView] = []
        self.reclaim_actions: list[Action] = []
        self.waits: list[Wait] = []
        # A reclaim that failed for (team, priority, within nominal, flavor, shape) at need n fails
        # for any larger need too, until another reclaim changes the victims or the free workers.
        self.failed_reclaims: dict[tuple, int] = {}
        self.reclaim_epoch = 0

    def _fitting_rooms(self, shape: WorkerShape) -> list[_Room]:
        """The flavors a worker of ``shape`` may draw from, in the table's order."""
        rooms = self._fits.get(shape)
        if rooms is None:
            rooms = self._fits[shape] = [r for r in self.order if r.flavor.refuses(shape) is None]
        return rooms

    def _room_of(self, job: JobView) -> Optional[_Room]:
        """Where a live job's workers are: its flavor, or (admitted before the table had it) the
        first its shape fits."""
        if job.flavor in self.rooms:
            return self.rooms[job.flavor]
        rooms = self._fitting_rooms(job.shape)
        return rooms[0] if rooms else None

    def _where(self, room: _Room, shape: WorkerShape) -> str:
        """" of <flavor>" in a reason, nothing for the implicit flavor."""
        return "" if self.implicit else f" of {shape.describe()} on {room.name}"

    # ------------------------------------------------------------------ the pass

    def run(self) -> list[Action]:
        self._admit_in_order()
        grows = self._grow()
        admits = [Admit(job.id, self.admitted[job.id], self.admit_reason[job.id], flavor=self.admit_flavor[job.id],
                        provisioning=job.id in self.provisioning) for job in self.admitted_jobs]
        return [*self.reclaim_actions, *admits, *grows, *self.waits]

    def _admit_in_order(self) -> None:
        queues: dict[str, deque[JobView]] = {}
        for job in self.waiting:
            if job.held:
                self.waits.append(Wait(job.id, WaitCause.HELD, "held by its team: resume it to queue it again"))
            elif job.team not in self.teams:
                self.waits.append(Wait(job.id, WaitCause.UNKNOWN_TEAM, f"unknown team {job.team!r}"))
            else:
                queues.setdefault(job.team, []).append(job)  # type: ignore[arg-type]
        for name, jobs in queues.items():
            jobs.sort(key=lambda j: admission_order(j, 0.0, self.now_s, self.policy))
            queues[name] = deque(jobs)
        # One heap entry per team's head; an entry is stale once its team's share changed.
        version = {name: 0 for name in queues}
        heap = [(admission_order(q[0], self.quotas.share(name), self.now_s, self.policy), 0, name)
                for name, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            _, entry_version, name = heapq.heappop(heap)
            if entry_version != version[name]:
                continue
            self.touched_teams = {name}
            self._consider(queues[name].popleft())
            for team in self.touched_teams:
                if team in queues and queues[team]:
                    version[team] += 1
                    head = queues[team][0]
                    heapq.heappush(heap, (admission_order(head, self.quotas.share(team), self.now_s, self.policy),
                                          version[team], team))

    # ------------------------------------------------------------------ one waiting job

    def _ceiling(self, job: JobView, room: _Room) -> float:
        """The most workers of the job's shape its team could ever hold on ``room``'s flavor."""
        key = (job.team, room.name, job.shape)
        ceiling = self._ceilings.get(key)
        if ceiling is None:
            ceiling = self._ceilings[key] = min(self.unused.headroom(job.team, room.name, job.shape),
                                                fitting(room.ceiling, job.shape))
        return ceiling

    def _consider(self, job: JobView) -> None:
        need = max(1, job.min_workers)
        rooms = self._fitting_rooms(job.shape)
        if not rooms:
            refused = no_flavor_reason(job.shape, [s.flavor for s in self.states])
            self.waits.append(Wait(job.id, WaitCause.NEVER_FITS,
                                   f"can never start: its shape ({job.shape.describe()}) {refused}"))
            return
        rooms = [room for room in rooms if need <= self._ceiling(job, room)]
        if not rooms:
            never = never_fits_reason(job.team, need, self.teams.values(), shape=job.shape, flavors=self.states)
            self.waits.append(Wait(job.id, WaitCause.NEVER_FITS, f"can never start: {never}"))
            return
        capped = self._group_headroom(job)
        if need > capped:
            self.waits.append(Wait(job.id, WaitCause.SWEEP_CAP,
                                   f"its sweep {job.group}'s trials hold {self.group_used.get(job.group, 0)} of its "
                                   f"max_workers {self.group_limit[job.group]}; starts when a trial ends or "
                                   f"shrinks"))
            return
        shape = job.shape
        open_rooms, reserved, heads = [], None, {}
        for room in rooms:
            head = heads[room.name] = self.quotas.headroom(job.team, room.name, shape)
            if room.reserved_for is not None and need <= head and need > room.workers_now(shape):
                reserved = reserved or room
                continue
            if need <= head and need <= room.workers_now(shape):
                self._admit(job, need, room)
                return
            open_rooms.append(room)
        for room in open_rooms:
            if need <= heads[room.name] and need <= room.workers_after_release(shape):
                self._claim(job, need, room)
                self.waits.append(Wait(job.id, WaitCause.RELEASING,
                                       f"{need} workers{self._where(room, shape)} are being released for it "
                                       f"(drains and pauses in flight); starts once they are free"))
                return
        for room in open_rooms:
            plan = self._plan_reclaim(job, need, room)
            if plan is not None:
                self._apply(job, need, room, plan)
                return
        if not open_rooms:
            self.waits.append(Wait(job.id, WaitCause.RESERVED,
                                   f"the free workers are kept for job {reserved.reserved_for.id}, "
                                   f"which has waited since {reserved.reserved_for.waited_since_s:.0f}"))
            return
        room = open_rooms[0]
        head = heads[room.name]  # a reclaim that failed undid its simulation: the quotas are as they were
        self.waits.append(self._blocked(job, need, head, room))
        if (need <= head and room.reserved_for is None
                and self.now_s - job.waited_since_s >= self.policy.reserve_after_s):
            room.reserve(job)

    def _admit(self, job: JobView, need: int, room: _Room) -> None:
        free = max(0, room.workers_now(job.shape))
        where = (f"{_count(free)} of {room.ceiling['workers']:g} cluster workers free" if self.implicit else
                 f"{room.name} has room for {_count(free)} workers of {job.shape.describe()}")
        self.admit_reason[job.id] = (
            f"{need} workers fit (min_workers; effective priority "
            f"{effective_priority(job, self.now_s, self.policy)}): {self.quotas.explain(job.team, room.name)}, "
            f"{where}")
        if self._claim(job, need, room):
            self.provisioning.add(job.id)
            self.admit_reason[job.id] += " (within the ceiling: the autoscaler adds the nodes)"
        self.admitted[job.id] = need
        self.admit_flavor[job.id] = room.name
        self.flavor_of[job.id] = room.name
        self.admitted_jobs.append(job)

    def _claim(self, job: JobView, workers: int, room: _Room) -> bool:
        """Count a job's workers against its team, its group and the flavor's capacity (free ones first)."""
        self.quotas.add(job.team, room.name, workers, job.shape)
        if job.group is not None:
            self.group_used[job.group] = self.group_used.get(job.group, 0) + workers
        return room.claim(workers, job.shape)

    def _group_headroom(self, job: JobView) -> float:
        """Workers the job's group (its sweep) may still take: its cap less what its jobs hold."""
        if job.group is None or job.group not in self.group_limit:
            return math.inf
        return self.group_limit[job.group] - self.group_used.get(job.group, 0)

    def _blocked(self, job: JobView, need: int, head: float, room: _Room) -> Wait:
        """Why a job that neither fits nor can reclaim waits: its team's quota, its cohort's, or
        the cluster's free workers (each sentence opens with it)."""
        if need <= head:
            if self.implicit:
                free_now = max(0.0, room.free_now["workers"])
                releasing = max(0.0, room.free_after_release["workers"] - free_now)
                return Wait(job.id, WaitCause.CLUSTER,
                            f"the cluster is full: needs {_workers(need)} (min_workers), the cluster has "
                            f"{free_now:g} free and {releasing:g} being released; nothing it may reclaim would make room")
            return Wait(job.id, WaitCause.CLUSTER,
                        f"the cluster is full: needs {_workers(need)}{self._where(room, job.shape)} (min_workers), "
                        f"which has {room.describe_free(job.shape)}; nothing it may reclaim would make room")
        cause = self._quota_cause(job, need, room)
        opening = ("over its team's quota" if cause is WaitCause.TEAM_QUOTA
                   else "its cohort has no quota to lend it now")
        return Wait(job.id, cause, f"{opening}: needs {_workers(need)}{self._where(room, job.shape)} (min_workers), "
                                   f"the team may take {_count(head)} more: "
                                   f"{self.quotas.explain(job.team, room.name)}; nothing it may reclaim would make room")

    def _quota_cause(self, job: JobView, need: int, room: _Room) -> WaitCause:
        """TEAM_QUOTA when the team's own limits stop it (beyond its nominal quota: its borrowing
        limit, or a cohort with nobody to borrow from); COHORT when they would allow it and the
        cohort's pool is what is used up (its own lendable part lent out, or nothing left to borrow)."""
        team = self.teams[job.team]
        if self.quotas.within_nominal(job.team, room.name, need, job.shape):
            return WaitCause.COHORT
        if self.quotas.over_borrowing_limit(job.team, room.name, need, job.shape):
            return WaitCause.TEAM_QUOTA
        lenders = [t for t in self.teams.values() if t.cohort_key == team.cohort_key and t.name != team.name]
        return WaitCause.COHORT if lenders else WaitCause.TEAM_QUOTA

    # ------------------------------------------------------------------ reclaim

    def _plan_reclaim(self, job: JobView, need: int, room: _Room) -> Optional[_Reclaim]:
        team, f, shape = self.teams[job.team], room.name, job.shape
        within_nominal = self.quotas.within_nominal(job.team, f, need, shape)
        memo_key = (job.team, job.priority, within_nominal, f, shape, self.reclaim_epoch)
        if need >= self.failed_reclaims.get(memo_key, need + 1):
            return None
        shrinkable, pausable = [], []
        for c in self.candidates:
            if (c.id in self.victims or self.flavor_of.get(c.id) != f
                    or self.teams[c.team].cohort_key != team.cohort_key):
                continue
            if c.team == job.team:
                may_shrink, may_pause = c.priority <= job.priority, c.priority < job.priority
            elif self.quotas.borrows(c.team, f):
                may_shrink = within_nominal or c.priority <= job.priority
                may_pause = within_nominal or c.priority < job.priority
            else:
                continue
            if may_shrink and c.elastic and self.target[c.id] > c.min_workers:
                shrinkable.append(c)
            if may_pause:
                pausable.append(c)
        if not shrinkable and not pausable:
            self.failed_reclaims[memo_key] = min(need, self.failed_reclaims.get(memo_key, need))
            return None
        shrinkable.sort(key=lambda c: shrink_order(c, self.quotas.share(c.team)))
        pausable.sort(key=lambda c: pause_order(c, self.now_s))

        sim_target = {c.id: self.target[c.id] for c in shrinkable + pausable}
        released = {r: 0.0 for r in room.ceiling}
        counted = set(room.ceiling) | set(room.flavor.resources)

        def gap() -> float:
            return max(need - self.quotas.headroom(job.team, f, shape),
                       need - room.workers_after_release(shape, released))

        def give_back(c: JobView, workers: int) -> None:
            self.quotas.add(c.team, f, -workers, c.shape)
            sim_target[c.id] -= workers
            for r in released:
                released[r] += workers * c.shape.amount(r)

        shrinks: dict[int, JobView] = {}
        for c in shrinkable:
            missing = gap()
            if missing <= 0:
                break
            workers = min(sim_target[c.id] - c.min_workers, _victim_workers(missing, shape, c.shape, counted))
            if c.team != job.team:
                workers = min(workers, self.quotas.borrowed_workers(c.team, f, c.shape))
            if workers > 0:
                give_back(c, workers)
                shrinks[c.id] = c
        pauses: list[JobView] = []
        paused_workers: dict[int, int] = {}
        for c in pausable:
            if gap() <= 0:
                break
            if c.team != job.team and not self.quotas.borrows(c.team, f):
                continue
            if sim_target[c.id] > 0:
                pauses.append(c)
                paused_workers[c.id] = sim_target[c.id]
                give_back(c, sim_target[c.id])
        if gap() > 0:  # not enough: undo the simulation
            for c in {**shrinks, **{p.id: p for p in pauses}}.values():
                self.quotas.add(c.team, f, self.target[c.id] - sim_target[c.id], c.shape)
            self.failed_reclaims[memo_key] = min(need, self.failed_reclaims.get(memo_key, need))
            return None
        # No more victims than needed: give back pauses that turned out unnecessary (last chosen
        # first), then trim shrinks worker by worker.
        for c in reversed(list(pauses)):
            workers = paused_workers[c.id]
            give_back(c, -workers)
            if gap() > 0:
                give_back(c, workers)
            else:
                pauses.remove(c)
        for c in reversed(list(shrinks.values())):
            while sim_target[c.id] < self.target[c.id] and c.id not in {p.id for p in pauses}:
                give_back(c, -1)
                if gap() > 0:
                    give_back(c, 1)
                    break
            if sim_target[c.id] == self.target[c.id]:
                del shrinks[c.id]
        pause_ids = {p.id for p in pauses}
        return _Reclaim(shrinks=[(c, sim_target[c.id]) for c in shrinks.values() if c.id not in pause_ids],
                        pauses=pauses, released=released, within_nominal=within_nominal)

    def _apply(self, job: JobView, need: int, room: _Room, plan: _Reclaim) -> None:
        """Issue a planned reclaim (its quota changes are already counted) and let ``job``
        claim what it frees."""
        self.reclaim_epoch += 1
        names = []
        for victim, to_workers in plan.shrinks:
            self.victims.add(victim.id)
            self.touched_teams.add(victim.team)
            why = self._reclaim_cause(job, need, victim, plan.within_nominal, room)
            self.reclaim_actions.append(Shrink(victim.id, to_workers, f"{why}; a drain at a step "
                                                                      f"boundary loses no work"))
            names.append(f"shrink of job {victim.id} to {to_workers}")
            self.target[victim.id] = to_workers
        for victim in plan.pauses:
            self.victims.add(victim.id)
            self.touched_teams.add(victim.team)
            at_risk = victim.work_at_risk(self.now_s)
            why = self._reclaim_cause(job, need, victim, plan.within_nominal, room)
            self.reclaim_actions.append(Pause(
                victim.id, f"{why}; shrinking was not enough, and of the jobs it may pause this one has "
                           f"the least work at risk ({victim.workers} workers x "
                           f"{at_risk / max(1, victim.workers):.0f} s since its last checkpoint)",
                work_at_risk_worker_s=at_risk))
            names.append(f"pause of job {victim.id}")
            self.target[victim.id] = 0
        for r, amount in plan.released.items():
            room.free_after_release[r] += amount
        self._claim(job, need, room)
        self.waits.append(Wait(job.id, WaitCause.RELEASING,
                               f"{need} workers{self._where(room, job.shape)} are being reclaimed for it "
                               f"({', '.join(names)}); starts once they are free"))

    def _reclaim_cause(self, job: JobView, need: int, victim: JobView, within_nominal: bool, room: _Room) -> str:
        wants = (f"job {job.id} (team {job.team}, priority {job.priority}) needs {need} "
                 f"workers{self._where(room, job.shape)}")
        if victim.team != job.team and within_nominal:
            nominal = (f"({self.teams[job.team].nominal_workers})" if self.implicit
                       else f"on {room.name}")
            return f"{wants} within its team's nominal quota {nominal}, which team {victim.team} borrows"
        if victim.priority < job.priority:
            return f"{wants} and outranks it (priority {victim.priority})"
        return (f"{wants}; this job has equal priority and gives back only workers above its "
                f"min_workers ({victim.min_workers}), which it grew into while they were idle")

    # ------------------------------------------------------------------ growth

    def _grow(self) -> list[Grow]:
        workers: dict[int, int] = {}
        heap = []
        for job in self.candidates + self.admitted_jobs:
            if not job.elastic or job.id in self.victims:
                continue
            now = self.admitted.get(job.id, self.target.get(job.id, 0))
            if now < job.max_workers:
                workers[job.id] = now
                heap.append((growth_order(job, now, self.quotas.share(job.team)), job))
        heapq.heapify(heap)
        grown: dict[int, JobView] = {}
        while heap:
            key, job = heapq.heappop(heap)
            current = growth_order(job, workers[job.id], self.quotas.share(job.team))
            if current != key:  # its team's share rose since: take its place again
                heapq.heappush(heap, (current, job))
                continue
            room = self.rooms[self.flavor_of[job.id]]
            if (room.reserved_for is not None or room.workers_now(job.shape) < 1
                    or room.workers_after_release(job.shape) < 1):
                continue
            if self.quotas.headroom(job.team, room.name, job.shape) < 1 - EPS or self._group_headroom(job) < 1:
                continue
            workers[job.id] += 1
            self.quotas.add(job.team, room.name, 1, job.shape)
            if job.group is not None:
                self.group_used[job.group] = self.group_used.get(job.group, 0) + 1
            if room.claim(1, job.shape) and job.id in self.admitted:
                self.provisioning.add(job.id)
            grown[job.id] = job
            if workers[job.id] < job.max_workers:
                heapq.heappush(heap, (growth_order(job, workers[job.id], self.quotas.share(job.team)), job))
        grows = []
        for job in sorted(grown.values(), key=lambda j: j.id):
            team_line = self.quotas.explain(job.team, self.flavor_of[job.id])
            if job.id in self.admitted:
                self.admit_reason[job.id] += f"; grown to {workers[job.id]} of max {job.max_workers} into idle workers"
                self.admitted[job.id] = workers[job.id]
            else:
                grows.append(Grow(job.id, workers[job.id], f"idle workers, no waiting job can use them; "
                                                           f"after growth {team_line}"))
        return grows


def _victim_workers(missing: float, shape: WorkerShape, victim: WorkerShape, counted: set[str]) -> int:
    """Workers of ``victim``'s shape that free ``missing`` workers of ``shape`` in the resources
    ``counted`` (one for one when they ask the same of each; the plan then trims any excess
    worker by worker). 0 when the victim frees none of what the job needs."""
    ratios = [shape.amount(r) / victim.amount(r) for r in counted if shape.amount(r) > 0 and victim.amount(r) > 0]
    return math.ceil(missing * max(ratios) - EPS) if ratios else 0
