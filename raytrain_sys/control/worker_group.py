"""The worker group: Ray actors, one per slot, each in a one-bundle placement group.

It owns actors and their placement groups; it does not decide membership or commit steps (the
Supervisor does). The first gang is all or nothing: every slot's placement group must be ready
within the start timeout, or all are removed and the start fails with a clear error.
Afterwards a slot can be added (a replacement or a newcomer, prepared in the background while
the others train) or removed (dead, hung, or on a draining node) one at a time, which is why
each worker has its own one-bundle placement group rather than a share of one gang-wide group.
``shutdown`` leaves no actor and no placement group behind, whatever happened.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_sys.control.worker import TrainWorker
from raytrain_sys.errors import ClusterCapacityError
from raytrain_sys.spec import JobSpec

log = logging.getLogger(__name__)


def connect_ray(spec: JobSpec) -> bool:
    """Connect to the cluster the spec or environment names, or start a local one.

    Returns True when this call started a local cluster (the caller then owns its shutdown).
    """
    if ray.is_initialized():
        return False
    address = spec.resources.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        # No runtime_env here: under `ray job submit` it would replace the job's own (its
        # working_dir); workers set their thread count themselves.
        ray.init(address=address, log_to_driver=True)
        return False
    num_cpus = spec.resources.local_num_cpus or os.cpu_count() or 1
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(spec.resources.cpus_per_worker)))}}
    # address="local" never attaches to some other cluster that happens to run on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             runtime_env=runtime_env, log_to_driver=True)
    return True


@dataclass
class Worker:
    """One slot: its actor, its placement group and where it runs."""

    slot: int  # stable id for logs and tests; never reused within a run
    actor: Any
    pg: Any
    info: dict = field(default_factory=dict)  # ip, node_id, pid once started
    ready_ref: Any = None  # node_info() call that completes when the actor is up

    @property
    def node_id(self) -> str:
        return self.info.get("node_id", "")


class WorkerGroup:
    def __init__(self, spec: JobSpec, local_cluster: bool):
        self.spec = spec
        self.local_cluster = local_cluster
        self.workers: list[Worker] = []  # members of the current process group, rank order
        self.pending: list[Worker] = []  # requested, not yet members
        self.generation = 0
        self._slots = itertools.count()

    # ------------------------------------------------------------------ resources
    def _bundle(self) -> dict[str, float]:
        r = self.spec.resources
        bundle = {"CPU": r.cpus_per_worker}
        if r.gpus_per_worker:
            bundle["GPU"] = r.gpus_per_worker
        return bundle

    def _check_capacity(self, num_workers: int) -> None:
        """Fail at once when no amount of waiting helps: a cluster we started cannot grow."""
        if not self.local_cluster:
            return
        total = ray.cluster_resources()
        for res, per_worker in self._bundle().items():
            need, have = per_worker * num_workers, total.get(res, 0.0)
            if need > have:
                raise ClusterCapacityError(
                    f"the local Ray cluster has {have:g} {res} in total but the group needs {need:g} "
                    f"(resources.num_workers={num_workers} x {per_worker:g} {res} per worker): "
                    f"lower resources.num_workers, or raise resources.local_num_cpus / connect to a "
                    f"bigger cluster with resources.ray_address")

    def request(self) -> Worker:
        """Ask for one more worker; it starts in the background (see ``ready_pending``)."""
        slot = next(self._slots)
        pg = placement_group([self._bundle()], strategy="STRICT_PACK",
                             name=f"raytrain-sys:{self.spec.name}:{slot}")
        r = self.spec.resources
        actor = TrainWorker.options(
            num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=0),
        ).remote(self.spec.to_dict())
        worker = Worker(slot, actor, pg, ready_ref=actor.node_info.remote())
        self.pending.append(worker)
        return worker

    def ready_pending(self, timeout_s: float = 0.0) -> list[Worker]:
        """Pending workers whose actor is up, moved out of ``pending`` (not yet members)."""
        if not self.pending:
            return []
        refs = [w.ready_ref for w in self.pending]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready = []
        for w in list(self.pending):
            if w.ready_ref in done:
                try:
                    w.info = ray.get(w.ready_ref)
                except ray.exceptions.RayError as exc:  # died while starting: drop, ask again later
                    log.warning("worker slot %d failed to start: %s", w.slot, exc)
                    self.pending.remove(w)
                    self._release(w)
                    continue
                self.pending.remove(w)
                ready.append(w)
        return ready

    def start(self, num_workers: int) -> None:
        """The first gang: all ``num_workers`` up within the start timeout, or none."""
        self._check_capacity(num_workers)
        for _ in range(num_workers):
            self.request()
        timeout = self.spec.resources.start_timeout_s
        pgs = [w.pg.ready() for w in self.pending]
        ready, _ = ray.wait(pgs, num_returns=len(pgs), timeout=timeout)
        if len(ready) < len(pgs):
            total, avail = ray.cluster_resources(), ray.available_resources()
            self.shutdown()
            raise ClusterCapacityError(
                f"the cluster could not hold {num_workers} workers x {self._bundle()} within "
                f"{timeout:g} s (resources.start_timeout_s); cluster total CPU={total.get('CPU', 0):g} "
                f"GPU={total.get('GPU', 0):g}, available CPU={avail.get('CPU', 0):g}: lower "
                f"resources.num_workers or add nodes")
        started = self.ready_pending(timeout_s=timeout + 60)
        if len(started) < num_workers:
            self.shutdown()
            raise ClusterCapacityError(f"only {len(started)} of {num_workers} workers started")
        self.workers = started

    # ------------------------------------------------------------------ membership
    def remove(self, workers: list[Worker]) -> None:
        """Kill and release workers (dead, hung or draining); the others keep running."""
        for w in workers:
            if w in self.workers:
                self.workers.remove(w)
            if w in self.pending:
                self.pending.remove(w)
            self._release(w)

    def add(self, workers: list[Worker]) -> None:
        self.workers.extend(workers)

    def _release(self, w: Worker) -> None:
        try:
            ray.kill(w.actor, no_restart=True)
        except Exception:  # already dead
            pass
        try:
            remove_placement_group(w.pg)
        except Exception:
            pass

    # ------------------------------------------------------------------ process group
    def form_process_group(self, timeout_s: float = 120.0) -> None:
        """New generation: a fresh master port on rank 0's node; every member (re)joins."""
        self.generation += 1
        master = self.workers[0]
        port = ray.get(master.actor.free_port.remote(), timeout=timeout_s)
        refs = [w.actor.setup_group.remote(rank, len(self.workers), master.info["ip"], port,
                                           self.generation)
                for rank, w in enumerate(self.workers)]
        results = ray.get(refs, timeout=timeout_s)
        log.info("process group generation %d formed: world=%d backend=%s master=%s:%d",
                 self.generation, len(self.workers), results[0]["backend"], master.info["ip"], port)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def actors(self) -> list[Any]:
        return [w.actor for w in self.workers]

    # ------------------------------------------------------------------ end
    def shutdown(self) -> None:
        for w in self.workers + self.pending:
            self._release(w)
        self.workers, self.pending = [], []
