"""The rules every door holds a request to (the API's schema, the client and CLI before sending,
the store before writing): what a team's, a cohort's, a flavor's and a job's name is, and the
bounds of every number a request can store.

Owns: ``NAME_RULE`` (a DNS label) and ``name_problem``, the looser rule naming an existing team
(``team_ref_problem``), a job's name (``job_name_problem``), and the bounds ``MAX_WORKERS``,
``PRIORITY_LIMIT``, ``MAX_WEIGHT``, ``MAX_JOB_ID`` with ``check_count``. Pure: imports nothing of
the service, so every other module of it may import this one.
"""

from __future__ import annotations

import re
from typing import Optional

from raytrain_sys.errors import ServiceInputError, quote


# A team's (or a cohort's) name is a DNS label (RFC 1123): so it is, unchanged, a URL path
# segment, a Prometheus and a Kubernetes label value, a file name, and one line of a log.
NAME_MAX_CHARS = 63  # a DNS label's and a Kubernetes label value's limit
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
NAME_RULE = ("1-63 lowercase letters (a-z), digits and '-', starting and ending with a letter or digit, "
             "e.g. 'ml-research'")
# The audit's principals besides teams (store.Principal's "admin", auth.ANONYMOUS, auth.BOOTSTRAP).
RESERVED_TEAM_NAMES = frozenset({"admin", "unauthenticated", "bootstrap"})
# A team made before the rule keeps its name and is named by it in requests (its quota, tokens,
# jobs), unless the name holds what a URL path segment or a log line cannot carry: '/' or a
# control character. So a request that names an existing team is held to this looser form.
TEAM_REF_MAX_CHARS = 64  # the teams.name column
TEAM_REF_PATTERN = r"^[^/\x00-\x1f\x7f-\x9f]{1,64}$"
_NAME_RE = re.compile(NAME_PATTERN)
_TEAM_REF_RE = re.compile(TEAM_REF_PATTERN)

# A job's name (the jobs.name column): one line, not blank.
JOB_NAME_MAX_CHARS = 200
JOB_NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*[^\x00-\x20\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
_JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)

# Bounds of the numbers a request stores, each well inside its column (32-bit INTEGER on PostgreSQL).
MAX_WORKERS = 100_000  # a quota or a job's size: beyond any Ray cluster (Ray is tested to a few thousand nodes)
PRIORITY_LIMIT = 1_000_000  # |priority|: aging adds a point per 10 min waited, so this is 19 years of waiting
MAX_WEIGHT = 1_000_000.0  # a fair-share weight: shares a million to one apart are no longer shares
MAX_JOB_ID = 2 ** 31 - 1  # jobs.id (INTEGER): a larger id cannot exist


def name_problem(name: object, what: str = "team name") -> Optional[str]:
    """Why ``name`` is not a valid new team (or cohort) name, or None: the one rule (``NAME_RULE``)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        return f"got {quote(name)}; a {what} is {NAME_RULE}"
    if what == "team name" and name in RESERVED_TEAM_NAMES:
        reserved = ", ".join(sorted(RESERVED_TEAM_NAMES))
        return f"got {quote(name)}; reserved: it names a principal in the audit ({reserved})"
    return None


def team_ref_problem(name: object) -> Optional[str]:
    """Why ``name`` cannot name an existing team in a request (``TEAM_REF_PATTERN``), or None."""
    if not isinstance(name, str) or not _TEAM_REF_RE.fullmatch(name):
        return (f"got {quote(name)}; a team's name has 1-{TEAM_REF_MAX_CHARS} characters, no '/' and no "
                f"control characters (a new team's: {NAME_RULE})")
    return None


def check_team_name(name: object, field: str = "team.name") -> str:
    """``name`` if it is a valid new team name, else ``ServiceInputError`` on ``field``."""
    problem = name_problem(name)
    if problem:
        raise ServiceInputError(field, problem)
    return name  # type: ignore[return-value]


def job_name_problem(name: object) -> Optional[str]:
    """Why ``name`` cannot be a job's name (``JOB_NAME_PATTERN``, at most ``JOB_NAME_MAX_CHARS``), or None."""
    if not isinstance(name, str) or len(name) > JOB_NAME_MAX_CHARS or not _JOB_NAME_RE.fullmatch(name):
        return f"got {quote(name)}; a job's name is one line of 1-{JOB_NAME_MAX_CHARS} characters, not all spaces"
    return None


def check_count(field: str, value: object, low: int = 0, high: int = MAX_WORKERS, low_name: str = "") -> int:
    """An integer in ``low..high`` (not a bool), else ``ServiceInputError`` on ``field``;
    ``low_name`` names where the lower bound comes from (another field)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ServiceInputError(field, f"got {quote(value)}; must be an integer")
    if value < low:
        raise ServiceInputError(field, f"got {quote(value)}; must be at least {low_name or low}")
    if value > high:
        raise ServiceInputError(field, f"got {quote(value)}; must be at most {high}")
    return value

__all__ = ["NAME_MAX_CHARS", "NAME_PATTERN", "NAME_RULE", "RESERVED_TEAM_NAMES", "TEAM_REF_MAX_CHARS",
           "TEAM_REF_PATTERN", "JOB_NAME_MAX_CHARS", "JOB_NAME_PATTERN", "MAX_WORKERS", "PRIORITY_LIMIT",
           "MAX_WEIGHT", "MAX_JOB_ID", "name_problem", "team_ref_problem", "check_team_name", "job_name_problem",
           "check_count"]
