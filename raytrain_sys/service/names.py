"""The names of the service's actors, and finding a job's runner by its job id, without importing
the runner or the service (which import torch).

Owns the names: ``raytrain-sys-service`` (the service, ``service/service.py``),
``raytrain-sys-job-<id>`` for a runner made for its job, and ``raytrain-sys-runner-spare-<hex>``
for a spare runner started ahead (``service/runner.py``), which is asked which job it runs. Read
by the reconciler, the jobs page, and a sweep's runner and trial proxies (light processes: a
proxy asks its job's runner for the run's evaluations, the sweep's runner wakes the service).
"""

from __future__ import annotations

from typing import Any, Optional

import ray

from raytrain_sys.control.spares import NAMESPACE

SERVICE_NAME = "raytrain-sys-service"
RUNNER_PREFIX = "raytrain-sys-job-"
SPARE_RUNNER_PREFIX = "raytrain-sys-runner-spare-"
SPARE_START_TIMEOUT_S = 10.0


def runner_name(job_id: int) -> str:
    return f"{RUNNER_PREFIX}{int(job_id)}"


def spare_runner_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(SPARE_RUNNER_PREFIX)]


def find_runner(job_id: int, spare_wait_s: float = SPARE_START_TIMEOUT_S):
    """The job's live runner (after a service restart too), or None: the one named after the
    job, else the spare runner that started it (``spare_runners``: asked for ``spare_wait_s``
    at most; a runner that runs a job answers in milliseconds, a spare still starting runs none)."""
    return find_runners([job_id], spare_wait_s).get(job_id)


def find_runners(job_ids: list[int], spare_wait_s: float = SPARE_START_TIMEOUT_S) -> dict[int, Any]:
    """``find_runner`` for many jobs: job id -> its live runner, for those found; the spare
    runners are asked once for all the jobs without a runner of their name."""
    found = {}
    for job_id in job_ids:
        try:
            found[job_id] = ray.get_actor(runner_name(job_id), namespace=NAMESPACE)
        except ValueError:
            pass
    missing = set(job_ids) - set(found)
    if missing:
        for _, handle, job in spare_runners(spare_wait_s):
            if job in missing:
                found[job] = handle
    return found


def spare_runners(wait_s: float = SPARE_START_TIMEOUT_S) -> list[tuple[str, Any, Optional[int]]]:
    """Each spare runner's name, handle and job (None: it runs none), those that answered within
    ``wait_s``: all are asked at once (a spare still importing answers only once it is up: asked
    one after the other, each of them cost a proxy the whole wait)."""
    asked = []
    for name in spare_runner_names():
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            asked.append((name, handle, handle.job.remote()))
        except ValueError:  # gone: not a runner to re-attach to
            continue
    if not asked:
        return []
    ready, _ = ray.wait([ref for _, _, ref in asked], num_returns=len(asked), timeout=wait_s)
    found = []
    for name, handle, ref in asked:
        if ref not in ready:
            continue  # not answering: not a runner to re-attach to
        try:
            found.append((name, handle, ray.get(ref)))
        except ray.exceptions.RayError:  # gone meanwhile
            continue
    return found
