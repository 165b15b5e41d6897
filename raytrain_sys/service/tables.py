"""The job service's SQL schema as SQLAlchemy Core tables.

Owns: table and column names and types. The schema in a database is made only by the Alembic
migrations in ``migrations/versions`` (never by ``metadata.create_all``); a test compares this
metadata with a migrated database, so a column added here without a migration fails CI. Times
are unix seconds (``_s``, double precision), sizes counts of workers (``_workers``).

Who writes what: ``store.Store`` is the only module that issues SQL. Within it, a job's
``state`` changes only through the guarded ``Store.transition`` (or ``Store.claim``, which
uses it), each change with its row in ``transitions``.
"""

from __future__ import annotations

from sqlalchemy import (Boolean, Column, Double, ForeignKey, Index, Integer, LargeBinary, MetaData, String, Table,
                        Text, UniqueConstraint, false)

# Named constraints, so that migrations and reflection agree on every name on every database.
metadata = MetaData(naming_convention={
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
})

teams = Table(
    "teams", metadata,
    Column("name", String(64), primary_key=True),
    Column("cohort", String(64), nullable=True),
    Column("nominal_workers", Integer, nullable=False),
    Column("borrowing_limit_workers", Integer, nullable=True),  # NULL: no limit
    Column("lending_limit_workers", Integer, nullable=True),  # NULL: lends all of its nominal quota
    Column("weight", Double, nullable=False),
    Column("created_at_s", Double, nullable=False),
    Column("updated_at_s", Double, nullable=False),
)

jobs = Table(
    "jobs", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("team", String(64), ForeignKey("teams.name"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("spec", Text, nullable=False),  # the job spec as submitted, YAML or JSON text
    Column("priority", Integer, nullable=False),  # higher is more important
    Column("state", String(16), nullable=False),  # a JobState value
    Column("held", Boolean, nullable=False),  # paused by its team: the scheduler leaves it waiting
    Column("min_workers", Integer, nullable=False),
    Column("max_workers", Integer, nullable=False),
    Column("elastic", Boolean, nullable=False),
    Column("workers", Integer, nullable=False),  # held now
    Column("target_workers", Integer, nullable=False),  # what the runner was last told
    Column("restarts", Integer, nullable=False),
    Column("mlflow_run_id", String(64), nullable=True),
    Column("last_checkpoint_step", Integer, nullable=True),
    Column("last_checkpoint_at_s", Double, nullable=True),
    Column("submitted_at_s", Double, nullable=False),
    Column("waiting_since_s", Double, nullable=False),
    Column("started_at_s", Double, nullable=True),
    Column("updated_at_s", Double, nullable=False),
    Column("message", Text, nullable=False),  # the last transition's reason
    Column("idempotency_key", String(128), nullable=True),  # a client's retry of a submit
    # A cancel asked for the job's checkpoints to be deleted once it has ended (migration 0002).
    Column("delete_checkpoints", Boolean, nullable=False, server_default=false()),
    # The code package the job runs with (its sha256, see packages.py; migration 0003); NULL: none.
    Column("package", String(64), nullable=True),
    # Why a job not running yet waits (migration 0004; NULL once it runs or ends, and before the
    # reconciler's first look): a WaitCause value, its sentence, since when that cause holds.
    Column("wait_cause", String(32), nullable=True),
    Column("wait_reason", Text, nullable=True),
    Column("wait_cause_since_s", Double, nullable=True),
    # Starts given up in a row (no progress past the bound, or not placed): back to the queue
    # until max_start_returns, then failed; 0 again once it runs.
    Column("start_returns", Integer, nullable=False, server_default="0"),
    # What one worker asks (from the spec, at submit: the scheduler reads no spec) and the flavor
    # its workers run on (set at admission; NULL while it waits, and for jobs admitted before
    # flavors: they count on the first flavor their shape fits). Migration 0005.
    Column("cpus_per_worker", Double, nullable=False, server_default="1"),
    Column("gpus_per_worker", Double, nullable=False, server_default="0"),
    Column("memory_per_worker_gb", Double, nullable=False, server_default="0"),
    Column("accelerator", String(64), nullable=False, server_default=""),
    Column("market", String(16), nullable=False, server_default="any"),
    Column("flavor", String(64), nullable=True),
    # A sweep's trial (migration 0006): its sweep and Tune's trial id, unique together, so that a
    # trial driven again (a restored sweep runner) finds its job instead of submitting another.
    Column("sweep_id", Integer, ForeignKey("sweeps.id"), nullable=True),
    Column("trial_id", String(64), nullable=True),
    Column("rung", Integer, nullable=False, server_default="0"),  # rungs the trial passed: it grows first
    # The trial's segment (migration 0007): 0, then one more each time PBT exploits the trial (its
    # job ended, the next started from the donor's checkpoint); (sweep_id, trial_id, segment)
    # unique, so that a proxy driven again re-attaches to its segment's job.
    Column("segment", Integer, nullable=False, server_default="0"),
    # Steps its runs committed and then trained again (migration 0008): a runner lost and the job
    # restarted from its checkpoint, or a run that restored one; never less than its run's record.
    Column("steps_redone", Integer, nullable=False, server_default="0"),
    UniqueConstraint("team", "idempotency_key"),
    UniqueConstraint("sweep_id", "trial_id", "segment"),
    Index(None, "state"),
)

# Sweeps (migration 0006; model.SweepRecord): Ray Tune decides, each trial is a job above.
# ``state`` changes only through Store.transition_sweep, each change with its sweep_transitions row.
sweeps = Table(
    "sweeps", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("team", String(64), ForeignKey("teams.name"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("spec", Text, nullable=False),  # the validated sweep spec, JSON
    Column("priority", Integer, nullable=False),
    Column("state", String(16), nullable=False),  # a SweepState value
    Column("max_workers", Integer, nullable=True),  # the per-sweep worker cap; NULL: none
    Column("storage_path", Text, nullable=False),  # Tune's experiment directory
    Column("mlflow_parent_run_id", String(64), nullable=True),
    Column("runner_restarts", Integer, nullable=False),
    Column("best_trial", String(64), nullable=True),
    Column("best_value", Double, nullable=True),
    Column("submitted_at_s", Double, nullable=False),
    Column("updated_at_s", Double, nullable=False),
    Column("message", Text, nullable=False),
    Index(None, "state"),
)

sweep_transitions = Table(
    "sweep_transitions", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sweep_id", Integer, ForeignKey("sweeps.id"), nullable=False),
    Column("from_state", String(16), nullable=True),  # NULL: the submit
    Column("to_state", String(16), nullable=False),
    Column("at_s", Double, nullable=False),
    Column("actor", String(64), nullable=False),
    Column("reason", Text, nullable=False),
    Index(None, "sweep_id"),
)

transitions = Table(
    "transitions", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", Integer, ForeignKey("jobs.id"), nullable=False),
    Column("from_state", String(16), nullable=True),  # NULL: the submit that created the job
    Column("to_state", String(16), nullable=False),
    Column("at_s", Double, nullable=False),
    Column("actor", String(64), nullable=False),
    Column("reason", Text, nullable=False),
    Index(None, "job_id"),
)

audit = Table(
    "audit", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at_s", Double, nullable=False),
    Column("actor", String(64), nullable=False),  # a team name or "admin"
    Column("action", String(64), nullable=False),
    Column("target", String(200), nullable=False),
    Column("result", Text, nullable=False),
    Index(None, "at_s"),
)

# Code packages (packages.py): a team's uploaded directory, kept for its jobs' runs and resumes.
packages = Table(
    "packages", metadata,
    Column("sha256", String(64), primary_key=True),
    Column("team", String(64), ForeignKey("teams.name"), primary_key=True),
    Column("size_bytes", Integer, nullable=False),
    Column("files", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
    Column("created_at_s", Double, nullable=False),
)

# The service's flavor table (Kueue's ResourceFlavors; flavors.ResourceFlavor), in its order of
# preference; empty: the implicit flavor counting workers (migration 0005).
flavors = Table(
    "flavors", metadata,
    Column("name", String(64), primary_key=True),
    Column("position", Integer, nullable=False),  # the table's order: a job of any market tries the first first
    Column("market", String(16), nullable=False),  # spot | on-demand (Ray's ray.io/market-type)
    Column("accelerator", String(64), nullable=False),  # Ray's ray.io/accelerator-type; "" CPU only
    Column("resources", String(64), nullable=False),  # what quotas count on it, comma separated
    Column("usd_per_cpu_hour", Double, nullable=False),
    Column("usd_per_gpu_hour", Double, nullable=False),
    Column("usd_per_memory_gb_hour", Double, nullable=False),
    Column("max_cpu", Double, nullable=True),  # NULL: no ceiling configured
    Column("max_gpu", Double, nullable=True),
    Column("max_memory_gb", Double, nullable=True),
)

# A team's quota of one resource on one flavor (teams.FlavorQuota; migration 0005).
team_quotas = Table(
    "team_quotas", metadata,
    Column("team", String(64), ForeignKey("teams.name"), primary_key=True),
    Column("flavor", String(64), primary_key=True),
    Column("resource", String(16), primary_key=True),  # flavors.RESOURCES
    Column("nominal", Double, nullable=False),
    Column("borrowing_limit", Double, nullable=True),  # NULL: as much as the cohort lends
    Column("lending_limit", Double, nullable=True),  # NULL: lends all of its nominal quota
)

tokens = Table(
    "tokens", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("team", String(64), ForeignKey("teams.name"), nullable=True),  # NULL for an admin token
    Column("is_admin", Boolean, nullable=False),
    Column("token_hash", String(64), nullable=False, unique=True),  # HMAC-SHA256, hex; never the token
    Column("created_at_s", Double, nullable=False),
    Column("revoked_at_s", Double, nullable=True),
)

store_meta = Table(
    "store_meta", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)
