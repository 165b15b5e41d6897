"""Teams and their quotas, in Kueue's words.

Owns: ``Team`` (a queue with a nominal quota of workers, a cohort it borrows from and lends to,
and a fair-share weight) and ``FlavorQuota`` (its quota of one resource on one flavor, when the
service has a flavor table); ``Team.quota`` reads either. The arithmetic over them is the
scheduler's (``service/scheduler/quota.py``). Pure: no Ray, no SQL, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from raytrain_sys.errors import ServiceInputError, quote
from raytrain_sys.service.bounds import name_problem
from raytrain_sys.service.flavors import DEFAULT_FLAVOR, RESOURCES, amount_problem


@dataclass(frozen=True)
class FlavorQuota:
    """A team's quota of one resource on one flavor (Kueue's ClusterQueue resourceGroups): its
    nominal amount, the most it borrows beyond it (None: as much as the cohort lends) and the
    most of it it lends (None: all of it). A team with no quota for a flavor's resource has
    nominal 0 there and may borrow from its cohort."""

    flavor: str
    resource: str
    nominal: float
    borrowing_limit: Optional[float] = None
    lending_limit: Optional[float] = None

    def __post_init__(self) -> None:
        if self.flavor == DEFAULT_FLAVOR:
            raise ServiceInputError("quota.flavor", f"got {quote(self.flavor)}; the service without a flavor table "
                                                    f"counts workers with the team's nominal_workers")
        problem = name_problem(self.flavor, "flavor name")
        if problem:
            raise ServiceInputError("quota.flavor", problem)
        if self.resource not in RESOURCES:
            raise ServiceInputError("quota.resource", f"got {quote(self.resource)}; one of {', '.join(RESOURCES)}")
        for field in ("nominal", "borrowing_limit", "lending_limit"):
            value = getattr(self, field)
            if value is None and field != "nominal":
                continue
            problem = amount_problem(value, f"a quota of {self.resource}")
            if problem:
                raise ServiceInputError(f"quota.{field}", problem)
        if self.lending_limit is not None and self.lending_limit > self.nominal:
            raise ServiceInputError("quota.lending_limit", f"got {self.lending_limit:g}; must not exceed nominal "
                                                           f"{self.nominal:g}")


@dataclass(frozen=True)
class Team:
    """A team's queue and quota, in Kueue's words (one resource: workers).

    ``nominal_workers`` is what the team is guaranteed. Teams in the same ``cohort`` lend each
    other the part of their nominal quota they do not use: at most ``lending_limit_workers`` of
    it (None: all of it), and a team borrows at most ``borrowing_limit_workers`` beyond its
    nominal (None: as much as the cohort lends). A team without a cohort is a cohort of one.
    ``weight`` scales its fair share: a team of weight 2 may borrow twice as much before it
    counts as having had its turn.

    These worker fields are its quota on the implicit flavor (a service with no flavor table).
    With a table, ``quotas`` holds its quota per flavor and resource (``FlavorQuota``), read
    through ``quota(flavor, resource)``, with the same cohort and weight.
    """

    name: str
    nominal_workers: int
    cohort: Optional[str] = None
    borrowing_limit_workers: Optional[int] = None
    lending_limit_workers: Optional[int] = None
    weight: float = 1.0
    quotas: tuple[FlavorQuota, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "quotas", tuple(self.quotas))
        if not self.name or not isinstance(self.name, str):
            raise ServiceInputError("team.name", f"got {quote(self.name)}; must be a non-empty string")
        for name in ("nominal_workers", "borrowing_limit_workers", "lending_limit_workers"):
            value = getattr(self, name)
            if value is None and name != "nominal_workers":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ServiceInputError(f"team.{name}", f"got {quote(value)}; must be an integer >= 0")
        if self.lending_limit_workers is not None and self.lending_limit_workers > self.nominal_workers:
            raise ServiceInputError("team.lending_limit_workers",
                                    f"got {self.lending_limit_workers}; must not exceed "
                                    f"nominal_workers {self.nominal_workers}")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            raise ServiceInputError("team.weight", f"got {quote(self.weight)}; must be a number > 0")

    @property
    def cohort_key(self) -> str:
        """The cohort this team shares with; its own name when it has none (a cohort of one)."""
        return self.cohort if self.cohort else f"team:{self.name}"

    @property
    def lendable_workers(self) -> int:
        """The part of the nominal quota the cohort may borrow when this team does not use it."""
        if self.lending_limit_workers is None:
            return self.nominal_workers
        return self.lending_limit_workers

    @property
    def guaranteed_workers(self) -> int:
        """The part of the nominal quota never lent: always this team's."""
        return self.nominal_workers - self.lendable_workers

    def quota(self, flavor: str, resource: str) -> tuple[float, Optional[float], Optional[float]]:
        """(nominal, borrowing limit, lending limit) of ``resource`` on ``flavor``: the worker
        fields on the implicit flavor, else its ``FlavorQuota`` (none: nominal 0, borrowing from
        the cohort unlimited, nothing to lend)."""
        if flavor == DEFAULT_FLAVOR:
            return self.nominal_workers, self.borrowing_limit_workers, self.lending_limit_workers
        for q in self.quotas:
            if q.flavor == flavor and q.resource == resource:
                return q.nominal, q.borrowing_limit, q.lending_limit
        return 0, None, 0

__all__ = ["FlavorQuota", "Team"]
