"""service/autoscale.py: what the service asks Ray's autoscaler for after a pass (pure), by
named cases; the whole loop on Ray's own autoscaler is tests/test_service_autoscaling.py."""

from __future__ import annotations

import dataclasses

import pytest

from raytrain_sys.service.autoscale import demand
from raytrain_sys.service.flavors import FlavorState, ResourceFlavor, WorkerShape
from raytrain_sys.service.model import JobState
from raytrain_sys.service.scheduler.snapshot import JobView, Snapshot
from raytrain_sys.service.teams import FlavorQuota, Team
from raytrain_sys.service.scheduler import decide

NOW = 10_000.0
SPOT = ResourceFlavor("spot-cpu", "spot", resources=("cpu",), max_cpu=8.0)
ON_DEMAND = ResourceFlavor("on-demand-cpu", "on-demand", resources=("cpu",), max_cpu=8.0)
CPU = (("CPU", 1.0),)
ON_SPOT = (("ray.io/market-type", "spot"),)
ON_OD = (("ray.io/market-type", "on-demand"),)


def job(id, state, workers=0, target=None, min=2, flavor="", shape=WorkerShape(), team="a") -> JobView:
    return JobView(id=id, team=team, priority=0, state=state, min_workers=min, max_workers=max(min, workers),
                   submitted_at_s=NOW - 100 + id, workers=workers,
                   target_workers=workers if target is None else target, flavor=flavor, shape=shape,
                   started_at_s=0.0, last_checkpoint_at_s=NOW - 10)


def implicit(present, ceiling, jobs, nominal=8) -> Snapshot:
    state = FlavorState(ResourceFlavor.implicit(), {"workers": float(ceiling)}, {"workers": float(present)})
    return Snapshot([Team("a", nominal)], jobs, cluster_workers=present, flavors=[state])


def flavored(jobs, spot_up=2.0, od_up=0.0) -> Snapshot:
    team = Team("a", 0, quotas=(FlavorQuota("spot-cpu", "cpu", 8), FlavorQuota("on-demand-cpu", "cpu", 8)))
    return Snapshot([team], jobs, flavors=[FlavorState(SPOT, {"cpu": 2.0}, {"cpu": spot_up}),
                                           FlavorState(ON_DEMAND, {"cpu": 8.0}, {"cpu": od_up})])


CASES = [
    ("nothing waits: every job runs at its target, the request is cleared",
     implicit(4, 8, [job(1, JobState.RUNNING, 2), job(2, JobState.RUNNING, 2)]),
     [], ()),
    ("an admission beyond what is up asks for the whole footprint: the running job's workers and its own",
     implicit(2, 8, [job(1, JobState.RUNNING, 2), job(2, JobState.QUEUED)]),
     [(CPU, ())] * 4, (2,)),
    ("a starting job waits (its runner places nothing yet): its workers are asked",
     implicit(2, 8, [job(1, JobState.STARTING, 0, target=2)]),
     [(CPU, ())] * 2, (1,)),
    ("a job waiting only for capacity is the head of the queue: asked for, the job behind it not",
     implicit(2, 2, [job(1, JobState.RUNNING, 2), job(2, JobState.QUEUED), job(3, JobState.QUEUED)]),
     [(CPU, ())] * 4, (2,)),
    ("a job over its team's quota asks for nothing: nodes would not start it",
     implicit(2, 8, [job(1, JobState.RUNNING, 2), job(2, JobState.QUEUED)], nominal=2),
     [], ()),
    ("flavors: the spot flavor is full, the queued job is admitted on on-demand and asked for there",
     flavored([job(1, JobState.RUNNING, 2, flavor="spot-cpu"), job(2, JobState.QUEUED)]),
     [(CPU, ON_SPOT)] * 2 + [(CPU, ON_OD)] * 2, (2,)),
]


@pytest.mark.parametrize("snapshot, bundles, waiting", [(s, b, w) for _, s, b, w in CASES],
                         ids=[name for name, _, _, _ in CASES])
def test_demand(snapshot, bundles, waiting):
    request = demand(snapshot, decide(snapshot, NOW))
    assert list(zip(request.bundles, request.selectors)) == bundles, request
    assert request.waiting == waiting
    assert request.describe().startswith("nothing waits" if not bundles else f"{len(bundles)} bundles")
    assert request.selector_dicts() is None or len(request.selector_dicts()) == len(request.bundles)


def test_a_pause_leaves_its_workers_out_and_a_grow_adds_them():
    grown = implicit(4, 8, [dataclasses.replace(job(1, JobState.RUNNING, 2, min=1), max_workers=4, elastic=True)])
    request = demand(grown, decide(grown, NOW))
    assert len(request.bundles) == 4 and request.waiting == (1,)  # grown to 4 into the ceiling
    reclaimed = implicit(2, 2, [job(1, JobState.RUNNING, 2, min=2),
                                dataclasses.replace(job(2, JobState.QUEUED), priority=5)])
    actions = decide(reclaimed, NOW)
    assert [type(a).__name__ for a in actions] == ["Pause", "Wait"]
    assert demand(reclaimed, actions).bundles == ()  # the paused job's workers go; job 2 waits on release
