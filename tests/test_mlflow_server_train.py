"""A run tracked on a real `mlflow server` on 127.0.0.1, paused and resumed by its run id."""

from __future__ import annotations

import mlflow

from raytrain_sys.control.supervisor import resume_job, run_job
from raytrain_sys.tracking import mlflow_tracker as mt
from tests.helpers import read_summary, tiny_spec


def test_resume_by_run_id_against_mlflow_server(ray_cluster, tiny_dataset, tmp_path, mlflow_server):
    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": 8, "stop_at_step": 4},
                     checkpoint={"every_steps": 4},
                     tracking={"uri": mlflow_server, "experiment": "server-resume"})
    paused = run_job(spec)
    assert paused.status == "stopped"
    resumed = resume_job(paused.mlflow_run_id, tracking_uri=mlflow_server)
    assert resumed.status == "finished" and resumed.mlflow_run_id == paused.mlflow_run_id

    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("server-resume")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [paused.mlflow_run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "8"
    assert run.data.tags[mt.TAG_GIT_COMMIT]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 9))
    record = mt.Tracker.lookup(mlflow_server, paused.mlflow_run_id)
    assert [c["step"] for c in record.checkpoint_records] == [4, 8]
    assert read_summary(resumed.run_dir)["losses"][:4] == paused.losses[:4]
