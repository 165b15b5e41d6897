"""Node agents (``control/node_agent``, ``Steps.node_agents``): one call per node per lease,
submitted to the node's ranks from the node. What a user would notice: nothing but the driver's
CPU (benchmarks/control_plane.py); the run is the same, bit for bit."""

from __future__ import annotations

import pytest

from raytrain_sys.control.node_agent import agent_with_room
from raytrain_sys.control.supervisor import run_job
from raytrain_sys.control.supervisor.steps import Steps
from tests.ft_common import agents_up, run_with_events
from tests.helpers import assert_params_equal, final_params, read_summary, tiny_spec


@pytest.mark.parametrize("held,node,per_agent,expected", [
    ({}, "a", 8, None),
    ({("a", 0): 3}, "a", 8, ("a", 0)),
    ({("a", 0): 8}, "a", 8, None),
    ({("a", 0): 2, ("a", 1): 1}, "a", 2, ("a", 1)),
    ({("a", 1): 0, ("a", 2): 0}, "a", 8, ("a", 1)),
    ({("b", 0): 0}, "a", 8, None),
], ids=["a node with no agent yet: a new one is started",
        "a node's agent with room takes the rank",
        "a node whose agent holds a node's worth of ranks: a new one is started",
        "the first agent of the node with room, not the first agent",
        "of several agents with room, the lowest index",
        "another node's agent never takes the rank"])
def test_agent_with_room(held, node, per_agent, expected):
    assert agent_with_room(held, node, per_agent) == expected


@pytest.mark.slow  # two runs of 20 steps, 30-60 s on the shared machine
def test_a_run_through_node_agents_is_the_same_run(ray_cluster, tiny_dataset, tmp_path, monkeypatch):
    """Leases of 4 sent through node agents, cut at the checkpoint and sent ahead, give bitwise
    the run of the driver's own calls; the same when the leases change path mid-run, under
    run-ahead (the driver's calls until the agents are up, then theirs)."""
    train = {"max_steps": 20, "log_every_steps": 5, "steps_per_call": 4}
    spec = dict(train=train, checkpoint={"every_steps": 10}, resources={"num_workers": 3})
    monkeypatch.setattr(Steps, "node_agents", "off")
    direct = run_job(tiny_spec(tmp_path / "direct", tiny_dataset, **spec))
    assert read_summary(direct.run_dir)["agent_calls"] == 0
    monkeypatch.setattr(Steps, "node_agents", "on")
    # Once the first lease committed, the agents are up: the leases after the one sent ahead of it
    # (the driver's own calls) go through them, each rank's first one waiting for the driver's.
    agents, _, _ = run_with_events(tiny_spec(tmp_path / "agents", tiny_dataset, **spec), {1: agents_up})
    assert read_summary(agents.run_dir)["agent_calls"] >= 3, "the leases did not go through the node agents"
    assert agents.losses == direct.losses and len(agents.losses) == 20
    assert read_summary(agents.run_dir)["leases"] == read_summary(direct.run_dir)["leases"]
    assert_params_equal(final_params(direct.newest_checkpoint), final_params(agents.newest_checkpoint))
