"""A sweep's MLflow record: its parent run, and its trials' curves read back.

Owns: the sweep's parent run (``parent_run``: made once, beside Tune's start, in a thread of its
own: ``ParentRun``; its id recorded in the store before any trial's job is submitted, so every
trial's run is its child), its end (``record_outcome``: the best trial and value, the trials'
table, the plot of their curves), the sweep's MLflow store made ahead while its runner starts
(``prepare_tracking``), and a trial job's curve of the metric as its run logged it
(``mlflow_history``). Writes in the store: the sweep's ``mlflow_parent_run_id``. The trials' own
runs are their jobs', written by their drivers (``tracking/``); a PBT segment's donor marks are
``segments.mark_segment``'s.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Optional

from raytrain_sys.service.model import JobRecord, SweepRecord, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.names import ACTOR
from raytrain_sys.service.sweeps.spec import SweepSpec, spec_of, tracking_uri

log = logging.getLogger(__name__)


def mlflow_history(job: JobRecord, metric: str) -> list[tuple[int, float]]:
    """The job's evaluations of ``metric`` as its MLflow run logged them (none before it runs)."""
    if not job.mlflow_run_id:
        return []
    from raytrain_sys.tracking.mlflow_tracker import metric_history, spec_tracking_uri

    return metric_history(spec_tracking_uri(json.loads(job.spec)), job.mlflow_run_id, metric)


class ParentRun:
    """``parent_run`` made in a thread of its own, on a store of its own; ``result`` waits for
    it and returns the sweep with it, or raises what making it raised (``error``: that, once it
    did)."""

    def __init__(self, db_url: str, sweep: SweepRecord):
        self.error: Optional[BaseException] = None
        self._sweep = sweep
        self._thread = threading.Thread(target=self._make, args=(db_url,), name="sweep-parent-run", daemon=True)
        self._thread.start()

    def _make(self, db_url: str) -> None:
        store = Store.open(db_url)
        try:
            self._sweep = parent_run(store, self._sweep)
            log.info("sweep %d: MLflow parent run %s", self._sweep.id, self._sweep.mlflow_parent_run_id)
        except BaseException as exc:  # noqa: BLE001: raised again by result() and Tune's next step
            log.exception("sweep %d: its MLflow parent run could not be made", self._sweep.id)
            self.error = exc
        finally:
            store.close()

    def result(self) -> SweepRecord:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self._sweep


def parent_run(store: Store, sweep: SweepRecord) -> SweepRecord:
    """The sweep with its MLflow parent run: made once (the space, scheduler and metric as
    params), recorded in the store before any trial is submitted, so that every trial's run is
    its child; a restored runner finds it recorded."""
    if sweep.mlflow_parent_run_id:
        return sweep
    from raytrain_sys.tracking.mlflow_tracker import TAG_SWEEP, start_parent_run

    spec = spec_of(sweep)
    params = {"space": json.dumps(spec.to_dict()["space"]), "scheduler": json.dumps(spec.to_dict()["scheduler"]),
              "metric": spec.metric, "mode": spec.mode, "num_samples": str(spec.num_samples),
              "trials": str(spec.trial_count)}
    run_id = start_parent_run(tracking_uri(spec), spec.base["tracking"]["experiment"], f"sweep-{sweep.id}-{sweep.name}",
                              params, {TAG_SWEEP: str(sweep.id)})
    return store.transition_sweep(sweep.id, SweepState.RUNNING, SweepState.RUNNING, actor=ACTOR,
                                  reason=f"MLflow parent run {run_id}", mlflow_parent_run_id=run_id)


def record_outcome(sweep: SweepRecord, spec: SweepSpec, table: list[dict], best_trial: Optional[str],
                   best_value: Optional[float]) -> None:
    """The parent run's end: the best trial and value, the trials' table (``outcome.trial_table``) and
    the plot of their curves (``sweep_curves.png``)."""
    from raytrain_sys.monitor.plots import sweep_curves_figure
    from raytrain_sys.tracking.mlflow_tracker import end_parent_run

    best = next((row for row in table if row["trial"] == best_trial), None)
    metrics = {f"best_{spec.metric}": best_value} if best_value is not None else {}
    tags = {"best_trial": str(best_trial), "best_job": str(best["job"] if best else ""),
            "best_run_id": str(best["mlflow_run_id"] if best else "")}
    figure = sweep_curves_figure(table, spec.metric, best_trial)
    end_parent_run(tracking_uri(spec), sweep.mlflow_parent_run_id, metrics, tags, {"trials.json": table},
                   figures={"sweep_curves.png": figure} if figure is not None else {})


def prepare_tracking(sweep: SweepRecord) -> threading.Thread:
    """Make the sweep's MLflow store (a new SQLite store's tables: 5.8 s at a load of 49) in a
    thread of the caller's process while its runner's process starts: the runner's parent run
    then opens a finished store (``mlflow_store.ensure_store`` makes it once, under a lock). A
    failure is only logged: the parent run meets it again and fails the sweep with it."""
    from raytrain_sys.tracking.mlflow_store import ensure_store

    def make() -> None:
        try:
            ensure_store(tracking_uri(spec_of(sweep)))
        except Exception as exc:  # noqa: BLE001: the runner's parent run reports it
            log.info("sweep %d: its MLflow store not made ahead: %s", sweep.id, exc)

    thread = threading.Thread(target=make, name=f"sweep-{sweep.id}-tracking", daemon=True)
    thread.start()
    return thread
