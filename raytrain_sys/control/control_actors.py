"""Where the service's control actors run: on the cluster's safe nodes when it has any.

Owns: reading the alive nodes for ``node_roles.control_placement`` (the decision itself, pure)
and handing its actor options to whoever creates a control actor: the service actor
(``service.start_service``), the jobs' runners and the spare runners (``service/runner.py``),
the warm spares' pool (``spares.start_pool``); a later kind of control actor (a sweep's runner)
calls ``control_options`` too. A control actor is one whose loss on a spot reclaim would stop
what it manages (a job's run, the queue): it asks the safe nodes' resource, so it never lands on
a node the cloud can take back. Training workers and read tasks are not control actors: they
run where their job's flavor puts them, and a reclaim costs a shrink at a step boundary.

Decided at each creation, from the nodes alive then: a control group that joins later is used
by the next runner, and a cluster with no safe node (a laptop, the test cluster) places them
anywhere, as before, and says so (``placement().where``, in ``service status``).
"""

from __future__ import annotations

from typing import Iterable

import ray

from raytrain_sys.control.node_roles import ControlPlacement, control_placement


def placement(avoid: Iterable[str] = ()) -> ControlPlacement:
    """The decision for the cluster as it is now (``node_roles.control_placement``); ``avoid``:
    node ids to place nothing on."""
    nodes = [(n.get("Resources") or {}, n.get("Labels") or {}) for n in ray.nodes() if n.get("Alive")]
    return control_placement(nodes, avoid)


def control_options(avoid: Iterable[str] = ()) -> dict:
    """Options for ``.options(**)`` of a control actor: the safe nodes' resource when the
    cluster has safe nodes, else none (a fresh dict each call: a caller may add to it); never on
    a node of ``avoid`` (ids: nodes lost a moment ago that Ray has not yet declared dead)."""
    options = placement(avoid).options
    return {key: dict(value) for key, value in options.items()}
