"""The names a cluster config gives its nodes, defined once: safe nodes, readers, flavors.

Owns: the custom resource that marks a node safe for the service's control actors (and the
one decision of where those actors go, ``control_placement``), the one
that marks a CPU node for read tasks, and how a node's flavor (spot or on-demand, and which
accelerator) is written as Ray node labels. The cluster configs (``cluster_configs/``: the
KubeRay manifests and the AWS launcher configs) give nodes these names, the scheduler reads
them, and ``tests/test_cluster_configs.py`` checks that every config uses these and no other
spelling. No Ray import: the configs' tests and the pure scheduler use it too.

What Ray 2.60 offers, measured on a local cluster (``ray start --block`` nodes):

* **Custom resources** (``ray start --resources``, a KubeRay group's ``resources``, a launcher
  node type's ``resources``): a number per node; an actor asking for some is placed only on a
  node that offers it. A safe node offers ``CONTROL_RESOURCE_PER_NODE`` of ``CONTROL_RESOURCE``
  and each control actor asks ``CONTROL_ASK``: a node holds that many control actors, and no
  control actor ever lands on a node without it.
* **Node labels** (``ray start --labels k=v``, a KubeRay group's ``labels``, a launcher node
  type's ``labels``, or for the market the environment variable ``RAY_NODE_MARKET_TYPE``):
  strings an actor, task or placement-group bundle selects with ``label_selector``
  (``{"ray.io/market-type": "spot"}``; ``"in(A, B)"`` and ``"!v"`` work too). Ray sets some
  itself: ``ray.io/node-id``; ``ray.io/accelerator-type`` from the GPU it detects (``A10G``,
  ``L4``, ``H100``...; absent on CPU-only nodes); ``ray.io/node-group`` from
  ``RAY_NODE_TYPE_NAME`` (KubeRay sets it to the worker group's name); ``ray.io/market-type``
  from ``RAY_NODE_MARKET_TYPE``. A flavor is written with these keys, Ray's own, so that Ray's
  autoscaler v2 (which scales a group up for a label selector) and KubeRay's samples read the
  same labels we do.

A label is the right tool for "which kind of node" (a placement constraint, never used up); a
custom resource for "how many of these may share a node" (the control actors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

# Safe (non-preemptible) nodes: the head and the control group. Large, so that every control
# actor (the service, runners, spare runners) asks a small share: 1000 control actors a node.
CONTROL_RESOURCE = "raytrain_control"
CONTROL_RESOURCE_PER_NODE = 1000
CONTROL_ASK = 1

# CPU nodes for read tasks (``data.read_resources: {data_reader: 1}`` sends reads there). A
# reader node offers one per CPU, so reads never outnumber its cores.
READ_RESOURCE = "data_reader"

# Ray's own node labels (ray._raylet.RAY_NODE_*_KEY; see the module docstring).
MARKET_LABEL = "ray.io/market-type"
ACCELERATOR_LABEL = "ray.io/accelerator-type"
NODE_GROUP_LABEL = "ray.io/node-group"
NODE_ID_LABEL = "ray.io/node-id"  # every node has it (Ray's default label)
HEAD_RESOURCE = "node:__internal_head__"  # the resource only the head node offers
# What Ray reads to set MARKET_LABEL on a node it starts (KubeRay pods, launcher nodes).
MARKET_ENV = "RAY_NODE_MARKET_TYPE"

SPOT = "spot"
ON_DEMAND = "on-demand"
MARKETS = (SPOT, ON_DEMAND)


@dataclass(frozen=True)
class Flavor:
    """A kind of node a job's workers can run on: its market and its accelerator (``""`` for
    CPU-only). Written on nodes as Ray labels (``node_labels``) and asked for with the same
    dict as a ``label_selector`` (``selector``)."""

    market: str
    accelerator: str = ""

    def __post_init__(self):
        if self.market not in MARKETS:
            raise ValueError(f"flavor market must be one of {MARKETS}, got {self.market!r}")

    @property
    def name(self) -> str:
        """``spot-A10G``, ``on-demand-cpu``: how reports and quotas name it."""
        return f"{self.market}-{self.accelerator or 'cpu'}"

    def node_labels(self) -> dict[str, str]:
        labels = {MARKET_LABEL: self.market}
        if self.accelerator:
            labels[ACCELERATOR_LABEL] = self.accelerator
        return labels

    def selector(self) -> dict[str, str]:
        """A ``label_selector`` for nodes of this flavor. A CPU flavor does not exclude GPU
        nodes: a CPU job may borrow them, and a quota that forbids it says so itself."""
        return self.node_labels()


def flavor_of(labels: Mapping[str, str]) -> Optional[Flavor]:
    """The flavor a node's labels declare, or None when it declares no market (a node of a
    config that predates flavors, or a local test cluster)."""
    market = labels.get(MARKET_LABEL, "")
    if market not in MARKETS:
        return None
    return Flavor(market, labels.get(ACCELERATOR_LABEL, ""))


def is_safe(resources: Mapping[str, float], labels: Mapping[str, str]) -> bool:
    """A node the service may put its control actors on: it offers CONTROL_RESOURCE, and no
    label says it is spot (a config that marks a spot node safe contradicts itself)."""
    return resources.get(CONTROL_RESOURCE, 0) > 0 and labels.get(MARKET_LABEL) != SPOT


@dataclass(frozen=True)
class ControlPlacement:
    """Where the service's control actors go: ``options`` to create one with (``.options(**)``),
    how many safe nodes the cluster has, and ``where`` in words (``service status``)."""

    options: dict
    safe_nodes: int
    where: str


def control_placement(nodes: Iterable[tuple[Mapping[str, float], Mapping[str, str]]],
                      avoid: Iterable[str] = ()) -> ControlPlacement:
    """The one decision of where control actors run, from the alive nodes' (resources, labels):
    on safe nodes (``is_safe``) when the cluster has any, asking ``CONTROL_ASK`` of
    ``CONTROL_RESOURCE`` and selecting no spot node (so that a config that gives a spot node the
    resource by mistake still gets no control actor there); anywhere when it has none (a
    laptop, a test cluster, a config that predates node roles), which works as before.

    Off the head when another safe node is up: a restarted head pod (KubeRay; GCS fault
    tolerance keeps the cluster's tables, not the head's processes) takes every actor that ran
    on it, and a runner lost is a job restarted. A head that is the only safe node still takes
    them.

    ``avoid``: ids of nodes to place nothing on (a node whose runner stopped answering: lost,
    not yet declared dead by Ray, and still listed alive meanwhile, seconds)."""
    avoid = sorted(set(avoid))
    nodes = [(resources, labels) for resources, labels in nodes if labels.get(NODE_ID_LABEL) not in avoid]
    safe = [(resources, labels) for resources, labels in nodes if is_safe(resources, labels)]
    if not safe:
        where = (f"any node: none offers {CONTROL_RESOURCE} (a laptop or a test cluster; on a cluster with spot "
                 f"nodes, give the head or a control group {CONTROL_RESOURCE}, see cluster_configs/README.md)")
        return ControlPlacement({"label_selector": {NODE_ID_LABEL: _none_of(avoid)}} if avoid else {}, 0,
                                where + _avoiding(avoid))
    selector = {MARKET_LABEL: f"!{SPOT}"}
    n = len(safe)
    where = f"safe nodes only: {n} node{'' if n == 1 else 's'} offer{'s' if n == 1 else ''} {CONTROL_RESOURCE}"
    heads = [labels.get(NODE_ID_LABEL) for resources, labels in safe if resources.get(HEAD_RESOURCE)]
    off = list(avoid)
    if heads and heads[0] and n > len(heads):
        off.append(heads[0])
        where += ", off the head (a head restart would take them)"
    if off:
        selector[NODE_ID_LABEL] = _none_of(off)
    return ControlPlacement({"resources": {CONTROL_RESOURCE: CONTROL_ASK}, "label_selector": selector}, n,
                            where + _avoiding(avoid))


def _none_of(node_ids: list[str]) -> str:
    """A label selector's value that matches none of ``node_ids``."""
    return f"!{node_ids[0]}" if len(node_ids) == 1 else f"!in({', '.join(node_ids)})"


def _avoiding(node_ids: list[str]) -> str:
    return f", not on {len(node_ids)} node(s) lost a moment ago ({', '.join(i[:8] for i in node_ids)})" \
        if node_ids else ""
