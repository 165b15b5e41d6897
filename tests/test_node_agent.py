"""Node agents (``control/node_agent``, ``Steps.node_agents``): one call per node per lease,
submitted to the node's ranks from the node. What a user would notice: nothing but the driver's
CPU (benchmarks/control_plane.py); the run is the same, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from raytrain_sys.control.node_agent import node_runs
from raytrain_sys.control.supervisor import run_job
from raytrain_sys.control.supervisor.steps import Steps
from tests.helpers import assert_params_equal, final_params, read_summary, tiny_spec


@dataclass
class _Member:
    node_id: str


@pytest.mark.parametrize("nodes,per_agent,expected", [
    ("aaa", 8, [(("a", 0), [0, 1, 2])]),
    ("aabba", 8, [(("a", 0), [0, 1, 4]), (("b", 0), [2, 3])]),
    ("aaaaa", 2, [(("a", 0), [0, 1]), (("a", 1), [2, 3]), (("a", 2), [4])]),
    ("", 8, []),
], ids=["one node's ranks: one agent",
        "ranks of a node that are not consecutive still share its agent, nodes in the order first seen",
        "a node with more ranks than an agent serves: runs of at most per_agent, keyed by their place",
        "no members: no agent"])
def test_node_runs(nodes, per_agent, expected):
    assert node_runs([_Member(n) for n in nodes], per_agent) == expected


@pytest.mark.slow  # two runs of 20 steps, 30-60 s on the shared machine
def test_a_run_through_node_agents_is_the_same_run(ray_cluster, tiny_dataset, tmp_path, monkeypatch):
    """Leases of 4 sent through node agents, cut at the checkpoint and sent ahead, give bitwise
    the run of the driver's own calls."""
    train = {"max_steps": 20, "log_every_steps": 5, "steps_per_call": 4}
    spec = dict(train=train, checkpoint={"every_steps": 10}, resources={"num_workers": 3})
    started: list[tuple] = []  # the agents each run started (Steps._agent, called through)
    agent = Steps._agent

    def counted(self, key, ranks):
        if key not in self._agents:
            started.append(key)
        return agent(self, key, ranks)

    monkeypatch.setattr(Steps, "_agent", counted)
    monkeypatch.setattr(Steps, "node_agents", "off")
    direct = run_job(tiny_spec(tmp_path / "direct", tiny_dataset, **spec))
    assert started == []
    monkeypatch.setattr(Steps, "node_agents", "on")
    agents = run_job(tiny_spec(tmp_path / "agents", tiny_dataset, **spec))
    assert len(started) >= 1, "no lease went through a node agent"
    assert agents.losses == direct.losses and len(agents.losses) == 20
    assert read_summary(agents.run_dir)["leases"] == read_summary(direct.run_dir)["leases"]
    assert_params_equal(final_params(direct.newest_checkpoint), final_params(agents.newest_checkpoint))
