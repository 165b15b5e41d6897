"""Fault tolerance on a real multi-node Ray cluster: kills, lost nodes, hangs, joins, drains.

Every test asserts what a user would notice: the run completes, committed steps never go
backwards and none is redone, the final parameters equal an uninterrupted run's over the same
global batches, and the audit log shows every sample exactly once. Runs are in fp64 so that a
changing world size (a different order of the gradient sums) cannot hide behind rounding noise.
Every ending (finished, failed, budget exceeded) leaves no actor and no placement group behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from raytrain_sys.control import drain
from raytrain_sys.control.supervisor import LIVENESS_EVERY_S, PING_TIMEOUT_S, run_job
from raytrain_sys.control.supervisor.steps import Steps
from raytrain_sys.errors import TrainingFailed
from tests.ft_common import (agents_up, assert_like_reference, assert_no_leftovers, ft_spec, kill_once_past, kill_soon,
                             lose_node_of, node_of_worker, restore_cluster_size, run_with_events,
                             supervisor_with_events, wait_for_a_ready_newcomer, worker_pid)
from tests.helpers import read_summary

STEPS = 16
CLUSTER_NODES = 4  # the session cluster's worker nodes (tests/conftest.py)
# Ray 2.60 kills a process that cannot answer (stopped) about 5 s after ray.kill (measured).
RAY_KILL_TIMEOUT_S = 5.0
# Room on top of a bound derived from the configured intervals: on this shared 2-core machine a
# process can wait seconds for a CPU (7 s seen for a 5 s bound at load average 47).
LOAD_ALLOWANCE_S = 4.0


def spec_for(tmp_path, dataset, **sections):
    return ft_spec(tmp_path, dataset, STEPS, **sections)


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_dataset, tmp_path_factory):
    """The same job without failures."""
    from tests.helpers import final_params

    result = run_job(spec_for(tmp_path_factory.mktemp("ref"), tiny_dataset))
    return final_params(result.newest_checkpoint), result


def like_reference(result, seen, reference, spec, dataset, **kw):
    return assert_like_reference(result, seen, reference, spec, dataset, STEPS, **kw)


def transitions(summary, state):
    return [t for t in summary["transitions"] if t["state"] == state]


def test_worker_killed_mid_step(reference, tiny_dataset, tmp_path, ray_cluster):
    spec = spec_for(tmp_path, tiny_dataset)
    result, sup, seen = run_with_events(spec, {
        6: lambda s: kill_soon(worker_pid(s, 1)),
        # The replacement, requested at once, joins at a step boundary once it is up.
        9: wait_for_a_ready_newcomer})
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    assert summary["failures"] == 1
    assert "rebuilding" in [t["state"] for t in summary["transitions"]]
    assert 1 in summary["world_sizes"] and summary["world_sizes"][-1] == 2
    assert_no_leftovers(ray_cluster, sup.run_key)


@pytest.mark.parametrize("node_agents", ["off", "on"], ids=["driver_calls", "through_node_agents"])
def test_worker_killed_mid_lease(reference, tiny_dataset, tmp_path, ray_cluster, monkeypatch, node_agents):
    """Leases of 5 steps (train.steps_per_call): a worker killed a few steps into one. The steps
    of the lease that finished on the survivor are committed from the results it kept, not
    redone; the rest are sent again after the rebuild; the run equals the uninterrupted one.
    The same with the leases through node agents (RAYTRAIN_NODE_AGENTS=on, Steps.node_agents), where
    the killed worker's call is its agent's: the driver asks the agent for it."""
    monkeypatch.setattr(Steps, "node_agents", node_agents)
    # No periodic checkpoint: each lease is sent ahead, so it runs as the one before commits.
    spec = spec_for(tmp_path, tiny_dataset, train={"steps_per_call": 5}, checkpoint={"every_steps": 0})

    agents = []

    def kill_a_few_steps_in(sup):
        # Step 6 is the first commit of the lease of steps 6..10: the members have just started
        # the lease of steps 11..15 (sent ahead). Kill once one of its steps finished.
        agents.append(sup.summary.agent_calls > 0)
        kill_once_past(sup, 1, 11)

    result, sup, seen = run_with_events(spec, {1: agents_up, 6: kill_a_few_steps_in})
    assert agents == [node_agents == "on"], agents  # the leases went the way asked
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    rebuild = transitions(summary, "rebuilding")
    assert len(rebuild) == 1 and rebuild[0]["reason"].startswith("steps 11..15 failed"), rebuild
    # The rebuild (from the lease's first step) ended with the survivor's finished steps committed.
    rebuilt = [t for t in summary["transitions"] if t["state"] == "running" and t["time"] > rebuild[0]["time"]]
    assert rebuild[0]["step"] == 10 and rebuilt[0]["step"] > 10, summary["transitions"]
    assert summary["failures"] == 1 and summary["leases"] < STEPS


def test_hung_worker_mid_step_is_detected_and_replaced(reference, tiny_dataset, tmp_path):
    """SIGSTOP in the middle of a step: its peer blocks in the all-reduce (gloo would wait 30
    minutes); the supervisor's liveness pings catch it, the hung worker is killed and replaced."""
    spec = spec_for(tmp_path, tiny_dataset)
    stopped_at = {}

    def stop(sup):
        stopped_at.update(t=time.time(), slot=sup.group.workers[1].slot)
        kill_soon(worker_pid(sup, 1), signal.SIGSTOP)

    result, sup, seen = run_with_events(spec, {7: stop, 10: wait_for_a_ready_newcomer})
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    rebuild = transitions(summary, "rebuilding")
    assert len(rebuild) == 1 and f"worker {stopped_at['slot']} on node" in rebuild[0]["reason"]
    assert "hung: no answer" in rebuild[0]["reason"], rebuild
    # A stopped worker stops answering pings: lost after one liveness interval plus one ping
    # timeout (checked once per interval), or at the step deadline (at least
    # elastic.hang_floor_s) if that comes first; with room for a loaded machine. Far sooner
    # than gloo's 30 minutes.
    detected_s = rebuild[0]["detected_at"] - stopped_at["t"]
    assert detected_s < 2 * LIVENESS_EVERY_S + PING_TIMEOUT_S + LOAD_ALLOWANCE_S
    # Then the hung process is killed (from its node, or by Ray within its ~5 s kill timeout),
    # its peer's all-reduce fails, and the group re-forms.
    assert rebuild[0]["time"] - rebuild[0]["detected_at"] < RAY_KILL_TIMEOUT_S + LOAD_ALLOWANCE_S
    assert summary["world_sizes"][-1] == 2 and "resizing" in [t["state"] for t in summary["transitions"]]


def test_unreachable_worker_that_no_kill_reaches(reference, tiny_dataset, tmp_path, monkeypatch):
    """A machine that vanishes closes no socket and takes no kill. Emulated here by a stopped
    worker whose kills (Ray's and the reaper's) never arrive while the run lasts: its peer's
    all-reduce must still fail, at the step's collective timeout (the step deadline plus the
    liveness margin), not after the group's 10 minutes, and the survivor carries on in place
    with nothing redone."""
    from raytrain_sys.control.worker_group import WorkerGroup

    spec = spec_for(tmp_path, tiny_dataset)
    frozen = {}
    release, reap = WorkerGroup._release, WorkerGroup.reap
    monkeypatch.setattr(WorkerGroup, "_release", lambda self, w: (
        None if w.slot == frozen.get("slot") else release(self, w)))
    monkeypatch.setattr(WorkerGroup, "reap", lambda self, ws: reap(
        self, [w for w in ws if w.slot != frozen.get("slot")]))

    def freeze(sup):
        w = sup.group.workers[1]
        # The deadline of the next step (the one the freeze hits), from the same step times.
        frozen.update(slot=w.slot, pid=w.info["pid"], worker=w, group=sup.group, t=time.time(),
                      deadline_s=sup._step_deadline_s())
        kill_soon(w.info["pid"], signal.SIGSTOP)

    try:
        result, sup, seen = run_with_events(spec, {7: freeze})
    finally:
        if "pid" in frozen:  # the "machine" may go now
            try:
                os.kill(frozen["pid"], signal.SIGKILL)
            except ProcessLookupError:  # gone already: the run's teardown ends its leftover actors by name
                pass
            release(frozen["group"], frozen["worker"])
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    rebuild = transitions(summary, "rebuilding")
    assert len(rebuild) == 1 and "hung: no answer" in rebuild[0]["reason"], rebuild
    assert "restoring" not in [t["state"] for t in summary["transitions"]]
    collective_timeout_s = frozen["deadline_s"] + LIVENESS_EVERY_S + PING_TIMEOUT_S
    assert collective_timeout_s < 60  # far below the group's own (train.step_timeout_s)
    assert rebuild[0]["time"] - frozen["t"] < collective_timeout_s + LOAD_ALLOWANCE_S


def test_hung_worker_during_checkpoint_is_detected(reference, tiny_dataset, tmp_path):
    """SIGSTOP right before a checkpoint: the writer stops answering its control path."""
    spec = spec_for(tmp_path, tiny_dataset)
    result, sup, seen = run_with_events(
        spec, {5: lambda s: kill_soon(worker_pid(s, 0), signal.SIGSTOP, delay_s=0.0)})
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    rebuild = transitions(summary, "rebuilding")
    assert len(rebuild) == 1 and "hung during the checkpoint of step 5" in rebuild[0]["reason"]
    started = next(t for t in summary["transitions"] if t["state"] == "checkpointing" and t["step"] == 5)
    # One watch interval plus one ping timeout, with room for a loaded machine.
    assert rebuild[0]["time"] - started["time"] < LIVENESS_EVERY_S + PING_TIMEOUT_S + LOAD_ALLOWANCE_S


@pytest.mark.parametrize("replacement", [
    "fresh",
    pytest.param("warm", marks=pytest.mark.warm_workers(needed=True)),
], ids=["a fresh replacement: the survivor trains alone while its process starts",
        "a warm spare replaces the lost worker at once: the pieces lost with the node are read again, "
        "not waited for as a hang"])
def test_node_removed(reference, tiny_dataset, tmp_path, ray_nodes, replacement):
    spec = spec_for(tmp_path, tiny_dataset)
    removed = []
    lost = {}
    keep = ""  # a node not to lose: the one the session's pool runs on (no safe node here: anywhere)
    if replacement == "warm":  # a spare idle on every node, the lost one's replacement too
        from ray._private.state import state

        from raytrain_sys.control.spares import find_pool

        pool = find_pool()
        assert ray.get(pool.wait_full.remote(120.0))
        keep = state.actor_table(pool._actor_id.hex())["Address"]["NodeID"]

    def lose_node(sup):
        victim = next(w for w in reversed(sup.group.workers) if w.node_id != keep)
        lost["slot"] = victim.slot
        lose_node_of(ray_nodes, victim, removed)

    try:
        result, sup, seen = run_with_events(spec, {6: lose_node})
    finally:
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    assert removed
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    rebuild = transitions(summary, "rebuilding")
    assert len(rebuild) == 1 and f"worker {lost['slot']} on node" in rebuild[0]["reason"], rebuild
    assert summary["failures"] == 1
    if replacement == "fresh":
        assert 1 in summary["world_sizes"]
    else:
        assert sup.group.spares_used == 3, sup.group.spares_used  # the first gang and the replacement


def test_all_workers_lost_restores_from_checkpoint(reference, tiny_dataset, tmp_path, ray_cluster):
    spec = spec_for(tmp_path, tiny_dataset)

    def kill_all(sup):
        for w in sup.group.workers:
            os.kill(w.info["pid"], signal.SIGKILL)

    result, sup, seen = run_with_events(spec, {7: kill_all})
    summary = like_reference(result, seen, reference, spec, tiny_dataset, redone_ok=True)
    # Step 5 was the newest checkpoint: steps 6..7 were redone, nothing else.
    assert summary["steps_redone"] == 2
    assert seen == list(range(1, 8)) + list(range(6, STEPS + 1))
    assert "restoring" in [t["state"] for t in summary["transitions"]]
    assert_no_leftovers(ray_cluster, sup.run_key)


def test_node_added_grows_an_elastic_group(reference, tiny_dataset, tmp_path, ray_nodes):
    """Elastic 1..3 with room for one worker: a node joins mid-run and the group grows."""
    # Hold all but one CPU so that only one worker fits at the start.
    hold = ray.util.placement_group([{"CPU": 1}] * (CLUSTER_NODES - 1), strategy="SPREAD")
    ray.get(hold.ready(), timeout=60)
    spec = spec_for(tmp_path, tiny_dataset, resources={"num_workers": 1},
                    elastic={"min_workers": 1, "max_workers": 3})

    def join(sup):
        ray_nodes.add_node(num_cpus=1, **ray_nodes.node_args)

    try:
        result, sup, seen = run_with_events(spec, {3: join, 5: wait_for_a_ready_newcomer})
    finally:
        ray.util.remove_placement_group(hold)
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    assert summary["world_sizes"][0] == 1 and max(summary["world_sizes"]) >= 2
    assert "resizing" in [t["state"] for t in summary["transitions"]]
    assert summary["failures"] == 0


def test_drain_notice_leaves_the_node_with_no_step_redone(reference, tiny_dataset, tmp_path,
                                                           ray_nodes):
    """A PREEMPTION drain with a deadline, then the node is killed at the deadline: the group
    leaves the node at the next step boundary, before the deadline, and loses nothing."""
    # Look up drains at every step boundary: the 16 tiny steps take well under a second.
    spec = spec_for(tmp_path, tiny_dataset, elastic={"drain_poll_s": 0.0})
    deadline_s = 15.0
    drained = {}

    def kill_at_deadline(node):
        # A node that is still alive at its deadline is killed, as a cloud reclaims it.
        if any(n is node for n in ray_nodes.worker_nodes):
            ray_nodes.remove_node(node, allow_graceful=False)

    def notice(sup):
        w = sup.group.workers[1]
        node = node_of_worker(ray_nodes, w)
        drained.update(slot=w.slot, node_id=w.node_id, t=time.time())
        assert drain.drain_node(w.node_id, "PREEMPTION", deadline_s, "test: spot preemption")
        timer = threading.Timer(deadline_s, kill_at_deadline, (node,))
        timer.daemon = True
        drained["timer"] = timer
        timer.start()

    try:
        result, sup, seen = run_with_events(spec, {6: notice})
        drained["timer"].join(timeout=deadline_s + 30)
    finally:
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    draining = transitions(summary, "draining")
    # The notice came as step 6 was committed, with step 7 already sent (train.run_ahead):
    # the next boundary is the one after step 7.
    assert len(draining) == 1 and draining[0]["step"] == 7, draining
    assert "worker(s) on draining node(s)" in draining[0]["reason"]
    assert draining[0]["time"] < drained["t"] + deadline_s
    # Left at that boundary: no failure, nothing redone, the world shrank after step 7.
    assert summary["failures"] == 0 and summary["steps_redone"] == 0
    assert summary["world_sizes"][:7] == [2] * 7 and summary["world_sizes"][7] == 1


def test_drain_of_the_last_worker_hands_the_state_over_in_memory(reference, tiny_dataset,
                                                                  tmp_path, ray_nodes):
    """The only worker's node is drained with time to spare: it trains on until a replacement
    is up elsewhere, which takes the state over from it in memory; no checkpoint restore."""
    spec = spec_for(tmp_path, tiny_dataset, resources={"num_workers": 1},
                    elastic={"min_workers": 1, "max_workers": 1, "drain_poll_s": 0.0})
    drained = {}

    def notice(sup):
        w = sup.group.workers[0]
        drained.update(slot=w.slot, node_id=w.node_id)
        assert drain.drain_node(w.node_id, "PREEMPTION", 120.0, "test: spot preemption")

    try:
        result, sup, seen = run_with_events(spec, {4: notice, 5: wait_for_a_ready_newcomer})
    finally:
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    states = [t["state"] for t in summary["transitions"]]
    assert "restoring" not in states and summary["failures"] == 0
    draining = transitions(summary, "draining")
    # Noticed at the boundary after step 5, sent ahead while step 4 was committed.
    assert "training on until a replacement is up" in draining[0]["reason"] and draining[0]["step"] == 5
    assert "take the state over" in draining[-1]["reason"]
    handover = draining[-1]["step"]
    assert 5 <= handover < STEPS
    # The periodic checkpoints only: nothing was saved for the handover.
    assert [c["step"] for c in summary["checkpoints"]] == [5, 10, 15, 16]
    assert set(summary["world_sizes"]) == {1}


def test_drain_notice_cuts_a_long_lease_short(reference, tiny_dataset, tmp_path, ray_nodes):
    """All 16 steps in one lease (train.steps_per_call), each step made long (rank 0's compute
    150x slower, elastic.fault_slow_rank), and a PREEMPTION notice a few steps in. The lease is
    cut short: the draining member leaves at the end of the step in flight, at most one step
    and one drain lookup (elastic.drain_poll_s = 0.25 s, shorter than a step: at most two
    steps after the one rank 0 held) after the notice, not at the lease's end many seconds
    later; no step is lost, none redone, and the run equals the uninterrupted one."""
    spec = spec_for(tmp_path, tiny_dataset, train={"steps_per_call": STEPS}, checkpoint={"every_steps": 0},
                    elastic={"fault_slow_rank": 0, "fault_slow_factor": 150.0, "straggler_margin": 0.0,
                             "drain_poll_s": 0.25, "hang_floor_s": 60.0})
    sup, seen = supervisor_with_events(spec, {})
    drained = {}

    def notice_mid_lease():
        # A few steps into the lease: rank 0 holds step 3 (asked on its control path).
        while sup.state.value not in ("finished", "failed"):
            workers = list(sup.group.workers) if sup.group is not None else []
            held = ray.get(workers[0].actor.ping.remote(), timeout=10) if len(workers) == 2 else 0
            if held >= 3:
                drained.update(t=time.time(), held=held, slot=workers[1].slot)
                assert drain.drain_node(workers[1].node_id, "PREEMPTION", 120.0, "test: mid-lease")
                return
            time.sleep(0.05)

    thread = threading.Thread(target=notice_mid_lease, daemon=True)
    thread.start()
    try:
        result = sup.run()
        thread.join(timeout=30)
    finally:
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    summary = like_reference(result, seen, reference, spec, tiny_dataset)
    [draining] = transitions(summary, "draining")
    left_at = draining["step"]
    step_s = sorted(summary["step_times"][:left_at])[left_at // 2]  # the slow steps' median
    assert step_s > spec.elastic.drain_poll_s, step_s  # else a lookup's wait may span more steps
    assert drained["held"] <= left_at <= drained["held"] + 2, (drained, draining)
    # The uncut lease would have held the node for the rest of the 16 steps: far longer than
    # the bound below (otherwise this test could not fail).
    bound_s = step_s + spec.elastic.drain_poll_s + 2.0  # + 2 s for a loaded machine
    assert (STEPS - left_at) * step_s > bound_s, (step_s, left_at)
    assert draining["time"] - drained["t"] < bound_s, (draining["time"] - drained["t"], step_s)
    assert "worker(s) on draining node(s)" in draining["reason"]
    assert summary["failures"] == 0 and summary["steps_redone"] == 0 and summary["leases"] >= 2
    assert set(summary["world_sizes"][:left_at]) == {2} and summary["world_sizes"][left_at] == 1


# --------------------------------------------------------------------------- endings
def test_no_leftovers_when_every_worker_is_lost_without_a_checkpoint(tiny_dataset, tmp_path,
                                                                      ray_cluster):
    spec = spec_for(tmp_path, tiny_dataset, checkpoint={"every_steps": 0, "save_on_exit": False})

    def kill_all(sup):
        for w in sup.group.workers:
            os.kill(w.info["pid"], signal.SIGKILL)

    sup, summary = run_events_expecting_failure(
        spec, {3: kill_all}, "every worker was lost at step 3 and no checkpoint")
    assert summary["status"] == "failed"
    assert_no_leftovers(ray_cluster, sup.run_key)


def test_no_leftovers_when_the_failure_budget_is_exceeded(tiny_dataset, tmp_path, ray_cluster):
    spec = spec_for(tmp_path, tiny_dataset, elastic={"max_failures": 1})

    def kill_one(sup):
        kill_soon(worker_pid(sup, len(sup.group.workers) - 1))

    # Kill, let the replacement join (two workers again), kill again: one failure too many.
    sup, _ = run_events_expecting_failure(spec, {3: kill_one, 4: wait_for_a_ready_newcomer,
                                                 6: kill_one},
                                          "2 membership failures within elastic.failure_window_s")
    summary = read_summary(sup.run_dir)
    assert summary["status"] == "failed" and summary["failures"] == 2
    assert summary["world_sizes"][-1] == 2  # the replacement was in when the second kill came
    # The survivor's state was saved before giving up: step 6, or 7 when the killed worker's
    # gradient was already in the all-reduce (the step finished on the survivor: committed).
    step = summary["committed_steps"]
    assert step in (6, 7) and summary["checkpoints"][-1]["step"] == step
    assert f"state saved at step {step}" in summary["reason"]
    assert_no_leftovers(ray_cluster, sup.run_key)


def test_no_leftovers_when_below_min_workers_past_the_timeout(tiny_dataset, tmp_path, ray_nodes):
    """min_workers=2, a node is lost and no other has room: a clear error after the timeout,
    with the survivor's state saved first."""
    spec = spec_for(tmp_path, tiny_dataset, elastic={"min_workers": 2, "below_min_timeout_s": 3.0})
    hold, removed = {}, []

    def fill_and_lose_a_node(sup):
        # Take every free CPU so that no replacement can start, then lose a worker's node.
        free = int(ray.available_resources().get("CPU", 0))
        if free:
            hold["pg"] = ray.util.placement_group([{"CPU": 1}] * free, strategy="SPREAD")
            ray.get(hold["pg"].ready(), timeout=60)
        lose_node_of(ray_nodes, sup.group.workers[1], removed)

    try:
        sup, _ = run_events_expecting_failure(spec, {6: fill_and_lose_a_node},
                                              "stayed below elastic.min_workers=2")
    finally:
        if "pg" in hold:
            ray.util.remove_placement_group(hold["pg"])
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    summary = read_summary(sup.run_dir)
    assert summary["status"] == "failed"
    assert "waiting" in [t["state"] for t in summary["transitions"]]
    # The node went while step 7 (sent ahead as step 6 was committed) ran, or just after it:
    # the state saved is the committed one either way.
    committed = summary["committed_steps"]
    assert committed in (6, 7) and summary["checkpoints"][-1]["step"] == committed
    assert f"state saved at step {committed}" in summary["reason"]
    assert_no_leftovers(ray_nodes.address, sup.run_key)


def run_events_expecting_failure(spec, events: dict, match: str):
    sup, _ = supervisor_with_events(spec, events)
    with pytest.raises(TrainingFailed, match=match):
        sup.run()
    return sup, read_summary(sup.run_dir)


def test_no_leftovers_when_finished(reference, ray_cluster):
    _, result = reference
    assert result.status == "finished"
    assert_no_leftovers(ray_cluster, os.path.basename(result.run_dir))
