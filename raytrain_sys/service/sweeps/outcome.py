"""A sweep's outcome: its trials' table and the best trial, from what their jobs logged.

Owns: the trials' table (``trial_table``: each trial's newest job, state, config, segments and
its curve of the metric across its PBT segments, ``trial_curve``, pure) and which trial is the
best (``best_of``, pure). The jobs' curves, not Tune's results, decide: the best model is one a
job trained, and Tune stops reading a trial's results when it stops the trial. Reads only: the
parent run's end is written by ``tracking.record_outcome``, the sweep's by ``runner.drive``.
"""

from __future__ import annotations

import json
from typing import Optional

from raytrain_sys.service.model import JobRecord
from raytrain_sys.service.store import Store
from raytrain_sys.service.sweeps.segments import resumed_from
from raytrain_sys.service.sweeps.spec import SweepSpec, get_field
from raytrain_sys.service.sweeps.tracking import mlflow_history


def trial_table(store: Store, sweep_id: int, spec: SweepSpec) -> list[dict]:
    """Every trial of the sweep, in the order of their first jobs: its newest segment's job,
    state, MLflow run and config (the values it ended with), its segments (job, run, the step it
    started at) and its curve of the metric across its segments (``trial_curve``: each
    evaluation its jobs logged, also those after Tune stopped following it: a stopped trial's
    job trains on until its cancel lands at its next boundary)."""
    by_trial: dict[str, list[JobRecord]] = {}
    for job in store.trials(sweep_id):
        by_trial.setdefault(job.trial_id, []).append(job)
    table = []
    for trial_id, jobs in by_trial.items():
        jobs = sorted(jobs, key=lambda j: j.segment)
        newest = jobs[-1]
        raw = json.loads(newest.spec)
        segments = [{"segment": j.segment, "job": j.id, "mlflow_run_id": j.mlflow_run_id,
                     "start_step": checkpoint_step_of(resumed_from(j))} for j in jobs]
        table.append({"trial": trial_id, "job": newest.id, "state": newest.state.value,
                      "mlflow_run_id": newest.mlflow_run_id, "config": {key: get_field(raw, key) for key in spec.space},
                      "segments": segments,
                      "curve": trial_curve([(s["start_step"], mlflow_history(j, spec.metric))
                                            for s, j in zip(segments, jobs)])})
    return table


def checkpoint_step_of(uri: str) -> int:
    """The step of a checkpoint directory's URI (``.../step_00000012``: 12); 0 for "" (a
    segment started from scratch)."""
    from raytrain_sys.checkpoint.checkpointer import split_checkpoint_uri

    split = split_checkpoint_uri(uri)
    return split[1] if split is not None else 0


def trial_curve(segments: list[tuple[int, list[tuple[int, float]]]]) -> list[tuple[int, float]]:
    """A trial's curve across its PBT segments, each (start step, its job's curve) in segment
    order: a segment's points up to the next segment's start, then the next one's. The points
    an exploited segment logged past the step its successor started from (its job trained on
    until its cancel landed) are not the trial's: the trial went on from the donor's
    checkpoint."""
    curve: list[tuple[int, float]] = []
    for i, (start, points) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else None
        curve.extend((step, value) for step, value in points if step > start and (end is None or step <= end))
    return curve


def best_of(table: list[dict], mode: str) -> tuple[Optional[str], Optional[float]]:
    """The trial whose job logged the best value of the metric (the lowest with mode "min"), and
    that value; (None, None) when no trial logged any. The jobs' curves, not Tune's results,
    decide: the best model is the one a job trained, and Tune stops reading a trial's results
    when it stops the trial. A tie goes to the trial first in the table."""
    best: tuple[Optional[str], Optional[float]] = (None, None)
    for row in table:
        for _, value in row["curve"]:
            if best[1] is None or (value < best[1] if mode == "min" else value > best[1]):
                best = (row["trial"], float(value))
    return best
