"""A node's agent: the one call per node per lease that submits the node's ranks' calls itself
(``Steps.node_agents``: ``RAYTRAIN_NODE_AGENTS=on``, or ``auto`` for groups of
``policy.NODE_AGENTS_FROM`` members or more and a node's run of at least two ranks; off by
default, when the driver calls every rank).

Owns nothing of the run: it holds its ranks' actor handles (``adopt``, sent again when the
group changes) and, for its most recent leases, the references of the calls it made for them
(``refs``), which the Supervisor asks for only on the failure path.

Why: the driver's CPU per lease is about one Ray task submission per rank (about 42 us of
driver CPU, plus about 7 us per piece reference passed; docs/SCALING.md, "One call per node").
With an agent per node the driver submits one call per node (its ranks' plans as plain bytes
and ints, the node's pieces each once), and the node's ranks' calls are submitted from the
node: the driver holds no reference per rank. Rank 0's call stays the driver's own (its
reports are how the driver follows the lease), so the happy path never needs the other ranks'
references; a failed or cut lease asks the agents for them (``Steps.member_refs``) and goes on
exactly as before (``liveness.collect``, ``Steps.settle``, ``Steps.drop``).

Ordering: a rank's leases come from one caller (its agent), in the order sent, so run-ahead
still queues lease k + 1 behind lease k. The Supervisor's other calls to a rank come from the
driver; each is made at a boundary after the ranks agreed on the lease's last step (so their
calls of it have begun) or after its calls were collected, as before.

An agent runs on its ranks' node (0 CPU, pinned with ``NodeAffinitySchedulingStrategy``) and
serves at most ``RANKS_PER_AGENT`` ranks of it; the agents start once the group is placed
(``Steps.start_agents``), beside the process group's forming, and end with the step loop. An agent that dies loses the references of its
ranks' calls: those ranks count as lost (``liveness.collect`` reads the missing answer as
``OwnerDiedError`` or the agent's own death), which a node's loss means anyway.
"""

from __future__ import annotations

from collections import OrderedDict

import ray

# A node's GPUs: the agent's fan-out is one node's ranks, as on a real node (and the stand-in
# benchmark, which runs every rank on one Ray node, gets the agents a fleet of 8-GPU nodes would).
RANKS_PER_AGENT = 8
# Leases whose call references an agent keeps: the Supervisor asks only for the running lease's
# and the one sent ahead of it.
KEPT_LEASES = 8


@ray.remote(num_cpus=0)
class NodeAgent:
    def __init__(self):
        self._ranks: dict[int, object] = {}  # slot -> the rank's actor handle
        self._leases: OrderedDict[int, list] = OrderedDict()  # lease id -> its calls' references

    def adopt(self, ranks: dict[int, object]) -> None:
        """The ranks this agent serves from now on (slot -> actor handle)."""
        self._ranks = dict(ranks)

    def lease(self, lease: int, first: int, count: int, steps: bytes, entries: bytes, timeout_s: float,
              ranks: list[tuple], pieces: list) -> int:
        """Submit lease ``lease`` to each of ``ranks`` (``(slot, lo, hi, arg, which)``: its rows,
        its plan's piece -> argument map, and which of the node's ``pieces`` it is passed, in
        order: as ``data.batches.rank_plans`` makes a rank's call). Returns at once."""
        refs = [self._ranks[slot].train_steps.remote(first, (count, steps, entries, lo, hi, arg), timeout_s,
                                                     *(pieces[k] for k in which), lease=lease)
                for slot, lo, hi, arg, which in ranks]
        self._leases[lease] = refs
        while len(self._leases) > KEPT_LEASES:
            self._leases.popitem(last=False)
        return len(refs)

    def refs(self, lease: int) -> list | None:
        """The references of lease ``lease``'s calls, in the order its ``ranks`` were sent (None
        when it is no longer kept)."""
        return self._leases.get(lease)


def node_runs(members: list, per_agent: int = RANKS_PER_AGENT) -> list[tuple[tuple[str, int], list[int]]]:
    """The members' indices grouped for their agents: by node (``Worker.node_id``, first seen
    first), each node's run cut into groups of at most ``per_agent``; each group keyed by
    (node, its place among the node's groups) so that an agent serves the same node's ranks
    from lease to lease."""
    by_node: dict[str, list[int]] = {}
    for i, w in enumerate(members):
        by_node.setdefault(w.node_id, []).append(i)
    return [((node, k // per_agent), idx[k:k + per_agent])
            for node, idx in by_node.items() for k in range(0, len(idx), per_agent)]
