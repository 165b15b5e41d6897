"""examples/custom_model, a user's own model factory, task, row transform and Parquet files,
trained from outside the package: through `raytrain-sys run`, through `ray job submit
--working-dir` (the user's code travels with the job), and with a worker killed and the group
resized (final parameters equal to a one-worker run's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.fixtures.custom_example import repo_env
from tests.fixtures.ray_head import _ray_cli
from tests.helpers import read_summary

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
_env = repo_env  # example_dir: tests/fixtures/custom_example.py


def _last_run(out: str) -> dict:
    return read_summary(os.path.realpath(os.path.join(out, "latest")))


def test_example_through_raytrain_sys_run(ray_cluster, example_dir, tmp_path):
    out = str(tmp_path / "runs")
    proc = subprocess.run([os.path.join(BIN, "raytrain-sys"), "run", "job.yaml", "--set", f"output_dir={out}",
                           "--set", f"resources.ray_address={ray_cluster}", "--set", "train.max_steps=40"],
                          cwd=example_dir, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "finished: 40 steps" in proc.stdout
    summary = _last_run(out)
    assert [e["step"] for e in summary["evals"]] == [20, 40]
    assert summary["evals"][-1]["accuracy"] > 0.5  # four balanced classes: chance is 0.25
    assert summary["best_checkpoint"]["step"] in (20, 40)


def test_example_with_a_kill_and_a_resize_equals_one_worker(ray_cluster, example_dir, tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "custom_model_chaos.py"),
                           str(tmp_path / "runs")], cwd=example_dir, capture_output=True, text=True,
                          env=_env(RAY_ADDRESS=ray_cluster), timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["statuses"] == ["finished", "finished"] and report["keys_equal"]
    assert report["failures"] >= 1 and len(report["world_sizes"]) >= 2, report
    assert report["max_rel_diff"] < 1e-6, report  # fp64: only the order of the sums differs
    got, want = report["evals"]
    assert [e["step"] for e in got] == [e["step"] for e in want] == [7, 14]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(b["loss"]) and a["accuracy"] == b["accuracy"]


@pytest.mark.slow
def test_example_through_ray_job_submit(ray_head, example_dir, tmp_path):
    out = str(tmp_path / "runs")
    job_id = f"rts-{uuid.uuid4().hex[:8]}"
    cmd = [_ray_cli(), "job", "submit", "--address", ray_head.dashboard_url, "--submission-id", job_id,
           "--working-dir", example_dir, "--", "raytrain-sys", "run", "job.yaml",
           "--set", f"output_dir={out}", "--set", "train.max_steps=20", "--set", "eval.every_steps=10"]
    proc = subprocess.run(cmd, env=ray_head.client_env(), capture_output=True, text=True, timeout=400)
    status = str(ray_head.client().get_job_status(job_id).value)
    logs = ray_head.client().get_job_logs(job_id)
    assert status == "SUCCEEDED", f"{status}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs[-3000:]}"
    assert "finished: 20 steps" in logs
    assert [e["step"] for e in _last_run(out)["evals"]] == [10, 20]
