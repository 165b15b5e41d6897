"""A launch's owner, recorded in the GCS (``control/launches.py``), decides what a resume does with
what an earlier launch left: a launch whose owner is gone is ended at once (its agents end their
ranks, its slots are removed), one whose owner lives refuses the resume. Also the job service's
hard stop: the launches of a runner it killed are ended (``end_launches_of``)."""

from __future__ import annotations

import time

import pytest
import ray

from raytrain_sys.control import launches
from raytrain_sys.control.node_agent import NodeAgent
from raytrain_sys.control.spares import NAMESPACE
from raytrain_sys.control.launches import clean_up_leftovers, find_leftovers, run_name_prefix
from raytrain_sys.errors import UserError
from tests.ft_common import wait_until


@pytest.mark.parametrize("name,prefix", [
    ("raytrain-sys:run-1:ab12cd34:0", "raytrain-sys:run-1:ab12cd34:"),
    ("raytrain-sys:run-1:ab12cd34:agent:0123456789abcdef:1", "raytrain-sys:run-1:ab12cd34:"),
    ("raytrain-sys-spare-0123", ""),
    ("raytrain-sys:run-1", ""),
    ("other:run-1:ab12cd34:0", ""),
], ids=["a worker's name: its launch", "an agent's name: its launch", "a warm spare belongs to no launch",
        "a name too short for a launch", "another tool's name"])
def test_launch_prefix(name, prefix):
    assert launches.launch_prefix(name) == prefix


@ray.remote(num_cpus=0)
class _Owner:
    def actor_id(self) -> str:
        return ray.get_runtime_context().get_actor_id()


def _launch(run_key: str, owner_id: str) -> str:
    """A launch of ``run_key`` owned by ``owner_id``: its record, a slot, a stand-in rank in it
    (detached, as a worker is) and the node's agent holding both."""
    prefix = run_name_prefix(run_key) + "l" + str(time.monotonic_ns())[-7:] + ":"
    launches.record(prefix, owner_id)
    node = ray.get_runtime_context().get_node_id()
    agent = NodeAgent.options(name=launches.agent_name(prefix, node, 0), namespace=NAMESPACE,
                              lifetime="detached").remote(prefix, node, owner_id, 600.0)
    pg = ray.util.placement_group([{"CPU": 0.01}], name=prefix + "0", lifetime="detached")
    ray.get(pg.ready(), timeout=120)
    rank = _Owner.options(name=prefix + "0", namespace=NAMESPACE, lifetime="detached").remote()
    ray.get([rank.actor_id.remote(), agent.keep.remote({0: (rank, pg)})], timeout=120)
    return prefix


def test_a_launch_whose_owner_is_gone_is_ended_at_once_and_one_whose_owner_lives_refuses(ray_cluster):
    owner = _Owner.remote()
    owner_id = ray.get(owner.actor_id.remote())
    run_key = "launches-test"
    prefix = _launch(run_key, owner_id)
    assert sorted(x.kind for x in find_leftovers(run_key)) == ["actor", "actor", "placement_group"]
    # The owner lives: the run is still driven, a resume refuses after its grace, touching nothing.
    with pytest.raises(UserError, match=f"run {run_key} is still running.*actor {owner_id}"):
        clean_up_leftovers(run_key, grace_s=1.0)
    assert len(find_leftovers(run_key)) == 3 and launches.owner_of(prefix) == owner_id
    # The owner gone: ended at once, long before the agent's own orphan timeout (600 s here).
    ray.kill(owner)
    t0 = time.monotonic()
    removed = clean_up_leftovers(run_key, grace_s=60.0)
    assert time.monotonic() - t0 < 30.0
    assert sorted(x.kind for x in removed) == ["actor", "actor", "placement_group"]
    assert wait_until(lambda: find_leftovers(run_key) == [], 30), find_leftovers(run_key)
    assert launches.owner_of(prefix) is None


def test_the_launches_of_a_killed_runner_are_ended(ray_cluster):
    owner = _Owner.remote()
    owner_id = ray.get(owner.actor_id.remote())
    _launch("launches-mine", owner_id)
    other_owner = _Owner.remote()
    other = _launch("launches-other", ray.get(other_owner.actor_id.remote()))
    ray.kill(owner)
    assert launches.end_launches_of(owner_id) == 1
    assert wait_until(lambda: find_leftovers("launches-mine") == [], 30), find_leftovers("launches-mine")
    assert len(find_leftovers("launches-other")) == 3  # another runner's launch is left alone
    launches.end_launch(other)
    ray.kill(other_owner)
    assert wait_until(lambda: find_leftovers("launches-other") == [], 30)


def test_an_agent_ends_its_launch_once_its_owner_has_been_gone_for_the_orphan_timeout(ray_cluster):
    owner = _Owner.remote()
    owner_id = ray.get(owner.actor_id.remote())
    run_key = "launches-orphan"
    prefix = run_name_prefix(run_key) + "orphan:"
    launches.record(prefix, owner_id)
    node = ray.get_runtime_context().get_node_id()
    agent = NodeAgent.options(name=launches.agent_name(prefix, node, 0), namespace=NAMESPACE,
                              lifetime="detached").remote(prefix, node, owner_id, 3.0)
    slot = ray.util.placement_group([{"CPU": 0.01}], name=prefix + "0", lifetime="detached")
    ray.get([slot.ready(), agent.ping.remote()], timeout=120)
    time.sleep(4.0)  # longer than the timeout, the owner alive: nothing ends
    assert len(find_leftovers(run_key)) == 2
    ray.kill(owner)
    killed = time.monotonic()
    # The slot was never the agent's (a slot still starting when its owner died): swept too.
    assert wait_until(lambda: find_leftovers(run_key) == [], 60), find_leftovers(run_key)
    assert time.monotonic() - killed >= 2.0
