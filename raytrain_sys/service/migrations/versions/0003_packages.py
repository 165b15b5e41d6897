"""Code packages: the packages table (a team's uploaded directory, see service/packages.py) and
jobs.package, the package a job runs with.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "packages",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at_s", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name=op.f("fk_packages_team_teams")),
        sa.PrimaryKeyConstraint("sha256", "team", name=op.f("pk_packages")),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("package", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("package")
    op.drop_table("packages")
