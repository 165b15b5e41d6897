"""The job service's state in SQL: a SQLite file by default, PostgreSQL in production.

Owns: every SQL statement of the service (the tables are in ``tables.py``, the schema is made
and upgraded only by the Alembic migrations, run when the store opens). Rules it keeps:

* **One guarded write per edge.** A job's ``state`` changes only in ``transition``:
  ``UPDATE jobs ... WHERE id = :id AND state IN (:expected)``; anything but exactly one row
  changed raises ``JobStateConflict`` and the transaction, with its ``transitions`` row, is
  rolled back. ``JobState.allowed`` is checked first, so a move the state table does not list
  never reaches the database.
* **Claims under a row lock**: ``claim`` picks the next job with ``FOR UPDATE SKIP LOCKED`` on
  PostgreSQL (two service processes never get the same job); on SQLite every transaction is
  ``BEGIN IMMEDIATE``, which serializes writers.
* **A wait reason belongs to the state it was given in**: a transition that changes the state
  clears ``wait_cause``/``wait_reason`` unless it sets new ones (so a job that runs or ends has
  none, whoever moved it); ``note_waits`` writes the reconciler's reasons for jobs still where
  it saw them, only those that changed, in one transaction a pass.
* **Tokens are never stored or logged**: only their HMAC-SHA256 under a per-database key
  (``store_meta``), looked up by hash. ``issue_token`` returns the token once.
* **One log directory per store** (``log_dir``): recorded in ``store_meta`` by the first part
  of the service that opens the store for it (or told another one), read by every later part,
  so that runners write job logs where ``service serve`` and ``jobs logs`` read them.
* **Errors name their cause**: an unreachable database raises ``ServiceStoreError`` naming the
  URL with its password masked; bad input raises ``ServiceInputError`` naming the field, before
  anything is written.
* **Flavors** (the service's table, ``flavors``) and each team's quota per flavor and
  resource (``team_quotas``) are written whole and checked first: a quota names a flavor of the
  table and a resource it counts; a flavor that live jobs run on is not removed from under them.
* **Sweeps** (``sweeps``) change state only in ``transition_sweep`` (one guarded write and its
  ``sweep_transitions`` row, as a job's). A trial is a job carrying ``(sweep_id, trial_id)``,
  unique together: ``submit`` of a trial that has a job returns that job (a re-driven trial
  re-attaches), and a sweep that has ended takes no new trial.
* **Nothing out of bounds is written**, whoever asks (the API, the service actor, a script): a
  new team's name and a cohort follow ``bounds.NAME_RULE``, every count and priority is within
  ``model``'s bounds (well inside the 32-bit columns). A team made before the name rule is read,
  listed and scheduled as it is.

It decides nothing: which job starts, grows or pauses is the scheduler's; who may do what is the
API's. Audit rows are written by whoever acts (``record_audit``), refusals included.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from sqlalchemy import bindparam, create_engine, delete, event, func, insert, inspect, or_, select, text, update
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, InterfaceError, OperationalError

from raytrain_sys.errors import JobStateConflict, ServiceInputError, ServiceStoreError, quote
from raytrain_sys.service import migrations
from raytrain_sys.service.bounds import (MAX_WEIGHT, PRIORITY_LIMIT, check_count, check_team_name, job_name_problem,
                                         name_problem)
from raytrain_sys.service.flavors import (DEFAULT_SHAPE, FlavorState, ResourceFlavor, WorkerShape, check_flavor_table,
                                          shape_refusal)
from raytrain_sys.service.model import (LIVE_STATES, AuditRecord, JobRecord, JobState, SweepRecord, SweepState,
                                        SweepTransitionRecord, TransitionRecord, WaitCause)
from raytrain_sys.service.scheduler.snapshot import JobView, Snapshot
from raytrain_sys.service.teams import FlavorQuota, Team
from raytrain_sys.service.scheduler.quota import never_fits_reason
from raytrain_sys.service.tables import (audit, flavors, jobs, packages, store_meta, sweep_transitions, sweeps,
                                         team_quotas, teams, tokens, transitions)

DEFAULT_URL = "sqlite:///raytrain-service.db"
LOG_DIR_NAME = "raytrain-sys-logs"  # the default log directory's name, beside a SQLite store's file
LOG_DIR_KEY = "log_dir"  # store_meta: the log directory every part of the service uses
TOKEN_PREFIX = "rts_"  # makes a leaked token easy to spot (secret scanners, logs)
CONNECT_TIMEOUT_S = 5  # a PostgreSQL host that does not answer fails the open in 5 s, not minutes
SQLITE_BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another (BEGIN IMMEDIATE) before failing
CLAIM_ATTEMPTS = 5  # a claim that loses a race to another writer tries the next job

# The columns ``transition`` may set beside the state (everything else is fixed at submit).
RUN_FIELDS = frozenset({"held", "delete_checkpoints", "workers", "target_workers", "restarts", "mlflow_run_id", "last_checkpoint_step",
                        "last_checkpoint_at_s", "started_at_s", "waiting_since_s", "wait_cause", "wait_reason",
                        "start_returns", "flavor"})
# The columns ``transition_sweep`` may set beside the state (its runner's outcomes).
SWEEP_RUN_FIELDS = frozenset({"mlflow_parent_run_id", "runner_restarts", "best_trial", "best_value"})
WAIT_FIELDS = ("wait_cause", "wait_reason")  # set together; wait_cause_since_s is the store's


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to: a team, or the admin."""

    team: Optional[str]
    is_admin: bool

    @property
    def name(self) -> str:
        """As recorded in the audit and transitions tables."""
        return "admin" if self.is_admin else str(self.team)


def mask_url(url: str) -> str:
    """The URL with its password hidden, the only form of a URL that goes into a message."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable database URL>"


class Store:
    """The service's tables behind one SQLAlchemy engine. Open with ``Store.open(url)``."""

    def __init__(self, engine: Engine, url: str):
        self.engine = engine
        self.url = mask_url(url)  # never the password
        self._secret = str(make_url(url).password or "")
        self._wakers: list[Callable[[], None]] = []

    def add_waker(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after each request a user makes through this store object (submit,
        pause, resume, cancel): the service's reconciler starts its pass then, not at its next
        poll."""
        self._wakers.append(fn)

    def requested(self) -> None:
        for fn in self._wakers:
            fn()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, url: str = DEFAULT_URL) -> "Store":
        """Connect, migrate the schema to the newest revision (Alembic; the only way tables are
        made), and return the store. Raises ``ServiceStoreError`` naming the masked URL and the
        cause when the database cannot be reached or used."""
        masked = mask_url(url)
        try:
            parsed = make_url(url)
        except ArgumentError as e:
            raise ServiceStoreError(f"cannot use database URL {masked}: {e}") from None
        try:
            engine = _engine(parsed)
        except (ArgumentError, ImportError) as e:
            raise ServiceStoreError(f"cannot use database URL {masked}: {e}") from None
        store = cls(engine, url)
        try:
            with store._tx() as conn:
                if conn.dialect.name == "postgresql":
                    # Two services opening one fresh database must not both create the tables.
                    conn.execute(text("SELECT pg_advisory_xact_lock(7242501)"))
                migrations.upgrade(conn)
        except BaseException:
            engine.dispose()
            raise
        return store

    @classmethod
    def missing(cls, url: str) -> Optional[str]:
        """Why there is no job service store at ``url`` (None: there is one), found without
        creating anything: a SQLite file that does not exist, or a database without the
        service's tables. ``open`` would make a new, empty store there."""
        try:
            parsed = make_url(url)
            engine = _engine(parsed)
        except (ArgumentError, ImportError) as e:
            raise ServiceStoreError(f"cannot use database URL {mask_url(url)}: {e}") from None
        if parsed.get_backend_name() == "sqlite":
            path = parsed.database or ""
            if path in ("", ":memory:"):
                return "an in-memory database holds no store"
            if not os.path.isfile(path):
                return f"no such file {os.path.abspath(path)}"
        store = cls(engine, url)
        try:
            with store._tx() as conn:
                has_schema = inspect(conn).has_table("alembic_version")
        finally:
            store.close()
        return None if has_schema else "the database has no job service tables"

    def close(self) -> None:
        self.engine.dispose()

    def log_dir(self, given: str = "", base_dir: str = "") -> str:
        """The directory of the service's logs (``job-<id>.log``, ``service.log``): ``given``
        when given (recorded, so that every later part uses it too), else the one recorded in
        this store, else the default, recorded: ``raytrain-sys-logs`` beside a SQLite file, or
        in ``base_dir`` (default: here) for a database that has no file. Absolute."""
        with self._tx() as conn:
            recorded = conn.execute(select(store_meta.c.value).where(store_meta.c.key == LOG_DIR_KEY)).scalar()
            chosen = os.path.abspath(given) if given else recorded or self._default_log_dir(base_dir)
            if chosen != recorded:
                if recorded is None:
                    conn.execute(insert(store_meta).values(key=LOG_DIR_KEY, value=chosen))
                else:
                    conn.execute(update(store_meta).where(store_meta.c.key == LOG_DIR_KEY).values(value=chosen))
        return chosen

    def _default_log_dir(self, base_dir: str) -> str:
        database = self.engine.url.database if self.engine.url.get_backend_name() == "sqlite" else None
        if database and database != ":memory:":
            return os.path.join(os.path.dirname(os.path.abspath(database)), LOG_DIR_NAME)
        return os.path.join(os.path.abspath(base_dir or os.getcwd()), LOG_DIR_NAME)

    def schema_revision(self) -> Optional[str]:
        """The Alembic revision the database is at."""
        with self._tx() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Connection]:
        """One transaction; a lost or refused connection becomes ``ServiceStoreError``."""
        try:
            with self.engine.begin() as conn:
                yield conn
        except (OperationalError, InterfaceError) as e:
            raise ServiceStoreError(f"cannot reach {self.url}: {self._cause(e)}") from None
        except DBAPIError as e:
            if e.connection_invalidated:
                raise ServiceStoreError(f"cannot reach {self.url}: {self._cause(e)}") from None
            raise

    def _cause(self, e: DBAPIError) -> str:
        lines = [ln.strip() for ln in str(e.orig).strip().splitlines() if ln.strip()]
        cause = "; ".join(lines[:2]) if lines else type(e.orig).__name__
        if self._secret:
            cause = cause.replace(self._secret, "***")
        return cause

    # ------------------------------------------------------------------ teams

    def add_team(self, team: Team, *, now_s: Optional[float] = None) -> Team:
        """Create a team (its quota); a name taken or not following ``bounds.NAME_RULE``, or a
        count out of bounds, raises ``ServiceInputError`` on the field."""
        check_team_name(team.name)
        _check_team_write(team)
        now = _now(now_s)
        try:
            with self._tx() as conn:
                conn.execute(insert(teams).values(**_team_row(team), created_at_s=now, updated_at_s=now))
        except IntegrityError:
            raise ServiceInputError("team.name", f"team {quote(team.name)} exists already") from None
        return team

    def update_team(self, team: Team, *, now_s: Optional[float] = None) -> Team:
        """Change a team's quota, cohort or weight (a cohort kept from before the name rule may
        stay; a new one follows it)."""
        with self._tx() as conn:
            cohort = conn.execute(select(teams.c.cohort).where(teams.c.name == team.name)).first()
            if cohort is None:
                raise ServiceInputError("team", f"unknown team {quote(team.name)}")
            _check_team_write(team, kept_cohort=cohort.cohort)
            conn.execute(update(teams).where(teams.c.name == team.name)
                         .values(**_team_row(team), updated_at_s=_now(now_s)))
        return team

    def teams(self) -> list[Team]:
        with self._tx() as conn:
            return _teams(conn)

    def team(self, name: str) -> Team:
        with self._tx() as conn:
            found = _teams(conn, name)
        if not found:
            raise ServiceInputError("team", f"unknown team {quote(name)}")
        return found[0]

    def set_quotas(self, team: str, flavor: str, quotas: Sequence[FlavorQuota], *,
                   now_s: Optional[float] = None) -> Team:
        """Replace ``team``'s quotas on ``flavor`` (none: it has nominal 0 there and borrows from its
        cohort). ``flavor`` must be in the table and every resource one it counts."""
        with self._tx() as conn:
            if conn.execute(select(teams.c.name).where(teams.c.name == team)).first() is None:
                raise ServiceInputError("team", f"unknown team {quote(team)}")
            table = {f.name: f for f in _flavors(conn)}
            if flavor not in table:
                known = ", ".join(table) or "none: the service has no flavor table (flavors set)"
                raise ServiceInputError("quota.flavor", f"got {quote(flavor)}; the service's flavors: {known}")
            for i, q in enumerate(quotas):
                if q.flavor != flavor:
                    raise ServiceInputError(f"quotas[{i}].flavor", f"got {quote(q.flavor)}; this call sets {flavor}'s")
                if q.resource not in table[flavor].resources:
                    raise ServiceInputError(f"quotas[{i}].resource", f"got {quote(q.resource)}; {flavor} counts "
                                                                     f"{', '.join(table[flavor].resources)}")
            resources = [q.resource for q in quotas]
            if len(set(resources)) != len(resources):
                raise ServiceInputError("quotas", f"a resource twice in {quote(resources)}: one quota a resource")
            conn.execute(delete(team_quotas).where(team_quotas.c.team == team, team_quotas.c.flavor == flavor))
            for q in quotas:
                conn.execute(insert(team_quotas).values(team=team, flavor=flavor, resource=q.resource,
                                                        nominal=float(q.nominal),
                                                        borrowing_limit=_float(q.borrowing_limit),
                                                        lending_limit=_float(q.lending_limit)))
            conn.execute(update(teams).where(teams.c.name == team).values(updated_at_s=_now(now_s)))
            return _teams(conn, team)[0]

    # ------------------------------------------------------------------ flavors

    def flavors(self) -> tuple[ResourceFlavor, ...]:
        """The service's flavor table, in its order (empty: the implicit flavor)."""
        with self._tx() as conn:
            return _flavors(conn)

    def set_flavors(self, table: Sequence[ResourceFlavor]) -> tuple[ResourceFlavor, ...]:
        """Replace the flavor table (``flavors.check_flavor_table``). A flavor that admitted live jobs
        run on cannot be removed (``ServiceInputError`` on ``flavors`` naming them); quotas of a
        removed flavor stay, and count again if it comes back."""
        table = check_flavor_table(list(table))
        names = {f.name for f in table}
        with self._tx() as conn:
            running = conn.execute(select(jobs.c.id, jobs.c.flavor).where(
                jobs.c.state.in_([s.value for s in LIVE_STATES]), jobs.c.flavor.is_not(None))).all()
            orphaned = sorted({(row.flavor, row.id) for row in running if row.flavor not in names | {"default"}})
            if orphaned:
                listed = ", ".join(f"job {job_id} on {flavor}" for flavor, job_id in orphaned[:10])
                raise ServiceInputError("flavors", f"would remove flavors live jobs run on ({listed}): keep them "
                                                   f"until those jobs end")
            conn.execute(delete(flavors))
            for position, f in enumerate(table):
                conn.execute(insert(flavors).values(
                    name=f.name, position=position, market=f.market, accelerator=f.accelerator,
                    resources=",".join(f.resources), usd_per_cpu_hour=f.usd_per_cpu_hour,
                    usd_per_gpu_hour=f.usd_per_gpu_hour, usd_per_memory_gb_hour=f.usd_per_memory_gb_hour,
                    max_cpu=f.max_cpu, max_gpu=f.max_gpu, max_memory_gb=f.max_memory_gb))
        return table

    # ------------------------------------------------------------------ jobs

    def submit(self, *, team: str, name: str, spec: str, min_workers: int, max_workers: Optional[int] = None,
               priority: int = 0, elastic: Optional[bool] = None, actor: str,
               idempotency_key: Optional[str] = None, cluster_workers: Optional[int] = None,
               package: Optional[str] = None, now_s: Optional[float] = None, shape: WorkerShape = DEFAULT_SHAPE,
               capacity: Optional[dict[str, dict[str, float]]] = None, sweep_id: Optional[int] = None,
               trial_id: Optional[str] = None, segment: int = 0) -> JobRecord:
        """Queue a job of workers of ``shape``. Rejects, naming the field and writing nothing: an
        unknown team, sizes out of range, a shape that fits no flavor of the table (on the spec's
        field: ``resources.market``, ``resources.accelerator_type`` or
        ``resources.gpus_per_worker``), a min_workers the team could never get on any flavor it
        fits (its nominal quota plus borrowing limit, bounded by its cohort and, when given, by
        the capacity: ``capacity`` per flavor and resource, or ``cluster_workers`` without a
        table), a ``package`` the team has not uploaded. A repeated ``idempotency_key`` of the same
        team returns the job it created first. A sweep's trial (``sweep_id`` and ``trial_id``, given
        together, and its ``segment``: 0, one more after each PBT exploit) of a live sweep of the
        same team: that segment's job when it has one already (a trial driven again re-attaches),
        else a new one."""
        if (sweep_id is None) != (trial_id is None):
            raise ValueError("a trial names both its sweep_id and its trial_id")
        max_workers = min_workers if max_workers is None else max_workers
        check_count("elastic.min_workers", min_workers, low=1)
        check_count("elastic.max_workers", max_workers, low=min_workers,
                    low_name=f"elastic.min_workers ({min_workers})")
        check_count("priority", priority, low=-PRIORITY_LIMIT, high=PRIORITY_LIMIT)
        problem = job_name_problem(name)
        if problem:
            raise ServiceInputError("name", problem)
        if not isinstance(spec, str):
            raise ServiceInputError("spec", "must be the job spec's YAML or JSON text")
        now = _now(now_s)
        try:
            with self._tx() as conn:
                _check_fits(conn, team, min_workers, shape, cluster_workers, capacity)
                if package is not None and not self._has_package(conn, package, team):
                    raise ServiceInputError("package", f"team {team} has uploaded no package {package}: "
                                                       f"upload it first (PUT /v1/packages/<sha256>)")
                if idempotency_key is not None:
                    row = conn.execute(select(jobs).where(jobs.c.team == team,
                                                          jobs.c.idempotency_key == idempotency_key)).first()
                    if row is not None:
                        return _job(row)
                if sweep_id is not None:
                    row = self._trial_row(conn, sweep_id, trial_id, segment)
                    if row is not None:
                        return _job(row)
                    _check_trial_sweep(conn, sweep_id, team)
                job_id = conn.execute(insert(jobs).values(
                    team=team, name=name, spec=spec, priority=priority, state=JobState.QUEUED.value, held=False,
                    min_workers=min_workers, max_workers=max_workers,
                    elastic=(max_workers > min_workers) if elastic is None else bool(elastic),
                    workers=0, target_workers=0, restarts=0, submitted_at_s=now, waiting_since_s=now,
                    updated_at_s=now, message="submitted", idempotency_key=idempotency_key, package=package,
                    cpus_per_worker=shape.cpu, gpus_per_worker=shape.gpu, memory_per_worker_gb=shape.memory_gb,
                    accelerator=shape.accelerator, market=shape.market, sweep_id=sweep_id, trial_id=trial_id,
                    segment=segment,
                ).returning(jobs.c.id)).scalar_one()
                conn.execute(insert(transitions).values(job_id=job_id, from_state=None, to_state=JobState.QUEUED.value,
                                                        at_s=now, actor=actor, reason="submitted"))
                return _job(conn.execute(select(jobs).where(jobs.c.id == job_id)).one())
        except IntegrityError:  # the same idempotency key (or trial), submitted at the same moment elsewhere
            if sweep_id is not None:
                with self._tx() as conn:
                    row = self._trial_row(conn, sweep_id, trial_id, segment)
                if row is None:
                    raise
                return _job(row)
            if idempotency_key is None:
                raise
            with self._tx() as conn:
                return _job(conn.execute(select(jobs).where(jobs.c.team == team,
                                                            jobs.c.idempotency_key == idempotency_key)).one())

    # ------------------------------------------------------------------ code packages

    def put_package(self, *, sha256: str, team: str, data: bytes, files: int,
                    now_s: Optional[float] = None) -> bool:
        """Keep a team's code package (``packages.check``ed by the caller). False when the team
        already had it (nothing written)."""
        try:
            with self._tx() as conn:
                if conn.execute(select(teams.c.name).where(teams.c.name == team)).first() is None:
                    raise ServiceInputError("team", f"no team {quote(team)}")
                if self._has_package(conn, sha256, team):
                    return False
                conn.execute(insert(packages).values(sha256=sha256, team=team, size_bytes=len(data), files=files,
                                                     data=data, created_at_s=_now(now_s)))
                return True
        except IntegrityError:  # the same upload, at the same moment elsewhere
            return False

    def package_info(self, sha256: str, team: Optional[str] = None) -> Optional[dict]:
        """Size, file count and upload time of a package (of ``team``'s when given), or None."""
        query = select(packages.c.sha256, packages.c.team, packages.c.size_bytes, packages.c.files,
                       packages.c.created_at_s).where(packages.c.sha256 == sha256)
        if team is not None:
            query = query.where(packages.c.team == team)
        with self._tx() as conn:
            row = conn.execute(query).first()
        return None if row is None else dict(row._mapping)

    def package_data(self, sha256: str) -> Optional[bytes]:
        """A package's bytes (whichever team uploaded it: they are the same), or None."""
        with self._tx() as conn:
            row = conn.execute(select(packages.c.data).where(packages.c.sha256 == sha256).limit(1)).first()
        return None if row is None else bytes(row.data)

    def prune_packages(self, cutoff_s: float) -> list[tuple[str, str]]:
        """Delete the code packages uploaded before ``cutoff_s`` that no job still waiting or
        running names and no job submitted since ``cutoff_s`` named. Returns the (sha256, team)
        deleted. A package pruned between a client's check that it is there and its submit makes
        that submit a refusal on ``package``; ``Client.submit`` then uploads it again, once."""
        live = [state.value for state in JobState if not state.terminal]
        with self._tx() as conn:
            used = set(conn.execute(select(jobs.c.package, jobs.c.team).where(
                jobs.c.package.is_not(None), or_(jobs.c.state.in_(live), jobs.c.submitted_at_s >= cutoff_s))).all())
            old = conn.execute(select(packages.c.sha256, packages.c.team).where(
                packages.c.created_at_s < cutoff_s)).all()
            gone = [(row.sha256, row.team) for row in old if (row.sha256, row.team) not in used]
            for sha256, team in gone:
                conn.execute(delete(packages).where(packages.c.sha256 == sha256, packages.c.team == team))
        return gone

    @staticmethod
    def _has_package(conn, sha256: str, team: str) -> bool:
        return conn.execute(select(packages.c.sha256).where(packages.c.sha256 == sha256,
                                                             packages.c.team == team)).first() is not None

    def job(self, job_id: int) -> JobRecord:
        return _job(self._one(jobs, job_id, "job"))

    def jobs(self, *, states: Optional[Iterable[Union[JobState, str]]] = None,
             team: Optional[str] = None) -> list[JobRecord]:
        """Jobs in submit order, optionally only those in ``states`` or of one team."""
        return [_job(r) for r in self._listed(jobs, states and [JobState(s).value for s in states], team)]

    def _one(self, table, row_id: int, what: str):
        """The row ``row_id`` of ``table`` (jobs, sweeps), or a 404's error naming ``<what>_id``."""
        with self._tx() as conn:
            row = conn.execute(select(table).where(table.c.id == row_id)).first()
        if row is None:
            raise ServiceInputError(f"{what}_id", f"no {what} {row_id}")
        return row

    def _listed(self, table, states: Optional[list[str]], team: Optional[str]) -> list:
        """``table``'s rows (jobs, sweeps) in submit order, only those in ``states`` (values;
        None: all) and of ``team`` (None: every team's)."""
        query = select(table).order_by(table.c.id)
        if states is not None:
            query = query.where(table.c.state.in_(states))
        if team is not None:
            query = query.where(table.c.team == team)
        with self._tx() as conn:
            return list(conn.execute(query))

    def transition(self, job_id: int, expected: Union[JobState, Sequence[JobState]], to: JobState, *,
                   actor: str, reason: str, now_s: Optional[float] = None, expected_held: Optional[bool] = None,
                   **changes: Any) -> JobRecord:
        """Move a job from one of the ``expected`` states to ``to`` (one guarded write, and its
        transitions row, in one transaction), setting the run fields in ``changes`` with it.
        ``expected_held`` (when not None) is part of the guard too: a team's hold or release of
        a waiting job is a move from (state, held) to (state, not held).
        Raises ``TransitionNotAllowed`` for an edge ``JobState`` does not list and
        ``JobStateConflict`` when the job is not in an expected state; nothing is written then."""
        expected_states = _states(expected)
        for state in expected_states:
            state.check_move(JobState(to))
        unknown = set(changes) - RUN_FIELDS
        if unknown:
            raise ValueError(f"transition cannot set {sorted(unknown)}; settable: {sorted(RUN_FIELDS)}")
        with self._tx() as conn:
            return self._transition(conn, job_id, expected_states, JobState(to), actor, reason, _now(now_s), changes,
                                    expected_held)

    def _transition(self, conn: Connection, job_id: int, expected: tuple[JobState, ...], to: JobState,
                    actor: str, reason: str, now: float, changes: dict,
                    expected_held: Optional[bool] = None) -> JobRecord:
        # Lock the row (PostgreSQL) so that the state recorded as "from" is the one replaced.
        found = conn.execute(select(jobs.c.state, jobs.c.held).where(jobs.c.id == job_id).with_for_update()).first()
        if found is None:
            raise ServiceInputError("job_id", f"no job {job_id}")
        current = found.state
        guard = [jobs.c.id == job_id, jobs.c.state.in_([s.value for s in expected])]
        if expected_held is not None:
            guard.append(jobs.c.held.is_(True) if expected_held else jobs.c.held.is_(False))
        changes = dict(changes)
        if any(f in changes for f in WAIT_FIELDS):
            if not all(f in changes for f in WAIT_FIELDS) or not to.pending:
                raise ValueError(f"a wait reason is set with both {WAIT_FIELDS}, on a move to a state not running yet")
            changes["wait_cause"] = WaitCause(changes["wait_cause"]).value
            changes["wait_cause_since_s"] = now
        elif current != to.value:  # a reason said why it waited in the state it leaves
            changes.update(wait_cause=None, wait_reason=None, wait_cause_since_s=None)
        result = conn.execute(update(jobs).where(*guard).values(state=to.value, updated_at_s=now, message=reason,
                                                                **changes))
        if result.rowcount != 1:
            wanted = " or ".join(s.value for s in expected)
            if expected_held is not None:
                now_is = f"{current}{' (held)' if found.held else ''}"
                wanted += " (held)" if expected_held else " (not held)"
            else:
                now_is = current
            raise JobStateConflict(
                f"job {job_id} is {now_is}, not {wanted}: cannot move it to {to.value} (nothing was changed)")
        conn.execute(insert(transitions).values(job_id=job_id, from_state=current, to_state=to.value, at_s=now,
                                                actor=actor, reason=reason))
        return _job(conn.execute(select(jobs).where(jobs.c.id == job_id)).one())

    def note_waits(self, notes: dict[int, tuple[JobState, WaitCause, str]], *,
                   now_s: Optional[float] = None) -> int:
        """Record why jobs not running yet wait: ``notes`` maps a job id to (the state it was
        seen in, the cause, the sentence). Written only for a job still in that state and only
        when the cause or the sentence differs from what is stored (no statement at all when
        nothing changed); ``wait_cause_since_s`` moves only when the cause does. No transitions
        row (the state does not change) and ``updated_at_s`` is left alone. One transaction;
        returns how many jobs were written."""
        if not notes:
            return 0
        now = _now(now_s)
        with self._tx() as conn:
            stored = conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.wait_cause, jobs.c.wait_reason,
                                         jobs.c.wait_cause_since_s).where(jobs.c.id.in_(list(notes)))).all()
            rows = []
            for row in stored:
                state, cause, reason = notes[row.id]
                if row.state != state.value or not state.pending or (row.wait_cause, row.wait_reason) == (
                        cause.value, reason):
                    continue
                since = row.wait_cause_since_s if row.wait_cause == cause.value and row.wait_cause_since_s else now
                rows.append({"_id": row.id, "_state": state.value, "_cause": cause.value, "_reason": reason,
                             "_since": since})
            if rows:
                conn.execute(update(jobs).where(jobs.c.id == bindparam("_id"), jobs.c.state == bindparam("_state"))
                             .values(wait_cause=bindparam("_cause"), wait_reason=bindparam("_reason"),
                                     wait_cause_since_s=bindparam("_since")), rows)
        return len(rows)

    def cancelled_with_checkpoints_to_delete(self) -> list[JobRecord]:
        """Cancelled jobs whose cancel asked for their checkpoints to go, not yet done."""
        query = (select(jobs).where(jobs.c.state == JobState.CANCELLED.value, jobs.c.delete_checkpoints.is_(True))
                 .order_by(jobs.c.id))
        with self._tx() as conn:
            return [_job(r) for r in conn.execute(query)]

    def checkpoints_deleted(self, job_id: int, *, actor: str, reason: str, now_s: Optional[float] = None) -> bool:
        """Record that a cancelled job's checkpoints are gone: the flag cleared and a note in its
        history (cancelled -> cancelled), in one transaction. False when another pass did it."""
        now = _now(now_s)
        with self._tx() as conn:
            result = conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.state == JobState.CANCELLED.value,
                                                     jobs.c.delete_checkpoints.is_(True))
                                  .values(delete_checkpoints=False, updated_at_s=now, message=reason))
            if result.rowcount != 1:
                return False
            conn.execute(insert(transitions).values(job_id=job_id, from_state=JobState.CANCELLED.value,
                                                    to_state=JobState.CANCELLED.value, at_s=now, actor=actor,
                                                    reason=reason))
        return True

    def claim(self, expected: Union[JobState, Sequence[JobState]], to: JobState, *, actor: str, reason: str,
              job_ids: Optional[Iterable[int]] = None, now_s: Optional[float] = None,
              **changes: Any) -> Optional[JobRecord]:
        """Take the oldest job in ``expected`` (among ``job_ids`` if given) and move it to ``to``,
        or return None if there is none. On PostgreSQL the candidate row is locked with ``FOR
        UPDATE SKIP LOCKED``, so concurrent claimers each get a different job."""
        expected_states = _states(expected)
        for state in expected_states:
            state.check_move(JobState(to))
        ids = None if job_ids is None else list(job_ids)
        for _ in range(CLAIM_ATTEMPTS):
            query = (select(jobs.c.id).where(jobs.c.state.in_([s.value for s in expected_states]))
                     .order_by(jobs.c.id).limit(1).with_for_update(skip_locked=True))
            if ids is not None:
                query = query.where(jobs.c.id.in_(ids))
            try:
                with self._tx() as conn:
                    job_id = conn.execute(query).scalar()
                    if job_id is None:
                        return None
                    return self._transition(conn, job_id, expected_states, JobState(to), actor, reason,
                                            _now(now_s), changes)
            except JobStateConflict:
                continue  # another claimer moved it between the select and the update
        return None

    def record_checkpoint(self, job_id: int, step: int, at_s: float) -> None:
        """A durable checkpoint of a live job (no state change: no transitions row)."""
        with self._tx() as conn:
            changed = conn.execute(update(jobs).where(jobs.c.id == job_id,
                                                      jobs.c.state.in_([s.value for s in LIVE_STATES]))
                                   .values(last_checkpoint_step=step, last_checkpoint_at_s=at_s,
                                           updated_at_s=_now(None))).rowcount
        if changed != 1:
            raise JobStateConflict(f"job {job_id} does not exist or has ended: checkpoint not recorded")

    def record_steps_redone(self, job_id: int, steps: int) -> None:
        """The steps a live job has trained twice so far (no state change: no transitions row);
        never lowered: a count the runner reports below the recorded one leaves it."""
        with self._tx() as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.steps_redone < steps)
                         .values(steps_redone=steps, updated_at_s=_now(None)))

    def history(self, job_id: int) -> list[TransitionRecord]:
        """Every transition of a job, oldest first."""
        with self._tx() as conn:
            rows = conn.execute(select(transitions).where(transitions.c.job_id == job_id)
                                .order_by(transitions.c.id)).all()
        return [TransitionRecord(job_id=r.job_id, from_state=JobState(r.from_state) if r.from_state else None,
                                 to_state=JobState(r.to_state), at_s=r.at_s, actor=r.actor, reason=r.reason)
                for r in rows]

    def snapshot(self, cluster_workers: int, flavor_states: Sequence[FlavorState] = ()) -> Snapshot:
        """The scheduler's input: every team (with its quotas) and every live job, read in one
        transaction, and the cluster's capacity: ``flavor_states`` (the table's flavors with
        their capacity) or, with none, ``cluster_workers``."""
        with self._tx() as conn:
            all_teams = _teams(conn)
            live = [JobView.of(_job(r)) for r in conn.execute(
                select(jobs).where(jobs.c.state.in_([s.value for s in LIVE_STATES])).order_by(jobs.c.id))]
            caps = tuple((r.id, r.max_workers) for r in conn.execute(
                select(sweeps.c.id, sweeps.c.max_workers).where(
                    sweeps.c.max_workers.is_not(None),
                    sweeps.c.state.in_([s.value for s in SweepState if not s.terminal]))))
        return Snapshot(all_teams, live, cluster_workers=cluster_workers, flavors=tuple(flavor_states),
                        group_limits=caps)

    # ------------------------------------------------------------------ sweeps

    def submit_sweep(self, *, team: str, name: str, spec: str, priority: int = 0, max_workers: Optional[int] = None,
                     storage_path: str, actor: str, trial_min_workers: int = 1, shape: WorkerShape = DEFAULT_SHAPE,
                     cluster_workers: Optional[int] = None, capacity: Optional[dict[str, dict[str, float]]] = None,
                     now_s: Optional[float] = None) -> SweepRecord:
        """Record a sweep (its spec validated by the caller, ``sweeps.spec``), queued for its
        sweep runner. An unknown team, a name or a count out of bounds, or trials of
        ``trial_min_workers`` of ``shape`` that could never start (as ``submit`` refuses a job)
        raise ``ServiceInputError`` on the field; nothing is written then."""
        check_count("priority", priority, low=-PRIORITY_LIMIT, high=PRIORITY_LIMIT)
        if max_workers is not None:
            check_count("max_workers", max_workers, low=1)
        problem = job_name_problem(name)
        if problem:
            raise ServiceInputError("name", problem.replace("a job's name", "a sweep's name"))
        now = _now(now_s)
        with self._tx() as conn:
            _check_fits(conn, team, trial_min_workers, shape, cluster_workers, capacity)
            sweep_id = conn.execute(insert(sweeps).values(
                team=team, name=name, spec=spec, priority=priority, state=SweepState.QUEUED.value,
                max_workers=max_workers, storage_path=storage_path, runner_restarts=0, submitted_at_s=now,
                updated_at_s=now, message="submitted").returning(sweeps.c.id)).scalar_one()
            conn.execute(insert(sweep_transitions).values(sweep_id=sweep_id, from_state=None,
                                                          to_state=SweepState.QUEUED.value, at_s=now, actor=actor,
                                                          reason="submitted"))
            return _sweep(conn.execute(select(sweeps).where(sweeps.c.id == sweep_id)).one())

    def sweep(self, sweep_id: int) -> SweepRecord:
        return _sweep(self._one(sweeps, sweep_id, "sweep"))

    def sweeps(self, *, states: Optional[Iterable[Union[SweepState, str]]] = None,
               team: Optional[str] = None) -> list[SweepRecord]:
        """Sweeps in submit order, optionally only those in ``states`` or of one team."""
        return [_sweep(r) for r in self._listed(sweeps, states and [SweepState(s).value for s in states], team)]

    def transition_sweep(self, sweep_id: int, expected: Union[SweepState, Sequence[SweepState]], to: SweepState, *,
                         actor: str, reason: str, now_s: Optional[float] = None, **changes: Any) -> SweepRecord:
        """Move a sweep from one of ``expected`` to ``to``, setting ``SWEEP_RUN_FIELDS`` with it: one
        guarded write and its sweep_transitions row, as ``transition`` does for a job. Raises
        ``TransitionNotAllowed`` for an edge ``SweepState`` does not list and ``JobStateConflict``
        when the sweep is not in an expected state; nothing is written then."""
        expected_states = (SweepState(expected),) if isinstance(expected, (SweepState, str)) else tuple(
            SweepState(s) for s in expected)
        to = SweepState(to)
        for state in expected_states:
            state.check_move(to)
        unknown = set(changes) - SWEEP_RUN_FIELDS
        if unknown:
            raise ValueError(f"transition_sweep cannot set {sorted(unknown)}; settable: {sorted(SWEEP_RUN_FIELDS)}")
        now = _now(now_s)
        with self._tx() as conn:
            found = conn.execute(select(sweeps.c.state).where(sweeps.c.id == sweep_id).with_for_update()).first()
            if found is None:
                raise ServiceInputError("sweep_id", f"no sweep {sweep_id}")
            result = conn.execute(update(sweeps).where(
                sweeps.c.id == sweep_id, sweeps.c.state.in_([s.value for s in expected_states]))
                .values(state=to.value, updated_at_s=now, message=reason, **changes))
            if result.rowcount != 1:
                wanted = " or ".join(s.value for s in expected_states)
                raise JobStateConflict(f"sweep {sweep_id} is {found.state}, not {wanted}: cannot move it to "
                                       f"{to.value} (nothing was changed)")
            conn.execute(insert(sweep_transitions).values(sweep_id=sweep_id, from_state=found.state, to_state=to.value,
                                                          at_s=now, actor=actor, reason=reason))
            return _sweep(conn.execute(select(sweeps).where(sweeps.c.id == sweep_id)).one())

    def sweep_history(self, sweep_id: int) -> list[SweepTransitionRecord]:
        """Every state change of a sweep, oldest first."""
        with self._tx() as conn:
            rows = conn.execute(select(sweep_transitions).where(sweep_transitions.c.sweep_id == sweep_id)
                                .order_by(sweep_transitions.c.id)).all()
        return [SweepTransitionRecord(sweep_id=r.sweep_id, to_state=SweepState(r.to_state), at_s=r.at_s,
                                      from_state=SweepState(r.from_state) if r.from_state else None, actor=r.actor,
                                      reason=r.reason) for r in rows]

    def trials(self, sweep_id: int) -> list[JobRecord]:
        """A sweep's trial jobs, in submit order."""
        with self._tx() as conn:
            return [_job(r) for r in conn.execute(select(jobs).where(jobs.c.sweep_id == sweep_id).order_by(jobs.c.id))]

    def set_rung(self, job_id: int, rung: int) -> bool:
        """Record the rungs a live trial passed (its sweep runner, after each of Tune's
        promotions): growth order only, no state change. False when the job has ended."""
        with self._tx() as conn:
            return conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.sweep_id.is_not(None),
                                                   jobs.c.state.in_([s.value for s in LIVE_STATES]))
                                .values(rung=int(rung))).rowcount == 1

    @staticmethod
    def _trial_row(conn: Connection, sweep_id: int, trial_id: Optional[str], segment: int):
        return conn.execute(select(jobs).where(jobs.c.sweep_id == sweep_id, jobs.c.trial_id == trial_id,
                                               jobs.c.segment == segment)).first()

    # ------------------------------------------------------------------ audit

    def record_audit(self, actor: str, action: str, target: str, result: str, *,
                     now_s: Optional[float] = None) -> None:
        """One row of who did what to what, and how it ended (``ok`` or why it was refused)."""
        with self._tx() as conn:
            conn.execute(insert(audit).values(at_s=_now(now_s), actor=actor, action=action, target=target,
                                              result=result))

    def audit_log(self, *, actor: Optional[str] = None, limit: Optional[int] = None) -> list[AuditRecord]:
        """Audit rows, oldest first (the newest ``limit`` of them if given)."""
        query = select(audit).order_by(audit.c.id.desc())
        if actor is not None:
            query = query.where(audit.c.actor == actor)
        if limit is not None:
            query = query.limit(limit)
        with self._tx() as conn:
            rows = conn.execute(query).all()
        return [AuditRecord(at_s=r.at_s, actor=r.actor, action=r.action, target=r.target, result=r.result)
                for r in reversed(rows)]

    # ------------------------------------------------------------------ tokens

    def issue_token(self, team: Optional[str], *, now_s: Optional[float] = None) -> str:
        """A new bearer token for ``team`` (None: an admin token). Only its hash is stored; the
        token itself is returned once and must not be logged."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._tx() as conn:
            if team is not None and conn.execute(select(teams.c.name).where(teams.c.name == team)).first() is None:
                raise ServiceInputError("team", f"unknown team {quote(team)}")
            conn.execute(insert(tokens).values(team=team, is_admin=team is None,
                                               token_hash=self._hash(conn, token), created_at_s=_now(now_s)))
        return token

    def authenticate(self, token: str) -> Optional[Principal]:
        """The team (or admin) a token belongs to, or None for an unknown or revoked token."""
        if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
            return None
        with self._tx() as conn:
            row = conn.execute(select(tokens.c.team, tokens.c.is_admin)
                               .where(tokens.c.token_hash == self._hash(conn, token),
                                      tokens.c.revoked_at_s.is_(None))).first()
        return None if row is None else Principal(team=row.team, is_admin=bool(row.is_admin))

    def revoke_tokens(self, team: Optional[str], *, now_s: Optional[float] = None) -> int:
        """Revoke every token of ``team`` (None: every admin token); returns how many."""
        owner = tokens.c.is_admin.is_(True) if team is None else tokens.c.team == team
        with self._tx() as conn:
            return conn.execute(update(tokens).where(owner, tokens.c.revoked_at_s.is_(None))
                                .values(revoked_at_s=_now(now_s))).rowcount

    def _hash(self, conn: Connection, token: str) -> str:
        key = conn.execute(select(store_meta.c.value).where(store_meta.c.key == "token_hmac_key")).scalar_one()
        return hmac.new(bytes.fromhex(key), token.encode(), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ counts

    def count_jobs(self) -> dict[str, int]:
        """Jobs per state."""
        with self._tx() as conn:
            return {state: n for state, n in conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state))}


# ----------------------------------------------------------------------------- helpers


def _engine(url) -> Engine:
    if url.get_backend_name() == "sqlite":
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

        # pysqlite's own transaction handling begins late and never for a SELECT; take it over so
        # that every transaction is BEGIN IMMEDIATE: one writer at a time, and a read followed by
        # a write in one transaction sees no other writer in between.
        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    connect_args = {"connect_timeout": CONNECT_TIMEOUT_S} if url.get_backend_name() == "postgresql" else {}
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)


def _now(now_s: Optional[float]) -> float:
    return time.time() if now_s is None else float(now_s)


def _states(expected: Union[JobState, str, Sequence[JobState]]) -> tuple[JobState, ...]:
    if isinstance(expected, (JobState, str)):
        return (JobState(expected),)
    return tuple(JobState(s) for s in expected)


def _check_team_write(team: Team, kept_cohort: Optional[str] = None) -> None:
    """The bounds a team is written within (``Team`` itself checks signs and the lending limit;
    rows from before a bound was set are read as they are)."""
    for field in ("nominal_workers", "borrowing_limit_workers", "lending_limit_workers"):
        value = getattr(team, field)
        if value is not None:
            check_count(f"team.{field}", value)
    if not team.weight <= MAX_WEIGHT:
        raise ServiceInputError("team.weight", f"got {quote(team.weight)}; must be a number in (0, {MAX_WEIGHT:g}]")
    if team.cohort is not None and team.cohort != kept_cohort:
        problem = name_problem(team.cohort, "cohort name")
        if problem:
            raise ServiceInputError("team.cohort", problem)


def _team_row(team: Team) -> dict:
    return {"name": team.name, "cohort": team.cohort, "nominal_workers": team.nominal_workers,
            "borrowing_limit_workers": team.borrowing_limit_workers,
            "lending_limit_workers": team.lending_limit_workers, "weight": float(team.weight)}


def _team(row, quotas: Sequence[FlavorQuota] = ()) -> Team:
    return Team(name=row.name, nominal_workers=row.nominal_workers, cohort=row.cohort,
                borrowing_limit_workers=row.borrowing_limit_workers,
                lending_limit_workers=row.lending_limit_workers, weight=row.weight, quotas=tuple(quotas))


def _teams(conn: Connection, name: Optional[str] = None) -> list[Team]:
    """Every team (or the one named) with its quotas per flavor, in name order."""
    query, quota_query = select(teams).order_by(teams.c.name), select(team_quotas).order_by(
        team_quotas.c.team, team_quotas.c.flavor, team_quotas.c.resource)
    if name is not None:
        query, quota_query = query.where(teams.c.name == name), quota_query.where(team_quotas.c.team == name)
    quotas: dict[str, list[FlavorQuota]] = {}
    for q in conn.execute(quota_query):
        quotas.setdefault(q.team, []).append(FlavorQuota(q.flavor, q.resource, q.nominal, q.borrowing_limit,
                                                         q.lending_limit))
    return [_team(r, quotas.get(r.name, ())) for r in conn.execute(query)]


def _flavors(conn: Connection) -> tuple[ResourceFlavor, ...]:
    return tuple(ResourceFlavor(name=r.name, market=r.market, accelerator=r.accelerator,
                                resources=tuple(r.resources.split(",")), usd_per_cpu_hour=r.usd_per_cpu_hour,
                                usd_per_gpu_hour=r.usd_per_gpu_hour, usd_per_memory_gb_hour=r.usd_per_memory_gb_hour,
                                max_cpu=r.max_cpu, max_gpu=r.max_gpu, max_memory_gb=r.max_memory_gb)
                 for r in conn.execute(select(flavors).order_by(flavors.c.position)))


def _float(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(value)


def _check_fits(conn: Connection, team: str, min_workers: int, shape: WorkerShape, cluster_workers: Optional[int],
                capacity: Optional[dict[str, dict[str, float]]]) -> None:
    """A job of ``min_workers`` of ``shape`` could ever start in ``team``: its shape fits a
    flavor of the table (else ``ServiceInputError`` on the spec's field) and some flavor's quota
    and capacity hold it (else on ``elastic.min_workers``); an unknown team on ``team``."""
    all_teams = _teams(conn)
    if team not in {t.name for t in all_teams}:
        raise ServiceInputError("team", never_fits_reason(team, min_workers, all_teams))
    table = _flavors(conn)
    refused = shape_refusal(shape, table)
    if refused:
        raise ServiceInputError(*refused)
    states = None if not table else [FlavorState(f, (capacity or {}).get(f.name, {})) for f in table]
    never = never_fits_reason(team, min_workers, all_teams, cluster_workers, shape=shape, flavors=states)
    if never:
        raise ServiceInputError("elastic.min_workers", never)


def _check_trial_sweep(conn: Connection, sweep_id: int, team: str) -> None:
    """A new trial belongs to a live sweep of its own team: a sweep that has ended submits no
    more trials (a runner that outlived its sweep's cancel is refused, naming the state)."""
    row = conn.execute(select(sweeps.c.team, sweeps.c.state).where(sweeps.c.id == sweep_id)).first()
    if row is None:
        raise ServiceInputError("sweep_id", f"no sweep {sweep_id}")
    if row.team != team:
        raise ServiceInputError("team", f"sweep {sweep_id} is team {row.team}'s, not {quote(team)}'s")
    if SweepState(row.state).terminal:
        raise JobStateConflict(f"sweep {sweep_id} is {row.state}: it submits no more trials")


def _sweep(row) -> SweepRecord:
    return SweepRecord(id=row.id, team=row.team, name=row.name, spec=row.spec, priority=row.priority,
                       state=SweepState(row.state), max_workers=row.max_workers, storage_path=row.storage_path,
                       mlflow_parent_run_id=row.mlflow_parent_run_id, runner_restarts=row.runner_restarts,
                       best_trial=row.best_trial, best_value=row.best_value, submitted_at_s=row.submitted_at_s,
                       updated_at_s=row.updated_at_s, message=row.message)


def _job(row) -> JobRecord:
    return JobRecord(id=row.id, team=row.team, name=row.name, spec=row.spec, priority=row.priority,
                     state=JobState(row.state), held=bool(row.held), min_workers=row.min_workers,
                     max_workers=row.max_workers, elastic=bool(row.elastic), workers=row.workers,
                     target_workers=row.target_workers, restarts=row.restarts, mlflow_run_id=row.mlflow_run_id,
                     last_checkpoint_step=row.last_checkpoint_step, last_checkpoint_at_s=row.last_checkpoint_at_s,
                     submitted_at_s=row.submitted_at_s, waiting_since_s=row.waiting_since_s,
                     started_at_s=row.started_at_s, updated_at_s=row.updated_at_s, message=row.message,
                     delete_checkpoints=bool(row.delete_checkpoints), package=row.package,
                     wait_cause=WaitCause(row.wait_cause) if row.wait_cause else None, wait_reason=row.wait_reason,
                     wait_cause_since_s=row.wait_cause_since_s, start_returns=row.start_returns,
                     cpus_per_worker=row.cpus_per_worker, gpus_per_worker=row.gpus_per_worker,
                     memory_per_worker_gb=row.memory_per_worker_gb, accelerator=row.accelerator, market=row.market,
                     flavor=row.flavor, sweep_id=row.sweep_id, trial_id=row.trial_id, rung=row.rung,
                     segment=row.segment, steps_redone=row.steps_redone)
