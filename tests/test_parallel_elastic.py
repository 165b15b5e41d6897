"""Sharded layouts under the Supervisor, on the multi-node session cluster (issue 5, "with the
supervisor"): state that a surviving peer still holds (an HSDP replica group) carries on in
memory, re-cut for the new world; state whose only shard died (FSDP over two ranks) comes back
from the newest checkpoint, resharded. Either way the run ends where one process ends (fp64),
with every sample exactly once.
"""

from __future__ import annotations

import pytest

from tests.ft_common import (assert_like_reference, ft_spec, kill_soon, one_worker_reference, run_with_events,
                             wait_for_a_ready_newcomer, worker_pid)

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

STEPS = 12
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}


@pytest.fixture(scope="module")
def one_process(ray_cluster, tiny_dataset, tmp_path_factory):
    """The same job on one worker: every layout must end here."""
    return one_worker_reference(tmp_path_factory, tiny_dataset, STEPS, MODEL)


def test_fsdp_shard_lost_restores_from_checkpoint_resharded(one_process, tiny_dataset, tmp_path):
    """Without peer copies (on by default for FSDP since issue 29: tests/test_peer_copies.py)."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL, parallel={"strategy": "fsdp"},
                   resources={"num_workers": 2}, checkpoint={"peer_copies": 0})
    events = {6: lambda s: kill_soon(worker_pid(s, 1)), 8: wait_for_a_ready_newcomer}
    result, sup, seen = run_with_events(spec, events)
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS, redone_ok=True)
    # Its shard had no copy: the survivor alone could not continue; checkpoint 5, step 6 redone.
    restore = [t for t in summary["transitions"] if t["state"] == "restoring"]
    assert restore and "do not hold all of the state" in restore[0]["reason"], summary["transitions"]
    assert summary["steps_redone"] == 1
    assert 2 in summary["world_sizes"][8:], "the replacement did not join"


def test_hsdp_replica_survives_a_lost_rank_in_memory(one_process, tiny_dataset, tmp_path):
    """HSDP 2 x 2 on four nodes; one rank dies: the other replica group still holds every shard.
    Three survivors cannot make an HSDP world (shard groups of 2), so one waits on standby until
    the replacement is up and the group grows back to four."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL,
                   parallel={"strategy": "hsdp", "fsdp": 2}, resources={"num_workers": 4})
    events = {5: lambda s: kill_soon(worker_pid(s, 3)), 7: wait_for_a_ready_newcomer}
    result, sup, seen = run_with_events(spec, events)
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    sizes = summary["world_sizes"]
    assert sizes[:5] == [4] * 5 and 2 in sizes and sizes[-1] == 4, sizes
    assert not [t for t in summary["transitions"] if t["state"] == "restoring"]


@pytest.mark.slow
def test_kill_while_shrinking_hsdp_reshards_from_memory(one_process, tiny_dataset, tmp_path, monkeypatch):
    """HSDP 2 x 2 asked to shrink to 2 at step 4: the leavers' pieces go through the object store
    and the stayers re-cut by blocks. One stayer is killed the moment the state starts moving
    (issue 17). The other stayer and the leavers' pieces still hold every shard: a replacement
    joins and takes its blocks from them, from memory, and the run ends like one process."""
    from raytrain_sys.control.supervisor.membership import Membership

    share = Membership._share_state_as_pieces
    killed = []

    def kill_a_stayer_then_share(self, members, held, step):
        if not killed:  # the first time the state moves: during the shrink
            killed.append(members[-1].info["pid"])
            kill_soon(killed[0])
        return share(self, members, held, step)

    monkeypatch.setattr(Membership, "_share_state_as_pieces", kill_a_stayer_then_share)
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, model=MODEL,
                   parallel={"strategy": "hsdp", "fsdp": 2}, resources={"num_workers": 4})
    events = {4: lambda s: s.requests.resize(2, "test shrink")}
    result, sup, seen = run_with_events(spec, events)
    summary = assert_like_reference(result, seen, one_process, spec, tiny_dataset, STEPS)
    assert killed, "the shrink never shared state"
    sizes = summary["world_sizes"]
    assert sizes[:4] == [4] * 4 and set(sizes[5:]) == {2}, (sizes, summary["transitions"])  # step 5 was sent ahead
    assert not [t for t in summary["transitions"] if t["state"] == "restoring"], summary["transitions"]
