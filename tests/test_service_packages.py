"""A service job that brings its own code: examples/custom_model's model factory, task and row
transform, sent with ``Client.submit(..., working_dir=)`` (``jobs submit --working-dir``) to a
service whose Python cannot import them. The same spec without the code fails before training,
naming the field; with it the job trains, is paused (its runner ends, and Ray drops the package
with it), resumes from its checkpoint (the package is put in the cluster again from the
service's store) and finishes in the same MLflow run, its evaluations where the spec asks."""

from __future__ import annotations

import importlib.util
import os

import pytest
import ray

from raytrain_sys.errors import UserError
from raytrain_sys.service import packages
from raytrain_sys.service.client import Client
from raytrain_sys.service.store import Store
from tests.fixtures.ray_head import _free_ports
from tests.ft_common import wait_until
from tests.helpers import read_summary
from tests.service_common import StepGates, api_answers, runner_heard, running_service

STEPS, HELD_AT = 40, 25
WAIT_S = 240.0


@pytest.mark.slow  # about 70 s: the service, a failed start, a start, a pause and a resume
def test_a_job_runs_the_code_its_team_sent_with_it_through_a_pause_and_a_resume(ray_cluster, example_dir, tmp_path):
    assert importlib.util.find_spec("tabular") is None, "the example must not be importable here"
    gates_dir = tmp_path / "gates"
    gates_dir.mkdir()
    gates = StepGates(str(gates_dir))
    db = tmp_path / "svc.db"
    [port] = _free_ports(1)
    overrides = [f"data.path={example_dir}/data", f"output_dir={tmp_path}/runs", f"train.max_steps={STEPS}",
                 "checkpoint.every_steps=10"]
    spec = os.path.join(example_dir, "job.yaml")
    with running_service(db, gates, serve_api=True, port=port) as svc:
        ray.get(svc.add_team.remote("a", 4))
        store = Store.open(f"sqlite:///{db}")
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: api_answers(url), 30), f"the service's API did not answer on {url}"
        client = Client(url, store.issue_token("a"))

        # Without its code: the runner cannot import the factory; the job fails before training.
        bare = client.submit(spec, overrides=overrides + [f"output_dir={tmp_path}/bare"])["id"]
        assert wait_until(lambda: client.job(bare)["state"] == "failed", WAIT_S), client.job(bare)
        message = client.job(bare)["message"]
        assert "cannot import 'tabular'" in message and "jobs submit: --working-dir" in message, message

        gates.hold(2, HELD_AT)
        job = client.submit(spec, overrides=overrides, working_dir=example_dir, excludes=["data", "runs"])
        assert job["id"] == 2 and job["package"] == packages.digest(
            packages.pack(example_dir, ["data", "runs"]))
        assert wait_until(lambda: gates.reached(2, HELD_AT), WAIT_S), client.job(2)
        first = client.job(2)
        client.pause(2, "code review")
        runner_heard(tmp_path, 2, "pause")
        gates.go(2, HELD_AT)
        assert wait_until(lambda: client.job(2)["state"] == "paused", WAIT_S), client.job(2)
        # The runner ended, and with it Ray's last reference to the package: the resume must
        # put it in the cluster again, from the service's store.
        assert wait_until(lambda: not _in_gcs(job["package"]), 30), "Ray kept the package of an ended runner"
        client.resume(2)
        assert wait_until(lambda: client.job(2)["state"] == "finished", WAIT_S), client.job(2)
        done = client.job(2)
        store.close()
    assert done["mlflow_run_id"] == first["mlflow_run_id"] and done["last_checkpoint_step"] == STEPS
    summary = read_summary(os.path.realpath(tmp_path / "runs" / "latest"))
    assert summary["committed_steps"] == STEPS and summary["mlflow_run_id"] == first["mlflow_run_id"]
    assert [e["step"] for e in summary["evals"]] == [20, 40]
    assert summary["evals"][-1]["accuracy"] > 0.5  # four balanced classes: chance is 0.25


def _in_gcs(sha256: str) -> bool:
    exists, _ = packages._gcs()
    return exists(packages.uri(sha256))


def test_a_package_goes_to_the_cluster_once_and_one_the_store_lost_is_an_error_saying_so(ray_cluster, tmp_path):
    (tmp_path / "mymod.py").write_text("X = 1\n")
    data = packages.pack(tmp_path)
    sha = packages.digest(data)
    loads = []

    def load(name):
        loads.append(name)
        return data

    assert packages.runtime_env(sha, load) == {"working_dir": packages.uri(sha)}
    assert _in_gcs(sha) and loads == [sha]
    assert packages.runtime_env(sha, load) == {"working_dir": packages.uri(sha)} and loads == [sha]  # there already
    with pytest.raises(UserError, match="the service's store no longer holds the job's code package"):
        packages.runtime_env("f" * 64, lambda _: None)
