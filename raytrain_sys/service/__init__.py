"""The job service: a persistent queue of training jobs for many teams, above the control layer.

Floors, each owning one thing (control never imports any of them): ``model`` (states, teams, the
scheduler's input and output), ``scheduler`` (pure decisions), ``store`` (SQL state through
SQLAlchemy, schema by Alembic ``migrations``), ``auth`` and ``api`` (the HTTP interface, which
writes only requests), ``client`` (its Python client). The reconciler, runner and metrics build on
these.
"""
