"""jobs.delete_checkpoints: a cancel's request to delete the job's checkpoints once it has ended.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26

The API writes it with the cancel (the intent); whoever ends the job (the reconciler, or a
cleanup of cancelled jobs) deletes the checkpoints and reads it back after a restart.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch_alter_table: SQLite cannot add a NOT NULL column with ALTER TABLE alone on every version.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("delete_checkpoints", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("delete_checkpoints")
