"""A sweep's MLflow record: its parent run, its PBT segments' marks, and its trials' curves read back.

Owns: the sweep's parent run (``parent_run``: made once, beside Tune's start, in a thread of its
own: ``ParentRun``; its id recorded in the store before any trial's job is submitted, so every
trial's run is its child), its end (``record_outcome``: the best trial and value, the trials'
table, the plot of their curves), the sweep's MLflow store made ahead while its runner starts
(``prepare_tracking``), the tags that mark a PBT segment's run with its donor
(``mark_segment_run``; which values, ``segments.mark_segment``), and a trial job's curve of the
metric as its run logged it (``mlflow_history``). Writes in the store: the sweep's
``mlflow_parent_run_id``; in MLflow: the parent run, and a segment's marks on its job's run. The
trials' own runs are their jobs', written by their drivers (``tracking/``, which knows nothing
of sweeps). MLflow is imported when first used, as ``tracking/mlflow_store`` reaches it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from typing import Any, Optional

from raytrain_sys.service.model import JobRecord, SweepRecord, SweepState
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.names import ACTOR
from raytrain_sys.service.sweeps.spec import SweepSpec, spec_of, tracking_uri

log = logging.getLogger(__name__)

TAG_SWEEP = "raytrain_sys.sweep"  # on the parent run: the sweep's id
TAG_SEGMENT = "raytrain_sys.segment"  # on a PBT segment's run: its number; the three below: its donor
TAG_DONOR_TRIAL = "raytrain_sys.donor_trial"
TAG_DONOR_STEP = "raytrain_sys.donor_step"
TAG_DONOR_CHECKPOINT = "raytrain_sys.donor_checkpoint"


def mlflow_history(job: JobRecord, metric: str) -> list[tuple[int, float]]:
    """The job's evaluations of ``metric`` as its MLflow run logged them (none before it runs)."""
    if not job.mlflow_run_id:
        return []
    from raytrain_sys.tracking.mlflow_tracker import spec_tracking_uri

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


def start_parent_run(tracking_uri: str, experiment: str, run_name: str, params: dict[str, str],
                     tags: dict[str, str]) -> str:
    """A sweep's parent run (its trials' runs are its children): created with ``params``, left
    running until ``end_parent_run``. Returns its id."""
    from mlflow.entities import Param

    from raytrain_sys.tracking import mlflow_store as ms

    client = ms.client(tracking_uri)
    experiment_id = ms.ensure_experiment(client, tracking_uri, experiment, None)
    run = ms.call(tracking_uri, f"create a run in experiment {experiment!r}",
                  lambda: client.create_run(experiment_id, run_name=run_name,
                                            tags={k: ms.fit(v, ms.MAX_TAG_VAL_LENGTH) for k, v in tags.items()}))
    items = [Param(k, ms.fit(v, ms.MAX_PARAM_VAL_LENGTH)) for k, v in params.items()]
    ms.call(tracking_uri, "log the sweep's params", lambda: client.log_batch(run.info.run_id, params=items))
    return run.info.run_id


def end_parent_run(tracking_uri: str, run_id: str, metrics: dict[str, float], tags: dict[str, str],
                   artifacts: dict[str, Any], status: str = "FINISHED", figures: dict[str, Any] | None = None) -> None:
    """Record a sweep's outcome on its parent run (metrics, tags, JSON artifacts, and
    ``figures``: matplotlib figures saved as PNGs under their names) and end it."""
    from mlflow.entities import Metric, RunTag

    from raytrain_sys.tracking import mlflow_store as ms

    client = ms.client(tracking_uri)
    now_ms = int(time.time() * 1000)
    ms.call(tracking_uri, "log the sweep's outcome", lambda: client.log_batch(
        run_id, metrics=[Metric(k, float(v), now_ms, 0) for k, v in metrics.items()],
        tags=[RunTag(k, ms.fit(v, ms.MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]))
    with tempfile.TemporaryDirectory() as tmp:
        for name, value in artifacts.items():
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                json.dump(value, f, indent=1, default=str)
            ms.call(tracking_uri, f"log {name}", lambda p=path: client.log_artifact(run_id, p))
        for name, fig in (figures or {}).items():
            path = os.path.join(tmp, name)
            fig.savefig(path)
            ms.call(tracking_uri, f"log {name}", lambda p=path: client.log_artifact(run_id, p))
    ms.call(tracking_uri, "end the sweep's run", lambda: client.set_terminated(run_id, status))


def mark_segment_run(tracking_uri: str, run_id: str, tags: dict[str, str], metrics: dict[str, float],
                     step: int) -> bool:
    """Tag a PBT segment's run with its donor and log its mutated values as metrics at ``step``
    (its start), once: False when the run was marked already (a trial proxy driven again)."""
    from mlflow.entities import Metric, RunTag

    from raytrain_sys.tracking import mlflow_store as ms

    client = ms.client(tracking_uri)
    run = ms.get_run(client, tracking_uri, run_id)
    if TAG_SEGMENT in run.data.tags:
        return False
    now_ms = int(time.time() * 1000)
    ms.call(tracking_uri, "mark the segment's run", lambda: client.log_batch(
        run_id, metrics=[Metric(k, float(v), now_ms, int(step)) for k, v in metrics.items()],
        tags=[RunTag(k, ms.fit(v, ms.MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]))
    return True


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """Every (step, value) of one metric of a run, one value a step (the last logged: a resumed
    run that logged a step again), in step order. A sweep's trial follows its job's evaluations
    with it."""
    from raytrain_sys.tracking import mlflow_store as ms

    client = ms.client(tracking_uri, recheck=False)  # polled every second: no check each time
    points = ms.call(tracking_uri, f"read metric {key} of run {run_id}",
                     lambda: client.get_metric_history(run_id, key))
    by_step: dict[int, tuple[int, float]] = {}
    for m in points:
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[int(m.step)] = (m.timestamp, float(m.value))
    return [(step, value) for step, (_, value) in sorted(by_step.items())]
