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
