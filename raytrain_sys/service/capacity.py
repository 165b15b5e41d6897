"""What the cluster can give each flavor: what is up now and, with autoscaling, the ceiling.

Owns: the capacity the scheduler admits against, per flavor (``flavor_states``), from the alive
nodes' resources and labels (``control/node_roles.flavor_of``: Ray's ``ray.io/market-type`` and
``ray.io/accelerator-type``). A node counts for the table's flavor of its market and accelerator;
a node of no flavor (no market label: the head of a config that predates flavors, a laptop)
counts for none. With no table, the service has one implicit flavor of worker slots: what is up
is the caller's count (``cluster_workers``).

With autoscaling on, the scheduler admits against the **ceiling**, what the worker groups can
reach, so that a job beyond what is up is accepted and its nodes are asked for
(``service/autoscale.py``): a flavor's ``max_cpu``/``max_gpu``/``max_memory_gb`` (the flavor
table: a service option, since Ray's cluster config names no labels for its node groups), and
for the implicit flavor ``max_cluster_workers`` or, when not given, what Ray's cluster config
says its node groups reach (``autoscaler_max_resources``). A ceiling below what is up is what is
up. Without autoscaling the ceiling is what is up, as before.

Pure but for ``autoscaler_max_resources`` (one read of Ray's GCS, private: named in
docs/SERVICE.md): the nodes come in as (resources, labels) pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Optional

from raytrain_sys.control import GB  # Ray counts memory in bytes, flavors in GB
from raytrain_sys.control.node_roles import flavor_of
from raytrain_sys.service.flavors import FlavorState, ResourceFlavor

RAY_RESOURCES = {"cpu": "CPU", "gpu": "GPU", "memory_gb": "memory"}


def present_by_flavor(table: Sequence[ResourceFlavor],
                      nodes: Iterable[tuple[Mapping[str, float], Mapping[str, str]]]) -> dict[str, dict[str, float]]:
    """Each flavor's CPUs, GPUs and GB of memory on the alive ``nodes`` labelled with it."""
    kinds = {(f.market, f.accelerator): f.name for f in table}
    present = {f.name: {"cpu": 0.0, "gpu": 0.0, "memory_gb": 0.0} for f in table}
    for resources, labels in nodes:
        flavor = flavor_of(labels)
        name = kinds.get((flavor.market, flavor.accelerator)) if flavor is not None else None
        if name is None:
            continue
        for resource, ray_name in RAY_RESOURCES.items():
            amount = float(resources.get(ray_name, 0.0))
            present[name][resource] += amount / GB if resource == "memory_gb" else amount
    return present


def flavor_states(table: Sequence[ResourceFlavor], nodes: Iterable[tuple[Mapping[str, float], Mapping[str, str]]],
                  *, cluster_workers: int, autoscaling: bool = False,
                  max_cluster_workers: Optional[int] = None) -> tuple[FlavorState, ...]:
    """The scheduler's capacity: the table's flavors with what is up and the ceiling (see the
    module docstring), or the implicit flavor of ``cluster_workers`` slots (ceiling
    ``max_cluster_workers`` when autoscaling)."""
    if not table:
        ceiling = cluster_workers
        if autoscaling and max_cluster_workers is not None:
            ceiling = max(cluster_workers, max_cluster_workers)
        return (FlavorState(ResourceFlavor.implicit(), {"workers": float(ceiling)},
                            {"workers": float(cluster_workers)}),)
    present = present_by_flavor(table, nodes)
    states = []
    for f in table:
        up = present[f.name]
        ceiling = dict(up)
        if autoscaling:
            for resource, most in f.ceiling().items():
                ceiling[resource] = max(up[resource], most)
        states.append(FlavorState(f, ceiling, up))
    return tuple(states)


def ceilings(states: Sequence[FlavorState]) -> dict[str, dict[str, float]]:
    """Each flavor's ceiling per resource (the submit check's capacity)."""
    return {s.name: s.capacity() for s in states}


def autoscaler_max_resources() -> Optional[dict[str, float]]:
    """What Ray's cluster config says its node groups can reach, per Ray resource (``CPU``,
    ``GPU``...), or None when the cluster has no autoscaler config in its GCS (a fixed cluster,
    a local one) or Ray does not answer. ``ray._private.state``: private, as Ray Data reads it."""
    try:
        from ray._private.state import state

        found = state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001: no config, an older or newer Ray: the service option decides
        return None
    return dict(found) if found else None


__all__ = ["present_by_flavor", "flavor_states", "ceilings", "autoscaler_max_resources"]
