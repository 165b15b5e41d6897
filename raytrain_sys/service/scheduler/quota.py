"""Quota arithmetic of teams and cohorts (Kueue's, per flavor and resource).

Owns: how much more a team may take (``Quotas.headroom``), how much it borrows, its fair
share, and the most it could ever get (``team_ceiling_workers``, for rejecting a submit that
could never run). ``Quotas`` is one ledger: one resource of one flavor (the implicit flavor's
workers, or a table flavor's cpu, gpu, memory_gb or workers). ``FlavorQuotas`` holds a ledger
per flavor and resource it counts, and answers in workers of a job's shape (a worker of 4 CPUs
takes 4 of a cpu ledger). Both are the scheduler's private, mutable copy of every team's usage
for one pass; they never read or write a ``Snapshot``. Pure: no Ray, no I/O.

The model, for a team t with nominal quota n, lending limit l (None: n) and borrowing limit b
(None: unlimited), using u (of one resource on one flavor):

* guaranteed g = n - l: never lent, always t's;
* the cohort's pool is the sum of every member's l; t draws on it for whatever it uses above
  g, so the pool's use is the sum over members of max(0, u - g);
* t may take min(max(0, g - u) + pool free, n + b - u) more.

A job of shape s fits k more workers on a flavor when k x s fits every ledger the flavor counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from raytrain_sys.errors import quote
from raytrain_sys.service.flavors import (DEFAULT_FLAVOR, DEFAULT_SHAPE, FlavorState, ResourceFlavor, WorkerShape,
                                          no_flavor_reason)
from raytrain_sys.service.teams import Team

UNLIMITED = math.inf
EPS = 1e-9  # amounts are sums of fractional CPUs and GBs: a worker that fits to rounding fits
UNITS = {"workers": "", "cpu": " CPU", "gpu": " GPU", "memory_gb": " GB"}


def fitting(amounts: Mapping[str, float], shape: WorkerShape) -> float:
    """How many whole workers of ``shape`` ``amounts`` (resource -> free amount) hold: negative
    when an amount is (more is promised than there is: the scheduler's gaps count it); every
    resource the shape asks none of holds any number of them (``UNLIMITED`` if it asks none)."""
    most = UNLIMITED
    for resource, free in amounts.items():
        need = shape.amount(resource)
        if need > 0:
            most = min(most, math.floor(free / need + EPS))
    return most


def _num(x: float) -> str:
    return f"{x:g}"


class Quotas:
    """Every team's simulated usage of one resource on one flavor during one scheduling pass
    (the implicit flavor's workers by default), and the cohorts' pools."""

    def __init__(self, teams: Iterable[Team], usage_workers: Mapping[str, float], flavor: str = DEFAULT_FLAVOR,
                 resource: str = "workers"):
        self.flavor, self.resource = flavor, resource
        self.teams: dict[str, Team] = {t.name: t for t in teams}
        self.usage: dict[str, float] = {name: 0 for name in self.teams}
        self.nominal: dict[str, float] = {}
        self.borrowing_limit: dict[str, float | None] = {}
        self.guaranteed: dict[str, float] = {}
        self.pool_capacity: dict[str, float] = {}
        self.pool_used: dict[str, float] = {}
        for team in self.teams.values():
            nominal, borrowing, lending = team.quota(flavor, resource)
            lendable = nominal if lending is None else lending
            self.nominal[team.name], self.borrowing_limit[team.name] = nominal, borrowing
            self.guaranteed[team.name] = nominal - lendable
            key = team.cohort_key
            self.pool_capacity[key] = self.pool_capacity.get(key, 0) + lendable
            self.pool_used.setdefault(key, 0)
        for name, used in usage_workers.items():
            if name in self.teams:
                self.add(name, used)

    def add(self, team_name: str, delta_workers: float) -> None:
        """Count ``delta_workers`` more (or fewer, if negative) against a team."""
        team = self.teams[team_name]
        before = self.usage[team_name]
        after = before + delta_workers
        self.usage[team_name] = after
        g = self.guaranteed[team_name]
        self.pool_used[team.cohort_key] += max(0, after - g) - max(0, before - g)

    def pool_free(self, team_name: str) -> float:
        key = self.teams[team_name].cohort_key
        return self.pool_capacity[key] - self.pool_used[key]

    def headroom(self, team_name: str) -> float:
        """What the team may still take: its own unused guaranteed part plus the cohort's free
        pool, within its borrowing limit."""
        used = self.usage[team_name]
        room = max(0, self.guaranteed[team_name] - used) + self.pool_free(team_name)
        limit = self.borrowing_limit[team_name]
        if limit is not None:
            room = min(room, self.nominal[team_name] + limit - used)
        return max(0, room)

    def borrowed(self, team_name: str) -> float:
        """What the team uses beyond its nominal quota (0 when within it)."""
        return max(0, self.usage[team_name] - self.nominal[team_name])

    def share(self, team_name: str) -> float:
        """The team's weighted fair share: what it borrows, divided by its weight (Kueue's
        dominant resource share for one resource). 0 for every team within its quota."""
        return self.borrowed(team_name) / self.teams[team_name].weight

    def explain(self, team_name: str) -> str:
        """One line on the team's quota position, for reasons."""
        limit = self.borrowing_limit[team_name]
        limit = "no borrowing limit" if limit is None else f"borrowing limit {_num(limit)}"
        unit = UNITS[self.resource]
        on = "" if self.flavor == DEFAULT_FLAVOR else f" on {self.flavor}"
        return (f"team {team_name} uses {_num(self.usage[team_name])}{unit} of nominal "
                f"{_num(self.nominal[team_name])}{unit}{on} ({limit}; cohort pool "
                f"{_num(max(0, self.pool_free(team_name)))} free)")


class FlavorQuotas:
    """Every team's usage of every flavor's counted resources during one pass: a ``Quotas`` per
    (flavor, resource), and answers in workers of a job's shape."""

    def __init__(self, teams: Iterable[Team], flavors: Sequence[ResourceFlavor]):
        teams = list(teams)
        self.teams: dict[str, Team] = {t.name: t for t in teams}
        self.ledgers: dict[str, list[Quotas]] = {f.name: [Quotas(teams, {}, f.name, r) for r in f.resources]
                                                 for f in flavors}
        every = [ledger for ledgers in self.ledgers.values() for ledger in ledgers]
        # Fair share across ledgers (Kueue's dominant resource share): what a team borrows of each
        # as a part of the service's whole quota of it. With one ledger the scale is left out:
        # it would not change any comparison, and the figures stay in workers.
        self._scale = {id(q): 1.0 if len(every) == 1 else max(1.0, sum(q.nominal.values())) for q in every}
        self._every = every

    def add(self, team_name: str, flavor: str, workers: float, shape: WorkerShape = DEFAULT_SHAPE) -> None:
        """Count ``workers`` more (or fewer) of ``shape`` against a team on ``flavor``."""
        for ledger in self.ledgers[flavor]:
            ledger.add(team_name, workers * shape.amount(ledger.resource))

    def headroom(self, team_name: str, flavor: str, shape: WorkerShape = DEFAULT_SHAPE) -> float:
        """Workers of ``shape`` the team may still take on ``flavor`` (``UNLIMITED`` when the
        flavor counts nothing the shape asks)."""
        most = UNLIMITED
        for q in self.ledgers[flavor]:
            need = shape.amount(q.resource)
            if need > 0:
                most = min(most, math.floor(q.headroom(team_name) / need + EPS))
        return most

    def usage(self, team_name: str, flavor: str) -> dict[str, float]:
        return {q.resource: q.usage[team_name] for q in self.ledgers[flavor]}

    def borrows(self, team_name: str, flavor: str) -> bool:
        """The team uses more than its nominal quota of some resource on ``flavor``."""
        return any(q.borrowed(team_name) > EPS for q in self.ledgers[flavor])

    def borrowed_workers(self, team_name: str, flavor: str, shape: WorkerShape) -> float:
        """The fewest workers of ``shape`` the team would give back to borrow nothing on
        ``flavor`` (a worker that straddles its nominal quota counts whole)."""
        most = 0.0
        for q in self.ledgers[flavor]:
            need = shape.amount(q.resource)
            if need > 0:
                most = max(most, math.ceil(q.borrowed(team_name) / need - EPS))
        return most

    def within_nominal(self, team_name: str, flavor: str, workers: float, shape: WorkerShape) -> bool:
        """``workers`` more of ``shape`` keep the team within its nominal quota on ``flavor``."""
        return all(q.usage[team_name] + workers * shape.amount(q.resource) <= q.nominal[team_name] + EPS
                   for q in self.ledgers[flavor])

    def over_borrowing_limit(self, team_name: str, flavor: str, workers: float, shape: WorkerShape) -> bool:
        """``workers`` more of ``shape`` would take the team past its borrowing limit somewhere."""
        for q in self.ledgers[flavor]:
            limit = q.borrowing_limit[team_name]
            after = q.usage[team_name] + workers * shape.amount(q.resource)
            if limit is not None and after > q.nominal[team_name] + limit + EPS:
                return True
        return False

    def share(self, team_name: str) -> float:
        """The team's weighted fair share: its largest borrowed part of any ledger (in workers
        when the service has one ledger), divided by its weight."""
        return max((q.borrowed(team_name) / self._scale[id(q)] for q in self._every), default=0.0) \
            / self.teams[team_name].weight

    def explain(self, team_name: str, flavor: str) -> str:
        """One line on the team's quota position on ``flavor``, for reasons."""
        lines = [q.explain(team_name) for q in self.ledgers[flavor]]
        return "; ".join(lines) if lines else f"team {team_name}: {flavor} counts nothing"


def team_ceiling_workers(team_name: str, teams: Iterable[Team], cluster_workers: int | None = None, *,
                         flavor: ResourceFlavor | None = None, shape: WorkerShape = DEFAULT_SHAPE) -> float:
    """The most workers (of ``shape``, on ``flavor``: by default the implicit flavor's) the team
    could ever hold at once: its nominal quota plus its borrowing limit, bounded by what its
    cohort can lend when nobody else uses anything, and by the cluster's size when given.
    Raises KeyError for an unknown team."""
    flavor = flavor or ResourceFlavor.implicit()
    quotas = FlavorQuotas(teams, [flavor])
    if team_name not in quotas.teams:
        raise KeyError(team_name)
    ceiling = quotas.headroom(team_name, flavor.name, shape)
    if cluster_workers is not None:
        ceiling = min(ceiling, cluster_workers)
    return ceiling


def never_fits_reason(team_name: str, min_workers: int, teams: Iterable[Team],
                      cluster_workers: int | None = None, *, shape: WorkerShape = DEFAULT_SHAPE,
                      flavors: Sequence[FlavorState] | None = None) -> str | None:
    """Why a job of ``min_workers`` (of ``shape``) could never start in this team, or None if
    it could: on no flavor it may draw from do its team's quota and the capacity (``flavors``'
    ceilings; without them, the implicit flavor of ``cluster_workers`` when given) hold it."""
    teams = list(teams)
    by_name = {t.name: t for t in teams}
    if team_name not in by_name:
        return f"unknown team {quote(team_name)} (known: {', '.join(sorted(by_name)) or 'none'})"
    if flavors is None:
        capacity = None if cluster_workers is None else {"workers": float(cluster_workers)}
        return _never_fits_on(by_name[team_name], min_workers, teams, ResourceFlavor.implicit(), capacity, shape)
    reasons = []
    for state in flavors:
        if state.flavor.refuses(shape) is None:
            why = _never_fits_on(by_name[team_name], min_workers, teams, state.flavor, state.capacity(), shape)
            if why is None:
                return None
            reasons.append(why if state.flavor.is_implicit else f"on {state.name}: {why}")
    return "; ".join(reasons) or no_flavor_reason(shape, [s.flavor for s in flavors])


def _never_fits_on(team: Team, min_workers: int, teams: list[Team], flavor: ResourceFlavor,
                   capacity: Mapping[str, float] | None, shape: WorkerShape) -> str | None:
    quota_ceiling = team_ceiling_workers(team.name, teams, flavor=flavor, shape=shape)
    if min_workers > quota_ceiling:
        cohort = f"cohort {team.cohort}" if team.cohort else "no cohort"
        if flavor.is_implicit:
            limit = ("no borrowing limit" if team.borrowing_limit_workers is None
                     else f"borrowing limit {team.borrowing_limit_workers}")
            return (f"min_workers {min_workers} is more than team {team.name} could ever get: "
                    f"{quota_ceiling} (nominal {team.nominal_workers}, {limit}, {cohort})")
        quotas = []
        for resource in flavor.resources:
            nominal, borrowing, _ = team.quota(flavor.name, resource)
            limit = "no borrowing limit" if borrowing is None else f"borrowing limit {_num(borrowing)}"
            quotas.append(f"{resource} nominal {_num(nominal)}, {limit}")
        return (f"min_workers {min_workers} of {shape.describe()} is more than team {team.name} could ever get: "
                f"{_count(quota_ceiling)} ({'; '.join(quotas)}; {cohort})")
    if capacity is not None:
        most = fitting(capacity, shape)
        if min_workers > most:
            if flavor.is_implicit:
                return f"min_workers {min_workers} is more than the cluster's {_count(most)} workers"
            held = ", ".join(f"{_num(v)}{UNITS[r]}" for r, v in sorted(capacity.items()))
            return (f"min_workers {min_workers} of {shape.describe()} is more than its capacity holds: "
                    f"{_count(most)} ({held or 'nothing'})")
    return None


def _count(x: float) -> str:
    return "unlimited" if x == UNLIMITED else _num(x)
