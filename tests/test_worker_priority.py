"""Training workers run at the priority the spec asks for, not at the nice 15 Ray gives its
worker processes (a busy rank would lose the CPU to every daemon wake-up, and its peers with it)."""

from __future__ import annotations

import os

import pytest

from raytrain_sys.errors import SpecError
from raytrain_sys.spec import from_dict
from tests.helpers import tiny_spec


def _nice_of_a_worker(spec) -> int:
    import ray

    from raytrain_sys.control.worker import TrainWorker

    actor = TrainWorker.options(num_cpus=0).remote(spec.to_dict())
    try:
        return ray.get(actor.node_info.remote(), timeout=120)["nice"]
    finally:
        ray.kill(actor)


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root or CAP_SYS_NICE")
def test_workers_run_at_normal_priority_by_default(ray_cluster, tiny_dataset, tmp_path):
    ray_nice = _nice_of_a_worker(tiny_spec(tmp_path, tiny_dataset, resources={"worker_niceness": None}))
    assert ray_nice > 0, "Ray no longer nices its workers: this setting has nothing to undo"
    assert _nice_of_a_worker(tiny_spec(tmp_path, tiny_dataset)) == 0


def test_niceness_out_of_range_names_the_field():
    with pytest.raises(SpecError, match="resources.worker_niceness.*-20..19"):
        from_dict({"resources": {"worker_niceness": 25}})
