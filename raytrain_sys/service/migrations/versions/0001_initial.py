"""The initial schema: teams, jobs, transitions, audit, tokens, store_meta.

Revision ID: 0001
Revises:
Create Date: 2026-11-25

Written out in full (not imported from ``tables.py``), so that this revision stays what it was
when later ones change the tables. Also stores the key tokens are hashed with (HMAC-SHA256), a
random value made once per database.
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("cohort", sa.String(length=64), nullable=True),
        sa.Column("nominal_workers", sa.Integer(), nullable=False),
        sa.Column("borrowing_limit_workers", sa.Integer(), nullable=True),
        sa.Column("lending_limit_workers", sa.Integer(), nullable=True),
        sa.Column("weight", sa.Double(), nullable=False),
        sa.Column("created_at_s", sa.Double(), nullable=False),
        sa.Column("updated_at_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_teams")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("held", sa.Boolean(), nullable=False),
        sa.Column("min_workers", sa.Integer(), nullable=False),
        sa.Column("max_workers", sa.Integer(), nullable=False),
        sa.Column("elastic", sa.Boolean(), nullable=False),
        sa.Column("workers", sa.Integer(), nullable=False),
        sa.Column("target_workers", sa.Integer(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("last_checkpoint_step", sa.Integer(), nullable=True),
        sa.Column("last_checkpoint_at_s", sa.Double(), nullable=True),
        sa.Column("submitted_at_s", sa.Double(), nullable=False),
        sa.Column("waiting_since_s", sa.Double(), nullable=False),
        sa.Column("started_at_s", sa.Double(), nullable=True),
        sa.Column("updated_at_s", sa.Double(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=128), nullable=True),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name=op.f("fk_jobs_team_teams")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("team", "idempotency_key", name=op.f("uq_jobs_team_idempotency_key")),
    )
    op.create_index(op.f("ix_jobs_state"), "jobs", ["state"], unique=False)
    op.create_table(
        "transitions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_transitions_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transitions")),
    )
    op.create_index(op.f("ix_transitions_job_id"), "transitions", ["job_id"], unique=False)
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit")),
    )
    op.create_index(op.f("ix_audit_at_s"), "audit", ["at_s"], unique=False)
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("team", sa.String(length=64), nullable=True),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at_s", sa.Double(), nullable=False),
        sa.Column("revoked_at_s", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name=op.f("fk_tokens_team_teams")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_tokens_token_hash")),
    )
    store_meta = op.create_table(
        "store_meta",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_store_meta")),
    )
    op.bulk_insert(store_meta, [{"key": "token_hmac_key", "value": secrets.token_hex(32)}])


def downgrade() -> None:
    op.drop_table("store_meta")
    op.drop_table("tokens")
    op.drop_index(op.f("ix_audit_at_s"), table_name="audit")
    op.drop_table("audit")
    op.drop_index(op.f("ix_transitions_job_id"), table_name="transitions")
    op.drop_table("transitions")
    op.drop_index(op.f("ix_jobs_state"), table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("teams")
