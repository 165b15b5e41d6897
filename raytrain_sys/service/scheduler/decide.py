"""One scheduling pass: ``decide(snapshot, now_s) -> list[Action]``.

Owns: the choice of which waiting job starts (``Admit``), which running elastic job grows or
shrinks (``Grow``, ``Shrink``), which running job is paused (``Pause``), and why every waiting
job still waits (``Wait``, with its ``WaitCause``). It writes nothing: every action is a value with a reason, carried
out by the reconciler (the one writer of run-time transitions), which logs each one. Pure: no
Ray, no SQL, no clock of its own; the snapshot is never changed (all simulation happens on
private copies: ``Quotas`` and the ``_Pass`` counters).

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

A shrink or pause frees workers only when the runner has drained them, so the job it was for is
admitted by a later pass (which sees the smaller ``workers``), never by the same one.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Optional

from raytrain_sys.service.model import (DEFAULT_POLICY, Action, Admit, Grow, JobState, JobView, Pause,
                                        Policy, Shrink, Snapshot, Team, Wait, WaitCause)
from raytrain_sys.service.scheduler.ordering import (admission_order, effective_priority, growth_order,
                                                     pause_order, shrink_order)
from raytrain_sys.service.scheduler.quota import Quotas, never_fits_reason, team_ceiling_workers


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def decide(snapshot: Snapshot, now_s: float, policy: Policy = DEFAULT_POLICY) -> list[Action]:
    """The actions of one scheduling pass over ``snapshot`` at time ``now_s`` (see the module
    docstring). Deterministic: the same snapshot, time and policy give the same list."""
    return _Pass(snapshot, now_s, policy).run()


@dataclass
class _Reclaim:
    """A planned reclaim: the victims and what each gives back."""

    shrinks: list[tuple[JobView, int]]  # (job, its new target)
    pauses: list[JobView]
    released_workers: int
    within_nominal: bool  # the waiting job's team stays within its nominal quota


class _Pass:
    def __init__(self, snapshot: Snapshot, now_s: float, policy: Policy):
        self.now_s = now_s
        self.policy = policy
        self.teams: dict[str, Team] = {t.name: t for t in snapshot.teams}
        self.cluster_workers = snapshot.cluster_workers
        usage: dict[str, int] = {}
        held = 0  # workers the cluster has given to (or promised) live jobs
        releasing = 0  # of those, workers on their way back (drains and pauses in flight)
        self.target: dict[int, int] = {}  # simulated targets of running jobs this pass may change
        self.candidates: list[JobView] = []  # running jobs that may shrink, pause or grow
        self.waiting: list[JobView] = []
        for job in snapshot.jobs:
            if job.state.admitted:
                usage[job.team] = usage.get(job.team, 0) + job.target_workers
                held += max(job.workers, job.target_workers)
                releasing += max(0, job.workers - job.target_workers)
                if job.state is JobState.RUNNING and not job.changing and job.team in self.teams:
                    self.candidates.append(job)
                    self.target[job.id] = job.target_workers
            elif job.state.releasing:
                held += job.workers
                releasing += job.workers
            elif job.state.waiting:
                self.waiting.append(job)
        self.quotas = Quotas(snapshot.teams, usage)
        # Free now, and free once every release in flight has landed (claims subtract from both).
        self.free_now = snapshot.cluster_workers - held
        self.free_after_release = self.free_now + releasing
        self.ceiling = {name: min(team_ceiling_workers(name, snapshot.teams), snapshot.cluster_workers)
                        for name in self.teams}
        self.reserved_for: Optional[JobView] = None
        self.victims: set[int] = set()
        self.touched_teams: set[str] = set()
        self.admitted: dict[int, int] = {}  # job id -> workers, in admission order
        self.admit_reason: dict[int, str] = {}
        self.admitted_jobs: list[JobView] = []
        self.reclaim_actions: list[Action] = []
        self.waits: list[Wait] = []
        # A reclaim that failed for (team, priority, within nominal) at need n fails for any
        # larger need too, until another reclaim changes the victims or the free workers.
        self.failed_reclaims: dict[tuple, int] = {}
        self.reclaim_epoch = 0

    # ------------------------------------------------------------------ the pass

    def run(self) -> list[Action]:
        self._admit_in_order()
        grows = self._grow()
        admits = [Admit(job.id, self.admitted[job.id], self.admit_reason[job.id]) for job in self.admitted_jobs]
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

    def _consider(self, job: JobView) -> None:
        team = self.teams[job.team]
        need = max(1, job.min_workers)
        if need > self.ceiling[job.team]:
            never = never_fits_reason(job.team, need, self.teams.values(), self.cluster_workers)
            self.waits.append(Wait(job.id, WaitCause.NEVER_FITS, f"can never start: {never}"))
            return
        room = self.quotas.headroom(job.team)
        if self.reserved_for is not None and need <= room and need > self.free_now:
            self.waits.append(Wait(job.id, WaitCause.RESERVED,
                                   f"the free workers are kept for job {self.reserved_for.id}, "
                                   f"which has waited since {self.reserved_for.waited_since_s:.0f}"))
            return
        if need <= room and need <= self.free_now:
            self.admit_reason[job.id] = (
                f"{need} workers fit (min_workers; effective priority "
                f"{effective_priority(job, self.now_s, self.policy)}): {self.quotas.explain(job.team)}, "
                f"{self.free_now} of {self.cluster_workers} cluster workers free")
            self._claim(job, need)
            self.admitted[job.id] = need
            self.admitted_jobs.append(job)
            return
        if need <= room and need <= self.free_after_release:
            self._claim(job, need)
            self.waits.append(Wait(job.id, WaitCause.RELEASING,
                                   f"{need} workers are being released for it (drains and pauses "
                                   f"in flight); starts once they are free"))
            return
        plan = self._plan_reclaim(job, team, need)
        if plan is not None:
            self._apply(job, need, plan)
            return
        self.waits.append(self._blocked(job, need, room))
        if (need <= room and self.reserved_for is None
                and self.now_s - job.waited_since_s >= self.policy.reserve_after_s):
            self.reserved_for = job
            self.free_after_release -= max(0, self.free_now)
            self.free_now = min(self.free_now, 0)

    def _claim(self, job: JobView, workers: int) -> None:
        """Count a job's workers against its team and the cluster (free ones first)."""
        self.quotas.add(job.team, workers)
        self.free_now -= min(max(0, self.free_now), workers)
        self.free_after_release -= workers

    def _blocked(self, job: JobView, need: int, room: int) -> Wait:
        """Why a job that neither fits nor can reclaim waits: its team's quota, its cohort's, or
        the cluster's free workers (each sentence opens with it)."""
        if need <= room:
            return Wait(job.id, WaitCause.CLUSTER,
                        f"the cluster is full: needs {_workers(need)} (min_workers), the cluster has "
                        f"{max(0, self.free_now)} free and "
                        f"{max(0, self.free_after_release - max(0, self.free_now))} being released; "
                        f"nothing it may reclaim would make room")
        cause = self._quota_cause(job, need)
        opening = ("over its team's quota" if cause is WaitCause.TEAM_QUOTA
                   else "its cohort has no quota to lend it now")
        return Wait(job.id, cause, f"{opening}: needs {_workers(need)} (min_workers), the team may take {room} more: "
                                   f"{self.quotas.explain(job.team)}; nothing it may reclaim would make room")

    def _quota_cause(self, job: JobView, need: int) -> WaitCause:
        """TEAM_QUOTA when the team's own limits stop it (beyond its nominal quota: its borrowing
        limit, or a cohort with nobody to borrow from); COHORT when they would allow it and the
        cohort's pool is what is used up (its own lendable part lent out, or nothing left to borrow)."""
        team = self.teams[job.team]
        after = self.quotas.usage[job.team] + need
        if after <= team.nominal_workers:
            return WaitCause.COHORT
        limit = team.borrowing_limit_workers
        if limit is not None and after > team.nominal_workers + limit:
            return WaitCause.TEAM_QUOTA
        lenders = [t for t in self.teams.values() if t.cohort_key == team.cohort_key and t.name != team.name]
        return WaitCause.COHORT if lenders else WaitCause.TEAM_QUOTA

    # ------------------------------------------------------------------ reclaim

    def _plan_reclaim(self, job: JobView, team: Team, need: int) -> Optional[_Reclaim]:
        within_nominal = self.quotas.usage[job.team] + need <= team.nominal_workers
        memo_key = (job.team, job.priority, within_nominal, self.reclaim_epoch)
        if need >= self.failed_reclaims.get(memo_key, need + 1):
            return None
        shrinkable, pausable = [], []
        for c in self.candidates:
            if c.id in self.victims or self.teams[c.team].cohort_key != team.cohort_key:
                continue
            if c.team == job.team:
                may_shrink, may_pause = c.priority <= job.priority, c.priority < job.priority
            elif self.quotas.borrowed(c.team) > 0:
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
        released = 0

        def gap() -> int:
            return max(need - self.quotas.headroom(job.team), need - (self.free_after_release + released))

        def give_back(c: JobView, workers: int) -> None:
            nonlocal released
            self.quotas.add(c.team, -workers)
            sim_target[c.id] -= workers
            released += workers

        shrinks: dict[int, JobView] = {}
        for c in shrinkable:
            missing = gap()
            if missing <= 0:
                break
            workers = min(sim_target[c.id] - c.min_workers, missing)
            if c.team != job.team:
                workers = min(workers, self.quotas.borrowed(c.team))
            if workers > 0:
                give_back(c, workers)
                shrinks[c.id] = c
        pauses: list[JobView] = []
        paused_workers: dict[int, int] = {}
        for c in pausable:
            if gap() <= 0:
                break
            if c.team != job.team and self.quotas.borrowed(c.team) <= 0:
                continue
            if sim_target[c.id] > 0:
                pauses.append(c)
                paused_workers[c.id] = sim_target[c.id]
                give_back(c, sim_target[c.id])
        if gap() > 0:  # not enough: undo the simulation
            for c in {**shrinks, **{p.id: p for p in pauses}}.values():
                self.quotas.add(c.team, self.target[c.id] - sim_target[c.id])
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
                        pauses=pauses, released_workers=released, within_nominal=within_nominal)

    def _apply(self, job: JobView, need: int, plan: _Reclaim) -> None:
        """Issue a planned reclaim (its quota changes are already counted) and let ``job``
        claim what it frees."""
        self.reclaim_epoch += 1
        names = []
        for victim, to_workers in plan.shrinks:
            self.victims.add(victim.id)
            self.touched_teams.add(victim.team)
            why = self._reclaim_cause(job, need, victim, plan.within_nominal)
            self.reclaim_actions.append(Shrink(victim.id, to_workers, f"{why}; a drain at a step "
                                                                      f"boundary loses no work"))
            names.append(f"shrink of job {victim.id} to {to_workers}")
            self.target[victim.id] = to_workers
        for victim in plan.pauses:
            self.victims.add(victim.id)
            self.touched_teams.add(victim.team)
            at_risk = victim.work_at_risk(self.now_s)
            why = self._reclaim_cause(job, need, victim, plan.within_nominal)
            self.reclaim_actions.append(Pause(
                victim.id, f"{why}; shrinking was not enough, and of the jobs it may pause this one has "
                           f"the least work at risk ({victim.workers} workers x "
                           f"{at_risk / max(1, victim.workers):.0f} s since its last checkpoint)",
                work_at_risk_worker_s=at_risk))
            names.append(f"pause of job {victim.id}")
            self.target[victim.id] = 0
        self.free_after_release += plan.released_workers
        self._claim(job, need)
        self.waits.append(Wait(job.id, WaitCause.RELEASING,
                               f"{need} workers are being reclaimed for it ({', '.join(names)}); "
                               f"starts once they are free"))

    def _reclaim_cause(self, job: JobView, need: int, victim: JobView, within_nominal: bool) -> str:
        wants = f"job {job.id} (team {job.team}, priority {job.priority}) needs {need} workers"
        if victim.team != job.team and within_nominal:
            return (f"{wants} within its team's nominal quota ({self.teams[job.team].nominal_workers}), "
                    f"which team {victim.team} borrows")
        if victim.priority < job.priority:
            return f"{wants} and outranks it (priority {victim.priority})"
        return (f"{wants}; this job has equal priority and gives back only workers above its "
                f"min_workers ({victim.min_workers}), which it grew into while they were idle")

    # ------------------------------------------------------------------ growth

    def _grow(self) -> list[Grow]:
        if self.reserved_for is not None:
            return []
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
        while heap and self.free_now > 0 and self.free_after_release > 0:
            key, job = heapq.heappop(heap)
            current = growth_order(job, workers[job.id], self.quotas.share(job.team))
            if current != key:  # its team's share rose since: take its place again
                heapq.heappush(heap, (current, job))
                continue
            if self.quotas.headroom(job.team) <= 0:
                continue
            workers[job.id] += 1
            self.quotas.add(job.team, 1)
            self.free_now -= 1
            self.free_after_release -= 1
            grown[job.id] = job
            if workers[job.id] < job.max_workers:
                heapq.heappush(heap, (growth_order(job, workers[job.id], self.quotas.share(job.team)), job))
        grows = []
        for job in sorted(grown.values(), key=lambda j: j.id):
            team_line = self.quotas.explain(job.team)
            if job.id in self.admitted:
                self.admit_reason[job.id] += f"; grown to {workers[job.id]} of max {job.max_workers} into idle workers"
                self.admitted[job.id] = workers[job.id]
            else:
                grows.append(Grow(job.id, workers[job.id], f"idle workers, no waiting job can use them; "
                                                           f"after growth {team_line}"))
        return grows
