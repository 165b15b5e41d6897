"""Control off spot: the service's actors (the service, the jobs' runners, the spare runners, the
warm spares' pool) run on a safe node when the cluster has one, and anywhere when it has none.

On the session cluster, which has no safe node: the service says so and works as before. Then a
node offering ``raytrain_control`` (and no CPU, as a control group's pod gives the jobs none)
joins: every control actor of a service started then lands on it, and a job trains on the
worker nodes as before.
"""

from __future__ import annotations

import pytest
import ray

from raytrain_sys.control import control_actors
from raytrain_sys.control import node_roles as roles
from raytrain_sys.service.runner import NAMESPACE, RUNNER_PREFIX, SPARE_RUNNER_PREFIX, find_runner
from raytrain_sys.control.spares import POOL_NAME
from raytrain_sys.service.service import SERVICE_NAME
from tests.ft_common import wait_until
from tests.service_common import StepGates, running_service
from tests.test_service_runner import job_spec, wait_state


HEAD = ({"raytrain_control": 1000, "node:__internal_head__": 1}, {"ray.io/node-id": "h" * 56})
ONLY_SAFE = {"resources": {"raytrain_control": 1}, "label_selector": {"ray.io/market-type": "!spot"}}
OFF_HEAD = {"resources": {"raytrain_control": 1},
            "label_selector": {"ray.io/market-type": "!spot", "ray.io/node-id": "!" + "h" * 56}}


@pytest.mark.parametrize("nodes, safe, options", [
    ([({"CPU": 1}, {}), ({"CPU": 1}, {})], 0, {}),
    ([({"CPU": 0, "raytrain_control": 1000}, {"ray.io/market-type": "on-demand"}), ({"CPU": 4}, {})], 1, ONLY_SAFE),
    ([({"raytrain_control": 1000}, {"ray.io/market-type": "spot"}), ({"CPU": 4}, {})], 0, {}),
    ([HEAD, ({"raytrain_control": 1000}, {"ray.io/market-type": "on-demand"}), ({"CPU": 4}, {})], 2, OFF_HEAD),
    ([HEAD, ({"CPU": 4}, {})], 1, ONLY_SAFE),
    ([HEAD, ({"raytrain_control": 1000}, {"ray.io/market-type": "spot"})], 1, ONLY_SAFE),
], ids=["a test cluster: no safe node, control actors anywhere",
        "a control group: control actors ask its resource and select no spot node",
        "a spot node offering the resource is not a safe node",
        "the head and a control group: control actors off the head, which a restart would take them with",
        "the head the only safe node: control actors on the head",
        "the head and a spot node offering the resource: the head, the only safe node"])
def test_control_placement(nodes, safe, options):
    placement = roles.control_placement(nodes)
    assert placement.safe_nodes == safe and placement.options == options
    if options:
        assert placement.where.startswith("safe nodes only")
        assert ("off the head" in placement.where) == ("ray.io/node-id" in options["label_selector"])
    else:
        assert placement.where.startswith("any node: none offers raytrain_control")


LOST = "l" * 56  # a node whose runner stopped answering: lost, not yet declared dead


@pytest.mark.parametrize("nodes, safe, options", [
    ([({"CPU": 1}, {"ray.io/node-id": LOST}), ({"CPU": 1}, {})], 0, {"label_selector": {"ray.io/node-id": "!" + LOST}}),
    ([({"raytrain_control": 1000}, {"ray.io/node-id": LOST}), ({"CPU": 4}, {})], 0,
     {"label_selector": {"ray.io/node-id": "!" + LOST}}),
    ([HEAD, ({"raytrain_control": 1000}, {"ray.io/node-id": LOST}), ({"raytrain_control": 1000}, {})], 2,
     {"resources": {"raytrain_control": 1},
      "label_selector": {"ray.io/market-type": "!spot", "ray.io/node-id": f"!in({LOST}, {'h' * 56})"}}),
], ids=["no safe node: anywhere but the lost node",
        "the lost node was the only safe one: anywhere else",
        "the head and two control nodes, one lost: the other control node (off the head and the lost one)"])
def test_control_placement_avoids_a_node_lost_a_moment_ago(nodes, safe, options):
    placement = roles.control_placement(nodes, avoid=[LOST])
    assert placement.safe_nodes == safe and placement.options == options
    assert "not on 1 node(s) lost a moment ago (llllllll)" in placement.where


def _node_of_actor(name: str) -> str:
    from ray._private.state import state

    actor_id = ray.get_actor(name, namespace=NAMESPACE)._actor_id.hex()
    return state.actor_table(None)[actor_id]["Address"]["NodeID"]


def _control_actor_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and (a["name"] in (SERVICE_NAME, POOL_NAME)
                                               or a["name"].startswith((RUNNER_PREFIX, SPARE_RUNNER_PREFIX)))]


def test_control_actors_run_on_a_safe_node_when_the_cluster_has_one(ray_nodes, tiny_dataset, tmp_path):
    from ray._private.state import state

    gates_dir = tmp_path / "gates"
    gates_dir.mkdir()
    gates = StepGates(str(gates_dir))
    assert control_actors.control_options() == {}
    with running_service(tmp_path / "plain.db", gates, warm_workers_per_node=0) as svc:
        where = ray.get(svc.info.remote())["control_nodes"]
        assert where.startswith("any node: none offers raytrain_control"), where

    safe = ray_nodes.add_node(num_cpus=0, resources={"raytrain_control": 1000}, **ray_nodes.node_args)
    try:
        assert wait_until(lambda: control_actors.placement().safe_nodes == 1, 30)
        spec = job_spec(tmp_path, tiny_dataset, "on-workers", steps=4, resources={"num_workers": 2})
        with running_service(tmp_path / "safe.db", gates, warm_workers_per_node=1) as svc:
            assert ray.get(svc.info.remote())["control_nodes"] == "safe nodes only: 1 node offers raytrain_control"
            ray.get(svc.add_team.remote("a", 4))
            gates.hold(1, 2)
            job_id = ray.get(svc.submit.remote("a", spec))["id"]
            assert wait_until(lambda: gates.reached(job_id, 2), 120)
            names = _control_actor_names()  # the service, the pool, the job's runner, the spare runners
            nodes = {name: _node_of_actor(name) for name in names}
            assert set(nodes.values()) == {safe.node_id}, nodes
            assert SERVICE_NAME in names and POOL_NAME in names, names
            runner = find_runner(job_id)._actor_id.hex()
            assert state.actor_table(None)[runner]["Address"]["NodeID"] == safe.node_id
            workers = [g["bundles_to_node_id"][0] for g in state.placement_group_table().values()
                       if g["state"] == "CREATED" and g["name"].startswith("raytrain-sys:")]
            assert len(workers) == 2 and safe.node_id not in workers, workers  # the job's slots: worker nodes
            gates.go(job_id, 2)
            job = wait_state(svc, job_id, "finished")
            assert "finished at step 4" in job["message"], job
    finally:
        ray_nodes.remove_node(safe)
        assert wait_until(lambda: control_actors.placement().safe_nodes == 0, 30)
