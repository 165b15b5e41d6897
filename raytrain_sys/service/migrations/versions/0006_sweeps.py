"""Sweeps: the sweeps table and its transitions, and on jobs the (sweep_id, trial_id) a trial
carries, unique together, and the rungs it passed (rung: it grows first).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28

A store of 0005 has no sweep: every job keeps NULL in both columns (a job of its own), and the
unique constraint holds over NULLs on SQLite and PostgreSQL alike (NULLs are distinct).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("max_workers", sa.Integer(), nullable=True),
        sa.Column("storage_path", sa.Text(), nullable=False),
        sa.Column("mlflow_parent_run_id", sa.String(length=64), nullable=True),
        sa.Column("runner_restarts", sa.Integer(), nullable=False),
        sa.Column("best_trial", sa.String(length=64), nullable=True),
        sa.Column("best_value", sa.Double(), nullable=True),
        sa.Column("submitted_at_s", sa.Double(), nullable=False),
        sa.Column("updated_at_s", sa.Double(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name="fk_sweeps_team_teams"),
        sa.PrimaryKeyConstraint("id", name="pk_sweeps"),
    )
    op.create_index("ix_sweeps_state", "sweeps", ["state"])
    op.create_table(
        "sweep_transitions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], name="fk_sweep_transitions_sweep_id_sweeps"),
        sa.PrimaryKeyConstraint("id", name="pk_sweep_transitions"),
    )
    op.create_index("ix_sweep_transitions_sweep_id", "sweep_transitions", ["sweep_id"])
    # batch_alter_table: SQLite adds a foreign key and a unique constraint only by copying the table.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("sweep_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("trial_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("rung", sa.Integer(), nullable=False, server_default="0"))
        batch.create_foreign_key("fk_jobs_sweep_id_sweeps", "sweeps", ["sweep_id"], ["id"])
        batch.create_unique_constraint("uq_jobs_sweep_id_trial_id", ["sweep_id", "trial_id"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("uq_jobs_sweep_id_trial_id", type_="unique")
        batch.drop_constraint("fk_jobs_sweep_id_sweeps", type_="foreignkey")
        batch.drop_column("rung")
        batch.drop_column("trial_id")
        batch.drop_column("sweep_id")
    op.drop_index("ix_sweep_transitions_sweep_id", table_name="sweep_transitions")
    op.drop_table("sweep_transitions")
    op.drop_index("ix_sweeps_state", table_name="sweeps")
    op.drop_table("sweeps")
