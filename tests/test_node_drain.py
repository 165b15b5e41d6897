"""Eviction becomes a drain: a Kubernetes worker pod's termination path, on local Ray.

A worker pod of ``cluster_configs/kubernetes/`` runs ``ray start --block`` as its main process
and ``raytrain-sys node drain --reason preemption --deadline-s N --wait`` as its preStop hook:
Kubernetes runs the hook when the pod is to end, then sends SIGTERM to the main process, whose
own handler (Ray 2.60) drains the node too and exits once it is idle. Here a node joins the
session cluster as a pod's does: ``ray start --block --address <head>`` in a subprocess, 1 CPU,
its own temp dir (so its own runtime-env directory, as tests/conftest.py gives every node) and
``RAY_CLOUD_INSTANCE_ID`` set to a pod name, as KubeRay sets it. An elastic job trains with one
worker there and one on a session node (the other session nodes are held by idle actors so that
the two workers land there); then, in one case the hook runs as a pod's exec would (the same
environment, no node id given), in the other the ``ray start`` process gets SIGTERM. Either way
the job leaves the node at a step boundary and loses no step, and the hook (or the process)
returns well within its budget.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from raytrain_sys.control import drain
from raytrain_sys.control.node_drain import plan_drain
from tests.ft_common import run_with_events, wait_until
from tests.helpers import read_summary, tiny_spec

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
RAYTRAIN_SYS = str(Path(sys.executable).parent / "raytrain-sys")
STEPS = 14
DRAIN_AT = 4  # the notice comes as step 4 is committed
HOOK_DEADLINE_S = 60.0  # the preStop's --deadline-s (a pod's grace period is longer)
SIGTERM_DRAIN_S = 60.0  # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S of the pod's ray start


# --------------------------------------------------------------------------- the decision
T = 1000.0


@pytest.mark.parametrize("current, wanted, send, deadline", [
    (None, T + 60, True, T + 60),
    (drain.DrainInfo("PREEMPTION", None), T + 60, True, T + 60),
    (drain.DrainInfo("PREEMPTION", T + 30), T + 60, False, T + 30),
    (drain.DrainInfo("PREEMPTION", T + 60), T + 60, False, T + 60),
    (drain.DrainInfo("PREEMPTION", T + 120), T + 60, True, T + 60),
], ids=["a node not draining is drained with our deadline",
        "a drain with no deadline gets ours",
        "an earlier deadline (a spot notice's) is kept, never moved later",
        "the same deadline is not sent again",
        "a later deadline is brought forward to ours"])
def test_plan_drain(current, wanted, send, deadline):
    plan = plan_drain(current, wanted)
    assert (plan.send, plan.deadline_unix_s) == (send, deadline), plan.reason


# --------------------------------------------------------------------------- a pod's node
@dataclass
class PodNode:
    name: str
    env: dict
    proc: subprocess.Popen
    temp_dir: str
    log_path: str
    node_id: str = ""
    blockers: list = field(default_factory=list)

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def pod_env(pod_name: str, gcs_address: str) -> dict:
    """The environment KubeRay gives a worker pod's containers (the parts Ray reads)."""
    env = dict(os.environ)
    env.update({"RAY_ADDRESS": gcs_address, "RAY_CLOUD_INSTANCE_ID": pod_name,
                "RAY_NODE_TYPE_NAME": "gpu-spot", "RAY_NODE_MARKET_TYPE": "spot",
                "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(SIGTERM_DRAIN_S),
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    env.pop("RAY_TMPDIR", None)
    return env


@pytest.fixture
def pod_node(ray_nodes):
    """A node started as a worker pod starts it, with every session worker node but one held by
    an idle 1-CPU actor, so that a 2-worker job has one worker on each of the two free CPUs."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = f"raytrain-worker-gpu-spot-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    temp_dir = tempfile.mkdtemp(prefix="rtsp-", dir="/tmp")  # socket paths < 107 characters
    log_path = os.path.join(temp_dir, "ray-start.log")
    env = pod_env(name, ray_nodes.address)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [RAY, "start", "--block", f"--address={ray_nodes.address}", "--num-cpus=1",
             f"--object-store-memory={ray_nodes.node_args['object_store_memory']}",
             f"--temp-dir={temp_dir}", "--disable-usage-stats"],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    pod = PodNode(name, env, proc, temp_dir, log_path)

    @ray.remote(num_cpus=1)
    class Holder:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    try:
        node = wait_until(lambda: next((n for n in drain.alive_nodes().values()
                                        if n.instance_id == name), None), 120.0, 0.2)
        assert node is not None, f"the pod's node never joined:\n{pod.output()[-3000:]}"
        pod.node_id = node.node_id
        assert node.labels.get("ray.io/market-type") == "spot"  # from RAY_NODE_MARKET_TYPE
        session = sorted(n.node_id for n in ray_nodes.worker_nodes)
        pod.blockers = [Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            nid, soft=False)).remote() for nid in session[1:]]
        ray.get([b.node.remote() for b in pod.blockers], timeout=60)
        yield pod
    finally:
        for b in pod.blockers:
            ray.kill(b)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if pod.node_id:
            wait_until(lambda: pod.node_id not in drain.alive_nodes(), 60.0, 0.2)
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_with_termination(pod: PodNode, tmp_path, dataset, terminate):
    """Train the elastic job; at step DRAIN_AT call ``terminate(pod)`` and hold the step loop
    until the node is seen draining (so the notice falls between two known steps)."""
    spec = tiny_spec(tmp_path, dataset, train={"max_steps": STEPS, "steps_per_call": 1},
                     elastic={"min_workers": 1, "max_workers": 2, "drain_poll_s": 0.0})
    placed = {}

    def notice(sup):
        on_pod = [w for w in sup.group.workers if w.node_id == pod.node_id]
        placed.update(on_pod=len(on_pod), nodes=sorted(w.node_id for w in sup.group.workers))
        terminate(pod)
        assert wait_until(lambda: pod.node_id in drain.draining_nodes(), 30.0, 0.02), \
            f"the pod's node never started draining:\n{pod.output()[-3000:]}"

    result, sup, seen = run_with_events(spec, {DRAIN_AT: notice})
    assert placed["on_pod"] == 1, placed  # one worker trained on the pod's node
    return result, read_summary(result.run_dir)


def assert_left_at_a_boundary(result, summary):
    assert result.status == "finished" and result.committed_steps == STEPS
    # Nothing lost: no failure, no step redone; the world shrank from 2 to 1 at a boundary.
    assert summary["failures"] == 0 and summary["steps_redone"] == 0, summary["transitions"]
    sizes = summary["world_sizes"]
    assert sizes[:DRAIN_AT] == [2] * DRAIN_AT and sizes[-1] == 1, sizes
    draining = [t for t in summary["transitions"] if t["state"] == "draining"]
    assert len(draining) == 1 and "worker(s) on draining node(s)" in draining[0]["reason"], draining


def test_hook_without_a_node_of_its_own(ray_nodes):
    """A pod whose Ray node is already gone (or never started) has nothing to drain: success,
    said in one line. Several nodes that could be this one (here: every session node shares
    one IP) is a one-line error naming --node-id, not a guess."""
    gone = pod_env("a-pod-that-is-gone", ray_nodes.address)
    run = subprocess.run([RAYTRAIN_SYS, "node", "drain", "--wait"], env=gone,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("nothing to drain: no alive Ray node with instance id "
                                 "'a-pod-that-is-gone'")
    ambiguous = dict(gone)
    del ambiguous["RAY_CLOUD_INSTANCE_ID"]
    run = subprocess.run([RAYTRAIN_SYS, "node", "drain", "--wait"], env=ambiguous,
                         capture_output=True, text=True, timeout=120)
    errors = [line for line in run.stderr.splitlines() if line.startswith("raytrain-sys: error")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-2000:]
    assert "alive Ray nodes have IP" in errors[0] and "pass --node-id" in errors[0]
    session = {n.node_id for n in ray_nodes.worker_nodes} | {ray_nodes.head_node.node_id}
    assert not session & set(drain.draining_nodes())  # nothing was drained


# --------------------------------------------------------------------------- the two paths
@pytest.mark.timeout(400)
def test_prestop_hook_drains_the_node_and_returns_once_our_worker_left(
        pod_node, tmp_path, tiny_dataset):
    hook = {}

    def run_prestop(pod):
        # As the kubelet runs a preStop exec: in the pod's environment, no node id given.
        cmd = [RAYTRAIN_SYS, "node", "drain", "--reason", "preemption",
               "--deadline-s", f"{HOOK_DEADLINE_S:g}", "--wait"]
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=pod.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

        def wait():
            out, err = proc.communicate(timeout=HOOK_DEADLINE_S + 60)
            hook.update(rc=proc.returncode, out=out, err=err, took_s=time.time() - t0)

        hook["thread"] = threading.Thread(target=wait, daemon=True)
        hook["thread"].start()

    result, summary = run_with_termination(pod_node, tmp_path, tiny_dataset, run_prestop)
    hook["thread"].join(timeout=HOOK_DEADLINE_S + 60)
    print({k: v for k, v in hook.items() if k != "thread"})
    assert_left_at_a_boundary(result, summary)
    assert hook["rc"] == 0, hook["err"][-3000:]
    assert f"node {pod_node.node_id[:12]}: draining (PREEMPTION)" in hook["out"]
    assert "training slots here at the start: 1" in hook["out"]
    assert "none left" in hook["out"] or "the node is gone" in hook["out"]
    assert hook["took_s"] < HOOK_DEADLINE_S


@pytest.mark.timeout(400)
def test_sigterm_to_ray_start_block_drains_and_exits_once_idle(pod_node, tmp_path, tiny_dataset):
    sent = {}

    def sigterm(pod):
        sent["t"] = time.time()
        pod.proc.send_signal(signal.SIGTERM)  # what the kubelet sends the pod's main process

        def wait():
            pod.proc.wait(timeout=SIGTERM_DRAIN_S + 60)
            sent["exited_after_s"] = time.time() - sent["t"]

        sent["thread"] = threading.Thread(target=wait, daemon=True)
        sent["thread"].start()

    result, summary = run_with_termination(pod_node, tmp_path, tiny_dataset, sigterm)
    sent["thread"].join(timeout=SIGTERM_DRAIN_S + 60)
    exited_after_s = sent["exited_after_s"]
    print({"ray_start_exited_after_sigterm_s": round(exited_after_s, 2)})
    assert_left_at_a_boundary(result, summary)
    # Ray's handler waited for the node to be idle (our worker gone), not for its timeout.
    out = pod_node.output()
    assert "finished draining" in out, out[-3000:]
    assert exited_after_s < SIGTERM_DRAIN_S
    dead = drain.nodes()[pod_node.node_id]
    assert not dead.alive and dead.death_reason in (drain.DEATH_PREEMPTED, drain.DEATH_EXPECTED)
