"""service/capacity.py: what each flavor has up, from the nodes' labels, and the ceiling the
scheduler admits against with autoscaling (pure: nodes as (resources, labels))."""

from __future__ import annotations

import pytest

from raytrain_sys.service.capacity import GB, flavor_states
from raytrain_sys.service.flavors import ResourceFlavor

SPOT = ResourceFlavor("spot-cpu", "spot", resources=("cpu",), max_cpu=32.0)
A10G = ResourceFlavor("spot-a10g", "spot", "A10G", resources=("gpu",), max_gpu=8.0)
ON_DEMAND = ResourceFlavor("on-demand-cpu", "on-demand", resources=("cpu",))
NODES = [({"CPU": 4, "memory": 8 * GB}, {"ray.io/market-type": "spot"}),
         ({"CPU": 8, "GPU": 1, "memory": 32 * GB}, {"ray.io/market-type": "spot", "ray.io/accelerator-type": "A10G"}),
         ({"CPU": 4, "GPU": 1}, {"ray.io/market-type": "spot", "ray.io/accelerator-type": "H100"}),
         ({"CPU": 2, "raytrain_control": 1000}, {}),
         ({"CPU": 4}, {"ray.io/market-type": "on-demand"})]


@pytest.mark.parametrize("autoscaling, flavor, up, ceiling", [
    (False, "spot-cpu", {"cpu": 4, "gpu": 0, "memory_gb": 8}, {"cpu": 4, "gpu": 0, "memory_gb": 8}),
    (False, "spot-a10g", {"cpu": 8, "gpu": 1, "memory_gb": 32}, {"cpu": 8, "gpu": 1, "memory_gb": 32}),
    (True, "spot-cpu", {"cpu": 4, "gpu": 0, "memory_gb": 8}, {"cpu": 32, "gpu": 0, "memory_gb": 8}),
    (True, "spot-a10g", {"cpu": 8, "gpu": 1, "memory_gb": 32}, {"cpu": 8, "gpu": 8, "memory_gb": 32}),
    (True, "on-demand-cpu", {"cpu": 4, "gpu": 0, "memory_gb": 0}, {"cpu": 4, "gpu": 0, "memory_gb": 0}),
], ids=["a flavor's nodes by their market label", "a GPU flavor's nodes by market and accelerator",
        "autoscaling: the flavor's max_cpu is its ceiling", "autoscaling: max_gpu, the other resources as up",
        "autoscaling without a configured ceiling: what is up"])
def test_each_flavor_counts_the_nodes_labelled_with_it(autoscaling, flavor, up, ceiling):
    states = {s.name: s for s in flavor_states([SPOT, A10G, ON_DEMAND], NODES, cluster_workers=0,
                                               autoscaling=autoscaling)}
    assert states[flavor].capacity(present=True) == pytest.approx(up)
    assert states[flavor].capacity() == pytest.approx(ceiling)


def test_no_table_is_the_implicit_flavor_of_worker_slots():
    [state] = flavor_states([], NODES, cluster_workers=6)
    assert state.flavor.is_implicit and state.capacity() == state.capacity(present=True) == {"workers": 6.0}
    [state] = flavor_states([], NODES, cluster_workers=6, autoscaling=True, max_cluster_workers=20)
    assert (state.capacity(), state.capacity(present=True)) == ({"workers": 20.0}, {"workers": 6.0})
    [state] = flavor_states([], NODES, cluster_workers=6, autoscaling=True, max_cluster_workers=2)
    assert state.capacity() == {"workers": 6.0}  # a ceiling below what is up is what is up
