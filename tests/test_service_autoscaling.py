"""Queue-driven autoscaling on Ray's own autoscaler, end to end: the job service on a fake
autoscaling cluster (Ray's fake multi-node provider, ``tests/autoscaling_cluster.py``), in a child
process of its own (a process has one Ray connection; this one's, if any, is the session
cluster's), with a head of no CPU, so that every job needs nodes the autoscaler adds.

What a user would notice: a submit beyond what is up is accepted (the scheduler admits against
the ceiling, ``max_cluster_workers``); the service asks Ray's autoscaler for it within one pass;
the job waits with the reason ``provisioning`` (never back in the queue); a node joins and the
job trains to its end; then the request is cleared and the idle node released after the
autoscaler's idle timeout. On autoscaler v2, which scales a node group for a label selector, a
flavor that is full sends the next job to the flavor that is free, and that flavor's node comes
up and trains it. Each scenario runs once, bounded (``tests/autoscale_scenario.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.autoscale_scenario import IDLE_TIMEOUT_S, POLL_S

REPO = Path(__file__).resolve().parent.parent
SCENARIO_TIMEOUT_S = 900  # a scenario takes 1-2 minutes here; a loaded machine slows Ray's starts a lot
PASS_S = POLL_S + 1.5  # one pass: its poll, and at most status_wait_s (1 s) for runners' answers, and some slack


def run_scenario(work: Path, dataset: str, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, "-m", "tests.autoscale_scenario", "--work", str(work), "--dataset", dataset,
                          *flags], env=env, cwd=work, capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)
    assert run.returncode == 0, f"the scenario failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_submit_beyond_capacity_scales_up_trains_and_lets_the_node_go(tiny_dataset, tmp_path):
    r = run_scenario(tmp_path, tiny_dataset)
    seen = r["seen"]
    assert r["nodes_before"] == 1 and r["accepted"] - r["submit"] < 5  # nothing up for it, accepted at once
    assert r["requested_at_s"] - seen["submit"] <= PASS_S, "the scale request within one pass"
    assert r["ray_request"] == [{"CPU": 1.0}, {"CPU": 1.0}]  # Ray's own record of what it was asked
    assert seen["requested"] < seen["node_joined"] < seen["first_step"] < seen["finished"]
    assert r["history"] == ["queued", "starting", "running", "finished"], "never back in the queue"
    assert r["wait_causes"][0] == "provisioning", r["wait_causes"]
    assert r["summary"]["steps_redone"] == 0 and r["summary"]["world_sizes"][-1] == 2
    assert r["ray_request_after"] == [] and seen["cleared"] - seen["finished"] <= PASS_S
    # Released by Ray's autoscaler once idle for its timeout (it looks every second).
    assert seen["released"] - seen["cleared"] <= IDLE_TIMEOUT_S + 5.0, seen


@pytest.mark.slow
def test_a_flavor_full_while_another_is_free_scales_the_free_one(tiny_dataset, tmp_path):
    """Autoscaler v2: job A (any market) is admitted on spot-cpu (the table's first) and holds its
    one node; job B (any market) finds spot-cpu full and is admitted on on-demand-cpu, against
    capacity being provisioned; the on-demand node comes up and B's workers train there."""
    r = run_scenario(tmp_path, tiny_dataset, "--v2", "--flavors")
    a, b = r["a"], r["b"]
    assert (a["flavor"], b["flavor"]) == ("spot-cpu", "on-demand-cpu")
    assert r["a_slots"] == ["spot", "spot"] and r["b_slots"] == ["on-demand", "on-demand"], r
    assert sorted(r["nodes"]) == ["", "on-demand", "spot"]  # the head (no market) and one node per flavor
    assert r["wait_causes"][str(b["id"])][0] == "provisioning", r["wait_causes"]
    assert all(h == ["queued", "starting", "running", "finished"] for h in r["histories"].values()), r["histories"]
    seen = r["seen"]
    assert seen["released"] - seen["cleared"] <= IDLE_TIMEOUT_S + 5.0, seen
