"""Alembic's environment for the job service's schema.

``raytrain_sys.service.store`` runs the migrations in code (``migrations.upgrade``), passing an
open connection in ``config.attributes["connection"]``; the migrations then run inside the
caller's transaction. For the ``alembic`` command line, ``sqlalchemy.url`` in the config is
used instead. ``target_metadata`` is the store's tables, so ``alembic revision --autogenerate``
and the schema test compare against them.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from raytrain_sys.service.tables import metadata

config = context.config


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=metadata,
                      # SQLite alters tables by copying them: batch mode makes later migrations work there
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
