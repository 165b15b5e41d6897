"""The job service's schema migrations (Alembic), run in code when the store opens.

``upgrade(connection)`` brings the database to the newest revision; ``head()`` names that
revision. The migration scripts live in ``versions/`` and are installed with the package.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

MIGRATIONS_DIR = Path(__file__).resolve().parent


def config(connection=None) -> Config:
    """An Alembic config built in code (no alembic.ini): the script location inside the
    package, and the caller's open connection when given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    """The newest revision of the schema."""
    return ScriptDirectory.from_config(config()).get_current_head()


def upgrade(connection) -> None:
    """Migrate the database behind ``connection`` to the newest revision, inside the caller's
    transaction."""
    command.upgrade(config(connection), "head")
