"""The names a sweep's pieces are found by, without importing Ray Tune.

Owns the names: ``raytrain-sys-sweep-<id>-<submit second>``, the sweep runner's detached actor
(``runner.SweepRunner``), found by it (``find_runner``); ``sweep-<id>-<submit second>``, Tune's
experiment of the sweep under its storage path; and ``sweep-runner``, the actor the runner
writes the sweep's transitions as (its end, its MLflow parent run). Both names carry the submit
second so that a sweep of another store on the same cluster (``raytrain-sys sweep`` beside a
service, a test's fresh store) never finds this one's runner or experiment as its own.
"""

from __future__ import annotations

import ray

from raytrain_sys.control.spares import NAMESPACE
from raytrain_sys.service.model import SweepRecord

SWEEP_RUNNER_PREFIX = "raytrain-sys-sweep-"
ACTOR = "sweep-runner"


def runner_name(sweep: SweepRecord) -> str:
    """The runner's actor name: the sweep's id and submit second (``experiment_name``), so that a
    sweep of another store on the same cluster (``raytrain-sys sweep`` beside a service, a test's
    fresh store) never finds this one's runner as its own."""
    return f"{SWEEP_RUNNER_PREFIX}{experiment_name(sweep)[len('sweep-'):]}"


def experiment_name(sweep: SweepRecord) -> str:
    """Tune's experiment of the sweep: its id and submit second, so that a store made again in
    the same place never restores another sweep's experiment."""
    return f"sweep-{int(sweep.id)}-{int(sweep.submitted_at_s)}"


def find_runner(sweep: SweepRecord):
    """The sweep's runner by its name, None when it has none."""
    try:
        return ray.get_actor(runner_name(sweep), namespace=NAMESPACE)
    except ValueError:
        return None
