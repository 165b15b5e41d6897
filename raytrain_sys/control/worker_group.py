"""The worker group: Ray actors gang-scheduled in one placement group, all or nothing.

It owns actors and their placement group; it does not decide membership or commit steps (the
Supervisor does). ``shutdown`` leaves no actor and no placement group behind, whatever happened.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
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
    # Workers import raytrain_sys from the installed package; keep their logs quiet.
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(spec.resources.cpus_per_worker))),
                                "TOKENIZERS_PARALLELISM": "false"}}
    if address:
        # No runtime_env here: under `ray job submit` it would replace the job's own (its
        # working_dir); workers set their thread count themselves.
        ray.init(address=address, log_to_driver=True)
        return False
    num_cpus = spec.resources.local_num_cpus or os.cpu_count() or 1
    # address="local" never attaches to some other cluster that happens to run on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             runtime_env=runtime_env, log_to_driver=True)
    return True


@dataclass
class WorkerHandle:
    actor: Any
    bundle_index: int
    info: dict


class WorkerGroup:
    def __init__(self, spec: JobSpec, num_workers: int, local_cluster: bool):
        self.spec = spec
        self.num_workers = num_workers
        self.local_cluster = local_cluster
        self.pg = None
        self.workers: list[WorkerHandle] = []
        self.generation = 0

    # ------------------------------------------------------------------ start
    def _bundle(self) -> dict[str, float]:
        r = self.spec.resources
        bundle = {"CPU": r.cpus_per_worker}
        if r.gpus_per_worker:
            bundle["GPU"] = r.gpus_per_worker
        return bundle

    def _check_capacity(self) -> None:
        """Fail at once when no amount of waiting helps: a cluster we started cannot grow."""
        bundle = self._bundle()
        total = ray.cluster_resources()
        for res, per_worker in bundle.items():
            need = per_worker * self.num_workers
            have = total.get(res, 0.0)
            if need > have and self.local_cluster:
                raise ClusterCapacityError(
                    f"the local Ray cluster has {have:g} {res} in total but the group needs {need:g} "
                    f"(resources.num_workers={self.num_workers} x {per_worker:g} {res} per worker): "
                    f"lower resources.num_workers, or raise resources.local_num_cpus / connect to a "
                    f"bigger cluster with resources.ray_address")

    def start(self) -> None:
        self._check_capacity()
        bundles = [self._bundle() for _ in range(self.num_workers)]
        self.pg = placement_group(bundles, strategy=self.spec.resources.placement_strategy,
                                  name=f"raytrain-sys:{self.spec.name}")
        timeout = self.spec.resources.start_timeout_s
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            total = ray.cluster_resources()
            avail = ray.available_resources()
            self.shutdown()
            raise ClusterCapacityError(
                f"the cluster could not hold {self.num_workers} workers x {self._bundle()} within "
                f"{timeout:g} s (resources.start_timeout_s); cluster total CPU={total.get('CPU', 0):g} "
                f"GPU={total.get('GPU', 0):g}, available CPU={avail.get('CPU', 0):g}: lower "
                f"resources.num_workers or add nodes")
        r = self.spec.resources
        spec_dict = self.spec.to_dict()
        for i in range(self.num_workers):
            actor = TrainWorker.options(
                num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i),
                name=None,
            ).remote(spec_dict)
            self.workers.append(WorkerHandle(actor, i, {}))
        infos = ray.get([w.actor.node_info.remote() for w in self.workers], timeout=timeout + 60)
        for w, info in zip(self.workers, infos):
            w.info = info

    # ------------------------------------------------------------------ process group
    def form_process_group(self) -> None:
        """New generation: a fresh master port on rank 0's node, every rank (re)joins."""
        self.generation += 1
        master = self.workers[0]
        port = ray.get(master.actor.free_port.remote())
        refs = [w.actor.setup_group.remote(rank, len(self.workers), master.info["ip"], port,
                                           self.generation)
                for rank, w in enumerate(self.workers)]
        results = ray.get(refs, timeout=max(120.0, self.spec.resources.start_timeout_s))
        log.info("process group generation %d formed: world=%d backend=%s master=%s:%d",
                 self.generation, len(self.workers), results[0]["backend"], master.info["ip"], port)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def actors(self) -> list[Any]:
        return [w.actor for w in self.workers]

    # ------------------------------------------------------------------ end
    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.workers = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
