"""Why a job waits: jobs.wait_cause, wait_reason, wait_cause_since_s (a job not running yet: the
scheduler's cause, or the start's step) and jobs.start_returns (starts given up in a row).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27

The reconciler writes them when they change; a transition to another state clears the reason.
Jobs of an older store start without one (NULL) until the reconciler's first pass, and with no
start given up.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch_alter_table: SQLite cannot add a NOT NULL column with ALTER TABLE alone on every version.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("wait_cause", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("wait_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("wait_cause_since_s", sa.Double(), nullable=True))
        batch.add_column(sa.Column("start_returns", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("start_returns")
        batch.drop_column("wait_cause_since_s")
        batch.drop_column("wait_reason")
        batch.drop_column("wait_cause")
