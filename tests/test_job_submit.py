"""`ray job submit` end to end against a head started with `ray start --head`."""

from __future__ import annotations

import os
import subprocess
import uuid

import mlflow
import pytest

from tests.fixtures.ray_head import _ray_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_ray_job_submit_runs_the_job_and_records_it(ray_head, tiny_dataset, tmp_path):
    out = tmp_path / "runs"
    job_id = f"rts-{uuid.uuid4().hex[:8]}"
    overrides = [f"data.path={tiny_dataset}", f"output_dir={out}", "model.block_size=32",
                 "model.n_layer=1", "model.n_embd=32", "train.max_steps=6", "optim.warmup_steps=1",
                 "train.global_batch_size=8", "train.log_every_steps=2"]
    cmd = [_ray_cli(), "job", "submit", "--address", ray_head.dashboard_url,
           "--submission-id", job_id, "--working-dir", REPO, "--",
           "raytrain-sys", "run", "jobs/tinygpt.yaml", *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.run(cmd, env=ray_head.client_env(), capture_output=True, text=True, timeout=400)
    # `ray job status` exits 0 whatever the state: ask the job SDK.
    status = str(ray_head.client().get_job_status(job_id).value)
    logs = ray_head.client().get_job_logs(job_id)
    assert status == "SUCCEEDED", f"{status}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs[-3000:]}"
    assert "finished: 6 steps" in logs
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["tinygpt"])
    assert len(runs) == 1 and runs.iloc[0]["status"] == "FINISHED"
    assert runs.iloc[0]["params.train.max_steps"] == "6"
