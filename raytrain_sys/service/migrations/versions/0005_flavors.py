"""Flavors: the service's flavor table (flavors), a team's quota per flavor and resource
(team_quotas), and on jobs what one worker asks (cpus_per_worker, gpus_per_worker,
memory_per_worker_gb, accelerator, market) and the flavor its workers run on (flavor).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26

A store of 0004 has no flavor table: the service keeps its implicit flavor (workers counted
with each team's nominal_workers), so every team's quota and every job's place stay as they
were. Each job's shape is read from its stored spec (JSON, what requests.stored_spec wrote),
so that a flavor table set later counts the jobs of before as they asked; a spec that cannot
be read keeps the defaults (1 CPU, no GPU, any market). Their flavor stays NULL: the scheduler
counts such a job on the first flavor its shape fits.
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "flavors",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("market", sa.String(length=16), nullable=False),
        sa.Column("accelerator", sa.String(length=64), nullable=False),
        sa.Column("resources", sa.String(length=64), nullable=False),
        sa.Column("usd_per_cpu_hour", sa.Double(), nullable=False),
        sa.Column("usd_per_gpu_hour", sa.Double(), nullable=False),
        sa.Column("usd_per_memory_gb_hour", sa.Double(), nullable=False),
        sa.Column("max_cpu", sa.Double(), nullable=True),
        sa.Column("max_gpu", sa.Double(), nullable=True),
        sa.Column("max_memory_gb", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_flavors")),
    )
    op.create_table(
        "team_quotas",
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("flavor", sa.String(length=64), nullable=False),
        sa.Column("resource", sa.String(length=16), nullable=False),
        sa.Column("nominal", sa.Double(), nullable=False),
        sa.Column("borrowing_limit", sa.Double(), nullable=True),
        sa.Column("lending_limit", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name=op.f("fk_team_quotas_team_teams")),
        sa.PrimaryKeyConstraint("team", "flavor", "resource", name=op.f("pk_team_quotas")),
    )
    # batch_alter_table: SQLite cannot add a NOT NULL column with ALTER TABLE alone on every version.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cpus_per_worker", sa.Double(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("gpus_per_worker", sa.Double(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("memory_per_worker_gb", sa.Double(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("accelerator", sa.String(length=64), nullable=False, server_default=""))
        batch.add_column(sa.Column("market", sa.String(length=16), nullable=False, server_default="any"))
        batch.add_column(sa.Column("flavor", sa.String(length=64), nullable=True))
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("spec", sa.Text),
                    sa.column("cpus_per_worker", sa.Double), sa.column("gpus_per_worker", sa.Double),
                    sa.column("memory_per_worker_gb", sa.Double), sa.column("accelerator", sa.String),
                    sa.column("market", sa.String))
    conn = op.get_bind()
    for job_id, spec in conn.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        shape = _shape(spec)
        if shape:
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**shape))


def _shape(spec: str) -> dict:
    """The worker's shape from a stored spec, only the fields it sets (the rest: the defaults)."""
    try:
        resources = json.loads(spec).get("resources") or {}
    except (ValueError, AttributeError):
        return {}
    shape = {}
    for key, column in (("cpus_per_worker", "cpus_per_worker"), ("gpus_per_worker", "gpus_per_worker"),
                        ("memory_per_worker_gb", "memory_per_worker_gb")):
        value = resources.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            shape[column] = float(value)
    for key, column, width in (("accelerator_type", "accelerator", 64), ("market", "market", 16)):
        value = resources.get(key)
        if isinstance(value, str) and value and len(value) <= width:
            shape[column] = value
    return shape


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for column in ("flavor", "market", "accelerator", "memory_per_worker_gb", "gpus_per_worker",
                       "cpus_per_worker"):
            batch.drop_column(column)
    op.drop_table("team_quotas")
    op.drop_table("flavors")
