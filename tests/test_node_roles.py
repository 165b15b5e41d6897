"""node_roles: the names cluster configs give nodes, and how a flavor is read back from labels."""

from __future__ import annotations

import pytest

from raytrain_sys.control import node_roles as roles


@pytest.mark.parametrize("labels, flavor", [
    ({"ray.io/market-type": "spot", "ray.io/accelerator-type": "A10G"}, roles.Flavor("spot", "A10G")),
    ({"ray.io/market-type": "on-demand"}, roles.Flavor("on-demand")),
    ({"ray.io/accelerator-type": "A10G"}, None),
    ({"ray.io/market-type": "preemptible"}, None),
    ({}, None),
], ids=["a spot GPU node", "an on-demand CPU node", "no market: no flavor",
        "an unknown market is not guessed", "a local test node"])
def test_flavor_of(labels, flavor):
    assert roles.flavor_of(labels) == flavor


def test_a_flavor_is_written_and_selected_with_rays_labels():
    f = roles.Flavor(roles.SPOT, "A10G")
    assert f.name == "spot-A10G" and roles.Flavor(roles.ON_DEMAND).name == "on-demand-cpu"
    assert f.node_labels() == f.selector() == {"ray.io/market-type": "spot",
                                               "ray.io/accelerator-type": "A10G"}
    assert roles.flavor_of(f.node_labels()) == f
    with pytest.raises(ValueError, match="market must be one of"):
        roles.Flavor("Spot")


@pytest.mark.parametrize("resources, labels, safe", [
    ({"raytrain_control": 1000}, {"ray.io/market-type": "on-demand"}, True),
    ({"raytrain_control": 1000}, {}, True),
    ({"raytrain_control": 1000}, {"ray.io/market-type": "spot"}, False),
    ({"CPU": 8}, {"ray.io/market-type": "on-demand"}, False),
], ids=["an on-demand node offering the control resource",
        "a node offering it with no market label (a local cluster's head)",
        "a spot node is never safe, whatever it offers",
        "an on-demand node without the resource is not for control actors"])
def test_is_safe(resources, labels, safe):
    assert roles.is_safe(resources, labels) is safe
