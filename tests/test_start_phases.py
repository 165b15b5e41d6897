"""Where a run's start goes: summary.json's start_phases names each phase of the newest start,
in order, and they add up to the time before training began; the MLflow run is opened while
the workers start, and the run records it as before."""

from __future__ import annotations

import pytest

from raytrain_sys.control.supervisor import Supervisor
from tests.helpers import read_summary, tiny_spec

PHASES = ["preflight", "ray", "data", "placement", "workers", "tracking", "group", "first_batch"]


def test_start_phases_add_up_to_the_start(ray_cluster, tiny_dataset, tmp_path):
    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 3},
                     resources={"num_workers": 2})
    sup = Supervisor(spec)
    result = sup.run()
    assert result.status == "finished"
    summary = read_summary(result.run_dir)
    phases = summary["start_phases"]
    assert list(phases) == PHASES + ["total"], phases
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(phases[p] for p in PHASES) == pytest.approx(phases["total"], abs=0.02)
    started = summary["started_at"]
    running = next(t["time"] for t in summary["transitions"] if t["state"] == "running")
    assert phases["total"] <= running - started + 0.05
    assert summary["mlflow_run_id"] and sup.tracker is not None
    assert sup.tracker.run_id == summary["mlflow_run_id"]


def test_start_spans_show_what_ran_beside_the_start(ray_cluster, tiny_dataset, tmp_path):
    """start_spans: each phase of the start from its beginning to its end, one after another,
    and beside them the MLflow run's opening (begun once the workers were placed, recorded
    when open, possibly after training began) and the first read."""
    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 3}, resources={"num_workers": 2})
    result = Supervisor(spec).run()
    summary = read_summary(result.run_dir)
    spans, phases = summary["start_spans"], summary["start_phases"]
    assert [name for name in spans if name in phases] == PHASES, spans
    ends = [spans[name][1] for name in PHASES]
    assert ends == sorted(ends) and spans["preflight"][0] == 0.0
    for before, after in zip(PHASES, PHASES[1:]):
        assert spans[after][0] == pytest.approx(spans[before][1], abs=0.002)
        assert spans[after][1] - spans[after][0] == pytest.approx(phases[after], abs=0.002)
    opened = spans["mlflow_run"]
    assert spans["placement"][1] - 0.01 <= opened[0] <= opened[1]  # begun once placed
    assert summary["start_beside"]["tracking"] == pytest.approx(opened[1] - opened[0], abs=0.002)
    assert spans["first_read"][0] <= spans["placement"][0] + 0.01  # read while the slots were placed


def test_a_run_whose_mlflow_run_cannot_open_fails_saying_why(ray_cluster, tiny_dataset, tmp_path):
    """The MLflow run opens beside the start; an opening that fails (its experiment deleted, a
    store reachable at the pre-flight check) still fails the run with MLflow's reason."""
    from mlflow import MlflowClient

    from raytrain_sys.errors import TrackingError
    from raytrain_sys.tracking.mlflow_tracker import default_tracking_uri

    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 3}, resources={"num_workers": 2},
                     tracking={"experiment": "gone"})
    client = MlflowClient(default_tracking_uri(spec.output_dir))
    client.delete_experiment(client.create_experiment("gone"))
    sup = Supervisor(spec)
    with pytest.raises(TrackingError, match="experiment 'gone' .* is deleted"):
        sup.run()
    summary = read_summary(sup.run_dir)
    assert summary["status"] == "failed" and "is deleted" in summary["reason"]
    assert summary["mlflow_run_id"] == ""
