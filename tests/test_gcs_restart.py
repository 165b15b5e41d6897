"""The head's GCS killed and started again while a service job trains (issue 57's head restart).

Ray's GCS fault tolerance keeps the cluster's tables in an external Redis (KubeRay's
``gcsFaultToleranceOptions``; here Debian's ``redis-server`` on 127.0.0.1, named to the head by
``RAY_REDIS_ADDRESS``). While the GCS is down, the raylets, the actors and the calls between them
go on; what needs the GCS (naming actors, listing nodes, the KV) waits or fails, and the
service's passes must ride that out. Asserted, as a user would see it:

* the job commits steps through the outage, nothing redone;
* no job is started twice: the same runner process, the same workers, no restart counted;
* the service's HTTP API answers again once the GCS is back;
* the service and the job's runner run off the head, on the control node (the cluster is the
  KubeRay manifest's shape: a head and a control group both safe, two worker nodes);
* the run ends equal to an uninterrupted run: every step's loss, the final parameters, every
  sample exactly once.

The cluster (a head with no CPUs and two 1-CPU nodes) runs in a child process
(``tests/child_cluster.py``): ``python -m tests.test_gcs_restart child <dir>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.child_cluster import print_result, run_child
from tests.ft_common import assert_losses_like, expected_sample_ids, ft_spec
from tests.helpers import assert_params_close, final_params
from tests.service_common import StepGates, api_answers, free_port

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server not installed (scripts/install.sh dev installs it)")

STEPS = 60
KILL_AT = 8  # the committed step past which the GCS is killed
OUTAGE_S = 5.0  # how long the GCS stays down
HOLD_AT = 50  # the job waits here until the GCS is back, so that the outage lands mid-run


def job_spec(root: Path, dataset: str, name: str):
    return ft_spec(root / name, dataset, STEPS, resources={"num_workers": 2})


def test_a_gcs_restart_under_redis_costs_a_training_service_job_nothing(tmp_path):
    r = run_child("tests.test_gcs_restart", str(tmp_path), timeout_s=480)
    print(json.dumps({k: v for k, v in r.items() if k not in ("reference_losses",)}, indent=1))
    job = r["job"]
    assert job["state"] == "finished" and job["restarts"] == 0, job
    assert r["starts"] == 1, r["transitions"]  # queued -> starting -> running once, never again
    assert r["runner_pid_after"] == r["runner_pid_before"], "the job's runner was replaced"
    # The service and the runner run on the control node, off the head (a head restart takes
    # what runs there; with a control group up, nothing of ours does).
    assert r["runner_node"] == r["service_node"] == r["control_node"] != r["head_node"], r
    assert r["worker_pids_after"] == r["worker_pids_before"], "the job's workers were replaced"
    # Steps committed while the GCS was down: the step loop waits on no GCS call (its lookup of
    # the draining nodes waited out the outage and committed 3 steps in these 5 s).
    assert r["committed_at_restart"] >= r["committed_at_kill"] + 5, r
    assert r["api_during_outage"], r  # the service's HTTP API answered while the GCS was down
    assert r["api_after_restart_s"] is not None and r["api_after_restart_s"] < 30.0, r
    assert r["names_after_restart_s"] is not None and r["names_after_restart_s"] < 30.0, r

    summary = json.loads(Path(r["run_dir"], "summary.json").read_text())
    assert summary["committed_steps"] == STEPS and summary["steps_redone"] == 0
    assert summary["failures"] == 0, summary.get("recovery")
    spec = job_spec(tmp_path, r["dataset"], "job")
    assert_losses_like(summary, r["reference_losses"], STEPS)
    assert_params_close(final_params(summary["newest_checkpoint"]), final_params(r["reference_checkpoint"]),
                        rtol=1e-6, atol=1e-9)
    by_step = {}
    with open(os.path.join(r["run_dir"], "sample_ids.jsonl")) as f:
        for line in map(json.loads, f):
            by_step[line["step"]] = [i for rank in line["ranks"] for i in rank]
    ids = [i for s in sorted(by_step) for i in by_step[s]]
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert ids == expected_sample_ids(spec, r["dataset"], STEPS) and len(set(ids)) == len(ids)


# --------------------------------------------------------------------------- child
def _child(root: Path) -> dict:
    redis_dir = tempfile.mkdtemp(prefix="rtsr-", dir="/tmp")
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", redis_dir],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ["RAY_REDIS_ADDRESS"] = f"127.0.0.1:{redis_port}"  # read by the head node Cluster starts
    os.environ["RAY_external_storage_namespace"] = f"rts-{os.getpid()}"
    import ray
    from ray.cluster_utils import Cluster

    from raytrain_sys.control.supervisor import run_job
    from raytrain_sys.data.prepare import prepare_text_dataset
    from raytrain_sys.service.runner import find_runner
    from raytrain_sys.service.service import start_service, stop_service
    from tests.ft_common import wait_until

    dataset = str(root / "data")
    prepare_text_dataset(dataset, row_len=33, rows_per_shard=512, max_bytes=400_000)
    temp_dir = tempfile.mkdtemp(prefix="rtsg-", dir="/tmp")  # Ray socket paths < 107 chars
    if not wait_until(lambda: subprocess.run(["redis-cli", "-p", str(redis_port), "ping"], capture_output=True,
                                             text=True).stdout.strip() == "PONG", 10):
        raise RuntimeError("redis-server did not start")
    # As the KubeRay manifest has it: the head and a control group both safe (raytrain_control),
    # two worker nodes.
    control = {"raytrain_control": 1000}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "temp_dir": temp_dir, "include_dashboard": False,
                                      "resources": control})
    out: dict = {"dataset": dataset, "head_node": cluster.head_node.node_id}
    try:
        out["control_node"] = cluster.add_node(num_cpus=0, resources=control).node_id
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        gates_dir = root / "gates"
        gates_dir.mkdir()
        gates = StepGates(str(gates_dir))
        api_port = free_port()
        api_url = f"http://127.0.0.1:{api_port}"
        svc = start_service(f"sqlite:///{root / 'svc.db'}", port=api_port, poll_s=0.2, warm_workers_per_node=0,
                            log_dir=str(root / "logs"), serve_api=True, step_hook=gates)
        ray.get(svc.add_team.remote("a", 2))
        spec = job_spec(root, dataset, "job").to_dict() | {"name": "job"}
        gates.hold(1, KILL_AT)
        gates.hold(1, HOLD_AT)
        job_id = ray.get(svc.submit.remote("a", spec))["id"]
        assert wait_until(lambda: gates.reached(job_id, KILL_AT), 180), ray.get(svc.job.remote(job_id))
        runner = find_runner(job_id)
        out["runner_pid_before"] = ray.get(runner.ping.remote())
        actors = ray._private.state.state.actor_table(None)
        out["runner_node"] = actors[runner._actor_id.hex()]["Address"]["NodeID"]
        out["service_node"] = actors[svc._actor_id.hex()]["Address"]["NodeID"]
        out["worker_pids_before"] = json.loads((gates_dir / f"at-{job_id}-{KILL_AT}").read_text())["pids"]

        errors = out["status_errors"] = []

        def committed() -> int | None:
            try:  # a call to a live actor through its handle: it needs no GCS
                return ray.get(runner.status.remote(), timeout=5).committed_step
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                return None

        (gates_dir / f"go-{job_id}-{KILL_AT}").touch()
        cluster.head_node.kill_gcs_server()
        out["committed_at_kill"] = KILL_AT
        time.sleep(OUTAGE_S)
        out["committed_at_restart"] = committed()
        out["api_during_outage"] = api_answers(api_url)
        cluster.head_node.start_gcs_server()
        restarted = time.monotonic()
        out["api_after_restart_s"] = (time.monotonic() - restarted
                                      if wait_until(lambda: api_answers(api_url), 60, 0.2) else None)

        def named_runner() -> bool:  # a lookup by name: the GCS's
            try:
                return find_runner(job_id) is not None
            except Exception:
                return False

        out["names_after_restart_s"] = (time.monotonic() - restarted
                                        if wait_until(named_runner, 60, 0.2) else None)
        assert wait_until(lambda: gates.reached(job_id, HOLD_AT), 180), ray.get(svc.job.remote(job_id))
        out["runner_pid_after"] = ray.get(find_runner(job_id).ping.remote(), timeout=30)
        out["worker_pids_after"] = json.loads((gates_dir / f"at-{job_id}-{HOLD_AT}").read_text())["pids"]
        (gates_dir / f"go-{job_id}-{HOLD_AT}").touch()
        assert wait_until(lambda: ray.get(svc.job.remote(job_id))["state"] in ("finished", "failed", "cancelled"),
                          180, 0.5), ray.get(svc.job.remote(job_id))
        out["job"] = ray.get(svc.job.remote(job_id))
        out["transitions"] = [(t["from"], t["to"], t["reason"]) for t in ray.get(svc.history.remote(job_id))]
        out["starts"] = sum(1 for t in out["transitions"] if t[1] == "starting")
        out["run_dir"] = str(next(Path(root, "job").rglob("summary.json")).parent)
        stop_service()
        reference = run_job(job_spec(root, dataset, "reference"))
        out["reference_checkpoint"] = reference.newest_checkpoint
        out["reference_losses"] = list(reference.losses)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()
        redis.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(redis_dir, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"] and len(sys.argv) == 3:
        print_result(lambda: _child(Path(sys.argv[2])))
    sys.exit(f"usage: python -m tests.test_gcs_restart child <dir> (got {sys.argv[1:]})")
