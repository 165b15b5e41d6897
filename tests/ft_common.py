"""Shared by the fault-tolerance tests: fault injection at committed steps and the assertions a
user would notice (the run completes, committed steps never go backwards, final parameters and
each step's loss equal an uninterrupted run's, every sample exactly once, nothing left on the
cluster)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import ray
import torch

from raytrain_sys.control.supervisor import Supervisor
from raytrain_sys.control.launches import find_leftovers, run_name_prefix
from raytrain_sys.data import order
from raytrain_sys.data.shards import read_manifest
from tests.helpers import assert_params_close, final_params, read_summary, tiny_spec


def ft_spec(tmp_path, dataset, steps: int, **sections):
    """fp64, so that a changing world size (another order of the gradient sums) cannot hide
    behind rounding noise; sample ids logged for the exactly-once audit.

    One step a call (``train.steps_per_call: 1``): faults are injected from the driver's commit
    of step k, and only then does "the next step" name one step (under a lease of several, the
    members are steps past the commit the driver sees). Faults inside leases: the chaos test
    and ``test_worker_killed_mid_lease``."""
    base = dict(train={"max_steps": steps, "precision": "fp64", "log_every_steps": 4, "steps_per_call": 1},
                data={"log_sample_ids": True},
                checkpoint={"every_steps": 5, "keep_last": 2},
                elastic={"hang_floor_s": 4.0, "below_min_timeout_s": 60.0})
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return tiny_spec(tmp_path, dataset, **base)


def one_worker_reference(tmp_path_factory, dataset, steps: int, model: dict):
    """The same job on one worker, which every layout must end equal to: (final parameters,
    result)."""
    spec = ft_spec(tmp_path_factory.mktemp("one"), dataset, steps, model=model, resources={"num_workers": 1})
    result = Supervisor(spec).run()
    return final_params(result.newest_checkpoint), result


def agents_up(sup, timeout_s: float = 120.0) -> None:
    """An event (``supervisor_with_events``): wait until every member but rank 0 answers to its
    node's agent (``NodeAgents.hand_over``), so that the leases from the next one on go through
    the agents (a short test run can end before an agent's process is up)."""
    agents = sup.group.agents

    def handed() -> bool:
        agents.hand_over()
        return all(agents.holds(w) for w in sup.group.workers[1:])

    assert wait_until(handed, timeout_s), "the members' node agents did not come up"


def run_with_events(spec, events: dict):
    """Run a job with ``events`` (see ``supervisor_with_events``): (result, supervisor, steps seen)."""
    sup, seen = supervisor_with_events(spec, events)
    return sup.run(), sup, seen


def supervisor_with_events(spec, events: dict):
    """A Supervisor that calls ``events[N](supervisor)`` when step N is first committed.

    Each event fires once: a step committed again after a restore from a checkpoint (steps
    redone) does not inject its fault a second time. An event that returns False is not due
    yet (e.g. no replacement requested so far) and is tried again at the next committed step;
    at most one event runs per step, and per lease: the steps of a lease (train.steps_per_call)
    are committed together, and faults due at three of them would otherwise land at once, in
    the lease after it.
    """
    seen: list[int] = []
    pending = dict(events)
    fired_in = [-1]  # the lease (its index among the run's committed calls) of the last event
    sup: Supervisor

    def on_step(report):
        seen.append(report.step)
        due = [s for s in pending if s <= report.step]
        if due and sup.summary.leases != fired_in[0]:
            fired_in[0] = sup.summary.leases
            first = min(due)
            if pending[first](sup) is not False:
                del pending[first]

    sup = Supervisor(spec, on_step=on_step)
    return sup, seen


def kill_soon(pid: int, sig=signal.SIGKILL, delay_s: float = 0.002) -> None:
    """Signal a worker process a moment into the next step (mid-step, not between steps).

    Called from the commit of step k, when step k+1 already runs (sent ahead). The moment must
    be short against a step: the tiny test job's steps take about 10 ms once the driver no
    longer relays rows, so the 20 ms used before landed two steps later (or in the checkpoint
    after them), not in the next step."""
    threading.Timer(delay_s, os.kill, (pid, sig)).start()


def kill_once_past(sup, index: int, step: int, timeout_s: float = 10.0) -> None:
    """SIGKILL member ``index`` as soon as it holds step ``step`` (its control path's ping, which
    answers while a step runs): a kill a given number of steps into a lease, whatever the step
    times (a delay reckoned from the last lease's time lands late when that lease was slow, e.g.
    a node agent's first calls on a loaded machine)."""
    actor, pid = sup.group.workers[index].actor, worker_pid(sup, index)
    held = wait_until(lambda: ray.get(actor.ping.remote()) >= step, timeout_s, interval_s=0.001)
    assert held, f"member {index} did not reach step {step} within {timeout_s:g} s"
    os.kill(pid, signal.SIGKILL)


def worker_pid(sup, index):
    return sup.group.workers[index].info["pid"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(pred, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval_s)
    return pred()


def wait_for_a_ready_newcomer(sup, timeout_s: float = 120.0, every: bool = False):
    """Block the step loop (called from an event) until a requested replacement is up (with
    ``every``, all of those requested), so that the next step boundary takes it in: makes "the
    worker is replaced" deterministic. False (not due yet) while no replacement has been
    requested, e.g. during a rebuild that is still committing the step in flight."""
    pending = list(sup.group.pending)
    if not pending:
        return False
    want = len(pending) if every else 1
    deadline = time.monotonic() + timeout_s
    # A newcomer on a warm spare starts once its slot is placed (``started_pending`` starts it).
    while len(started := [w for w in sup.group.started_pending() if w in pending]) < want:
        assert time.monotonic() < deadline, f"{want - len(started)} replacement slot(s) not placed within {timeout_s:g} s"
        time.sleep(0.05)
    ready, _ = ray.wait([w.ready_ref for w in started], num_returns=want, timeout=max(0.0, deadline - time.monotonic()))
    if len(ready) != want:  # say what the ones not up are doing (pending creation: not placed)
        from ray._private import state

        states = {w.slot: state.actors(actor_id=w.actor._actor_id.hex()).get("State")
                  for w in started if w.ready_ref not in ready}
        raise AssertionError(f"{want - len(ready)} replacement worker(s) not started within {timeout_s:g} s "
                             f"(slot: actor state {states})")
    return True


def node_of_worker(cluster, worker):
    return next(n for n in cluster.worker_nodes if n.node_id == worker.node_id)


def lose_node_of(cluster, worker, removed: list) -> None:
    """Remove a worker's node without grace, as a vanished machine, and wait until the worker's
    process is gone too. Ray's raylet-death check ends a worker about a second after its raylet:
    until then a "lost" node keeps training, and the fault would miss the run."""
    node = node_of_worker(cluster, worker)
    cluster.remove_node(node, allow_graceful=False)
    removed.append(node)
    pid = worker.info["pid"]
    assert wait_until(lambda: not pid_alive(pid), 60.0), f"worker pid {pid} outlived its node"


def restore_cluster_size(cluster, size: int) -> None:
    """Keep the session cluster at ``size`` worker nodes for the tests that follow."""
    from raytrain_sys.control.drain import alive_nodes

    alive = alive_nodes()
    for node in list(cluster.worker_nodes):
        # Gone by itself (a drained node exits once idle), or still draining: a draining node
        # reports free CPUs but takes no new work, and without an autoscaler nothing ends it;
        # the tests that follow would wait on it for their workers.
        if node.node_id not in alive or alive[node.node_id].draining:
            cluster.remove_node(node, allow_graceful=False)
    while len(cluster.worker_nodes) < size:
        cluster.add_node(num_cpus=1, **cluster.node_args)
    while len(cluster.worker_nodes) > size:  # a set: any node; no run holds one any more
        cluster.remove_node(next(iter(cluster.worker_nodes)))
    cluster.wait_for_nodes()


def expected_sample_ids(spec, dataset, steps: int) -> list[int]:
    m = read_manifest(dataset)
    B = spec.train.global_batch_size
    return order.sample_ids(tuple(sh.num_rows for sh in m.shards), spec.data.seed,
                            spec.data.shuffle_window, spec.data.shuffle_block_rows, 0,
                            steps * B).tolist()


def assert_like_reference(result, seen, reference, spec, dataset, steps: int,
                          redone_ok: bool = False) -> dict:
    ref_params, _ = reference
    assert result.status == "finished" and result.committed_steps == steps, result
    summary = read_summary(result.run_dir)
    if not redone_ok:
        assert seen == list(range(1, steps + 1)), f"steps went backwards or were redone: {seen}"
        assert summary["steps_redone"] == 0
    else:  # after a restore, steps are redone from the checkpoint on, ending at the last one
        assert not seen or seen[-1] == steps
    assert_params_close(final_params(result.newest_checkpoint), ref_params, rtol=1e-6, atol=1e-9)
    assert_losses_like(summary, reference[1].losses, steps)
    # Exactly once: committed steps' ids are the plan's ids, each sample once.
    with open(os.path.join(result.run_dir, "sample_ids.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    by_step = {}
    for line in lines:  # a restore re-logs redone steps; the last record of a step counts
        by_step[line["step"]] = [i for rank in line["ranks"] for i in rank]
    assert sorted(by_step) == list(range(1, steps + 1))
    ids = [i for s in sorted(by_step) for i in by_step[s]]
    assert ids == expected_sample_ids(spec, dataset, steps) and len(set(ids)) == len(ids)
    return summary


def assert_losses_like(summary: dict, reference_losses: list[float], steps: int) -> None:
    """Each step's loss in the run's record equals the uninterrupted run's (fp64: rtol 1e-6),
    steps committed from a survivor included; only a step in ``losses_partial`` (its loss lost
    with the ranks that died in its agreement, at most one a failure) may differ."""
    partial = set(summary.get("losses_partial", []))
    assert len(partial) <= summary["failures"], (sorted(partial), summary["failures"])
    kept = [s for s in range(1, steps + 1) if s not in partial]
    losses = summary["losses"]
    assert len(losses) == steps and len(reference_losses) == steps, (len(losses), len(reference_losses))
    torch.testing.assert_close(torch.tensor([losses[s - 1] for s in kept], dtype=torch.float64),
                               torch.tensor([reference_losses[s - 1] for s in kept], dtype=torch.float64),
                               rtol=1e-6, atol=0)


def _idle_spare(name: str) -> bool:
    """A warm spare that no job has claimed (raytrain_sys.control.spares): the pool's, not a
    run's. A claimed one is a run's worker like any other, and counts."""
    from raytrain_sys.control.spares import NAMESPACE, SPARE_PREFIX

    if not name.startswith(SPARE_PREFIX):
        return False
    try:
        return not ray.get(ray.get_actor(name, namespace=NAMESPACE).spare_state.remote(), timeout=10)["claimed"]
    except Exception:  # gone meanwhile, or still starting (a spare being made is no run's either)
        return True


def assert_no_leftovers(cluster_address: str, run_key: str) -> None:
    """No actor alive and no placement group left of the run (and no TrainWorker of any run),
    read from the GCS tables (what Ray's state API serves), and through Ray's state API itself
    when this cluster's dashboard is up: on a shared machine another cluster may hold its port,
    and the state API then cannot be reached."""
    from ray._private import state

    from raytrain_sys.control.spares import RECYCLE_TIMEOUT_S, SPARE_PREFIX

    prefix = run_name_prefix(run_key)

    def alive():
        return [(a.get("Name"), a["ActorClassName"], a["State"]) for a in state.actors().values()
                if a["State"] != "DEAD" and ((a.get("Name") or "").startswith(prefix)
                                             or a["ActorClassName"] == "TrainWorker")
                and not _idle_spare(a.get("Name") or "")]

    # A warm spare the run gave back is the pool's once its recycle ends (within the pool's
    # RECYCLE_TIMEOUT_S); one still claimed past it, and any other worker, is left over.
    deadline = time.monotonic() + RECYCLE_TIMEOUT_S
    actors = alive()
    while actors and all((name or "").startswith(SPARE_PREFIX) for name, _, _ in actors) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        actors = alive()
    groups = [(g["name"], g["state"]) for g in ray.util.placement_group_table().values()
              if g["name"].startswith(prefix) and g["state"] != "REMOVED"]
    assert not actors, f"actors left alive: {actors}"
    assert not groups, f"placement groups left: {groups}"
    assert find_leftovers(run_key) == []

    from ray.util.state import list_actors, list_placement_groups

    try:
        api_actors = list_actors(address=cluster_address, filters=[("state", "!=", "DEAD")],
                                 limit=10_000)
        api_groups = list_placement_groups(address=cluster_address, limit=10_000)
    except ConnectionError as exc:  # no dashboard on this cluster: the GCS check above stands
        print(f"Ray state API unavailable ({exc}); checked the GCS tables only")
        return
    actors = [(a.name, a.state) for a in api_actors
              if ((a.name or "").startswith(prefix) or a.class_name == "TrainWorker") and not _idle_spare(a.name or "")]
    groups = [(g.name, g.state) for g in api_groups
              if (g.name or "").startswith(prefix) and g.state != "REMOVED"]
    assert not actors, f"actors left alive (state API): {actors}"
    assert not groups, f"placement groups left (state API): {groups}"
