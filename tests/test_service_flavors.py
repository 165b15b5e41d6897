"""Flavors on the session cluster: a job runs on the nodes of the flavor it was admitted on, priced
as that flavor, and a shape or size no flavor could hold is refused at submit naming the field.

The session cluster's four worker nodes carry no market label (no flavor). A node labelled
``ray.io/market-type: spot`` joins (as a KubeRay spot group's pod is labelled): it is the
``spot-cpu`` flavor's capacity; the ``on-demand-cpu`` flavor has no node.
"""

from __future__ import annotations

import pytest
import ray

from raytrain_sys.errors import ServiceInputError
from tests.ft_common import wait_until
from tests.helpers import read_summary
from tests.service_common import StepGates, running_service
from tests.test_service_runner import job_spec, run_dir_of, wait_state

FLAVORS = [{"name": "spot-cpu", "market": "spot", "resources": ["cpu"], "usd_per_cpu_hour": 0.5},
           {"name": "on-demand-cpu", "market": "on-demand", "resources": ["cpu"], "usd_per_cpu_hour": 2.0}]


def test_a_job_runs_on_its_flavors_nodes_priced_as_that_flavor(ray_nodes, tiny_dataset, tmp_path):
    from ray._private.state import state

    gates_dir = tmp_path / "gates"
    gates_dir.mkdir()
    gates = StepGates(str(gates_dir))
    spot = ray_nodes.add_node(num_cpus=2, labels={"ray.io/market-type": "spot"}, **ray_nodes.node_args)
    try:
        assert wait_until(lambda: any(n["Alive"] and n.get("Labels", {}).get("ray.io/market-type") == "spot"
                                      for n in ray.nodes()), 30)
        with running_service(tmp_path / "svc.db", gates, flavors=FLAVORS, warm_workers_per_node=0) as svc:
            info = ray.get(svc.info.remote())
            assert info["flavors"]["spot-cpu"]["up"]["cpu"] == 2.0 and info["flavors"]["on-demand-cpu"]["up"]["cpu"] == 0
            ray.get(svc.add_team.remote("a", 0))  # no nominal workers: the flavors' quotas are what count
            store_team = ray.get(svc.set_quotas.remote("a", "spot-cpu", {"cpu": {"nominal": 4}}))
            assert store_team["quotas"][0]["nominal"] == 4.0

            with pytest.raises(ServiceInputError) as refused:  # 4 CPUs a worker: spot-cpu holds 2
                ray.get(svc.submit.remote("a", job_spec(tmp_path, tiny_dataset, "big", resources={
                    "num_workers": 1, "cpus_per_worker": 4})))
            assert refused.value.field == "spec.resources.num_workers" and "its capacity holds: 0" in str(refused.value)
            with pytest.raises(ServiceInputError) as refused:  # no flavor has that GPU
                ray.get(svc.submit.remote("a", job_spec(tmp_path, tiny_dataset, "gpu", resources={
                    "gpus_per_worker": 1, "accelerator_type": "H100"})))
            assert refused.value.field == "spec.resources.gpus_per_worker", refused.value

            gates.hold(1, 2)
            job_id = ray.get(svc.submit.remote("a", job_spec(tmp_path, tiny_dataset, "spot-job", steps=4,
                                                             resources={"num_workers": 2})))["id"]
            assert wait_until(lambda: gates.reached(job_id, 2), 120)
            job = ray.get(svc.job.remote(job_id))
            assert (job["flavor"], job["market"], job["cpus_per_worker"]) == ("spot-cpu", "any", 1.0)
            slots = [g["bundles_to_node_id"][0] for g in state.placement_group_table().values()
                     if g["state"] == "CREATED" and g["name"].startswith("raytrain-sys:")]
            assert slots == [spot.node_id, spot.node_id], slots  # the flavor's nodes, not the unlabelled ones
            gates.go(job_id, 2)
            wait_state(svc, job_id, "finished")
        summary = read_summary(run_dir_of(tmp_path / "spot-job"))
        assert summary["cost"]["cost_per_worker_hour"] == 0.5  # spot-cpu's price for 1 CPU, not on-demand's
    finally:
        ray_nodes.remove_node(spot)
