"""Peer copies (issue 29): in a layout whose shards have no replica, each rank's blocks are
copied to a peer's host memory after every step, and a lost rank's shard comes back from its
copy: 0 steps redone, with no checkpoint to fall back on. A rank and its peer lost together
fall back to the checkpoint, named in the summary; a rank killed while its copy is in flight
goes back to the copies of the committed step, never a newer one half held. Every run ends where
one process ends (fp64), every sample exactly once.
"""

from __future__ import annotations

import copy

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from raytrain_sys.control import drain
from raytrain_sys.control.peer_copies import Channel, PeerCopies, flat_layout, peer_ring, room, to_wire, wanted
from raytrain_sys.parallel.reshard import Piece
from tests.ft_common import (assert_like_reference, ft_spec, kill_soon, lose_node_of, node_of_worker,
                             one_worker_reference, restore_cluster_size, run_with_events, wait_for_a_ready_newcomer,
                             worker_pid)

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

STEPS = 18
CLUSTER_NODES = 4  # the session cluster's worker nodes (tests/conftest.py)
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}


# ----------------------------------------------------------------------------- pure
@pytest.mark.parametrize("nodes, peers", [
    # two nodes of two: every rank's copy on the other node, each rank holding one
    (["a", "a", "b", "b"], [2, 3, 0, 1]),
    # ranks of a node interleaved with the other's: still across nodes, one each
    (["a", "b", "a", "b"], [1, 0, 3, 2]),
    # one node: the next rank (a lost process, not a lost node)
    (["a", "a", "a"], [1, 2, 0]),
    # two ranks on two nodes: each other's
    (["a", "b"], [1, 0]),
    # four nodes of one: a ring across them
    (["a", "b", "c", "d"], [1, 2, 3, 0]),
])
def test_peer_ring_puts_each_copy_on_another_node_when_there_is_one(nodes, peers):
    assert peer_ring(nodes) == peers


def test_peer_ring_with_one_crowded_node_still_copies_off_it():
    """Three ranks on a, one on b: no bijection keeps every copy off its rank's node, so b holds
    a's three copies (and a's one copy of b): a lost node never takes a rank with its copy."""
    nodes = ["a", "a", "a", "b"]
    peers = peer_ring(nodes)
    assert all(nodes[r] != nodes[p] for r, p in enumerate(peers)), peers


@pytest.mark.parametrize("setting, degrees, on", [
    (-1, {"pp": 1, "dp": 1, "fsdp": 2, "tp": 1}, True),   # FSDP: the only shard of each block
    (-1, {"pp": 2, "dp": 1, "fsdp": 1, "tp": 1}, True),   # PP stages without DP
    (-1, {"pp": 2, "dp": 1, "fsdp": 2, "tp": 1}, True),   # 2-D
    (-1, {"pp": 1, "dp": 2, "fsdp": 2, "tp": 1}, False),  # HSDP with a second replica holds it
    (-1, {"pp": 1, "dp": 4, "fsdp": 1, "tp": 1}, False),  # plain DDP: every rank holds it all
    (0, {"pp": 1, "dp": 1, "fsdp": 2, "tp": 1}, False),   # asked off
    (1, {"pp": 1, "dp": 2, "fsdp": 2, "tp": 1}, True),    # asked on
])
def test_peer_copies_are_on_by_default_where_a_shard_has_no_replica(setting, degrees, on):
    assert wanted(setting, degrees) is on


@pytest.mark.parametrize("copy_mb, ranks_on_node, available_mb, fits", [
    (100, 1, 1000, True),     # 4 x 100 MB within half of 1 GB
    (130, 1, 1000, False),    # 520 MB: more than half
    (100, 2, 1000, False),    # two ranks on the node: 800 MB
    (1, 8, 100, True),
    (172, 1, 20000, True),    # no object store to fit: the channel's copies are in memory
])
def test_auto_peer_copies_need_room_in_host_memory(copy_mb, ranks_on_node, available_mb, fits):
    assert room(copy_mb * 2**20, ranks_on_node, available_mb * 2**20) is fits


def test_a_held_copy_reuses_the_arrays_of_a_dropped_one_but_never_one_still_read():
    """Each step's copy lands in the arrays of the copy an agreement dropped (no fresh pages a
    step); an array someone still reads (a rebuild's pieces) is never written over."""
    copies = PeerCopies()
    where = []
    for step in range(6):
        state = torch.full((3, 4), float(step), dtype=torch.float64)
        copies.hold(0, 1, step, to_wire({"w": Piece((3, 4), (0, 0), state), "tied": Piece((3, 4), (0, 0), state),
                                         "b": Piece((2,), (0,), torch.ones(2))}))
        held = copies.pieces("held", 0, 1, step)
        assert held["w"].data is held["tied"].data and torch.equal(held["w"].data, state)
        where.append(held["w"].data.data_ptr())
        if step == 2:
            still_read = copies.pieces("held", 0, 1, 1)
        del held
        copies.agreed(step, 0)
        assert [c[3] for c in copies.held()] == [step]
    assert where[2] == where[0] and where[3] not in (where[1], where[2]) and where[4] == where[2], where
    assert torch.equal(still_read["w"].data, torch.full((3, 4), 1.0, dtype=torch.float64))


def test_a_copy_over_the_channel_arrives_whole_and_only_in_its_generation():
    """The channel's way (gloo between the two ends, as between two ranks' processes; here two
    threads): the held pieces equal the sent ones step after step, a tied block stays one, and a
    copy of a generation the holder has no channel for is refused, nothing held."""
    import numpy as np
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sender, holder = Channel(store, 0, 1, 20.0), Channel(store, 1, 1, 20.0)
    copies = PeerCopies()
    copies.channel, copies.generation = holder, 1
    try:
        for step in range(3):
            state = torch.arange(12, dtype=torch.float64).reshape(3, 4) + step
            wire = to_wire({"w": Piece((3, 4), (0, 0), state), "tied": Piece((3, 4), (0, 0), state),
                            "b": Piece((4,), (2,), torch.full((2,), float(step), dtype=torch.float32))})
            meta, arrays, total = flat_layout(wire)
            assert total == 12 * 8 + 2 * 4 and len(arrays) == 2
            flat = np.empty(total, np.uint8)
            for start, array in arrays:
                flat[start:start + array.nbytes] = array
            sent = sender.send(1, flat)
            copies.hold(1, 0, step, ("channel", meta))
            sent.result(timeout=20)
            held = copies.pieces("held", 1, 0, step)
            assert held["w"].data is held["tied"].data and torch.equal(held["w"].data, state)
            assert held["b"].offset == (2,) and torch.equal(held["b"].data, torch.full((2,), float(step)))
            del held
            copies.agreed(step, 1)
        copies.generation = 2  # a copy of a generation this end has no channel for: refused, none held
        with pytest.raises(RuntimeError, match="no channel"):
            copies.hold(1, 0, 3, ("channel", meta))
        assert [c[3] for c in copies.held()] == [2]
    finally:
        sender.close()
        holder.close()


def test_a_ranks_blocks_are_reused_between_steps_but_never_stale():
    """The blocks a rank sends are worked out once and read its live state (a step updates it in
    place); a load, a swapped ``.data`` or a new layout makes them be worked out again: what is
    sent always equals the state as it is now."""
    from raytrain_sys.control.worker import TrainWorker
    from raytrain_sys.parallel.reshard import local_pieces

    torch.manual_seed(0)
    cls = TrainWorker.__ray_actor_class__  # the class under the actor, its state without a process
    worker = cls.__new__(cls)
    worker.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    worker.optimizer = torch.optim.AdamW(worker.model.parameters(), lr=0.1)
    worker.generation, worker.coords, worker._pieces_cache = 1, None, None

    def step():
        worker.model(torch.randn(5, 4)).square().sum().backward()
        worker.optimizer.step()

    def sent_is_now():
        sent, now = worker._owned_pieces(), local_pieces(worker.model, worker.optimizer, copy=True)
        assert sent.keys() == now.keys()
        for key in now:
            assert torch.equal(sent[key].data, now[key].data), key
        return sent

    step()
    first = sent_is_now()
    step()
    assert sent_is_now() is first  # the same views, now reading the second step's values
    weight = worker.model[0].weight
    weight.data = weight.data.clone()  # new memory behind the same parameter
    with torch.no_grad():
        weight.add_(1.0)
    swapped = sent_is_now()
    assert swapped is not first
    worker.optimizer.load_state_dict(copy.deepcopy(worker.optimizer.state_dict()))  # new state tensors
    step()
    loaded = sent_is_now()
    assert loaded is not swapped
    worker.generation = 2  # a new layout
    assert sent_is_now() is not loaded


def test_blocks_off_the_cpu_are_never_reused():
    """A GPU's blocks reach the copy as CPU copies made at the call (``.cpu()``): the cache is
    only for state on the CPU, judged by the state's tensors, not by the (CPU) pieces."""
    from raytrain_sys.control.worker import views_of_state

    on_cpu, elsewhere = torch.zeros(2), torch.empty(2, device="meta")  # meta: any device but the CPU
    assert views_of_state([(on_cpu, on_cpu.data_ptr())])
    assert not views_of_state([(on_cpu, on_cpu.data_ptr()), (elsewhere, 0)])


# ----------------------------------------------------------------------------- on the cluster
@pytest.fixture(scope="module")
def one_process(ray_cluster, tiny_dataset, tmp_path_factory):
    """The same job on one worker: every layout must end here."""
    return one_worker_reference(tmp_path_factory, tiny_dataset, STEPS, MODEL)


def _recoveries(summary):
    return summary["recoveries"]


@pytest.mark.parametrize("parallel, workers, killed", [
    ({"strategy": "fsdp"}, 2, 1),
    ({"strategy": "fsdp"}, 4, 2),
    ({"pp": 2}, 2, 1),
    ({"strategy": "fsdp", "pp": 2}, 4, 2),
], ids=["fsdp2", "fsdp4", "pp2", "pp2xfsdp2"])
def test_a_lost_rank_comes_back_from_its_peer_copy_with_no_step_redone(
        one_process, tiny_dataset, tmp_path, parallel, workers, killed):
    """SIGKILL a rank at step 15 with no checkpoint to fall back on (checkpoint.every_steps 0):
    its shard comes back from the copy its peer holds; nothing is redone, and the replacement
    joins from the survivors' memory too."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel=parallel,
                   resources={"num_workers": workers}, checkpoint={"every_steps": 0})
    events = {15: lambda s: kill_soon(worker_pid(s, killed)),
              16: lambda s: wait_for_a_ready_newcomer(s, every=True)}
    result, sup, seen = run_with_events(spec, events)
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    recoveries = _recoveries(summary)
    assert len(recoveries) == 1 and recoveries[0]["from"] == "peer copies", recoveries
    assert recoveries[0]["steps_redone"] == 0 and recoveries[0]["step"] >= 15, recoveries
    assert not [t for t in summary["transitions"] if t["state"] == "restoring"], summary["transitions"]
    assert not summary["checkpoints"][:-1], "a checkpoint before the final one: none was configured"
    assert summary["world_sizes"][-1] == workers, summary["world_sizes"]


def test_a_lost_rank_of_fsdp_x_tp_comes_back_from_its_peer_copy_with_no_step_redone(
        one_process, tiny_dataset, tmp_path):
    """FSDP2 x TP2 (a 2-D layout whose every block has one owner): rank 3 killed at step 15 with
    no checkpoint configured; the three survivors form a world of two (tp x fsdp must divide it)
    from their own state and rank 3's copy; nothing is redone."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel={"strategy": "fsdp", "tp": 2},
                   resources={"num_workers": 4}, checkpoint={"every_steps": 0})
    result, sup, seen = run_with_events(spec, {15: lambda s: kill_soon(worker_pid(s, 3))})
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    recoveries = _recoveries(summary)
    assert len(recoveries) == 1 and recoveries[0]["from"] == "peer copies", recoveries
    assert recoveries[0]["steps_redone"] == 0 and recoveries[0]["step"] >= 15, recoveries
    assert not [t for t in summary["transitions"] if t["state"] == "restoring"], summary["transitions"]


def test_a_rank_killed_mid_lease_comes_back_from_the_confirmed_copies(one_process, tiny_dataset, tmp_path):
    """Leases of 5 steps: within a lease each copy moves while the next step computes, and a
    step commits only once the next step's agreement (or the lease's end) confirmed every
    rank's copy of it. A rank killed a few steps into the lease of steps 11..15: the steps
    confirmed on the survivor are committed, the survivor goes back to its snapshot of the
    newest of them, the lost rank's blocks come from its copy; 0 steps redone."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel={"strategy": "fsdp"},
                   resources={"num_workers": 2}, train={"steps_per_call": 5}, checkpoint={"every_steps": 0})

    def kill_a_few_steps_in(sup):
        kill_soon(worker_pid(sup, 1), delay_s=2.5 * sup.steps._step_times[-1])

    result, sup, seen = run_with_events(spec, {6: kill_a_few_steps_in, 12: wait_for_a_ready_newcomer})
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    recoveries = _recoveries(summary)
    assert len(recoveries) == 1 and recoveries[0]["from"] == "peer copies", recoveries
    assert recoveries[0]["steps_redone"] == 0 and recoveries[0]["step"] >= 10, recoveries


def test_a_rank_killed_while_its_copy_is_in_flight_goes_back_to_the_committed_copies(
        one_process, tiny_dataset, tmp_path):
    """Every copy takes half a second to be held (elastic.fault_copy_delay_s): a rank killed
    0.15 s into the step after 10 dies with its copy of step 11 in flight, after every rank ran step 11's
    optimizer step but before the step was agreed. Step 10 is the committed one: the survivor goes
    back to its own snapshot of it (its copy was on the lost rank), the lost rank's blocks come
    from the copy of step 10 its peer held; step 11 is not counted as redone (it never
    committed), and the run ends like one process."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel={"strategy": "fsdp"},
                   resources={"num_workers": 2}, checkpoint={"every_steps": 0},
                   elastic={"fault_copy_delay_s": 0.5})
    events = {10: lambda s: kill_soon(worker_pid(s, 1), delay_s=0.15), 11: wait_for_a_ready_newcomer}
    result, sup, seen = run_with_events(spec, events)
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    recoveries = _recoveries(summary)
    assert len(recoveries) == 1 and recoveries[0] == {**recoveries[0], "step": 10, "from": "peer copies",
                                                      "steps_redone": 0}, recoveries


def test_a_rank_and_its_peer_lost_together_fall_back_to_the_checkpoint(one_process, tiny_dataset, tmp_path):
    """FSDP over four ranks on four nodes: rank 1 and the peer holding its copy are killed at
    once. The survivors cannot cover rank 1's blocks: the checkpoint of step 5 is restored and
    the steps since redone, and the summary and the transition say why."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel={"strategy": "fsdp"},
                   resources={"num_workers": 4})
    pair = []

    def kill_rank_and_peer(sup):
        peer = sup.membership.peers[1]
        pair.extend([1, peer])
        for index in pair:
            kill_soon(worker_pid(sup, index))

    events = {7: kill_rank_and_peer, 8: lambda s: wait_for_a_ready_newcomer(s, every=True)}
    result, sup, seen = run_with_events(spec, events)
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS, redone_ok=True)
    assert pair and pair[1] != 1
    recoveries = _recoveries(summary)
    assert recoveries and recoveries[0]["from"] == "checkpoint" and recoveries[0]["steps_redone"] >= 2, recoveries
    restore = [t for t in summary["transitions"] if t["state"] == "restoring"]
    assert restore and "its peer copy was lost with it" in restore[0]["reason"], summary["transitions"]



def test_a_lost_node_comes_back_from_the_peer_copies_on_other_nodes(one_process, tiny_dataset, tmp_path, ray_nodes):
    """FSDP over two ranks on two nodes; rank 1's node vanishes after step 15 (no grace): its
    rank's copy is on rank 0's node, so the survivor alone holds the whole step, and nothing is
    redone with no checkpoint configured. The driver reads the rows (data.delivery=driver): with
    read tasks, the next steps' rows may lie in the lost node's object store, and a replacement's
    lease then waits for them (its pings queued behind it) until Ray declares the node dead,
    some 15 s on; the replacement was taken for hung. That is the data plane's, not this test's."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel={"strategy": "fsdp"},
                   resources={"num_workers": 2}, checkpoint={"every_steps": 0},
                   data={"log_sample_ids": True, "delivery": "driver"})
    removed = []

    def lose_node(sup):
        assert sup.group.workers[0].node_id != sup.group.workers[1].node_id
        lose_node_of(ray_nodes, sup.group.workers[1], removed)

    try:
        result, sup, seen = run_with_events(spec, {15: lose_node, 16: wait_for_a_ready_newcomer})
    finally:
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    assert removed
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    recoveries = _recoveries(summary)
    assert len(recoveries) == 1 and recoveries[0]["from"] == "peer copies", recoveries
    assert recoveries[0]["steps_redone"] == 0, recoveries
    assert summary["peer_copies"]["peers"] == [1, 0], summary["peer_copies"]


def test_a_drained_nodes_shard_is_handed_over_before_it_leaves(one_process, tiny_dataset, tmp_path, ray_nodes):
    """FSDP over two ranks with copies on; rank 1's node gets a preemption notice after step 6:
    its shard goes to the survivor before the node is let go at the next boundary (not from a
    copy, not from a checkpoint: none is configured), and nothing is redone.

    From the notice to the run's end the cluster's other nodes are held (a placement group of
    their CPUs), so that the world of 1 is seen: the replacement asked for as the member leaves
    comes up in 2-4 s, about as long as the leave's re-form takes (the leaver's pieces are
    indexed and cut by tasks that start processes), and up by the end of it, it joins at that
    same boundary (the plan's Grow after LeaveDraining), and no step runs at world 1 (once in a
    FAST=1 suite run, and in one of four runs of this test on 2026-11-27)."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel={"strategy": "fsdp"},
                   resources={"num_workers": 2}, checkpoint={"every_steps": 0}, elastic={"drain_poll_s": 0.0})
    drained, held = [], []

    def notice(sup):
        w = sup.group.workers[1]
        assert sup.membership.peers == [1, 0], sup.membership.peers  # copies on, across the two nodes
        free = sorted({n.node_id for n in ray_nodes.worker_nodes} - {m.node_id for m in sup.group.workers})
        held.append(placement_group([{"CPU": 1}] * len(free), name="test-hold-free-nodes",
                                    bundle_label_selector=[{"ray.io/node-id": n} for n in free]))
        ray.get(held[-1].ready(), timeout=60)
        drained.append(node_of_worker(ray_nodes, w))
        assert drain.drain_node(w.node_id, "PREEMPTION", 60.0, "test: spot preemption")

    try:
        sources = []
        result, sup, seen = run_with_events(spec, {6: notice, 10: lambda s: sources.append(s.membership.last_sources)})
    finally:
        for pg in held:
            remove_placement_group(pg)
        for node in drained:
            if any(n is node for n in ray_nodes.worker_nodes):
                ray_nodes.remove_node(node, allow_graceful=False)
        restore_cluster_size(ray_nodes, CLUSTER_NODES)
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    draining = [t for t in summary["transitions"] if t["state"] == "draining"]
    assert len(draining) == 1 and "draining node" in draining[0]["reason"], summary["transitions"]
    assert summary["failures"] == 0 and summary["steps_redone"] == 0 and not summary["recoveries"], summary
    assert not [t for t in summary["transitions"] if t["state"] == "restoring"], summary["transitions"]
    assert 1 in summary["world_sizes"], summary["world_sizes"]
    assert sources == [["survivors"]], sources  # the leaver's own pieces, not the survivor's copy of them
