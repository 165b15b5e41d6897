"""A fake autoscaling Ray cluster, for the job service's autoscaling test and benchmark.

Ray's own autoscaler (v1, or v2 with ``v2=True``) driving Ray's fake multi-node node provider:
the provider ``ray.cluster_utils.AutoscalingCluster`` configures, whose "nodes" are real raylets
started on this machine with the node type's resources and labels, and stopped when the
autoscaler terminates them. The head is private (``tests/fixtures/ray_head.start_ray_head``: its
own temp dir and ports, no auth), and stopping it kills its own processes only.

``AutoscalingCluster`` itself is not used, for two reasons found in Ray 2.60: its ``start`` and
``shutdown`` run ``ray stop --force``, which kills every Ray process of the user on the machine
(the session cluster of the tests, other engineers' clusters); and its config template,
``fake_multi_node/example.yaml``, is not in Ray's wheel, so its constructor raises (and the
``fake_multinode`` provider type, whose defaults are that file, cannot start). The provider is
named here as an external module instead, whose defaults need no file, with the keys that
template gives it.

A process has one Ray connection: a test connects to this cluster from a child process of its
own (``tests/test_service_autoscaling.py``), never from the session's pytest process.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator, Optional

from raytrain_sys.control.node_roles import CONTROL_RESOURCE
from raytrain_sys.control.node_roles import CONTROL_RESOURCE_PER_NODE as CONTROL_PER_NODE
from tests.fixtures.ray_head import RayHead, start_ray_head

PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"  # the provider's, for v2
# A head whose raylet does not register within Ray's fixed 30 s (a loaded machine: seen at a load
# average of 40 on 2 cores) is started once more; anything else fails at once.
HEAD_STARTS = 2
SLOW_START = ("timed out during startup", "Deadline Exceeded")


def cluster_config(worker_types: dict, gcs_address: str, *, idle_timeout_s: float, v2: bool,
                   head_resources: Optional[dict] = None) -> dict:
    """An autoscaling config for ``ray start --autoscaling-config``: ``worker_types`` as Ray's
    ``available_node_types`` (resources, labels, min_workers, max_workers), a head of
    ``head_resources``, nodes idle ``idle_timeout_s`` released (the config takes minutes, as a
    fraction)."""
    types = {name: {"node_config": {}, "min_workers": 0, **spec} for name, spec in worker_types.items()}
    head = dict(head_resources or {"CPU": 0, CONTROL_RESOURCE: CONTROL_PER_NODE})  # what `ray start` gives it
    types["ray.head.default"] = {"resources": head, "node_config": {}, "max_workers": 0}
    provider = {"type": "external", "module": PROVIDER, "gcs_address": gcs_address, "use_node_id_as_ip": True,
                "disable_node_updaters": True, "disable_launch_config_check": True}
    if v2:
        provider.update(launch_multiple=True, head_node_id=FAKE_HEAD_NODE_ID)
    return {"cluster_name": "raytrain-sys-fake", "max_workers": sum(t.get("max_workers", 0) for t in types.values()),
            "provider": provider, "available_node_types": types, "head_node_type": "ray.head.default",
            "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60.0, "docker": {},
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": []}


@contextlib.contextmanager
def autoscaling_cluster(worker_types: dict, *, idle_timeout_s: float = 6.0, v2: bool = False,
                        head_cpus: int = 0, ready_timeout_s: float = 120.0) -> Iterator[RayHead]:
    """Start the fake autoscaling cluster (see the module docstring) and yield its head, the
    safe node (``raytrain_control``); every process of it is ended on exit. The autoscaler looks
    every second (``AUTOSCALER_UPDATE_INTERVAL_S``)."""
    import ray._private.services

    node_ip = ray._private.services.get_node_ip_address()
    env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    if v2:
        env.update(RAY_enable_autoscaler_v2="1", RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID,
                   RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID)

    def autoscaling_args(gcs_address: str, temp_dir: str) -> list[str]:
        port = gcs_address.rsplit(":", 1)[1]
        config = cluster_config(worker_types, f"{node_ip}:{port}", idle_timeout_s=idle_timeout_s, v2=v2)
        path = os.path.join(temp_dir, "autoscaling.json")
        with open(path, "w") as f:
            json.dump(config, f)
        # The head is the safe node (as the KubeRay and AWS configs make it): the service's actors
        # run there, never on a node the autoscaler adds (they would keep it from going idle).
        return [f"--autoscaling-config={path}", f"--resources={json.dumps({CONTROL_RESOURCE: CONTROL_PER_NODE})}"]

    for attempt in range(HEAD_STARTS):
        stack = contextlib.ExitStack()
        try:
            head = stack.enter_context(start_ray_head(auth="disabled", num_cpus=head_cpus,
                                                      ready_timeout_s=ready_timeout_s, extra_env=env,
                                                      extra_args=autoscaling_args))
        except RuntimeError as exc:  # its processes are ended already (start_ray_head's own clean-up)
            if attempt + 1 == HEAD_STARTS or not any(m in str(exc) for m in SLOW_START):
                raise
            continue
        with stack:
            yield head
        return
