"""The job service: a persistent queue of training jobs for many teams, above the control layer.

Floors, each owning one thing (control never imports any of them): ``model`` (states, teams, the
scheduler's input and output), ``scheduler`` (pure decisions), ``store`` (SQL state through
SQLAlchemy, schema by Alembic ``migrations``), ``requests`` (what a user writes: submit, pause,
resume, cancel), ``auth`` and ``api`` (the HTTP interface, which writes only requests),
``client`` (its Python client), ``reconciler`` (the one writer of run-time transitions),
``runner`` (one Supervisor per job, in a detached actor), ``service`` (the service actor: store,
reconciler loop, API). Metrics build on these.
"""
