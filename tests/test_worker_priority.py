"""Training workers run at the priority the spec asks for (resources.worker_niceness), not at the
nice 15 Ray gives its worker processes (a busy rank would lose the CPU to every daemon wake-up,
and its peers with it); a warm spare a job adopts moves every thread, not only one."""

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


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root or CAP_SYS_NICE")
def test_an_adopted_spare_runs_every_thread_at_the_jobs_priority(ray_cluster, tiny_dataset, tmp_path):
    """A spare's warm-up starts torch's threads at Ray's 15; adopting a job moves all of them
    (``nice`` is the process's least favoured thread)."""
    import ray

    from raytrain_sys.control.worker import TrainWorker

    @ray.remote(num_cpus=0)
    class Owner:
        def actor_id(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    owner = Owner.remote()
    spare = TrainWorker.options(num_cpus=0).remote(None)
    try:
        idle = ray.get(spare.claim.remote(ray.get(owner.actor_id.remote())), timeout=120)["nice"]
        assert idle > 0, "an idle spare is expected at Ray's nice value"
        ray.get(spare.adopt.remote(tiny_spec(tmp_path, tiny_dataset).to_dict()), timeout=120)
        assert ray.get(spare.node_info.remote(), timeout=60)["nice"] == 0
    finally:
        ray.kill(spare)
        ray.kill(owner)


def test_niceness_out_of_range_names_the_field():
    with pytest.raises(SpecError, match="resources.worker_niceness.*-20..19"):
        from_dict({"resources": {"worker_niceness": 25}})
