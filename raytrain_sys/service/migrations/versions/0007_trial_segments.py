"""Trial segments: a sweep's trial may run as several jobs, one per PBT segment (an exploit ends
the trial's job and starts the next from the donor's checkpoint), so the job of a trial is
unique by (sweep_id, trial_id, segment), not (sweep_id, trial_id).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26

A store of 0006 keeps its trials' jobs as segment 0: each trial had one job, as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch_alter_table: SQLite changes a unique constraint only by copying the table.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("segment", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_constraint("uq_jobs_sweep_id_trial_id", type_="unique")
        batch.create_unique_constraint("uq_jobs_sweep_id_trial_id_segment", ["sweep_id", "trial_id", "segment"])


def downgrade() -> None:
    # A store with a trial of several segments cannot go back: 0006 allows one job per trial.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("uq_jobs_sweep_id_trial_id_segment", type_="unique")
        batch.create_unique_constraint("uq_jobs_sweep_id_trial_id", ["sweep_id", "trial_id"])
        batch.drop_column("segment")
