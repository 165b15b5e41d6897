"""What the job service asks Ray's autoscaler for after each pass: the queue's demand.

Owns: ``demand(snapshot, actions)``, the bundles the cluster should be able to hold for the
service's jobs (``ray.autoscaler.sdk.request_resources(bundles=..., bundle_label_selectors=...)``,
carried out by the reconciler, which asks only when the request changed). Pure: no Ray.

Ray's request is a floor on the cluster's size, not an addition to what runs: "scale to ensure
this set of resource shapes can fit", counting the nodes that are busy (v1 ignores current
usage for it, v2 likewise treats it as a cluster constraint). So the request is the whole
footprint the queue needs, one bundle per worker, each with its flavor's label selector (the
job's placement bundles ask the same): every admitted job at its target after this pass (the
scheduler's admissions, growth, shrinks and pauses applied; workers placed or still waiting for
nodes), and the head of the queue per flavor, the first job that waits only for capacity (so
that nodes start coming while releases are in flight, or when the ceiling was set low). Ray's
own demand (pending placement groups) covers placed-but-unscheduled slots too; the request adds
what no placement group asks yet: a starting job's runner before it places its workers, and
the queue's head.

When nothing waits (no job starting or resuming, none below its target, none queued on
capacity) the request is cleared (``request_resources(bundles=[])``): nodes whose work ended
go idle, and Ray's autoscaler releases them after its idle timeout. A running job's nodes are
busy, not idle, so clearing never takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_sys.control import slot_bundle
from raytrain_sys.control.node_roles import Flavor
from raytrain_sys.service.flavors import ResourceFlavor, WorkerShape
from raytrain_sys.service.model import JobState, WaitCause
from raytrain_sys.service.scheduler.actions import Action, Admit, Grow, Pause, Shrink, Wait
from raytrain_sys.service.scheduler.snapshot import Snapshot

@dataclass(frozen=True)
class Request:
    """The bundles to ask for (one a worker) and their label selectors, index for index; no
    bundles: clear the request. ``waiting``: why it is made (job ids that wait), for the log."""

    bundles: tuple[tuple[tuple[str, float], ...], ...]
    selectors: tuple[tuple[tuple[str, str], ...], ...]
    waiting: tuple[int, ...] = ()

    def bundle_dicts(self) -> list[dict[str, float]]:
        return [dict(b) for b in self.bundles]

    def selector_dicts(self) -> Optional[list[dict[str, str]]]:
        """The label selectors, or None when no bundle has one (Ray's own default)."""
        if not any(self.selectors):
            return None
        return [dict(s) for s in self.selectors]

    def describe(self) -> str:
        if not self.bundles:
            return "nothing waits: request cleared"
        counts: dict[tuple, int] = {}
        for bundle, selector in zip(self.bundles, self.selectors):
            counts[(bundle, selector)] = counts.get((bundle, selector), 0) + 1
        shapes = ", ".join(f"{n} x {dict(b)}" + (f" on {dict(s)}" if s else "") for (b, s), n in counts.items())
        return f"{len(self.bundles)} bundles ({shapes}) for jobs {', '.join(map(str, self.waiting))} waiting"


def bundle_of(shape: WorkerShape) -> dict[str, float]:
    """One worker's placement bundle, as the worker group asks it (``control.slot_bundle``)."""
    return slot_bundle(shape.cpu, shape.gpu, shape.memory_gb)


def selector_of(flavor: Optional[ResourceFlavor]) -> dict[str, str]:
    """The label selector of a flavor's workers, Ray's node labels (``node_roles.Flavor``); none
    for the implicit flavor."""
    if flavor is None or flavor.is_implicit:
        return {}
    return Flavor(flavor.market, flavor.accelerator).selector()


def demand(snapshot: Snapshot, actions: list[Action]) -> Request:
    """The request after a pass (see the module docstring)."""
    flavors = {s.name: s.flavor for s in snapshot.flavor_states}
    order = [s.flavor for s in snapshot.flavor_states]
    by_id = {j.id: j for j in snapshot.jobs}
    target: dict[int, int] = {}  # admitted jobs' workers after this pass
    flavor_of: dict[int, Optional[ResourceFlavor]] = {}
    waiting: list[int] = []
    for job in snapshot.jobs:
        if job.state.admitted:
            target[job.id] = max(job.workers, job.target_workers)
            flavor_of[job.id] = flavors.get(job.flavor) or _first_fitting(order, job.shape)
            if job.state is not JobState.RUNNING or job.workers < job.target_workers:
                waiting.append(job.id)
    heads: dict[str, int] = {}  # per flavor, the first job waiting only for capacity
    for action in actions:
        job = by_id.get(action.job_id)
        if job is None:
            continue
        if isinstance(action, Admit):
            target[job.id] = action.workers
            flavor_of[job.id] = flavors.get(action.flavor)
            waiting.append(job.id)
        elif isinstance(action, (Grow, Shrink)):
            target[job.id] = action.to_workers
            if isinstance(action, Grow):
                waiting.append(job.id)
        elif isinstance(action, Pause):
            target.pop(job.id, None)
        elif isinstance(action, Wait) and action.cause is WaitCause.CLUSTER:
            flavor = _first_fitting(order, job.shape)
            name = flavor.name if flavor is not None else ""
            if name not in heads:
                heads[name] = job.id
                target[job.id] = max(1, job.min_workers)
                flavor_of[job.id] = flavor
                waiting.append(job.id)
    if not waiting:
        return Request((), ())
    bundles, selectors = [], []
    for job_id in sorted(target):
        job = by_id[job_id]
        bundle = tuple(sorted(bundle_of(job.shape).items()))
        selector = tuple(sorted(selector_of(flavor_of.get(job_id)).items()))
        bundles += [bundle] * target[job_id]
        selectors += [selector] * target[job_id]
    return Request(tuple(bundles), tuple(selectors), tuple(sorted(set(waiting))))


def _first_fitting(order: list[ResourceFlavor], shape: WorkerShape) -> Optional[ResourceFlavor]:
    return next((f for f in order if f.refuses(shape) is None), None)


__all__ = ["Request", "bundle_of", "selector_of", "demand"]
