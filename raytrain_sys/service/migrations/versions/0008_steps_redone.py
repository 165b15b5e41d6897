"""Steps trained twice: jobs.steps_redone, the steps a job's runs committed and then trained again
(a runner lost and its job restarted from its checkpoint, or a run that restored a checkpoint).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

The reconciler writes it from the runner's status and at a restart; jobs of an older store start
at 0 (what their runs redid before is in their summary.json, not here).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("steps_redone", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("steps_redone")
