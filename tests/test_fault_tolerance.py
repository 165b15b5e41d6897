"""Fault tolerance on a real multi-node Ray cluster: kills, lost nodes, hangs, joins, drains.

Every test asserts what a user would notice: the run completes, committed steps never go
backwards and none is redone, the final parameters equal an uninterrupted run's over the same
global batches, and the audit log shows every sample exactly once. Runs are in fp64 so that a
changing world size (a different order of the gradient sums) cannot hide behind rounding noise.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import ray

from raytrain_sys.control.supervisor import Supervisor, run_job
from raytrain_sys.data import order
from raytrain_sys.data.shards import read_manifest
from tests.helpers import assert_params_close, final_params, read_summary, tiny_spec

STEPS = 16


def ft_spec(tmp_path, dataset, **sections):
    base = dict(train={"max_steps": STEPS, "precision": "fp64", "log_every_steps": 4},
                data={"log_sample_ids": True},
                checkpoint={"every_steps": 5, "keep_last": 2},
                elastic={"hang_floor_s": 4.0, "below_min_timeout_s": 60.0})
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return tiny_spec(tmp_path, dataset, **base)


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dataset, tmp_path_factory):
    """The same job without failures."""
    result = run_job(ft_spec(tmp_path_factory.mktemp("ref"), tiny_dataset))
    return final_params(result.newest_checkpoint), result


def run_with_events(spec, events: dict):
    """Run a job; at the listed committed steps call ``event(supervisor)``."""
    seen: list[int] = []
    sup: Supervisor

    def on_step(report):
        seen.append(report.step)
        if report.step in events:
            events[report.step](sup)

    sup = Supervisor(spec, on_step=on_step)
    return sup.run(), sup, seen


def kill_soon(pid: int, sig=signal.SIGKILL, delay_s: float = 0.02) -> None:
    """Signal a worker process a moment into the next step (mid-step, not between steps)."""
    threading.Timer(delay_s, os.kill, (pid, sig)).start()


def assert_like_reference(result, seen, reference, spec, dataset, redone_ok: bool = False):
    ref_params, ref_result = reference
    assert result.status == "finished" and result.committed_steps == STEPS
    summary = read_summary(result.run_dir)
    if not redone_ok:
        assert seen == list(range(1, STEPS + 1)), f"steps went backwards or were redone: {seen}"
        assert summary["steps_redone"] == 0
    assert_params_close(final_params(result.newest_checkpoint), ref_params, rtol=1e-6, atol=1e-9)
    # Exactly once: committed steps' ids are the plan's ids, each sample once.
    with open(os.path.join(result.run_dir, "sample_ids.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    by_step = {}
    for line in lines:  # a restore re-logs redone steps; the last record of a step counts
        by_step[line["step"]] = [i for rank in line["ranks"] for i in rank]
    assert sorted(by_step) == list(range(1, STEPS + 1))
    ids = [i for s in sorted(by_step) for i in by_step[s]]
    m = read_manifest(dataset)
    B = spec.train.global_batch_size
    expected = order.sample_ids(tuple(sh.num_rows for sh in m.shards), spec.data.seed,
                                spec.data.shuffle_window, spec.data.shuffle_block_rows, 0, STEPS * B)
    assert ids == expected.tolist() and len(set(ids)) == len(ids)
    return summary


def worker_pid(sup, index):
    return sup.group.workers[index].info["pid"]


def test_worker_killed_mid_step(reference, tiny_dataset, tmp_path):
    spec = ft_spec(tmp_path, tiny_dataset)
    result, sup, seen = run_with_events(spec, {6: lambda s: kill_soon(worker_pid(s, 1))})
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset)
    assert summary["failures"] == 1
    assert "rebuilding" in [t["state"] for t in summary["transitions"]]
    assert 1 in summary["world_sizes"] or summary["world_sizes"].count(2) == STEPS


def test_hung_worker_is_detected_and_replaced(reference, tiny_dataset, tmp_path):
    spec = ft_spec(tmp_path, tiny_dataset)
    result, sup, seen = run_with_events(
        spec, {5: lambda s: kill_soon(worker_pid(s, 0), signal.SIGSTOP, delay_s=0.0)})
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset)
    rebuild = next(t for t in summary["transitions"] if t["state"] == "rebuilding")
    assert "hung" in rebuild["reason"]
    # Detected within the deadline (floor 4 s) plus the ping timeout, not gloo's 30 minutes.
    before = next(t for t in summary["transitions"] if t["state"] == "running" and t["step"] == 5
                  or t["step"] == 5)
    assert rebuild["time"] - before["time"] < 4.0 + 3.0 + 5.0


def test_node_removed(reference, tiny_dataset, tmp_path, ray_nodes):
    spec = ft_spec(tmp_path, tiny_dataset)
    removed = []

    def lose_node(sup):
        node_id = sup.group.workers[1].node_id
        node = next(n for n in ray_nodes.worker_nodes if n.node_id == node_id)
        ray_nodes.remove_node(node, allow_graceful=False)
        removed.append(node)

    try:
        result, sup, seen = run_with_events(spec, {6: lose_node})
    finally:
        for _ in removed:  # keep the session cluster at full size for the next tests
            ray_nodes.add_node(num_cpus=1, **ray_nodes.node_args)
        ray_nodes.wait_for_nodes()
    assert removed
    assert_like_reference(result, seen, reference, spec, tiny_dataset)


def test_all_workers_lost_restores_from_checkpoint(reference, tiny_dataset, tmp_path):
    spec = ft_spec(tmp_path, tiny_dataset)

    def kill_all(sup):
        for w in sup.group.workers:
            os.kill(w.info["pid"], signal.SIGKILL)

    result, sup, seen = run_with_events(spec, {7: kill_all})
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset, redone_ok=True)
    # Step 5 was the newest checkpoint: steps 6..7 were redone, nothing else.
    assert summary["steps_redone"] == 2
    assert seen == list(range(1, 8)) + list(range(6, STEPS + 1))


def test_node_added_grows_an_elastic_group(reference, tiny_dataset, tmp_path, ray_nodes):
    """Elastic 1..3 with room for one worker: a node joins mid-run and the group grows."""
    # Hold all but one CPU so that only one worker fits at the start.
    hold = ray.util.placement_group([{"CPU": 1}] * 3, strategy="SPREAD")
    ray.get(hold.ready(), timeout=60)
    added = []
    spec = ft_spec(tmp_path, tiny_dataset, resources={"num_workers": 1},
                   elastic={"min_workers": 1, "max_workers": 3})

    def join(sup):
        added.append(ray_nodes.add_node(num_cpus=1, **ray_nodes.node_args))

    try:
        result, sup, seen = run_with_events(spec, {3: join})
    finally:
        ray.util.remove_placement_group(hold)
        for node in added:
            ray_nodes.remove_node(node)
    summary = assert_like_reference(result, seen, reference, spec, tiny_dataset)
    assert summary["world_sizes"][0] == 1 and max(summary["world_sizes"]) >= 2
    assert "resizing" in [t["state"] for t in summary["transitions"]]
