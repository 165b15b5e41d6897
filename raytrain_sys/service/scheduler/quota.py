"""Quota arithmetic of teams and cohorts (Kueue's, for one resource: workers).

Owns: how much more a team may take (``Quotas.headroom``), how much it borrows, its fair
share, and the most it could ever get (``team_ceiling_workers``, for rejecting a submit that
could never run). ``Quotas`` is the scheduler's private, mutable copy of every team's usage for
one pass; it never reads or writes a ``Snapshot``. Pure: no Ray, no I/O.

The model, for a team t with nominal quota n, lending limit l (None: n) and borrowing limit b
(None: unlimited), using u workers:

* guaranteed g = n - l: never lent, always t's;
* the cohort's pool is the sum of every member's l; t draws on it for whatever it uses above
  g, so the pool's use is the sum over members of max(0, u - g);
* t may take min(max(0, g - u) + pool free, n + b - u) more workers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from raytrain_sys.errors import quote
from raytrain_sys.service.model import Team

UNLIMITED = math.inf


class Quotas:
    """Every team's simulated usage during one scheduling pass, and the cohorts' pools."""

    def __init__(self, teams: Iterable[Team], usage_workers: Mapping[str, int]):
        self.teams: dict[str, Team] = {t.name: t for t in teams}
        self.usage: dict[str, int] = {name: 0 for name in self.teams}
        self.pool_capacity: dict[str, int] = {}
        self.pool_used: dict[str, int] = {}
        for team in self.teams.values():
            key = team.cohort_key
            self.pool_capacity[key] = self.pool_capacity.get(key, 0) + team.lendable_workers
            self.pool_used.setdefault(key, 0)
        for name, used in usage_workers.items():
            if name in self.teams:
                self.add(name, used)

    def add(self, team_name: str, delta_workers: int) -> None:
        """Count ``delta_workers`` more (or fewer, if negative) workers against a team."""
        team = self.teams[team_name]
        before = self.usage[team_name]
        after = before + delta_workers
        self.usage[team_name] = after
        g = team.guaranteed_workers
        self.pool_used[team.cohort_key] += max(0, after - g) - max(0, before - g)

    def pool_free(self, team_name: str) -> int:
        key = self.teams[team_name].cohort_key
        return self.pool_capacity[key] - self.pool_used[key]

    def headroom(self, team_name: str) -> int:
        """Workers the team may still take: its own unused guaranteed part plus the cohort's
        free pool, within its borrowing limit."""
        team = self.teams[team_name]
        used = self.usage[team_name]
        room = max(0, team.guaranteed_workers - used) + self.pool_free(team_name)
        if team.borrowing_limit_workers is not None:
            room = min(room, team.nominal_workers + team.borrowing_limit_workers - used)
        return max(0, room)

    def borrowed(self, team_name: str) -> int:
        """Workers the team uses beyond its nominal quota (0 when within it)."""
        return max(0, self.usage[team_name] - self.teams[team_name].nominal_workers)

    def share(self, team_name: str) -> float:
        """The team's weighted fair share: what it borrows, divided by its weight (Kueue's
        dominant resource share for one resource). 0 for every team within its quota."""
        team = self.teams[team_name]
        return self.borrowed(team_name) / team.weight

    def explain(self, team_name: str) -> str:
        """One line on the team's quota position, for reasons."""
        team = self.teams[team_name]
        limit = ("no borrowing limit" if team.borrowing_limit_workers is None
                 else f"borrowing limit {team.borrowing_limit_workers}")
        return (f"team {team.name} uses {self.usage[team_name]} of nominal {team.nominal_workers} "
                f"({limit}; cohort pool {max(0, self.pool_free(team_name))} free)")


def team_ceiling_workers(team_name: str, teams: Iterable[Team], cluster_workers: int | None = None) -> int:
    """The most workers the team could ever hold at once: its nominal quota plus its borrowing
    limit, bounded by what its cohort can lend when nobody else uses anything, and by the
    cluster's size when given. Raises KeyError for an unknown team."""
    quotas = Quotas(teams, {})
    if team_name not in quotas.teams:
        raise KeyError(team_name)
    ceiling = quotas.headroom(team_name)
    if cluster_workers is not None:
        ceiling = min(ceiling, cluster_workers)
    return ceiling


def never_fits_reason(team_name: str, min_workers: int, teams: Iterable[Team],
                      cluster_workers: int | None = None) -> str | None:
    """Why a job of ``min_workers`` could never start in this team, or None if it could."""
    teams = list(teams)
    by_name = {t.name: t for t in teams}
    if team_name not in by_name:
        return f"unknown team {quote(team_name)} (known: {', '.join(sorted(by_name)) or 'none'})"
    quota_ceiling = team_ceiling_workers(team_name, teams)
    if min_workers > quota_ceiling:
        team = by_name[team_name]
        limit = ("no borrowing limit" if team.borrowing_limit_workers is None
                 else f"borrowing limit {team.borrowing_limit_workers}")
        cohort = f"cohort {team.cohort}" if team.cohort else "no cohort"
        return (f"min_workers {min_workers} is more than team {team_name} could ever get: "
                f"{quota_ceiling} (nominal {team.nominal_workers}, {limit}, {cohort})")
    if cluster_workers is not None and min_workers > cluster_workers:
        return f"min_workers {min_workers} is more than the cluster's {cluster_workers} workers"
    return None
