"""The job service on Ray's own autoscaler: one scenario, run in a process of its own.

A process holds one Ray connection, and the tests' pytest process holds the session cluster's:
``tests/test_service_autoscaling.py`` and ``benchmarks/autoscale.py`` run this in a child
process, which starts a fake autoscaling cluster (``tests/autoscaling_cluster.py``), the service
on it with autoscaling on, and a job for more than is up. It prints one JSON line of what it saw
(times are unix seconds) and ends every process it started.

    python -m tests.autoscale_scenario --work DIR --dataset DIR [--v2] [--flavors] [--drain] [--warm-workers N]

Scenarios:

* plain (no flavor table; ``max_cluster_workers`` 2, the head has no CPU): a 2-worker job is
  submitted on an empty cluster; the scale request, the node's join, the first committed step,
  the end, the request cleared and the node's release are timed. With ``--drain``, the job is
  elastic 1..2 on 1-CPU nodes and one of its nodes is drained by ``raytrain-sys node drain
  --wait`` (a worker pod's preStop hook) while it trains: its steps lost are counted.
* ``--flavors`` (autoscaler v2, which scales a node group for a label selector): spot-cpu and
  on-demand-cpu, a node group of one 2-CPU node each; job A (any market) is admitted on spot and
  held at step 2; job B (any market) finds spot full and is admitted on on-demand, whose node
  comes up and trains it, while A still holds the spot node.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.5  # the service's pass
IDLE_TIMEOUT_S = 6.0  # Ray's autoscaler releases a node idle this long (the config's 0.1 minutes)
STEPS = 16


def _spec(work: Path, dataset: str, name: str, **resources) -> dict:
    from tests.ft_common import ft_spec

    elastic = resources.pop("elastic", None)
    spec = ft_spec(work / name, dataset, STEPS, resources={"num_workers": 2, **resources},
                   **({"elastic": elastic} if elastic else {})).to_dict()
    return spec | {"name": name}


class _Watch:
    """Polls the service and the cluster; keeps the first time each thing was seen."""

    def __init__(self, svc, gates):
        self.svc, self.gates, self.seen, self.causes = svc, gates, {}, {}

    def mark(self, key: str) -> float:
        return self.seen.setdefault(key, time.time())

    def until(self, key: str, pred, timeout_s: float, what: str):
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for job in ray.get(self.svc.jobs.remote()):  # every wait cause a job showed, in order
                causes = self.causes.setdefault(job["id"], [])
                if job["wait_cause"] and (not causes or causes[-1] != job["wait_cause"]):
                    causes.append(job["wait_cause"])
            value = pred()
            if value:
                self.mark(key)
                return value
            time.sleep(0.1)
        raise TimeoutError(f"{what} not within {timeout_s:g} s")


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def ray_request(v2: bool) -> list:
    """What Ray's autoscaler was asked (the service's request_resources), read back from Ray."""
    if not v2:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get("autoscaler_resource_request")
        return json.loads(raw) if raw else []
    from ray.autoscaler.v2.sdk import get_cluster_resource_state
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    constraints = get_cluster_resource_state(internal_kv_get_gcs_client()).cluster_resource_constraints
    return [dict(b.resources_bundle) for c in constraints for r in c.resource_requests
            for b in [r.request] for _ in range(r.count)]


def slots_on(job_id: int) -> list[str]:
    """The labels' market of the nodes holding the job's placement groups."""
    from ray._private.state import state

    from raytrain_sys.service.runner import find_runner

    import ray

    runner = find_runner(job_id)
    run_key = ray.get(runner.status.remote()).run_dir.rstrip("/").rsplit("/", 1)[-1] if runner else ""
    nodes = {n["NodeID"]: n.get("Labels", {}).get("ray.io/market-type", "") for n in ray.nodes()}
    return [nodes.get(g["bundles_to_node_id"][0], "?") for g in state.placement_group_table().values()
            if g["state"] == "CREATED" and run_key and run_key in g["name"]]


def plain(args, svc, gates, watch) -> dict:
    import ray

    ray.get(svc.add_team.remote("a", 4))
    before = len(alive_nodes())
    resources = {"num_workers": 2}
    if args.drain:
        resources = {"num_workers": 2, "elastic": {"min_workers": 1, "max_workers": 2}}
    spec = _spec(args.work, args.dataset, "beyond", **resources)
    if args.drain:
        gates.hold(1, 4)
    submitted = watch.mark("submit")
    job_id = ray.get(svc.submit.remote("a", spec))["id"]
    out = {"submit": submitted, "accepted": time.time(), "nodes_before": before}
    watch.until("requested", lambda: (ray.get(svc.info.remote())["autoscaling"]["requested_bundles"] or 0) >= 2,
                60, "the scale request")
    out["requested_at_s"] = ray.get(svc.info.remote())["autoscaling"]["requested_at_s"]
    out["ray_request"] = ray_request(args.v2)
    watch.until("node_joined", lambda: len(alive_nodes()) > before, 120, "a node's join")
    out["first_step"] = float(watch.until("first_step", lambda: gates.stamp(job_id, 1), 240, "the first step"))
    if args.drain:
        assert watch.until("at_4", lambda: gates.reached(job_id, 4), 240, "step 4")
        out.update(_drain_one_node(args, job_id, gates, watch))
    watch.until("finished", lambda: ray.get(svc.job.remote(job_id))["state"] == "finished", 300, "the job's end")
    watch.until("cleared", lambda: ray.get(svc.info.remote())["autoscaling"]["requested_bundles"] == 0, 60,
                "the request cleared")
    out["ray_request_after"] = ray_request(args.v2)
    watch.until("released", lambda: len(alive_nodes()) == before, 180, "the node's release")
    out["history"] = [t["to"] for t in ray.get(svc.history.remote(job_id))]
    out["wait_causes"] = watch.causes.get(job_id, [])
    out["summary"] = _summary(args.work / "beyond")
    return out


def _drain_one_node(args, job_id: int, gates, watch) -> dict:
    """The termination path: ``raytrain-sys node drain --wait`` on one of the job's nodes."""

    from ray._private.state import state

    pgs = [g for g in state.placement_group_table().values() if g["state"] == "CREATED"
           and g["name"].startswith("raytrain-sys:")]
    node_id = pgs[0]["bundles_to_node_id"][0]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": args.address}
    started = time.time()
    hook = subprocess.Popen([sys.executable, "-m", "raytrain_sys.cli.main", "node", "drain", "--node-id", node_id,
                             "--deadline-s", "120", "--wait"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # the drain is set before the held step goes on
    gates.go(job_id, 4)
    output, _ = hook.communicate(timeout=180)
    return {"drain_hook_rc": hook.returncode, "drain_hook_s": time.time() - started, "drain_output": output[-2000:],
            "drained_node": node_id,
            "drained_node_alive_after": any(n["NodeID"] == node_id for n in alive_nodes())}


def flavors(args, svc, gates, watch) -> dict:
    import ray

    table = [{"name": "spot-cpu", "market": "spot", "resources": ["cpu"], "max_cpu": 2, "usd_per_cpu_hour": 0.01},
             {"name": "on-demand-cpu", "market": "on-demand", "resources": ["cpu"], "max_cpu": 2,
              "usd_per_cpu_hour": 0.04}]
    ray.get(svc.set_flavors.remote(table))
    ray.get(svc.add_team.remote("a", 0))
    for name in ("spot-cpu", "on-demand-cpu"):
        ray.get(svc.set_quotas.remote("a", name, {"cpu": 4}))
    before = len(alive_nodes())
    gates.hold(1, 2)
    a = ray.get(svc.submit.remote("a", _spec(args.work, args.dataset, "a-any")))["id"]
    watch.until("a_at_2", lambda: gates.reached(a, 2), 300, "job A's step 2")
    b = ray.get(svc.submit.remote("a", _spec(args.work, args.dataset, "b-any")))["id"]
    watch.until("b_admitted", lambda: ray.get(svc.job.remote(b))["flavor"], 60, "job B's admission")
    watch.until("b_first_step", lambda: gates.stamp(b, 1), 300, "job B's first step")
    out = {"a": ray.get(svc.job.remote(a)), "b": ray.get(svc.job.remote(b)), "b_slots": slots_on(b),
           "a_slots": slots_on(a), "nodes": sorted(n.get("Labels", {}).get("ray.io/market-type", "")
                                                   for n in alive_nodes()),
           "ray_request": ray_request(args.v2)}
    gates.go(a, 2)
    for job_id in (a, b):
        watch.until(f"finished_{job_id}", lambda j=job_id: ray.get(svc.job.remote(j))["state"] == "finished", 300,
                    f"job {job_id}'s end")
    watch.until("cleared", lambda: ray.get(svc.info.remote())["autoscaling"]["requested_bundles"] == 0, 60,
                "the request cleared")
    watch.until("released", lambda: len(alive_nodes()) == before, 180, "the nodes' release")
    out["wait_causes"] = {job_id: watch.causes.get(job_id, []) for job_id in (a, b)}
    out["histories"] = {job_id: [t["to"] for t in ray.get(svc.history.remote(job_id))] for job_id in (a, b)}
    return out


def _summary(output_dir: Path) -> dict:
    found = sorted(output_dir.glob("runs/*/summary.json"))
    return json.loads(found[-1].read_text()) if found else {}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--v2", action="store_true", help="Ray's autoscaler v2 (label selectors respected)")
    p.add_argument("--flavors", action="store_true")
    p.add_argument("--drain", action="store_true")
    p.add_argument("--warm-workers", type=int, default=0,
                   help="the service's warm spares per node (and its two spare runners when > 0); 0: none")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("RAY_ADDRESS", None)

    import ray

    from raytrain_sys.service.service import start_service, stop_service
    from tests.autoscaling_cluster import autoscaling_cluster

    if args.flavors:
        types = {"spot": {"resources": {"CPU": 2}, "labels": {"ray.io/market-type": "spot"}, "max_workers": 1},
                 "on-demand": {"resources": {"CPU": 2}, "labels": {"ray.io/market-type": "on-demand"},
                               "max_workers": 1}}
    elif args.drain:
        types = {"cpu": {"resources": {"CPU": 1}, "max_workers": 3}}
    else:
        types = {"cpu": {"resources": {"CPU": 2}, "max_workers": 1}}
    started = time.time()
    result: dict = {"v2": args.v2, "scenario": "flavors" if args.flavors else "drain" if args.drain else "plain"}
    with autoscaling_cluster(types, idle_timeout_s=IDLE_TIMEOUT_S, v2=args.v2) as head:
        result["cluster_up_s"] = time.time() - started
        args.address = head.address
        ray.init(address=head.address, log_to_driver=False, logging_level="WARNING")
        gates_dir = args.work / "gates"
        gates_dir.mkdir(parents=True, exist_ok=True)
        gates = StampedGates(str(gates_dir))
        config = {"autoscaling": True, "provisioning_timeout_s": 300.0}
        if not args.flavors:
            config["max_cluster_workers"] = 2
        svc = start_service(f"sqlite:///{args.work}/svc.db", log_dir=str(args.work / "logs"), base_dir=str(args.work),
                            serve_api=False, warm_workers_per_node=args.warm_workers, poll_s=POLL_S, step_hook=gates,
                            **config)
        if args.warm_workers:  # the cluster warm (the spare runners up) before the submit, as a service runs
            _Watch(svc, gates).until("warm", lambda: ray.get(svc.info.remote())["spare_runners"]["up"] == 2, 120,
                                     "the spare runners")
        watch = _Watch(svc, gates)
        try:
            result.update((flavors if args.flavors else plain)(args, svc, gates, watch))
            result["seen"] = watch.seen
        finally:
            stop_service()
            ray.shutdown()
    result["total_s"] = time.time() - started
    print(json.dumps(result, default=str))


class StampedGates:
    """``tests.service_common.StepGates``, and the time each job's step 1 was committed."""

    def __init__(self, root: str):
        from tests.service_common import StepGates

        self.gates = StepGates(root)
        self.root = root

    def __call__(self, job_id, sup, report) -> None:
        if report.step == 1:
            path = os.path.join(self.root, f"stamp-{job_id}-1")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write(repr(time.time()))
        self.gates(job_id, sup, report)

    def stamp(self, job_id: int, step: int):
        path = os.path.join(self.root, f"stamp-{job_id}-{step}")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            text = f.read().strip()
        return float(text) if text else None

    def hold(self, job_id, step):
        self.gates.hold(job_id, step)

    def go(self, job_id, step):
        self.gates.go(job_id, step)

    def reached(self, job_id, step):
        return self.gates.reached(job_id, step)


if __name__ == "__main__":
    main()
