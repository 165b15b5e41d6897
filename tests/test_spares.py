"""Warm spares (raytrain_sys.control.spares) on the session cluster (four 1-CPU worker nodes).

What a user would notice: a job whose first gang is made of warm spares trains exactly as one
whose workers started fresh (same final parameters); a spare never outlives the job that took it
(its owner killed, its process ends); spares a job gives back at its end serve the next job, which
trains exactly as on fresh workers; a pool that restarts keeps its idle spares instead of
starting more; GPU slots never take spares, and a driver takes them only from a pool its own Ray
job started (``rts.connect(spec, warm_workers_per_node=1)``), which ends with that driver.

Every test here starts the pool it needs.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
import ray

from raytrain_sys.control.spares import (
    NAMESPACE,
    SPARE_PREFIX,
    SpareSource,
    end_spares_of,
    find_pool,
    start_pool,
    stop_pool,
    takes_spares,
)
from raytrain_sys.control.supervisor import Supervisor, run_job
from raytrain_sys.spec import from_dict
from tests.ft_common import ft_spec, wait_until
from tests.helpers import assert_params_equal, final_params

STEPS = 6


@ray.remote(num_cpus=0)
class Owner:
    """Stands where a job's runner stands: an actor that runs a Supervisor with spares."""

    def ping(self) -> int:
        return os.getpid()

    def run(self, spec_dict: dict) -> tuple[str, str]:
        sup = Supervisor(from_dict(spec_dict), spares=SpareSource.here())
        result = sup.run()
        return result.newest_checkpoint, sup.summary.transitions[0]["reason"]

    def claim(self, node_ids: list[str]) -> list[int]:
        """Take spares without a job: the pids of those taken."""
        self.taken = SpareSource.here().take(node_ids)
        return [ray.get(s.node_info.remote())["pid"] for s in self.taken if s is not None]

    def claim_new(self, node_id: str) -> int:
        """A spare started for this actor (a slot where the pool had none): its pid."""
        self.made = SpareSource.here().new_claimed(node_id)
        return ray.get(self.made.node_info.remote())["pid"]

    def actor_id(self) -> str:
        return ray.get_runtime_context().get_actor_id()


@pytest.fixture
def pool(ray_cluster):
    handle = start_pool(1)
    assert ray.get(handle.wait_full.remote(120.0)), ray.get(handle.status.remote())
    yield handle
    stop_pool()


def spare_pids() -> set[int]:
    """The pids of the pool's spares, idle or working (one that ends between the listing and its
    answer is not counted: the tests wait for spares to end)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith(SPARE_PREFIX)]
    pids = set()
    for name in names:
        try:
            pids.add(ray.get(ray.get_actor(name, namespace=NAMESPACE).node_info.remote(), timeout=30)["pid"])
        except (ValueError, ray.exceptions.RayActorError):  # ended meanwhile
            continue
    return pids


def worker_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]


@pytest.mark.parametrize("gpus, owner, pool_job, my_job, takes", [
    (0.0, "actor", "01000000", "02000000", True),
    (1.0, "actor", "01000000", "01000000", False),
    (0.0, "driver", "01000000", "01000000", True),
    (0.0, "driver", "01000000", "02000000", False),
    (0.0, "driver", "", "01000000", False),
    (1.0, "driver", "01000000", "01000000", False),
], ids=[
    "a job's runner takes any pool's spares",
    "a GPU slot never takes one: Ray binds a GPU to a process when it is created",
    "a driver takes the spares of a pool its own job started",
    "a driver never takes another job's spares: they may not import its code",
    "a driver whose pool's job is unknown takes none",
    "a driver's GPU slot takes none either",
])
def test_who_takes_spares(gpus, owner, pool_job, my_job, takes):
    assert takes_spares(gpus, owner, pool_job, my_job) is takes


def test_a_gang_of_spares_trains_like_fresh_workers(pool, ray_cluster, tiny_dataset, tmp_path):
    spec = ft_spec(tmp_path / "spares", tiny_dataset, STEPS, checkpoint={"every_steps": 0})
    owner = Owner.remote()
    newest, placed = ray.get(owner.run.remote(spec.to_dict()))
    assert placed == "2 workers placed (2 warm spares)"
    status = ray.get(pool.status.remote())
    assert status["taken"] == 2 and status["missed"] == 0, status
    # Fresh workers: the same parameters, bit for bit.
    reference = run_job(ft_spec(tmp_path / "fresh", tiny_dataset, STEPS, checkpoint={"every_steps": 0}), spares=None)
    assert_params_equal(final_params(newest), final_params(reference.newest_checkpoint))
    # The pool makes up for what was taken.
    assert ray.get(pool.wait_full.remote(120.0)), ray.get(pool.status.remote())
    ray.kill(owner)


def test_spares_given_back_serve_the_next_job_like_fresh_workers(ray_cluster, tiny_dataset, tmp_path):
    # No replacement is started while the test runs: what the first job gives back fills the nodes.
    pool = start_pool(1, refill_delay_s=600.0)
    try:
        assert ray.get(pool.wait_full.remote(120.0)), ray.get(pool.status.remote())
        before = spare_pids()
        first = Owner.remote()
        # Another job first: its own seed and learning rate, sharded (its own process groups and DTensors).
        other = ft_spec(tmp_path / "first", tiny_dataset, STEPS, checkpoint={"every_steps": 0},
                        train={"seed": 7}, optim={"lr": 0.05}, parallel={"strategy": "fsdp"})
        ray.get(first.run.remote(other.to_dict()))
        assert wait_until(lambda: ray.get(pool.status.remote())["recycled"] == 2, 60), ray.get(pool.status.remote())
        ray.kill(first)  # the job's runner ends: the spares it gave back are no longer its
        time.sleep(2.5)  # an owner watch still running would have ended its process by now (it polls every 1 s)
        assert spare_pids() == before, "the first job's spares were not given back, or something new started"
        second = Owner.remote()
        spec = ft_spec(tmp_path / "second", tiny_dataset, STEPS, checkpoint={"every_steps": 0})
        newest, placed = ray.get(second.run.remote(spec.to_dict()))
        assert placed == "2 workers placed (2 warm spares)"
        assert spare_pids() == before
        reference = run_job(ft_spec(tmp_path / "fresh", tiny_dataset, STEPS, checkpoint={"every_steps": 0}),
                            spares=None)
        assert_params_equal(final_params(newest), final_params(reference.newest_checkpoint))
        assert wait_until(lambda: ray.get(pool.status.remote())["recycled"] == 4, 60), ray.get(pool.status.remote())
        ray.kill(second)
    finally:
        stop_pool()


def test_spares_given_back_beyond_the_pools_count_are_kept_only_as_asked(ray_cluster, tiny_dataset, tmp_path):
    # The service asks the pool to keep given-back spares beyond its per-node count while a
    # sweep's trials are to start (keep_extra): here none per node, one beyond.
    pool = start_pool(1, refill_delay_s=600.0)
    try:
        assert ray.get(pool.wait_full.remote(120.0)), ray.get(pool.status.remote())
        owner = Owner.remote()
        job = owner.run.remote(ft_spec(tmp_path / "job", tiny_dataset, 150, checkpoint={"every_steps": 0}).to_dict())
        assert wait_until(lambda: ray.get(pool.status.remote())["taken"] == 2, 60)
        ray.get(pool.set_per_node.remote(0))  # the two idle spares left are ended at the next refill
        assert wait_until(lambda: not ray.get(pool.status.remote())["idle"], 30), ray.get(pool.status.remote())
        ray.get(pool.set_keep_extra.remote(1))
        result = ray.get(job)
        assert wait_until(lambda: ray.get(pool.status.remote())["ended_after_use"] == 1, 60), \
            json.dumps({"pool": ray.get(pool.status.remote()), "job": result}, default=str)
        status = ray.get(pool.status.remote())
        assert status["recycled"] == 1 and sum(status["idle"].values()) == 1, status
        ray.get(pool.set_keep_extra.remote(0))  # no more trials to start: the one kept goes
        assert wait_until(lambda: not ray.get(pool.status.remote())["idle"], 30), ray.get(pool.status.remote())
        ray.kill(owner)
    finally:
        stop_pool()


def test_a_claimed_spare_ends_with_its_owner(pool, ray_cluster):
    owner = Owner.remote()
    pids = ray.get(owner.claim.remote(worker_nodes()[:2]))
    assert len(pids) == 2
    assert all(psutil.pid_exists(p) for p in pids)
    ray.kill(owner)
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 20), \
        f"spares {pids} outlived the actor that claimed them"


def test_the_spares_of_a_killed_owner_are_ended_at_once_taken_or_started_for_it(pool, ray_cluster):
    """What the service does when it finds a job's runner dead (``end_spares_of``): every spare
    the runner claimed ends now, the one taken from the pool and the one started for a slot where
    the pool had none, not each when it notices its owner is gone."""
    owner = Owner.remote()
    node = worker_nodes()[0]
    pids = ray.get(owner.claim.remote([node])) + [ray.get(owner.claim_new.remote(node))]
    owner_id = ray.get(owner.actor_id.remote())
    ray.kill(owner)
    assert end_spares_of(owner_id) == 2
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 20), pids


def test_a_restarted_pool_keeps_its_idle_spares(pool, ray_cluster):
    before = ray.get(pool.status.remote())
    ray.kill(pool)  # the pool's process dies; its spares are detached and stay
    assert wait_until(lambda: find_pool() is None, 20)
    again = start_pool(1)
    status = ray.get(again.status.remote())
    assert status["idle"] == before["idle"] and status["started"] == 0, (before, status)
    assert ray.get(again.wait_full.remote(5.0))
    time.sleep(1.5)  # a refill pass: still nothing started
    assert ray.get(again.status.remote())["started"] == 0


def _placed(result) -> str:
    import json

    with open(result.summary_path) as f:
        return json.load(f)["transitions"][0]["reason"]


def test_a_drivers_runs_take_the_spares_of_its_own_pool_and_give_them_back(ray_cluster, tiny_dataset, tmp_path):
    """A notebook after ``rts.connect(spec, warm_workers_per_node=1)``: its runs start on the pool's
    warm processes, the next run on the same ones, and each trains exactly as on fresh workers."""
    from raytrain_sys.control.worker_group import connect_ray

    spec = ft_spec(tmp_path / "first", tiny_dataset, STEPS, checkpoint={"every_steps": 0})
    assert connect_ray(spec, warm_workers_per_node=1) is False  # the session's cluster, already connected
    pool = find_pool()
    try:
        assert ray.get(pool.wait_full.remote(120.0)), ray.get(pool.status.remote())
        before = spare_pids()
        first = run_job(spec)
        assert _placed(first) == "2 workers placed (2 warm spares)"
        assert wait_until(lambda: ray.get(pool.status.remote())["recycled"] == 2, 60), ray.get(pool.status.remote())
        second = run_job(ft_spec(tmp_path / "second", tiny_dataset, STEPS, checkpoint={"every_steps": 0}))
        assert _placed(second) == "2 workers placed (2 warm spares)"
        assert spare_pids() == before, "the runs' workers were not the pool's warm processes"
        fresh = run_job(ft_spec(tmp_path / "fresh", tiny_dataset, STEPS, checkpoint={"every_steps": 0}), spares=None)
        assert _placed(fresh) == "2 workers placed"
        for run in (first, second):
            assert_params_equal(final_params(run.newest_checkpoint), final_params(fresh.newest_checkpoint))
    finally:
        stop_pool()


DRIVER = """
import sys, time
import ray
from raytrain_sys.control.spares import SpareSource, start_pool
ray.init(address=sys.argv[1], log_to_driver=False)
pool = start_pool(1, home=sys.argv[2] == "home")
assert ray.get(pool.wait_full.remote(120.0))
source = SpareSource.here()
taken = source.take([sys.argv[3]])
print("TAKEN", ray.get(taken[0].node_info.remote())["pid"], flush=True)
time.sleep(600)
"""


def test_a_drivers_pool_and_its_spares_end_with_the_driver(ray_cluster, tmp_path):
    """A driver's pool is detached, as the service's is (a pool's restart keeps its spares), so
    nothing in Ray ends it with the notebook that started it: it watches that driver's Ray job,
    and its spares, idle or claimed, end once the job is dead. Another driver's run (this one)
    does not take that pool's spares."""
    import signal
    import subprocess
    import sys

    node = worker_nodes()[0]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, ray_cluster, "home", node], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("TAKEN"), line
        claimed = int(line.split()[1])
        assert wait_until(lambda: find_pool() is not None, 30)
        assert SpareSource.here() is None, "a driver took the spares of another driver's pool"
        pids = spare_pids() | {claimed}
        assert len(pids) >= 4 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: find_pool() is None, 30), "the pool outlived the driver that started it"
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30), \
        f"spares {[p for p in pids if psutil.pid_exists(p)]} outlived the driver whose pool made them"


def test_a_take_whose_caller_gave_up_ends_what_it_claimed(pool, ray_cluster):
    """A gang start waits CLAIM_TIMEOUT_S for the pool's take, then starts fresh workers (a claim
    of a spare on a node that vanished holds a take that long). What the take claimed is then
    ended, whether the caller's word comes after the take returned or before: no one adopts
    those spares, and a driver's claim would keep them for as long as the driver lives."""
    nodes = worker_nodes()[:2]
    owner = "job:" + ray.get_runtime_context().get_job_id()
    before = spare_pids()
    late = ray.get(pool.take.remote(nodes[:1], owner, "late"))
    assert late[0] is not None
    assert ray.get(pool.forget_take.remote("late")) == 1
    assert ray.get(pool.forget_take.remote("early")) == 0  # the word before the take
    assert ray.get(pool.take.remote(nodes[1:], owner, "early")) == [None]
    assert wait_until(lambda: len(before - spare_pids()) == 2, 20), (before, spare_pids())


def test_a_run_whose_pool_died_ends_its_spares_rather_than_hand_them_to_no_one(pool, ray_cluster, tiny_dataset,
                                                                              tmp_path):
    """The pool runs anywhere on a cluster with no safe node, and dies with its node: a run that
    gives its spares back then finds no one to take them, and ends them (claimed by a driver's
    job, they would live as long as the driver)."""
    from tests.ft_common import run_with_events

    pids = []

    def kill_pool(sup):
        pids.extend(w.info["pid"] for w in sup.group.workers)
        ray.kill(pool)

    spec = ft_spec(tmp_path / "run", tiny_dataset, STEPS, checkpoint={"every_steps": 0})
    result, sup, _ = run_with_events(spec, {3: kill_pool})
    assert result.status == "finished" and sup.group.spares_used == 2
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 20), \
        f"the run's spares {pids} outlived it, handed back to a pool that was gone"
